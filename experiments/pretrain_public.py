"""Public pretraining of a small GPT-2 on DART, the starting point for private fine-tuning on E2E.

The setting is public pretraining, then private fine-tuning: paper 2 ("Inner
Momentum for DP-Muon", §5 and appendix C) fine-tunes GPT-2 small from the
Hugging Face ``gpt2`` weights. Where those weights are not available, this
script makes a public starting point on the machine: a small GPT-2 trained
WITHOUT privacy on public text only. It is saved in the Hugging Face layout
(:func:`~dpmuon_jax.text.hf_weights.save_hf_gpt2`), so the private run takes
exactly the path of a user with the real weights::

    LMTrainConfig(data_dir=TEXT_DATA, init_weights="runs/pretrained_dart", vocab_size=8192, ...)

where ``TEXT_DATA`` is a folder with ``dart/``, ``e2e/`` and ``gpt2/``, laid out as
:mod:`dpmuon_jax.text.data` describes.

Data: DART v1.1.1 (Nan et al., 2021, "DART: Open-Domain Structured Data
Record to Text Generation") dev and test, ``dart/{dev,test}.jsonl[.gz]``,
every reference one (source, target) pair, the source linearised as in
:func:`dpmuon_jax.text.data.dart_source` and each pair encoded as the
fine-tuning encodes it (:func:`~dpmuon_jax.text.data.encode_pairs`):
``" {source} <|endoftext|> {target} <|endoftext|>"``. DART contains a
cleaned copy of E2E: references whose DART origin (the per-reference
``sources`` field) is ``"e2e"`` are verbatim E2E targets and are DROPPED, so
no E2E text enters pretraining (10,551 of 19,532 references remain). Entries
whose source hashes to 0 mod 50 (sha256) are held out to measure DART NLL.
The E2E validation split is read only after training, to report the model's
zero-shot E2E validation NLL.

With ``--e2e-public-slice M`` the pretraining pairs also include E2E's public
slice: every training pair whose restaurant ``name`` hashes to 0 mod M
(:func:`~dpmuon_jax.text.data.in_public_slice`, a rule on the name alone),
encoded as above and held out by the same source hash. Those restaurants
are then public: fine-tuning with ``LMTrainConfig(public_slice=M)`` removes
them from the private training set (its N), from validation and from test,
and the zero-shot E2E validation NLL is measured on the private restaurants
only. This is the same-distribution public data of public-data-assisted DP
training, not the web-text pretraining of the real ``gpt2`` weights.

Objective and optimizer (non-private): the causal LM NLL of every real token
(source, separators, target, closing end-of-text; not padding), averaged over
the batch's tokens; AdamW (Loshchilov & Hutter, "Decoupled Weight Decay
Regularization") with β = (0.9, 0.95), weight decay 0.1 on matrices only,
global-norm gradient clipping at 1, and a learning rate rising linearly for
``warmup`` steps to its peak, then a cosine decay to 10% of the peak at the
last step. Batches are drawn without replacement from a fresh permutation
each epoch (fixed seed), length-sorted within pools of 64 batches and cut
after their longest sequence (rounded up to 32 tokens). ``max_positions = max_length = 128``, the
fine-tuning's default ``max_length`` (E2E prompts ≤ 48 tokens + 64 generated
fit).

Size: at this scale the (V × d) tied embedding is most of the parameters and
the (B, T, V) logits most of the step, so ``--measure`` times candidate sizes
on the machine. The defaults are sized from it for a shared two-core CPU:
128 wide, 4 layers, 4 heads (the shape of
:data:`~dpmuon_jax.text.gpt2.GPT2_TINY`), GPT-2's BPE truncated to its first
8,192 tokens (lossless on any text, :class:`~dpmuon_jax.text.tokenizer.GPT2Tokenizer`),
1,000 steps of 32 pairs: 1.86M parameters, about 25 minutes here. The
truncated vocabulary makes every private fine-tuning release 3–5× cheaper
than GPT-2's full 50,257 (measured: 4,161 vs 768 tokens/s per AdamW step);
fine-tuning then passes ``vocab_size=8192`` with ``init_weights``, the only
difference from a user with the real weights (``vocab_size=None``).

Outputs under ``--out``: ``model.safetensors`` + ``config.json``,
``history.csv`` (the training-loss curve) and ``results.json`` (config,
tokens/s, wall time, DART losses, zero-shot E2E validation NLL, sha256 of the
weights)::

    python -m experiments.pretrain_public --data-dir TEXT_DATA --measure
    python -m experiments.pretrain_public --data-dir TEXT_DATA --out runs/pretrained_dart
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import hashlib
import json
import os
import time
from collections.abc import Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from dpmuon_jax.text.data import (
    TextPair,
    dart_source,
    e2e_name,
    encode_pairs,
    load_e2e,
    split_public_slice,
)
from dpmuon_jax.text.gpt2 import GPT2, GPT2Config, gpt2_model, token_nll
from dpmuon_jax.text.hf_weights import WEIGHTS_FILE, load_hf_gpt2, save_hf_gpt2
from dpmuon_jax.text.metrics import mean_token_nll
from dpmuon_jax.text.tokenizer import GPT2Tokenizer
from dpmuon_jax.text.train import LMTrainConfig, load_model, load_split
from dpmuon_jax.training.records import write_csv

DART_SPLITS = ("dev", "test")
EXCLUDED_ORIGINS = frozenset({"e2e"})
HELDOUT_EVERY = 50
# (dim, layers, heads, vocab_size) measured by --measure; None is GPT-2's 50,257.
CANDIDATES = ((128, 2, 4, None), (128, 4, 4, None), (192, 3, 6, None), (256, 2, 4, None),
              (256, 4, 4, None), (128, 4, 4, 8192), (256, 4, 4, 8192))


@dataclasses.dataclass(frozen=True)
class PretrainConfig:
  """One public pretraining run (see the module docstring for the protocol)."""

  data_dir: str
  out: str = "runs/pretrained_dart"
  dim: int = 128
  layers: int = 4
  heads: int = 4
  vocab_size: int | None = 8192  # None: GPT-2's 50,257, as the real weights
  max_length: int = 128
  steps: int = 1000
  batch_size: int = 32
  seed: int = 0
  learning_rate: float = 1e-3
  warmup: int = 100
  weight_decay: float = 0.1
  log_every: int = 25
  eval_every: int = 250
  eval_batch_size: int = 64
  e2e_eval_pairs: int | None = None  # None: the whole E2E validation split
  e2e_public_slice: int | None = None  # also train on E2E's public restaurants (this modulus)

  def gpt2_config(self, vocab_size: int) -> GPT2Config:
    return GPT2Config(vocab_size=vocab_size, max_positions=self.max_length, dim=self.dim,
                      num_layers=self.layers, num_heads=self.heads)


def _dart_path(data_dir: str, split: str) -> str:
  for name in (f"{split}.jsonl", f"{split}.jsonl.gz"):
    path = os.path.join(data_dir, "dart", name)
    if os.path.isfile(path):
      return path
  raise FileNotFoundError(f"No dart/{split}.jsonl[.gz] under {data_dir!r} (the layout of "
                          "dpmuon_jax.text.data, with DART's per-reference 'sources').")


def public_dart_pairs(data_dir: str) -> tuple[list[TextPair], list[str]]:
  """DART dev + test pairs without E2E-derived references, and the files read.

  Reads ``data_dir/dart/{dev,test}.jsonl[.gz]`` and nothing else. A reference
  is kept iff it is not ``null`` and its origin is not in :data:`EXCLUDED_ORIGINS`.
  """
  pairs, paths = [], []
  for split in DART_SPLITS:
    path = _dart_path(data_dir, split)
    paths.append(path)
    with (gzip.open(path, "rt", encoding="utf-8") if path.endswith(".gz")
          else open(path, encoding="utf-8")) as f:
      rows = [json.loads(line) for line in f if line.strip()]
    for row in rows:
      source = dart_source(row["tripleset"])
      pairs.extend(TextPair(source, ref) for ref, origin in zip(row["references"], row["sources"])
                   if ref is not None and origin not in EXCLUDED_ORIGINS)
  return pairs, paths


def public_e2e_pairs(data_dir: str, modulus: int) -> tuple[list[TextPair], list[str]]:
  """The E2E training pairs of the public restaurants
  (:func:`~dpmuon_jax.text.data.split_public_slice`), and their names."""
  public = split_public_slice(load_e2e(data_dir, "train"), modulus)[1]
  return public.pairs, sorted({e2e_name(g.source) for g in public.groups})


def split_heldout(pairs: Sequence[TextPair]) -> tuple[list[TextPair], list[TextPair]]:
  """(train, held-out): a source is held out iff sha256(source) ≡ 0 mod 50, so
  entries repeating a tripleset fall on one side."""
  held = lambda p: int(hashlib.sha256(p.source.encode()).hexdigest(), 16) % HELDOUT_EVERY == 0
  return [p for p in pairs if not held(p)], [p for p in pairs if held(p)]


def all_token_arrays(tokenizer: GPT2Tokenizer, pairs: Sequence[TextPair],
                     max_length: int) -> dict[str, np.ndarray]:
  """:func:`encode_pairs`, with ``loss_mask`` 1 on every real token after the first.

  A sequence's real tokens end at its last target token (or at ``max_length``
  when the cut left no target); padding after it keeps weight 0.
  """
  arrays = encode_pairs(tokenizer, pairs, max_length)
  target = arrays["loss_mask"]
  last = np.where(target.any(axis=1), max_length - 1 - np.argmax(target[:, ::-1], axis=1),
                  max_length - 1)
  t = np.arange(max_length)[None]
  mask = ((t >= 1) & (t <= last[:, None])).astype(np.float32)
  return {"tokens": arrays["tokens"], "loss_mask": mask}


def lm_adamw(config: PretrainConfig) -> tuple[optax.GradientTransformation, optax.Schedule]:
  """Non-private AdamW with warmup + cosine decay to 10% and global-norm clipping at 1."""
  schedule = optax.warmup_cosine_decay_schedule(
      0.0, config.learning_rate, min(config.warmup, config.steps // 2), config.steps,
      end_value=0.1 * config.learning_rate)
  decay_mask = lambda params: jax.tree.map(lambda x: x.ndim >= 2, params)
  optimizer = optax.chain(
      optax.clip_by_global_norm(1.0),
      optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=config.weight_decay, mask=decay_mask))
  return optimizer, schedule


def make_step(apply, optimizer: optax.GradientTransformation) -> Callable:
  """``step(params, opt_state, batch) -> (params, opt_state, loss)``, one non-private
  AdamW step on L = Σ_i Σ_t m_{i,t+1} nll_{i,t} / Σ_i Σ_t m_{i,t+1}."""

  def loss_fn(params, batch):
    total, count = token_nll(apply, params, batch)
    return jnp.sum(total) / jnp.maximum(jnp.sum(count), 1.0)

  @jax.jit
  def step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return step


def batch_indices(lengths: np.ndarray, batch_size: int, seed: int,
                  pool: int = 64) -> Iterator[np.ndarray]:
  """Batches of indices, each epoch a fresh permutation (the n mod B it leaves over sit out
  that epoch), cut into pools of ``pool`` batches whose examples are sorted by length
  before being batched; the epoch's batches are then shuffled. Sorting within a pool
  keeps a batch's lengths close, so little of each padded batch is padding."""
  rng = np.random.default_rng(seed)
  n = len(lengths) // batch_size * batch_size
  if n == 0:
    raise ValueError(f"{len(lengths)} examples are fewer than one batch of {batch_size}.")
  while True:
    order = rng.permutation(len(lengths))[:n]
    pools = np.array_split(order, max(1, n // (pool * batch_size)))
    batches = np.concatenate([c[np.argsort(lengths[c], kind="stable")] for c in pools])
    batches = batches.reshape(-1, batch_size)
    yield from batches[rng.permutation(len(batches))]


def trim(arrays: dict[str, np.ndarray], idx: np.ndarray, multiple: int = 32) -> dict:
  """Rows ``idx``, cut after the longest row's last real token rounded up to ``multiple``
  (few compiled shapes); only padding, of weight 0, is removed."""
  real = arrays["loss_mask"][idx].sum(axis=1) + 1
  width = min(arrays["tokens"].shape[1], int(-(-real.max() // multiple) * multiple))
  return {k: v[idx, :width] for k, v in arrays.items()}


def init_model(config: PretrainConfig, vocab_size: int):
  """``(apply, params, gpt2_config)`` from GPT-2's initialisation with ``config.seed``."""
  gpt2_config = config.gpt2_config(vocab_size)
  apply, params = gpt2_model(GPT2(gpt2_config, rngs=nnx.Rngs(config.seed)))
  return apply, params, gpt2_config


def _log_row(step: int, losses: list[float], schedule, config: PretrainConfig, tokens: float,
             started: float, n_train: int) -> dict:
  return {"step": step, "epoch": step * config.batch_size / n_train,
          "learning_rate": float(schedule(step - 1)), "train_loss": float(np.mean(losses)),
          "real_tokens": tokens, "seconds": time.perf_counter() - started}


def pretrain(config: PretrainConfig, tokenizer: GPT2Tokenizer, train: dict, heldout: dict,
             on_log: Callable[[list[dict]], None] = lambda history: None):
  """Runs ``config.steps`` AdamW steps on ``train``; returns (apply, params, gpt2_config, history).

  Every ``log_every`` steps a history row holds the mean training loss since
  the last row; every ``eval_every`` steps (and at the end) also the held-out
  DART NLL per target token (:func:`mean_token_nll`, as the fine-tuning's
  validation NLL).
  """
  apply, params, gpt2_config = init_model(config, tokenizer.vocab_size)
  optimizer, schedule = lm_adamw(config)
  step_fn, opt_state = make_step(apply, optimizer), optimizer.init(params)
  lengths = train["loss_mask"].sum(axis=1)
  batches = batch_indices(lengths, config.batch_size, config.seed)
  history, losses, tokens, padded, eval_seconds = [], [], 0.0, 0, 0.0
  started = time.perf_counter()
  for step in range(1, config.steps + 1):
    idx = next(batches)
    batch = trim(train, idx)
    params, opt_state, loss = step_fn(params, opt_state, batch)
    tokens += float(batch["loss_mask"].sum()) + len(idx)
    padded += batch["tokens"].size
    losses.append(float(loss))
    if step % config.log_every == 0 or step == config.steps:
      history.append(_log_row(step, losses, schedule, config, tokens, started,
                              len(train["tokens"])))
      history[-1]["padded_tokens"] = padded
      losses = []
      if step % config.eval_every == 0 or step == config.steps:
        t0 = time.perf_counter()
        history[-1]["heldout_dart_nll"] = mean_token_nll(apply, params, heldout,
                                                         config.eval_batch_size)
        eval_seconds += time.perf_counter() - t0
      history[-1]["eval_seconds"] = eval_seconds
      print(json.dumps(history[-1]), flush=True)
      on_log(history)
  return apply, params, gpt2_config, history


def public_data(config: PretrainConfig) -> tuple[GPT2Tokenizer, dict, dict, dict]:
  """Tokenizer, training arrays (all tokens), held-out arrays (target tokens) and counts;
  reads only ``gpt2/`` and ``dart/``, and with ``e2e_public_slice`` E2E's training split,
  of which only the public restaurants' pairs are kept."""
  tokenizer = GPT2Tokenizer(os.path.join(config.data_dir, "gpt2"), config.vocab_size)
  pairs, paths = public_dart_pairs(config.data_dir)
  counts = {"files": paths, "dart_pairs": len(pairs)}
  if config.e2e_public_slice is not None:
    e2e, names = public_e2e_pairs(config.data_dir, config.e2e_public_slice)
    pairs = pairs + e2e
    counts.update(e2e_public_pairs=len(e2e), e2e_public_names=names,
                  e2e_public_rule=f"sha256(name) % {config.e2e_public_slice} == 0")
  train, heldout = split_heldout(pairs)
  counts.update(pairs=len(pairs), train_pairs=len(train), heldout_pairs=len(heldout),
                excluded_origins=sorted(EXCLUDED_ORIGINS))
  return (tokenizer, all_token_arrays(tokenizer, train, config.max_length),
          encode_pairs(tokenizer, heldout, config.max_length), counts)


def zero_shot_e2e_nll(config: PretrainConfig, out: str, batch_size: int = 64) -> float:
  """E2E validation NLL per target token of the SAVED model, loaded as fine-tuning loads
  it (:func:`dpmuon_jax.text.train.load_model`) and scored as :func:`train_lm` scores
  validation (:func:`mean_token_nll` on :func:`encode_pairs` at ``max_length``): with
  ``e2e_public_slice``, on the private restaurants' validation pairs only, as fine-tuning
  with ``LMTrainConfig(public_slice=...)`` scores it."""
  ft = LMTrainConfig(data_dir=config.data_dir, init_weights=out, vocab_size=config.vocab_size,
                     max_length=config.max_length, eval_batch_size=batch_size,
                     public_slice=config.e2e_public_slice)
  tokenizer = GPT2Tokenizer(os.path.join(config.data_dir, "gpt2"), ft.vocab_size)
  apply, params, _, _ = load_model(ft, tokenizer.vocab_size)
  valid = load_split(ft, "valid").pairs[:config.e2e_eval_pairs]
  return mean_token_nll(apply, params, encode_pairs(tokenizer, valid, ft.max_length),
                        ft.eval_batch_size)


def sha256_file(path: str) -> str:
  with open(path, "rb") as f:
    return hashlib.file_digest(f, "sha256").hexdigest()


def run(config: PretrainConfig) -> dict:
  """Pretrains, saves the Hugging Face layout, checks it loads back, scores E2E zero-shot;
  writes ``history.csv`` and ``results.json`` next to the weights."""
  os.makedirs(config.out, exist_ok=True)
  tokenizer, train, heldout, counts = public_data(config)
  history_path = os.path.join(config.out, "history.csv")
  started = time.perf_counter()
  apply, params, gpt2_config, history = pretrain(
      config, tokenizer, train, heldout, lambda h: write_csv(history_path, h))
  wall = time.perf_counter() - started
  train_seconds = wall - history[-1]["eval_seconds"]  # incl. the step's compilation
  save_hf_gpt2(params, gpt2_config, config.out)
  loaded, loaded_config = load_hf_gpt2(config.out)
  same = loaded_config == gpt2_config and all(
      np.array_equal(a, b) for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(loaded)))
  results = {
      "setting": "public pretraining (non-private, DART without its E2E part"
                 + (", and E2E's public restaurants" if config.e2e_public_slice else "")
                 + "), then private fine-tuning with LMTrainConfig(init_weights=this directory"
                 + (f", public_slice={config.e2e_public_slice})" if config.e2e_public_slice
                    else ")"),
      "config": dataclasses.asdict(config), "model": gpt2_config._asdict(),
      "parameters": int(sum(np.size(x) for x in jax.tree.leaves(params))),
      "data": counts, "lr_schedule": "linear warmup, then cosine decay to 0.1 × peak",
      "wall_seconds": wall, "train_seconds": train_seconds,
      "real_tokens_per_second": history[-1]["real_tokens"] / train_seconds,
      "padded_tokens_per_second": history[-1]["padded_tokens"] / train_seconds,
      "final_train_loss": history[-1]["train_loss"],
      "heldout_dart_nll": history[-1]["heldout_dart_nll"],
      "roundtrip_bit_exact": bool(same),
      "e2e_valid_zero_shot_nll": zero_shot_e2e_nll(config, config.out),
      "e2e_eval_pairs": config.e2e_eval_pairs,
      "sha256": {WEIGHTS_FILE: sha256_file(os.path.join(config.out, WEIGHTS_FILE))},
  }
  with open(os.path.join(config.out, "results.json"), "w") as f:
    json.dump(results, f, indent=2)
  return results


def measure_step(config: PretrainConfig, vocab_size: int, timed_steps: int = 3) -> dict:
  """Seconds per non-private AdamW step at (batch_size, max_length) on this machine's CPU,
  after one compiling step; tokens/s counts every (padded) position. Trimmed training
  batches are shorter (DART, full vocabulary: 83 of 128 positions on average), so
  ``minutes_at_full_width`` bounds the run's time from above."""
  apply, params, gpt2_config = init_model(config, vocab_size)
  optimizer, _ = lm_adamw(config)
  step_fn, opt_state = make_step(apply, optimizer), optimizer.init(params)
  rng = np.random.default_rng(0)
  shape = (config.batch_size, config.max_length)
  batch = {"tokens": rng.integers(0, vocab_size, shape, dtype=np.int32),
           "loss_mask": np.ones(shape, np.float32)}
  params, opt_state, loss = step_fn(params, opt_state, batch)
  jax.block_until_ready(loss)
  started = time.perf_counter()
  for _ in range(timed_steps):
    params, opt_state, loss = step_fn(params, opt_state, batch)
  jax.block_until_ready(loss)
  seconds = (time.perf_counter() - started) / timed_steps
  return {"dim": config.dim, "layers": config.layers, "heads": config.heads,
          "vocab_size": vocab_size,
          "parameters": int(sum(np.size(x) for x in jax.tree.leaves(params))),
          "embedding_parameters": vocab_size * config.dim, "seconds_per_step": seconds,
          "padded_tokens_per_second": config.batch_size * config.max_length / seconds,
          "minutes_at_full_width": config.steps * seconds / 60, "steps": config.steps}


def measure(config: PretrainConfig, candidates: Sequence[tuple] = CANDIDATES) -> list[dict]:
  """:func:`measure_step` for each (dim, layers, heads, vocab_size); prints one JSON line each."""
  load = os.getloadavg()[0]
  print(f"# CPU: {os.cpu_count()} cores, 1-min load average {load:.2f}. They are SHARED with "
        "another training job, so these rates are under that contention.", flush=True)
  rows = []
  for dim, layers, heads, vocab in candidates:
    c = dataclasses.replace(config, dim=dim, layers=layers, heads=heads)
    rows.append(measure_step(c, vocab or 50257))
    print(json.dumps(rows[-1]), flush=True)
  return rows


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--data-dir", required=True, help="folder with dart/ and gpt2/ "
                      "(and e2e/ for the zero-shot E2E validation NLL after training)")
  parser.add_argument("--out", default=PretrainConfig.out)
  defaults = PretrainConfig(data_dir="")
  for name in ("dim", "layers", "heads", "steps", "batch_size", "seed", "warmup", "log_every",
               "eval_every"):
    parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(defaults, name))
  parser.add_argument("--vocab-size", type=int, default=defaults.vocab_size,
                      help="truncated BPE (fine-tuning then needs LMTrainConfig(vocab_size=V)); "
                      "0: GPT-2's full 50,257")
  parser.add_argument("--learning-rate", type=float, default=defaults.learning_rate)
  parser.add_argument("--e2e-eval-pairs", type=int, default=None,
                      help="score only the first n E2E validation pairs (default: all)")
  parser.add_argument("--e2e-public-slice", type=int, default=None, metavar="M",
                      help="also train on the E2E training pairs of the public restaurants, "
                      "sha256(name) %% M == 0 (fine-tuning then needs "
                      "LMTrainConfig(public_slice=M)); default: DART only")
  parser.add_argument("--measure", action="store_true",
                      help="time one AdamW step for each candidate size and exit")
  args = vars(parser.parse_args(argv))
  args["vocab_size"] = args["vocab_size"] or None
  do_measure = args.pop("measure")
  config = PretrainConfig(**args)
  if do_measure:
    measure(config)
  else:
    print(json.dumps(run(config), indent=2))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
