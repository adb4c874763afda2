"""Private table-to-text training of GPT-2 (paper 2, §5 and appendix C).

One run: Poisson sampling at rate q over the N training pairs, T releases,
each the sum of per-example queries (the gradient, or inner momentum's
average over recent states) clipped at C plus N(0, σ²C²) noise, divided by
the public denominator D (paper 2 uses D = 1025 on E2E, 1027 on DART, not
qN), then the optimizer's post-processing with the ``paper2`` routing
(hidden matrices on Muon; embeddings, tied head and 1-D leaves on AdamW)::

    q = 1/41, T = 410 (E2E) · q = 1/61, T = 610 (DART) · C = 1 · σ = calibrate(ε, δ, q, T)

A run is the GPT-2 task (:class:`LMTask`) of the one trainer
(:mod:`dpmuon_jax.training.driver`): it keeps SECRET checkpoints and a
release journal in ``output_dir``, resumes, exports its parameters with their
privacy certificate, and runs over several devices or processes with the
image trainer's rules. ``dpmuon train-lm`` runs it from the command line.

Validation NLL in nats per target token is measured every ``eval_every``
releases and at the end; at the end the model decodes each evaluation
source (greedy or beam, with a length cap) and is scored with BLEU and
ROUGE-L (:mod:`dpmuon_jax.text.metrics`). Evaluation reads held-out splits
only; the guarantee covers the training pairs and is per run (selecting
settings across runs, as paper 2 does by validation loss on seed 37, is not
covered).

``diagnostic_steps`` runs a NON-PRIVATE :class:`DiagnosticProbe` passed to
:func:`train_lm` before the update at those steps, on a fixed probe batch of
training pairs, with the run's own stored states: paper 2's polar-error /
clipping-residual probe (figures 3–4) is
:class:`dpmuon_jax.analysis.polar_metrics.InnerMomentumProbe`. Its output is
analysis only: it reads per-example gradients before noise and is not
covered by the guarantee.

Wall and CPU time are recorded (the training time covers every process of the
run, checkpoint writes left out). Peak memory is measured from outside, by a
callback of :func:`train_lm` (``benchmarks/_peak_memory.py``, which the text
sweeps use).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh

from dpmuon_jax import checks
from dpmuon_jax.data.users import group_by_user
from dpmuon_jax.distributed.mesh import shard_batch, sharded_capacity
from dpmuon_jax.distributed.sharding import parse_mesh_shape
from dpmuon_jax.models.taps import tapped
from dpmuon_jax.optimizers import registry
from dpmuon_jax.optimizers.options import Fallback
from dpmuon_jax.privacy.clipping import USER
from dpmuon_jax.privacy.release import PrivateTransformation
from dpmuon_jax.privacy.sampling import gather
from dpmuon_jax.privacy.setup import PrivateSetup, make_private
from dpmuon_jax.text.data import (
  TextDataset,
  e2e_name,
  encode_pairs,
  encode_prompts,
  load_text_dataset,
  split_public_slice,
)
from dpmuon_jax.text.generate import beam_search, decode_texts, greedy_decode
from dpmuon_jax.text.gpt2 import (
  GPT2,
  GPT2_CPU,
  GPT2_SMALL,
  GPT2_TINY,
  GPT2Config,
  checked_config,
  gpt2_model,
  lm_loss,
)
from dpmuon_jax.text.hf_weights import load_hf_gpt2, resolve_weights
from dpmuon_jax.text.metrics import bleu, dart_rouge_l, e2e_rouge_l, mean_token_nll
from dpmuon_jax.text.records import LINE, RECORD_LAYOUTS, RecordsError, load_records
from dpmuon_jax.text.tokenizer import GPT2Tokenizer
from dpmuon_jax.training.driver import Run, run_task
from dpmuon_jax.training.loop import LoopState
from dpmuon_jax.training.records import write_csv
from dpmuon_jax.training.settings import (
  PrivacySettings,
  RunControl,
  RunSettings,
  in_open_unit_interval,
  in_unit_interval,
  redefault,
  setting,
)
from dpmuon_jax.training.step import make_private_step
from dpmuon_jax.transforms.history import ordered_history

PyTree = Any

MODEL_PRESETS = {"gpt2": GPT2_SMALL, "gpt2_tiny": GPT2_TINY, "gpt2_cpu": GPT2_CPU}


class DiagnosticProbe(Protocol):
  """NON-PRIVATE analysis of a run at ``config.diagnostic_steps`` (see :func:`train_lm`).

  It reads a probe batch of training pairs beyond the releases: its output is
  not covered by the guarantee and never feeds back into training.
  """

  def rows(self, loss_fn, params: PyTree, past_states: Sequence[PyTree], step: int,
           config: LMTrainConfig, probe_batch: PyTree) -> Sequence[NamedTuple]:
    """Rows (NamedTuples, written to ``diagnostics.csv``) at θ_t = ``params``, with
    [θ_{t−1}, θ_{t−2}, …] (most recent first) from the optimizer state."""
    ...

  def summary(self, rows: Sequence[Any]) -> dict:
    """The JSON-able ``results["nonprivate_diagnostics"]`` of all the rows (its own kind)."""
    ...


def _gpt2_optimizer(flag: str, name: str) -> str:
  """A registered optimizer with a ``"gpt2"`` preset."""
  try:
    registry.preset(name, registry.GPT2)
  except ValueError as error:
    raise ValueError(f"{flag}: {error}") from None
  return name


def _steps(flag: str, steps: tuple[int, ...]) -> tuple[int, ...]:
  """Release indices (ints >= 0)."""
  return tuple(checks.check_nonnegative_int(flag, step) for step in steps)


def _positive_int(help: str, default: int | None = None) -> Any:
  return setting(default, help=help, check=checks.check_positive_int)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LMTrainConfig(RunSettings):
  """One private GPT-2 run on E2E or DART.

  Attributes:
    data_dir: folder with ``e2e/``, ``dart/``, ``gpt2/``, laid out as
      described in :mod:`dpmuon_jax.text.data`; ``tokenizer_dir`` defaults
      to ``data_dir/gpt2``.
    init_weights: a local Hugging Face GPT-2 directory (fine-tuning, paper 2);
      ``None`` trains ``model`` from scratch (results say so).
    model: a :data:`MODEL_PRESETS` name; ``model_overrides``: GPT2Config fields.
    vocab_size: truncated BPE vocabulary
      (:class:`~dpmuon_jax.text.tokenizer.GPT2Tokenizer`); ``None``: GPT-2's.
      With ``init_weights`` it must be the checkpoint's (8,192 for
      ``experiments.pretrain_public``'s default start).
    optimizer: a name with a ``"gpt2"`` preset in
      :mod:`dpmuon_jax.optimizers.registry` (paper 2's tables: the
      ``paper2`` routing and an AdamW group); ``optimizer_kwargs`` go to its
      factory (e.g. inner momentum's ``history``/``decay``/``fallback_*``).
    learning_rate, fallback_learning_rate: Muon group / AdamW group (paper 2:
      0.002 / 0.0035), constant.
    sampling_rate, steps, denominator, clip: q, T, D, C. ``denominator=None``
      uses qN.
    clipped_sum_method: ``"vmap"`` (per-example gradients), ``"ghost"`` or
      ``"automatic"`` (ghost clipping, :mod:`dpmuon_jax.privacy.ghost`: the
      model is built with :func:`~dpmuon_jax.models.taps.tapped`; same sum and
      sensitivity, no per-example gradients of the tapped weights).
    train_split: the split trained on (``"train"``); never ``"valid"`` (every run
      scores it) nor one of ``generate_splits``: a score of the private training
      data would be published as if it were held out.
    train_subset: the first n training pairs only (CPU scale); N is then n.
    public_slice: E2E only: every pair whose restaurant is public
      (:func:`~dpmuon_jax.text.data.in_public_slice` with this modulus) is
      removed from every split, so training (N, q's meaning, the accounting),
      validation and decoding see the private restaurants only; ``None``: all.
    capacity: rows of each padded Poisson batch (default mean + 6 sd); a
      sample above it is not cut but spills into extra chunks of the same
      release, so a tighter capacity only trades padding for extra chunks.
    eval_pairs: validation pairs for the NLL (``None``: all).
    generate_splits / generate_groups: splits to decode and score, and how
      many of their groups (``None``: all).
    log_dir: also write the validation NLL, ε spent and the learning rates
      as TensorBoard event files there (:mod:`dpmuon_jax.training.tracking`).
    mesh: ``"DATAxMODEL"`` (e.g. ``"2x4"``), a mesh over all devices (of
      every process, with several): rows split over data, each matrix and its optimizer state
      split over model (:mod:`dpmuon_jax.distributed.sharding`); ``None``:
      one device, or the data-parallel mesh of ``devices``.
    devices, resume, max_steps, checkpoint_every, log_clip_stats, progress,
      plot: as for the image trainer (:class:`~dpmuon_jax.training.trainer.TrainConfig`):
      the run keeps SECRET checkpoints and a release journal in
      ``output_dir`` and resumes from them; with several processes
      (:mod:`dpmuon_jax.distributed.multihost`) the data mesh spans every
      device of every process.
  """

  data_dir: str | None = setting(
      None, help="folder with e2e/, dart/ and gpt2/ (text.data's layout); not needed with "
      "--train-file")
  dataset: str = setting("e2e", choices=("e2e", "dart"), help="e2e or dart")
  train_file: str | None = setting(
      None, metavar="FILE", help="your own text instead of --dataset: .jsonl ({prompt, "
      "completion} or {text} per line), .csv (the same columns) or plain text")
  valid_file: str | None = setting(
      None, metavar="FILE", help="held-out records of the same format for the validation NLL "
      "(default: --valid-fraction of --train-file)")
  valid_fraction: float = setting(
      0.1, check=in_open_unit_interval, help="--train-file without --valid-file: this "
      "fraction of its records (of its users, at user level) held out, chosen by a hash of "
      "each record's tokens (user id)")
  text_records: str = setting(LINE, choices=RECORD_LAYOUTS, help="a plain-text --train-file: "
                              "one record per line, or per paragraph (blank-line separated)")
  user_field: str | None = setting(
      None, help="the JSONL field or CSV column naming each record's user (--privacy-unit user)")
  output_dir: str = redefault(RunControl, "output_dir", "runs/lm")
  tokenizer_dir: str | None = setting(
      None, help="GPT-2's vocab.json and merges.txt (default: DATA_DIR/gpt2)")
  init_weights: str | None = setting(
      None, help="GPT-2 weights to fine-tune: a local Hugging Face folder, or a name (gpt2, "
      "gpt2-medium, gpt2-large, gpt2-xl, distilgpt2; the hub extra; default: from scratch)")
  model: str = setting(  # checked with the shape, from scratch only: _scratch_config
      "gpt2", help=f"from-scratch shape: {', '.join(MODEL_PRESETS)}")
  model_overrides: dict = setting(default_factory=dict,
                                  help="GPT2Config fields over the shape, as JSON")
  vocab_size: int | None = _positive_int(
      "keep GPT-2's first V BPE tokens (from scratch; default: all)")
  max_length: int = _positive_int("tokens per source || target pair", 128)
  optimizer: str = setting(
      "dp_muon_im", check=_gpt2_optimizer,
      help="a name with a GPT-2 preset (dp_muon_im, dp_muon, dp_muon_bc, ...)")
  optimizer_kwargs: dict = setting(  # checked with the optimizer: registry.check_options
      default_factory=dict,
      help="keyword arguments of the optimizer, as JSON (e.g. history, decay)")
  learning_rate: float = setting(0.002, check=checks.check_positive, aliases=("--lr",),
                                 help="Muon group's constant rate")
  fallback_learning_rate: float = setting(
      0.0035, check=checks.check_positive, aliases=("--fallback-lr",),
      help="AdamW group's constant rate (embeddings, head, 1-D leaves)")
  epsilon: float = redefault(PrivacySettings, "epsilon", 8.0)
  sampling_rate: float = setting(1 / 41, check=in_unit_interval,
                                 help="Poisson sampling rate q")
  steps: int = _positive_int("T, the number of releases σ is calibrated for", 410)
  denominator: float | None = setting(1025.0, check=checks.check_positive,
                                      help="public denominator D of the release ('none': qN)")
  train_split: str = setting("train", help="the split trained on (not valid nor a "
                             "--generate-splits one: they are scored)")
  train_subset: int | None = _positive_int("train on the first n pairs only (N is then n)")
  public_slice: int | None = _positive_int(
      "E2E: drop the public restaurants (hash of the name mod this) everywhere")
  capacity: int | None = _positive_int("rows of each padded Poisson batch (default: mean + 6 sd)")
  eval_pairs: int | None = _positive_int("validation pairs scored (default: all)")
  eval_batch_size: int = _positive_int("pairs per validation batch", 64)
  generate_splits: tuple[str, ...] = setting(
      ("valid", "test"),
      help="splits decoded and scored at the end, comma-separated ('' for none)")
  generate_groups: int | None = _positive_int("sources decoded per split (default: all)")
  beam_size: int = _positive_int("1: greedy decoding", 1)
  max_new_tokens: int = _positive_int("decoding length cap", 64)
  diagnostic_steps: tuple[int, ...] = setting(
      (), check=_steps, help="NON-PRIVATE polar-error / clipping-residual probe at these releases")
  diagnostic_examples: int = _positive_int("training pairs of the probe batch", 32)
  progress: bool = redefault(RunControl, "progress", False)
  plot: bool = redefault(RunControl, "plot", False)


def validate_config(config: LMTrainConfig) -> None:
  """Refuses, in one line and before anything loads, what the fields' own checks cannot
  see: fields together, the optimizer's options and the model's shape."""
  if config.diagnostic_steps and config.optimizer != "dp_muon_im":
    raise ValueError("diagnostic_steps compare inner momentum with the current-only query: "
                     "they need optimizer='dp_muon_im'.")
  registry.check_options(config.optimizer, config.optimizer_kwargs, "optimizer_kwargs")
  if config.init_weights is None:  # the shape trained from scratch
    _scratch_config(config)
  if config.mesh is not None:
    parse_mesh_shape(config.mesh)
  if config.train_split == "valid" or config.train_split in config.generate_splits:
    raise ValueError(f"train_split {config.train_split!r} is also scored or decoded (validation "
                     "NLL, generate_splits): its scores would publish the private training "
                     "data as if it were held out; train on another split.")
  _check_own_text(config)
  _check_user_level(config)
  if config.capacity and config.microbatch_size and config.capacity % config.microbatch_size:
    raise ValueError(f"capacity {config.capacity} is not a multiple of microbatch_size "
                     f"{config.microbatch_size}.")


def _check_own_text(config: LMTrainConfig) -> None:
  if config.train_file is None:
    if config.data_dir is None:
      raise ValueError("--data-dir is needed for --dataset e2e or dart (or give --train-file).")
    if config.valid_file is not None:
      raise ValueError("--valid-file goes with --train-file.")
  elif config.public_slice is not None or config.train_subset is not None:
    raise ValueError("--public-slice and --train-subset apply to --dataset e2e/dart, not to "
                     "--train-file.")


def _check_user_level(config: LMTrainConfig) -> None:
  if config.privacy_unit != USER:
    if config.user_field is not None:
      raise ValueError("--user-field goes with --privacy-unit user.")
    return
  if config.user_field is None:
    raise ValueError("--privacy-unit user needs --user-field: the field naming each "
                     "record's user.")
  if config.diagnostic_steps:
    raise ValueError("diagnostic_steps probe per-record gradients; not at user level.")


def lm_optimizer(config: LMTrainConfig, release_kwargs: dict[str, Any]) -> PrivateTransformation:
  """The configured optimizer from its ``"gpt2"`` preset: the ``paper2`` routing, an AdamW group."""
  fallback = Fallback(kind="adamw", learning_rate=config.fallback_learning_rate)
  kwargs = {"fallback": fallback, **config.optimizer_kwargs}
  return registry.build(config.optimizer, config.learning_rate, release_kwargs, registry.GPT2,
                        **kwargs)


def _model_description(config: LMTrainConfig, gpt2_config: GPT2Config,
                       pretrained: bool) -> dict:
  """The export certificate's public description of the model: the shape trained, which
  for ``init_weights`` is the loaded checkpoint's, not ``config.model``'s preset."""
  shape = {"architecture": "gpt2", "shape": gpt2_config._asdict(),
           "pretrained_initialisation": pretrained}
  return shape if pretrained else {**shape, "preset": config.model,
                                   "overrides": dict(config.model_overrides)}


def _scratch_config(config: LMTrainConfig) -> GPT2Config:
  """The preset ``config.model`` with ``config.model_overrides``, checked."""
  if config.model not in MODEL_PRESETS:
    raise ValueError(f"Unknown model {config.model!r}; choose from {', '.join(MODEL_PRESETS)}.")
  return checked_config(MODEL_PRESETS[config.model], config.model_overrides, "model_overrides")


def load_model(config: LMTrainConfig, vocab_size: int) -> tuple[Any, PyTree, GPT2Config, bool]:
  """``(apply, params, gpt2_config, pretrained)`` from ``init_weights`` or from scratch."""
  tap = tapped if config.clipped_sum_method != "vmap" else (lambda module: module)
  if config.init_weights is not None:
    params, gpt2_config = load_hf_gpt2(resolve_weights(config.init_weights))
    if gpt2_config.vocab_size != vocab_size:
      raise ValueError(f"The checkpoint's vocabulary has {gpt2_config.vocab_size} tokens, the "
                       f"tokenizer {vocab_size}: set vocab_size (--vocab-size) to the "
                       f"checkpoint's, {gpt2_config.vocab_size} (None is GPT-2's 50,257).")
    module = nnx.eval_shape(lambda: GPT2(gpt2_config, rngs=nnx.Rngs(0)))
    apply, _ = gpt2_model(tap(module))
    return apply, params, gpt2_config, True
  gpt2_config = _scratch_config(config)
  if gpt2_config.vocab_size != vocab_size:
    gpt2_config = gpt2_config._replace(vocab_size=vocab_size)
  apply, params = gpt2_model(tap(GPT2(gpt2_config, rngs=nnx.Rngs(config.model_seed))))
  return apply, params, gpt2_config, False


def generate_texts(apply, params, tokenizer: GPT2Tokenizer, sources: list[str],
                   config: LMTrainConfig, batch_size: int = 32) -> list[str]:
  """Decodes every source (greedy, or beam search when ``beam_size > 1``)."""
  prompts, lengths = encode_prompts(tokenizer, sources, config.max_length)
  width = int(lengths.max()) if len(sources) else 1
  texts = []
  for start in range(0, len(sources), batch_size):
    p = prompts[start:start + batch_size, :width]
    n = lengths[start:start + batch_size]
    pad = batch_size - len(p)
    p = np.concatenate([p, np.full((pad, width), tokenizer.eos_id, np.int32)])
    n = np.concatenate([n, np.ones((pad,), np.int32)])
    if config.beam_size > 1:
      out = beam_search(apply, params, jnp.asarray(p), jnp.asarray(n), config.max_new_tokens,
                        tokenizer.eos_id, config.beam_size)
    else:
      out = greedy_decode(apply, params, jnp.asarray(p), jnp.asarray(n), config.max_new_tokens,
                          tokenizer.eos_id)
    texts.extend(decode_texts(tokenizer, out)[:len(p) - pad])
  return [t.strip() for t in texts]


def score_split(apply, params, tokenizer, data: TextDataset, config: LMTrainConfig) -> dict:
  """BLEU and ROUGE-L of decoded outputs on ``data``'s groups (E2E or DART scorers)."""
  groups = data.groups[:config.generate_groups]
  hypotheses = generate_texts(apply, params, tokenizer, [g.source for g in groups], config)
  references = [g.references for g in groups]
  scores = {"groups": len(groups), "bleu": bleu(hypotheses, references)}
  rouge = e2e_rouge_l if data.name == "e2e" else dart_rouge_l
  try:
    scores["rouge_l"] = rouge(hypotheses, references)
  except RuntimeError as error:  # the official E2E tokenizer needs java
    scores["rouge_l_error"] = str(error)
  scores["examples"] = [{"source": g.source, "output": h}
                        for g, h in zip(groups[:5], hypotheses[:5])]
  return scores


class _LMData(NamedTuple):
  tokenizer: GPT2Tokenizer
  valid: TextDataset | None  # the validation split's pairs and groups (None: own text)
  train_arrays: dict  # one row per training pair, or per user (``record_mask``)
  valid_arrays: dict
  num_pairs: int  # N: training pairs, or users at user level


def load_split(config: LMTrainConfig, split: str) -> TextDataset:
  """A split of ``config.dataset``, without its public slice where ``config.public_slice``."""
  if config.data_dir is None:
    raise ValueError(f"{config.dataset!r} is read from --data-dir (or give --train-file).")
  data = load_text_dataset(config.dataset, config.data_dir, split)
  return data if config.public_slice is None else split_public_slice(data, config.public_slice)[0]


def _tokenizer(config: LMTrainConfig) -> GPT2Tokenizer:
  """GPT-2's BPE from ``tokenizer_dir``, else ``data_dir/gpt2``, else tiktoken's ``"gpt2"``."""
  if config.tokenizer_dir is not None:
    return GPT2Tokenizer(config.tokenizer_dir, config.vocab_size)
  if config.data_dir is not None:
    return GPT2Tokenizer(os.path.join(config.data_dir, "gpt2"), config.vocab_size)
  return GPT2Tokenizer.from_tiktoken(config.vocab_size)


def _load_lm_data(config: LMTrainConfig) -> _LMData:
  """Tokenizer, the training pairs (encoded, grouped by user at user level) and validation."""
  tokenizer = _tokenizer(config)
  if config.train_file is not None:
    return _own_text(config, config.train_file, tokenizer)
  train = load_split(config, config.train_split)
  valid = load_split(config, "valid")
  pairs = train.pairs[:config.train_subset]
  arrays, n = encode_pairs(tokenizer, pairs, config.max_length), len(pairs)
  if config.privacy_unit == USER:  # E2E: the restaurant is the user
    arrays, n = _by_user(config, arrays, np.asarray([_pair_user(config, p) for p in pairs]))
  return _LMData(
      tokenizer, valid, arrays,
      encode_pairs(tokenizer, valid.pairs[:config.eval_pairs], config.max_length), n)


E2E_USER_FIELDS = ("name", "source")


def _pair_user(config: LMTrainConfig, pair) -> str:
  """E2E's user: ``name``, the restaurant (34 in the training split), or ``source``, the
  meaning representation (every reference written for one table, about 4,900)."""
  if config.dataset != "e2e" or config.user_field not in E2E_USER_FIELDS:
    raise ValueError("--privacy-unit user on a built-in dataset: E2E with --user-field name "
                     "(the restaurant) or source (the table); your own records: --train-file "
                     "with a user field.")
  return e2e_name(pair.source) if config.user_field == "name" else pair.source


def _by_user(config: LMTrainConfig, arrays: dict, users: np.ndarray) -> tuple[dict, int]:
  """The training rows grouped one per user (:func:`~dpmuon_jax.data.users.group_by_user`)."""
  groups = group_by_user(arrays, users, config.max_examples_per_user)
  print(f"user-level DP: {groups.num_users} users, {groups.records_kept} records kept, "
        f"{groups.records_dropped} dropped past --max-examples-per-user "
        f"{config.max_examples_per_user}.", flush=True)
  return groups.arrays, groups.num_users


def _own_text(config: LMTrainConfig, train_file: str, tokenizer: GPT2Tokenizer) -> _LMData:
  """``--train-file`` (and ``--valid-file``, or ``--valid-fraction`` of it held out)."""
  user_field = config.user_field if config.privacy_unit == USER else None
  train = load_records(train_file, tokenizer, config.max_length, config.text_records,
                       user_field)
  _note_truncated(train_file, train.truncated, train.num_records, config.max_length)
  arrays, users = train.arrays, train.users
  if config.valid_file is not None:
    valid = load_records(config.valid_file, tokenizer, config.max_length, config.text_records)
    _note_truncated(config.valid_file, valid.truncated, valid.num_records, config.max_length)
    valid_arrays = valid.arrays
  else:
    held_out = _held_out(arrays["tokens"] if users is None else users, config.valid_fraction)
    if held_out.all() or not held_out.any():
      raise RecordsError(f"{train_file}: --valid-fraction {config.valid_fraction} of "
                         f"{len(held_out)} {'records' if users is None else 'users'} leaves "
                         "no training or no validation record; give --valid-file.")
    valid_arrays = {k: np.asarray(v[held_out]) for k, v in arrays.items()}
    arrays = {k: np.asarray(v[~held_out]) for k, v in arrays.items()}
    users = None if users is None else users[~held_out]
  if config.eval_pairs is not None:
    valid_arrays = {k: v[:config.eval_pairs] for k, v in valid_arrays.items()}
  n = len(arrays["tokens"])
  if users is not None:
    arrays, n = _by_user(config, arrays, np.asarray(users))
  return _LMData(tokenizer, None, arrays, valid_arrays, n)


def _note_truncated(path: str, truncated: int, total: int, max_length: int) -> None:
  if truncated:
    print(f"{path}: {truncated} of {total} records are longer than --max-length {max_length} "
          "tokens and were cut at the right.", flush=True)


def _held_out(keys: np.ndarray, fraction: float) -> np.ndarray:
  """Whether each record (row of tokens) or user id is held out: sha256 of it mod 10⁶ below
  fraction·10⁶, a rule on the record alone, fixed before the run."""
  def digest(key) -> int:
    data = np.ascontiguousarray(key).tobytes() if isinstance(key, np.ndarray) else str(
        key).encode("utf-8")
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "big") % 10**6

  return np.asarray([digest(key) < fraction * 10**6 for key in keys])


def _lm_setup(config: LMTrainConfig, n: int, root, rows_devices: int = 1) -> PrivateSetup:
  """Sampler (q over the N training pairs), σ for (ε, δ, T), release and ledger."""
  return make_private(
      target_epsilon=config.epsilon, target_delta=config.delta, dataset_size=n,
      expected_batch_size=config.sampling_rate * n, l2_clip_norm=config.clip,
      steps=config.steps, key=root, accountant=config.accountant,
      denominator=config.denominator, privacy_unit=config.privacy_unit,
      noise=config.noise, bands=config.bands, buffers=config.buffers,
      capacity=config.capacity or sharded_capacity(n, config.sampling_rate, rows_devices,
                                                   config.microbatch_size),
  )


def _check_probe(config: LMTrainConfig, probe: DiagnosticProbe | None) -> None:
  if config.diagnostic_steps and probe is None:
    raise ValueError("diagnostic_steps need a probe: pass e.g. "
                     "probe=dpmuon_jax.analysis.polar_metrics.InnerMomentumProbe().")


def _chunks_of(train_arrays: dict, mesh: Mesh | None = None) -> Callable:
  """The loop's ``to_chunks``: each padded chunk's rows gathered, with its mask (on the mesh)."""
  if mesh is None:
    return lambda padded, _: [(gather(train_arrays, c), jnp.asarray(c.mask)) for c in padded]
  return lambda padded, _: [shard_batch(mesh, gather(train_arrays, c), c.mask) for c in padded]


# History columns -> TensorBoard tags.
TRACKED = {"valid_nll": "valid/nll", "epsilon": "privacy/epsilon_spent",
           "learning_rate": "train/learning_rate",
           "fallback_learning_rate": "train/fallback_learning_rate"}
PLOTTED = (("valid_nll", "validation NLL (nats/token)"), ("epsilon", "ε spent"))


@dataclasses.dataclass
class LMTask:
  """GPT-2 table-to-text as a task of the one trainer (:mod:`dpmuon_jax.training.driver`)."""

  config: LMTrainConfig
  data: _LMData
  probe: DiagnosticProbe | None = None
  # What is scored and decoded, and the NON-PRIVATE probe: never a release.
  evaluation_fields: ClassVar[tuple[str, ...]] = (
      "eval_pairs", "eval_batch_size", "generate_splits", "generate_groups", "beam_size",
      "max_new_tokens", "diagnostic_steps", "diagnostic_examples")

  def privacy_config(self) -> dict:
    """What must not change between a checkpoint and its resumption."""
    c = self.config
    return {"dataset": c.dataset, "dataset_size": self.data.num_pairs, "train_split":
            c.train_split, "train_subset": c.train_subset, "public_slice": c.public_slice,
            "optimizer": c.optimizer, "model": c.model, "model_overrides": c.model_overrides,
            "init_weights": c.init_weights, "vocab_size": c.vocab_size,
            "max_length": c.max_length, "sampling_rate": c.sampling_rate,
            "denominator": c.denominator, "clip": c.clip, "delta": c.delta,
            "accountant": c.accountant, **_new_privacy_fields(c)}

  def data_arrays(self) -> Sequence[np.ndarray]:
    return [self.data.train_arrays[k] for k in sorted(self.data.train_arrays)]

  def build(self, root, mesh: Mesh | None, rows_devices: int) -> Run:
    """GPT-2, the private setup (σ for T releases), the optimizer, the step and evaluation."""
    config, lm_data = self.config, self.data
    rows_per_chunk = rows_devices * (config.microbatch_size or 1)
    if config.capacity and config.capacity % rows_per_chunk:  # before a release is journaled
      raise ValueError(f"capacity {config.capacity} does not split into {rows_devices} "
                       f"device(s) × microbatches of {config.microbatch_size or 1}.")
    apply, params, gpt2_config, pretrained = load_model(config, lm_data.tokenizer.vocab_size)
    setup = _lm_setup(config, lm_data.num_pairs, root, rows_devices)
    optimizer = lm_optimizer(config, setup.release_kwargs)
    loss_fn = lm_loss(apply)
    step_fn = make_private_step(optimizer, loss_fn, microbatch_size=config.microbatch_size,
                                clipped_sum_method=config.clipped_sum_method, mesh=mesh)
    probe_batch = {k: v[:config.diagnostic_examples] for k, v in lm_data.train_arrays.items()}
    diagnostic_rows: list[NamedTuple] = []
    validation_nll = lambda p: mean_token_nll(apply, p, lm_data.valid_arrays,
                                              config.eval_batch_size)

    def before_release(state: LoopState) -> None:
      if state.step in config.diagnostic_steps:  # NON-PRIVATE probe, labelled as such
        rows = self.probe.rows(  # pyright: ignore[reportOptionalMemberAccess]  # checked
            loss_fn, state.params, ordered_history(state.opt_state), state.step, config,
            probe_batch)
        diagnostic_rows.extend(rows)

    def results(params: PyTree, history: list[dict]) -> dict:
      return {"pretrained": pretrained, "model": gpt2_config._asdict(),
              "parameters": int(sum(np.size(x) for x in jax.tree.leaves(params))),
              "train_pairs": lm_data.num_pairs, "valid_nll": history[-1]["valid_nll"],
              "scores": _scores(config, apply, params, lm_data)}

    def write_extra(output_dir: str, results: dict) -> None:
      """NON-PRIVATE diagnostics.csv, and their summary in the results."""
      if diagnostic_rows:
        results["nonprivate_diagnostics"] = self.probe.summary(  # pyright: ignore[reportOptionalMemberAccess]
            diagnostic_rows)
        write_csv(os.path.join(output_dir, "diagnostics.csv"),
                  [r._asdict() for r in diagnostic_rows])

    return Run(
        setup, optimizer, step_fn, _chunks_of(lm_data.train_arrays, mesh), params,
        setup.sampler.steps_per_epoch,
        evaluate=lambda p: {"valid_nll": validation_nll(p)}, results=results,
        rates={"learning_rate": optax.constant_schedule(config.learning_rate),
               "fallback_learning_rate": optax.constant_schedule(config.fallback_learning_rate)},
        eval_every=config.steps, tracked=TRACKED, plotted=PLOTTED,
        model=_model_description(config, gpt2_config, pretrained), before_release=before_release,
        print_records=True, write_extra=write_extra)


def _new_privacy_fields(c: LMTrainConfig) -> dict:
  """What a resume must keep of the settings added after the first checkpoints were made,
  where it differs from what those had (so that their runs still resume)."""
  fields = {}
  if c.train_file is not None:
    fields.update(train_file=os.path.basename(c.train_file), text_records=c.text_records)
  if c.privacy_unit == USER:
    fields.update(privacy_unit=c.privacy_unit, user_field=c.user_field,
                  max_examples_per_user=c.max_examples_per_user)
  fields.update(c.noise_config())
  return fields


def _scores(config: LMTrainConfig, apply, params, lm_data: _LMData) -> dict:
  """BLEU and ROUGE-L of the decoded generation splits (none for your own text: it has no
  references)."""
  scores = {}
  if lm_data.valid is None:
    return scores
  for split in config.generate_splits:
    data = lm_data.valid if split == "valid" else load_split(config, split)
    scores[split] = score_split(apply, params, lm_data.tokenizer, data, config)
  return scores


def train_lm(config: LMTrainConfig, probe: DiagnosticProbe | None = None,
             callbacks: Sequence[Callable[[int], None]] = ()) -> dict:
  """Runs (or resumes) one private GPT-2 run with the one trainer
  (:func:`~dpmuon_jax.training.driver.run_task`).

  Writes ``results.json``, ``history.csv``, ``export/``, the SECRET checkpoints
  and release journal and (with ``diagnostic_steps``) ``diagnostics.csv``
  under ``output_dir``. ``probe`` is the NON-PRIVATE analysis run at
  ``config.diagnostic_steps`` (required with them), e.g.
  :class:`dpmuon_jax.analysis.polar_metrics.InnerMomentumProbe`; a resumed run's
  diagnostics cover the releases after its resumption. ``callbacks`` are called with
  the number of releases made after each release
  (:func:`~dpmuon_jax.training.driver.run_task`).
  """
  validate_config(config)
  _check_probe(config, probe)
  return run_task(LMTask(config, _load_lm_data(config), probe), callbacks)
