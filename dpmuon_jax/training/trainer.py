"""The main job: train a Flax model privately to a target (ε, δ).

Each step (docs/design.md, "One training step")::

    Poisson(q) indices ─► padded batch + mask ─► augment (own key stream)
      ─► per-example gradients ─► clipped sum ─► ONE Gaussian release ─► optimizer

The privacy ledger records every release; the run stops, saves and says so
before a release that would cross the ε budget. Checkpoints (orbax) hold the
parameters, optimizer state, step, RNG state and the ledger; resuming is
refused when the privacy configuration changed. Checkpoints hold RNG state and
are therefore SECRET.

Reported training-set statistics (clip fraction, gradient norms) are
non-private and only logged; test-set metrics use the public test split.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
import math
import os
import time
from collections.abc import Callable
from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh

from dpmuon_jax.data.augment import augment
from dpmuon_jax.data.images import ImageDataset, normalize
from dpmuon_jax.data.loaders import load_dataset
from dpmuon_jax.distributed.mesh import (
    DATA_AXIS,
    data_mesh,
    shard_batch,
    sharded_capacity,
)
from dpmuon_jax.distributed.multihost import (
    agree_on_root,
    check_same_everywhere,
    is_multi_process,
    is_primary,
    replicate,
    sync,
)
from dpmuon_jax.distributed.sharding import (
    MODEL_AXIS,
    model_mesh,
    model_size,
    param_specs,
    parse_mesh_shape,
    shard_train_state,
)
from dpmuon_jax.models.registry import model_and_loss
from dpmuon_jax.optimizers import registry as optimizer_registry
from dpmuon_jax.privacy.accounting import PrivacyLedger
from dpmuon_jax.privacy.clipping import CLIPPING_STYLES, clipping_by_name
from dpmuon_jax.privacy.ghost import CLIPPED_SUM_METHODS
from dpmuon_jax.privacy.keys import RootKey, root_key, stream_key
from dpmuon_jax.privacy.release import PrivateTransformation, noise_stream, with_noise_counter
from dpmuon_jax.privacy.setup import PrivateSetup, make_private
from dpmuon_jax.training.checkpoint import (
    TrainingCheckpoint,
    latest_good_step,
    restore_checkpoint,
    restore_metadata,
    save_checkpoint,
)
from dpmuon_jax.training.export import export_run
from dpmuon_jax.training.journal import (
    JOURNAL_NAME,
    JournalEntry,
    append_entry,
    check_settings,
    mend_torn_line,
    plan_resume,
    read_records,
)
from dpmuon_jax.training.loop import BUDGET, COMPLETED, Hooks, LoopState, run_releases
from dpmuon_jax.training.records import write_csv
from dpmuon_jax.training.step import PrivateStep, make_private_step
from dpmuon_jax.training.tracking import MissingExtraError, history_tags, tensorboard_writer

PyTree = Any


class TrainingError(ValueError):
  """A configuration or resume problem, reported to the user in one line."""


@dataclasses.dataclass
class TrainConfig:
  """Settings of one private training run (the ``dpmuon train`` flags).

  ``batch_size`` is the EXPECTED batch size qN of Poisson sampling and the
  release denominator D. ``learning_rate=None`` takes the optimizer's paper
  preset. ``seed=None`` draws noise and sampling randomness from OS entropy;
  a seed makes the run reproducible and is recorded as seeded.
  """

  model: str = "cnn"
  dataset: str = "digits"
  data_dir: str | None = None
  optimizer: str = "dp_muon"
  optimizer_options: dict = dataclasses.field(default_factory=dict)  # e.g. {"buffer": "ema"}
  epsilon: float = 4.0
  delta: float = 1e-5
  batch_size: int = 256
  epochs: float = 10.0
  learning_rate: float | None = None
  fallback_learning_rate: float | None = None  # Muon family: the 1-D group's peak η′
  warmup_fraction: float = 0.05
  clip: float = 1.0
  clipping: str = "flat"  # one of privacy.clipping.CLIPPING_STYLES, all with total bound clip
  noise_multiplier: float | None = None  # None: calibrate to (epsilon, delta)
  seed: int | None = None
  output_dir: str = "runs/dpmuon"
  resume: bool = False
  microbatch_size: int | None = None
  clipped_sum_method: str = "vmap"  # "vmap", "ghost" or "automatic" (privacy.ghost)
  augment: bool = False
  eval_every: int | None = None  # steps; None: once per epoch
  checkpoint_every: int | None = None  # steps; None: once per epoch
  log_clip_stats: bool = False
  accountant: str = "rdp"
  max_steps: int | None = None  # stop early (e.g. smoke tests); the ledger stays exact
  progress: bool = True
  plot: bool = True
  model_seed: int = 0  # public initialisation seed
  devices: int | None = None  # data-parallel devices; None or 1: one device
  mesh: str | None = None  # "DATAxMODEL" over all devices: state split over model (sharding.py)
  model_overrides: dict = dataclasses.field(default_factory=dict)  # e.g. {"groups": 8}
  init_weights: str | None = None  # msgpack of a params dict (flax.serialization); None: scratch
  secure_noise: bool = False  # exact discrete Gaussian noise from OS entropy (one device)
  log_dir: str | None = None  # TensorBoard event files (the tensorboard extra); None: none

  def privacy_config(self, dataset_size: int) -> dict:
    """What must not change between a checkpoint and its resumption."""
    return {
        "dataset": self.dataset,
        "dataset_size": dataset_size,
        "optimizer": self.optimizer,
        "model": self.model,
        "model_overrides": self.model_overrides,
        "init_weights": self.init_weights,
        "batch_size": self.batch_size,
        "clip": self.clip,
        "clipping": self.clipping,
        "delta": self.delta,
        "accountant": self.accountant,
        "secure_noise": self.secure_noise,
    }


def _validate(config: TrainConfig, data: ImageDataset) -> None:
  if not config.epsilon > 0:
    raise TrainingError(f"--epsilon must be > 0, got {config.epsilon}.")
  if not 0 < config.delta < 1:
    raise TrainingError(f"--delta must be in (0, 1), got {config.delta}.")
  if not 0 < config.batch_size <= data.num_train:
    raise TrainingError(
        f"--batch-size must be in [1, {data.num_train}] (the training set size), "
        f"got {config.batch_size}."
    )
  if config.optimizer not in optimizer_registry.OPTIMIZERS:
    raise TrainingError(
        f"Unknown optimizer {config.optimizer!r}; choose from "
        f"{', '.join(optimizer_registry.OPTIMIZERS)}."
    )
  if config.clipped_sum_method not in CLIPPED_SUM_METHODS:
    raise TrainingError(f"--clipped-sum-method must be one of {', '.join(CLIPPED_SUM_METHODS)}, "
                        f"got {config.clipped_sum_method!r}.")
  if config.secure_noise and config.clipped_sum_method != "vmap":
    raise TrainingError("--secure-noise rounds every clipped query to its grid, which ghost "
                        "clipping never forms: use --clipped-sum-method vmap.")
  if config.clipping not in CLIPPING_STYLES:
    raise TrainingError(
        f"--clipping must be one of {', '.join(CLIPPING_STYLES)}, got {config.clipping!r}."
    )
  from dpmuon_jax import checks

  optional_positive_ints = {
      "--microbatch-size": config.microbatch_size,
      "eval_every": config.eval_every,
      "checkpoint_every": config.checkpoint_every,
      "--max-steps": config.max_steps,
      "--devices": config.devices,
  }
  try:
    checks.check_positive("--epochs", config.epochs)
    checks.check_positive("--clip", config.clip)
    if config.learning_rate is not None:  # 0 is refused: it would silently mean the preset
      checks.check_positive("--lr", config.learning_rate)
    if config.fallback_learning_rate is not None:
      checks.check_nonnegative("--fallback-lr", config.fallback_learning_rate)
    checks.check_in_range("warmup_fraction", config.warmup_fraction, 0.0, 1.0, True, False)
    if config.noise_multiplier is not None:
      checks.check_nonnegative("--noise-multiplier", config.noise_multiplier)
    if config.seed is not None:
      checks.check_int("--seed", config.seed)
    checks.check_int("model_seed", config.model_seed)
    for name, value in optional_positive_ints.items():
      if value is not None:
        checks.check_positive_int(name, value)
  except ValueError as error:
    raise TrainingError(str(error)) from None


def _learning_rate_schedule(config: TrainConfig, total_steps: int,
                            peak: float | None = None) -> optax.Schedule:
  """Cosine decay with linear warm-up over ``warmup_fraction`` of the run (paper 1).

  ``peak``: the schedule's top; ``None``: the run's learning rate (or the preset's).
  """
  if peak is None:
    peak = config.learning_rate or optimizer_registry.preset(config.optimizer).learning_rate
  warmup = int(config.warmup_fraction * total_steps)
  return optax.warmup_cosine_decay_schedule(0.0, peak, warmup, max(total_steps, warmup + 1))


def _optimizer_options(config: TrainConfig, total_steps: int) -> dict:
  """``optimizer_options`` with the Muon family's 1-D group on the run's schedule.

  The fallback group (:class:`~dpmuon_jax.optimizers.options.Fallback`: the
  options', else the preset's) runs its own peak rate η′ —
  ``fallback_learning_rate`` if given, else the Fallback's — under the same
  warm-up and cosine decay as the Muon group (paper 1 decays every group).
  """
  options = dict(config.optimizer_options)
  preset = optimizer_registry.preset(config.optimizer).kwargs
  fallback = options.get("fallback", preset.get("fallback"))
  if fallback is None:
    if config.fallback_learning_rate is not None:
      raise ValueError(f"{config.optimizer} has no fallback group: fallback_learning_rate "
                       "is for the Muon family.")
    return options
  peak = config.fallback_learning_rate
  if peak is None:
    peak = fallback.learning_rate
  if isinstance(peak, (int, float)):
    fallback = dataclasses.replace(fallback,
                                   learning_rate=_learning_rate_schedule(config, total_steps, peak))
  options["fallback"] = fallback
  return options


def _make_batch_fn(data: ImageDataset, use_augment: bool) -> Callable:
  info = data.info
  x_train = jnp.asarray(data.x_train)
  y_train = jnp.asarray(data.y_train)

  @jax.jit
  def batch_fn(indices, mask, key):
    """Gathers a padded batch; padding rows are zero dummies, never real examples."""
    safe = jnp.where(mask, indices, 0)
    images = jnp.where(mask[:, None, None, None], x_train[safe], 0)
    labels = jnp.where(mask, y_train[safe], 0)
    if use_augment:
      images = augment(key, images, crop_padding=info.crop_padding, hflip=info.hflip)
    return {"image": normalize(images, info.mean, info.std), "label": labels}

  return batch_fn


def evaluation_fn(apply, info, images: np.ndarray, labels: np.ndarray,
                  eval_batch: int = 500) -> Callable[[PyTree], tuple[float, float]]:
  """``evaluate(params) -> (mean cross-entropy, accuracy)`` on ``images``, ``labels``.

  Images are normalised with ``info``'s public constants; fixed-size padded
  chunks, so one compilation serves every call.
  """

  @jax.jit
  def batch_metrics(params, images, labels, mask):
    logits = apply(params, normalize(images, info.mean, info.std))
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    correct = jnp.argmax(logits, -1) == labels
    return jnp.sum(jnp.where(mask, loss, 0.0)), jnp.sum(mask & correct)

  def evaluate(params) -> tuple[float, float]:
    n = len(labels)
    total_loss, total_correct = 0.0, 0
    for start in range(0, n, eval_batch):
      idx = np.arange(start, start + eval_batch)
      mask = idx < n
      idx = np.where(mask, idx, 0)
      loss, correct = batch_metrics(params, images[idx], labels[idx], mask)
      total_loss += float(loss)
      total_correct += int(correct)
    return total_loss / n, total_correct / n

  return evaluate


def _initial_params(params: PyTree, path: str | None) -> PyTree:
  """The model's own initialisation, or public pretrained weights from ``path``."""
  if path is None:
    return params
  from flax import serialization

  try:
    with open(path, "rb") as f:
      loaded = serialization.from_bytes(params, f.read())
  except OSError as error:
    raise TrainingError(f"--init-weights: cannot read {path}: {error.strerror}.") from None
  except (ValueError, KeyError, TypeError) as error:
    raise TrainingError(
        f"--init-weights: {path} does not match the model's parameters ({error})."
    ) from None
  for (where, want), got in zip(
      jax.tree_util.tree_flatten_with_path(params)[0], jax.tree.leaves(loaded)
  ):
    if np.shape(got) != np.shape(want):
      raise TrainingError(
          f"--init-weights: {path} has shape {np.shape(got)} at "
          f"{jax.tree_util.keystr(where)}, the model needs {np.shape(want)}."
      )
  return loaded


def _progress(total: int, initial: int, enabled: bool):
  if not enabled:
    return None
  from tqdm.auto import tqdm

  return tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True)


_FINISHED = ("completed", "budget")
# TrainConfig fields that change neither the clipped sums nor the trajectory.
_NOT_FINGERPRINTED = (
    "output_dir", "resume", "progress", "plot", "eval_every", "checkpoint_every",
    "max_steps", "log_clip_stats", "log_dir",
)


def run_fingerprint(config: TrainConfig, data: ImageDataset, stream: np.ndarray) -> str:
  """A digest of everything that determines the releases of a run, the data included.

  Two runs with equal fingerprints, resumed from the same checkpoint on the
  same backend, make bit-identical releases; the release journal replays lost
  releases only then. ``stream`` is the noise stream the releases draw from
  (:func:`~dpmuon_jax.privacy.release.noise_stream`): a lost release redone
  from another stream would be a second release of the same sum, never a
  replay, whatever the settings say.
  """
  settings = {k: v for k, v in dataclasses.asdict(config).items() if k not in _NOT_FINGERPRINTED}
  digest = hashlib.sha256()
  digest.update(json.dumps(settings, sort_keys=True, default=str).encode())
  digest.update(np.asarray(stream, np.uint32).tobytes())
  for array in (data.x_train, data.y_train):
    array = np.ascontiguousarray(array)
    digest.update(f"{array.dtype}{array.shape}".encode())
    digest.update(array.tobytes())
  digest.update(f"{jax.__version__} {jax.default_backend()} {_library_version()}".encode())
  # The key -> noise map depends on it: a replay under the other setting would add other noise.
  digest.update(f"threefry_partitionable={jax.config.values['jax_threefry_partitionable']}".encode())
  if is_multi_process():  # another summation order: a release would not replay bit for bit
    digest.update(f"processes={jax.process_count()} devices={jax.device_count()}".encode())
  return digest.hexdigest()


def _library_version() -> str:
  try:
    return importlib.metadata.version("dpmuon-jax")
  except importlib.metadata.PackageNotFoundError:
    return "unknown"


def recorded_config(output_dir: str) -> dict | None:
  """The settings a run in ``output_dir`` was made with (its newest checkpoint's), or ``None``.

  Only what determines the run: the fields that control how it is run
  (``--max-steps``, progress, logging, ...) are left out, so a resume states
  them anew.
  """
  ckpt_dir = os.path.join(output_dir, "checkpoints")
  step = latest_good_step(ckpt_dir)
  if step is None:
    return None
  config = restore_metadata(ckpt_dir, step)["config"]
  return {k: v for k, v in config.items() if k not in _NOT_FINGERPRINTED}


def _resume_point(
    config: TrainConfig, ckpt_dir: str, journal_path: str, dataset_size: int
) -> tuple[int | None, dict | None]:
  """The checkpoint step and metadata to resume from (``None`` for a new run)."""
  has_journal = bool(read_records(journal_path))
  step = latest_good_step(ckpt_dir)
  if not config.resume:
    if step is not None or has_journal:
      raise TrainingError(
          f"{config.output_dir} already holds a run (checkpoints or a release journal): "
          "pass --resume to continue or finish it (it reuses the run's settings), or choose "
          "another --output-dir for a new run."
      )
    return None, None
  if step is None:
    if not has_journal:
      raise TrainingError(f"--resume: no checkpoint in {ckpt_dir}.")
    return None, None  # crashed before its first checkpoint: the journal still counts
  metadata = restore_metadata(ckpt_dir, step)
  saved, current = metadata["privacy_config"], config.privacy_config(dataset_size)
  if saved != current:
    changed = {k: (saved.get(k), v) for k, v in current.items() if saved.get(k) != v}
    raise TrainingError(f"Refusing to resume: the privacy configuration changed {changed}.")
  saved_seed = metadata["config"].get("seed")
  if config.seed is not None and config.seed != saved_seed:
    raise TrainingError(
        f"Refusing to resume: --seed {config.seed} differs from the run's "
        f"{'seed ' + str(saved_seed) if saved_seed is not None else 'OS-entropy root key'}; "
        "resume without --seed or with the same one."
    )
  return step, metadata


RESULTS_NAME = "results.json"


def _outputs_written(output_dir: str) -> bool:
  """Whether a run's final outputs exist (the last thing :func:`_finish` writes is results)."""
  return os.path.exists(os.path.join(output_dir, RESULTS_NAME))


def _finished(config: TrainConfig, run: _Run, ledger: PrivacyLedger, root: RootKey,
              ckpt_dir: str, metadata: dict, resume_step: int | None) -> dict:
  """The results of a run that already ended (completed or stopped by its budget).

  A run stopped after its final checkpoint but before its outputs writes them now,
  from that checkpoint, without another release.
  """
  if not _outputs_written(config.output_dir):
    params, opt_state, start, history = _starting_point(run, ckpt_dir, metadata, resume_step)
    state = LoopState(params, opt_state, start, metadata["key_index"])
    return _finish(config, run, ledger, history, state, metadata["stop_reason"], 0.0, start,
                   root.seeded)
  print(
      f"The run in {config.output_dir} already finished ({metadata['stop_reason']}) after "
      f"{ledger.count} releases, ε = {ledger.epsilon():.4f}; nothing to do."
  )
  with open(os.path.join(config.output_dir, RESULTS_NAME)) as f:
    return json.load(f)


class _Run(NamedTuple):
  """What one run is built from (public settings and functions, no data)."""

  setup: PrivateSetup
  optimizer: PrivateTransformation
  schedule: optax.Schedule
  step_fn: PrivateStep
  to_chunks: Callable
  evaluate: Callable
  initial_params: PyTree
  steps_per_epoch: int
  end: int
  mesh: Mesh | None = None


def _train_mesh(config: TrainConfig, num_devices: int) -> Mesh | None:
  """``--mesh DATAxMODEL`` over every device, else the data mesh of ``--devices`` (or none)."""
  if config.mesh is None:
    return data_mesh(num_devices) if num_devices > 1 else None
  if is_multi_process():
    raise TrainingError("--mesh shards the state within one process only (checkpoints "
                        "gather it); use --devices with several processes.")
  try:
    data, model = parse_mesh_shape(config.mesh)
    if config.devices is not None and config.devices != data * model:
      raise ValueError(f"--devices {config.devices} disagrees with --mesh {config.mesh}.")
    return model_mesh(data, model)
  except ValueError as error:
    raise TrainingError(f"--mesh: {error}") from None


def _check_layouts(mesh: Mesh | None, params: PyTree) -> None:
  """A leaf that the mesh's 'model' axis cannot split stops the run, naming the leaf."""
  if mesh is not None:
    try:
      param_specs(params, model_size(mesh))
    except ValueError as error:
      raise TrainingError(f"--mesh: {error}") from None


def _num_devices(config: TrainConfig) -> int:
  """``--devices`` (default 1); with several processes, every device of every process."""
  if is_multi_process():
    if config.devices not in (None, jax.device_count()):
      raise TrainingError(
          f"--devices {config.devices}: the mesh of {jax.process_count()} processes spans all "
          f"their {jax.device_count()} devices; leave --devices out or pass {jax.device_count()}."
      )
    return jax.device_count()
  num_devices = config.devices or 1
  if num_devices > jax.device_count():
    raise TrainingError(
        f"--devices {num_devices}: only {jax.device_count()} device(s) are available."
    )
  return num_devices


def _build_run(config: TrainConfig, data: ImageDataset, root: RootKey) -> _Run:
  """Model, private setup (σ, sampler, release, ledger), optimizer and jitted step."""
  num_devices = _num_devices(config) if config.mesh is None else 1
  mesh = _train_mesh(config, num_devices)
  rows_devices = num_devices if mesh is None else dict(mesh.shape)[DATA_AXIS]
  model, loss_fn = model_and_loss(
      config.model, cast(int, data.num_classes), data.image_shape, seed=config.model_seed,
      tapped=config.clipped_sum_method != "vmap", **config.model_overrides,
  )
  setup = make_private(
      target_epsilon=config.epsilon, target_delta=config.delta, dataset_size=data.num_train,
      expected_batch_size=config.batch_size, l2_clip_norm=config.clip, epochs=config.epochs,
      key=root, accountant=config.accountant, noise_multiplier=config.noise_multiplier,
      clipping=clipping_by_name(config.clipping, config.clip), secure_noise=config.secure_noise,
      # The padded batch must split evenly into devices × microbatches.
      capacity=sharded_capacity(
          data.num_train, config.batch_size / data.num_train, rows_devices,
          config.microbatch_size),
  )
  schedule = _learning_rate_schedule(config, setup.steps)
  optimizer = optimizer_registry.build(config.optimizer, schedule, setup.release_kwargs,
                                       **_optimizer_options(config, setup.steps))
  _check_layouts(mesh, model.params)
  step_fn = make_private_step(optimizer, loss_fn, microbatch_size=config.microbatch_size,
                              mesh=mesh, clipped_sum_method=config.clipped_sum_method)
  batch_fn = _make_batch_fn(data, config.augment)
  augmentation_key, _ = stream_key(root, "augmentation")

  def to_chunks(padded, key_index):
    step_key = jax.random.fold_in(augmentation_key, key_index)
    chunks = []
    for i, chunk in enumerate(padded):
      mask = jnp.asarray(chunk.mask)
      batch = batch_fn(chunk.indices, mask, jax.random.fold_in(step_key, i))
      chunks.append((batch, mask) if mesh is None else shard_batch(mesh, batch, mask))
    return chunks

  end = setup.steps if config.max_steps is None else min(setup.steps, config.max_steps)
  evaluate = evaluation_fn(model.apply, data.info, data.x_test, data.y_test)
  return _Run(setup, optimizer, schedule, step_fn, to_chunks, evaluate,
              _initial_params(model.params, config.init_weights),
              max(1, round(1 / setup.sampler.sampling_rate)), end, mesh)


def _metadata(config: TrainConfig, data: ImageDataset, run: _Run, root: RootKey,
              ledger: PrivacyLedger, key_index: int, stop: str | None, history) -> dict:
  """What a checkpoint records besides the arrays (SECRET: holds the root key)."""
  return {
      "privacy_config": config.privacy_config(data.num_train),
      "ledger": ledger.to_json(),
      "root_key": np.asarray(root.key).tolist(),
      "seeded": bool(root.seeded),
      "key_index": key_index,
      "stop_reason": stop,
      "clipping": run.optimizer.release.clipping.describe(),
      "secure_noise": run.optimizer.release.secure_noise,
      "history": history,
      "config": dataclasses.asdict(config),
  }


def _resumed_ledger(run: _Run, metadata: dict | None) -> PrivacyLedger:
  """The run's ledger: a new one, or the checkpoint's if it accounts for the same settings."""
  if metadata is None:
    return run.setup.ledger
  ledger = PrivacyLedger.from_json(metadata["ledger"])
  try:
    ledger.check_compatible(run.setup.ledger)
  except ValueError as error:
    raise TrainingError(f"Refusing to resume: {error}; resume with the run's own settings "
                        "(leave them out: --resume reuses them) or choose another "
                        "--output-dir.") from None
  return ledger


def _starting_point(run: _Run, ckpt_dir, metadata, resume_step):
  """(params, opt_state, step, history) of a new run or of its checkpoint."""
  params = run.initial_params
  opt_state = run.optimizer.init(params)
  if metadata is None:
    return (*_placed(run.mesh, params, opt_state), 0, [])
  restored = restore_checkpoint(ckpt_dir, TrainingCheckpoint(params, opt_state, 0, {}),
                                resume_step)
  params, opt_state = restored.params, restored.opt_state
  if is_multi_process():  # each process read its own copy: one replicated state on the mesh
    params, opt_state = replicate(data_mesh(), (params, opt_state))
  return (*_placed(run.mesh, params, opt_state), restored.step, metadata["history"])


def _placed(mesh: Mesh | None, params: PyTree, opt_state: PyTree) -> tuple[PyTree, PyTree]:
  """The state split over a (data, model) mesh's 'model' axis; as it is otherwise."""
  if mesh is None or MODEL_AXIS not in mesh.axis_names:
    return params, opt_state
  return shard_train_state(mesh, params, opt_state)


def _plan_keys(config, run: _Run, ledger, journal_path, fingerprint, start, metadata, root):
  """Replays or charges the releases lost after the checkpoint (see training/journal.py).

  The lost releases must have been made under this run's privacy settings
  (read from the journal); otherwise the resume is refused, with or without
  a checkpoint. Without a checkpoint every journaled release is lost.
  """
  key_index = metadata.get("key_index", start) if metadata is not None else 0
  records = read_records(journal_path)
  lost = [e for e in records if e.key_index >= key_index]
  try:  # after a checkpoint, entries older than journaled settings are the checkpoint's own
    check_settings([e for e in lost if metadata is None or e.privacy is not None],
                   ledger.config._asdict())
  except ValueError as error:
    raise TrainingError(
        f"Refusing to resume: {error}. Resume with the run's own settings, or start a new "
        "--output-dir."
    ) from None
  plan = plan_resume(
      records, start, key_index, fingerprint,
      # Secure noise comes from OS entropy at every release: it never replays.
      replayable=(metadata is not None or root.seeded) and not config.secure_noise,
  )
  if plan.charge_now:
    ledger.record(run.setup.sampler, run.optimizer, count=plan.charge_now)
    print(
        f"{plan.charge_now} release(s) made after the last checkpoint cannot be replayed "
        f"exactly: charged to the ledger (ε = {ledger.epsilon():.4f}), fresh noise from here."
    )
  return plan


def train(config: TrainConfig, data: ImageDataset | None = None) -> dict:
  """Runs (or resumes) one private training run and returns its results.

  Writes ``results.json``, ``history.csv``, ``curves.png``, owner-only
  checkpoints, the release journal and ``export/`` (the parameters and the
  privacy certificate, nothing secret) under ``config.output_dir``.
  """
  data = load_dataset(config.dataset, config.data_dir) if data is None else data
  _validate(config, data)
  os.makedirs(config.output_dir, exist_ok=True)
  ckpt_dir = os.path.join(config.output_dir, "checkpoints")
  journal_path = os.path.join(config.output_dir, JOURNAL_NAME)
  resume_step, metadata = _resume_point(config, ckpt_dir, journal_path, data.num_train)
  # Several processes: process 0's root everywhere (and a barrier: all have read the run dir).
  root = agree_on_root(root_key(config.seed) if metadata is None else RootKey(
      jnp.asarray(metadata["root_key"], jnp.uint32), metadata["seeded"]))
  run = _build_run(config, data, root)
  ledger = _resumed_ledger(run, metadata)
  if metadata is not None and metadata.get("stop_reason") in _FINISHED:
    return _finished(config, run, ledger, root, ckpt_dir, metadata, resume_step)
  params, opt_state, start, history = _starting_point(run, ckpt_dir, metadata, resume_step)
  fingerprint = run_fingerprint(config, data, noise_stream(opt_state))
  plan = _plan_keys(config, run, ledger, journal_path, fingerprint, start, metadata, root)
  check_same_everywhere("the run and its resume point", f"{fingerprint} {start} {plan}")
  state = LoopState(params, with_noise_counter(opt_state, plan.key_index), start, plan.key_index)

  if is_primary():  # a line torn by the crash would run into the next one
    mend_torn_line(journal_path)

  def save(state: LoopState, stop: str | None = None) -> None:
    meta = _metadata(config, data, run, root, ledger, state.key_index, stop, history)
    if is_primary():  # several processes: process 0 writes checkpoints, journal and outputs
      save_checkpoint(ckpt_dir, TrainingCheckpoint(state.params, state.opt_state, state.step, meta))

  bar = _progress(run.end, start, config.progress and is_primary())
  tracker = _open_tracker(config.log_dir if is_primary() else None, start)
  hooks = Hooks(
      before=(lambda s: append_entry(journal_path, JournalEntry(
          s.step, s.key_index, fingerprint, ledger.config._asdict())))
      if is_primary() else None,
      after=_after_release(config, run, ledger, history, bar, save, tracker),
  )
  started = time.perf_counter()
  state, stop_reason = run_releases(
      run.step_fn, state, run.end, sampler=run.setup.sampler, optimizer=run.optimizer,
      to_chunks=run.to_chunks, ledger=ledger, hooks=hooks)
  if stop_reason == COMPLETED and run.end < run.setup.steps:
    stop_reason = "max_steps"
  if stop_reason == BUDGET:
    print(f"Stopped before step {state.step + 1}: one more release would exceed "
          f"ε = {config.epsilon} (spent {ledger.epsilon():.4f}). Checkpoint saved.")
  if state.key_index < plan.replay_until:
    # Lost releases this run did not redo still happened: charge them, skip their keys.
    ledger.record(run.setup.sampler, run.optimizer, count=plan.replay_until - state.key_index)
    state = state._replace(opt_state=with_noise_counter(state.opt_state, plan.replay_until),
                           key_index=plan.replay_until)
  if bar is not None:
    bar.close()
  save(state, stop_reason)
  results = _finish(config, run, ledger, history, state, stop_reason,
                    time.perf_counter() - started, start, root.seeded)
  _close_tracker(tracker, history)
  return results


# History columns -> TensorBoard tags; ``nonprivate_*`` columns go under ``nonprivate/``.
TRACKED = {"test_loss": "test/loss", "test_accuracy": "test/accuracy",
           "epsilon": "privacy/epsilon_spent", "learning_rate": "train/learning_rate",
           "epoch": "train/epoch"}


def _open_tracker(log_dir: str | None, start: int):
  """The run's TensorBoard writer (``None`` without ``--log-dir``).

  Resumed from step ``start``, it first drops what an interrupted run logged after it.
  """
  try:
    return tensorboard_writer(log_dir, purge_step=start + 1 if start else None)
  except MissingExtraError as error:
    raise TrainingError(str(error)) from None


def _close_tracker(tracker, history: list[dict]) -> None:
  """Writes the final evaluation when the hook did not, and closes the event files."""
  if tracker is None:
    return
  if history and history[-1]["step"] != tracker.last_step:
    tracker.scalars(history[-1]["step"], history_tags(history[-1], TRACKED))
  tracker.close()


def _after_release(config, run: _Run, ledger, history, bar, save, tracker=None) -> Callable:
  """Evaluates, logs and checkpoints after a release (the loop's ``after`` hook)."""
  eval_every = config.eval_every or run.steps_per_epoch
  checkpoint_every = config.checkpoint_every or run.steps_per_epoch

  def after(previous: LoopState, state: LoopState, out) -> None:
    del previous
    done = state.step
    if done % eval_every == 0 or done == run.end:
      test_loss, test_acc = run.evaluate(state.params)
      record = {"step": done, "epoch": done / run.steps_per_epoch, "epsilon": ledger.epsilon(),
                "test_loss": test_loss, "test_accuracy": test_acc,
                "learning_rate": float(np.asarray(run.schedule(done)))}
      if config.log_clip_stats:
        record["nonprivate_clip_fraction"] = float(out.stats.clip_fraction)
        record["nonprivate_mean_grad_norm"] = float(out.stats.mean_norm)
      history.append(record)
      if tracker is not None:
        tracker.scalars(done, history_tags(record, TRACKED))
      if bar is not None:
        bar.set_postfix(loss=f"{test_loss:.3f}", acc=f"{test_acc:.3f}",
                        eps=f"{record['epsilon']:.2f}")
    if bar is not None:
      bar.update(1)
    if done % checkpoint_every == 0 and done != run.end:
      save(state)

  return after


def _finish(config, run: _Run, ledger, history, state: LoopState, stop_reason, elapsed, start,
            seeded) -> dict:
  """Final evaluation, results.json, history.csv, the plot and the export."""
  if not history or history[-1]["step"] != state.step:
    test_loss, test_acc = run.evaluate(state.params)
    history.append({"step": state.step, "epoch": state.step / run.steps_per_epoch,
                    "epsilon": ledger.epsilon(), "test_loss": test_loss,
                    "test_accuracy": test_acc})
  results = _results(config, run.setup, ledger, history, stop_reason, elapsed,
                     state.step - start, run.steps_per_epoch, seeded)
  results["export"] = "export"  # relative to the run's folder, which may be moved
  if is_primary():
    export_run(config.output_dir)  # parameters + certificate, no secrets, in export/
    _write_outputs(config.output_dir, results, history, config.plot)
  sync("dpmuon train: outputs written")  # several processes: none returns before they exist
  return results


def _results(config, setup, ledger, history, stop_reason, elapsed, steps_run,
             steps_per_epoch, seeded) -> dict:
  final = history[-1]
  return {
      "final_test_accuracy": final["test_accuracy"],
      "best_test_accuracy": max(h["test_accuracy"] for h in history),
      "final_test_loss": final["test_loss"],
      "epsilon_spent": ledger.epsilon(),
      "target_epsilon": config.epsilon,
      "delta": config.delta,
      "noise_multiplier": setup.noise_multiplier,
      "sampling_rate": setup.sampler.sampling_rate,
      "denominator": setup.release.release.denominator,
      "releases": ledger.count,
      "planned_steps": setup.steps,
      "stop_reason": stop_reason,
      "seeded": bool(seeded),
      "secure_noise": setup.release.release.secure_noise,
      "clipping": setup.release.release.clipping.describe(),
      "seconds_per_epoch": elapsed / max(steps_run, 1) * steps_per_epoch if steps_run else None,
      "initialisation": (
          f"pretrained weights from {config.init_weights}" if config.init_weights
          else "from scratch"
      ),
      "guarantee": (
          "per run, add/remove-one adjacency; hyperparameter search across runs is not covered"
      ),
      # The seed is the root key of a seeded run: it stays in the owner-only checkpoints.
      "config": {**dataclasses.asdict(config), "seed": None},
  }


def _write_outputs(output_dir: str, results: dict, history: list[dict], plot: bool) -> None:
  """history.csv, the plot, then results.json (atomically, last: it marks the outputs done)."""
  fields = sorted({k for h in history for k in h}, key=lambda k: (k != "step", k))
  write_csv(os.path.join(output_dir, "history.csv"), history, fields)
  if plot:
    _plot(output_dir, history)
  path = os.path.join(output_dir, RESULTS_NAME)
  with open(path + ".tmp", "w") as f:
    json.dump(results, f, indent=2)
  os.replace(path + ".tmp", path)


def _plot(output_dir: str, history: list[dict]) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  steps = [h["step"] for h in history]
  fig, axes = plt.subplots(1, 3, figsize=(12, 3.2))
  for ax, key, label in zip(
      axes,
      ("test_accuracy", "test_loss", "epsilon"),
      ("test accuracy", "test loss", "ε spent"),
  ):
    ax.plot(steps, [h[key] for h in history], marker="o", ms=3)
    ax.set_xlabel("step")
    ax.set_title(label)
    if key == "epsilon" and any(math.isfinite(h[key]) for h in history):
      ax.set_ylim(bottom=0)
  fig.tight_layout()
  fig.savefig(os.path.join(output_dir, "curves.png"), dpi=110)
  plt.close(fig)
