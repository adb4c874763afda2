"""The main job: train a Flax image classifier privately to a target (ε, δ).

Each step (docs/design.md, "One training step")::

    Poisson(q) indices ─► padded batch + mask ─► augment (own key stream)
      ─► per-example gradients ─► clipped sum ─► ONE Gaussian release ─► optimizer

This module is the image task of the one trainer
(:mod:`dpmuon_jax.training.driver`), which keeps the ledger, the checkpoints
(SECRET: they hold the RNG state), the release journal, several processes
and the export. The run stops, saves and says so before a release that would
cross the ε budget; resuming is refused when the privacy configuration changed.

Reported training-set statistics (clip fraction, gradient norms) are
non-private and only logged; test-set metrics use the public test split.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, cast

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh

from dpmuon_jax import checks
from dpmuon_jax.data.augment import augment
from dpmuon_jax.data.images import ImageDataset, normalize
from dpmuon_jax.data.loaders import TFDS_NAMES, load_dataset
from dpmuon_jax.data.users import UserGroups, group_by_user
from dpmuon_jax.distributed.mesh import shard_batch, sharded_capacity
from dpmuon_jax.models.registry import MODEL_NAMES, model_and_loss
from dpmuon_jax.optimizers import registry as optimizer_registry
from dpmuon_jax.privacy.clipping import CLIPPING_STYLES, USER, clipping_by_name
from dpmuon_jax.privacy.keys import RootKey, stream_key
from dpmuon_jax.privacy.query import RECORD_MASK
from dpmuon_jax.privacy.setup import make_private
from dpmuon_jax.training.driver import (
  RESULTS_NAME,
  Run,
  TrainingError,
  recorded_config,
  run_fingerprint,
  run_task,
)
from dpmuon_jax.training.journal import JOURNAL_NAME
from dpmuon_jax.training.settings import RunSettings, setting
from dpmuon_jax.training.step import make_private_step

PyTree = Any

__all__ = ["JOURNAL_NAME", "RESULTS_NAME", "TRAIN_BATCH_SIZE", "ImageTask", "TrainConfig",
           "TrainingError", "evaluation_fn", "recorded_config", "run_fingerprint", "train"]


TRAIN_BATCH_SIZE = 256
"""The expected batch size of every command that trains images (train, tune, compare)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig(RunSettings):
  """Settings of one private training run; each field is the ``dpmuon train`` flag of its name.

  ``batch_size`` is the EXPECTED batch size qN of Poisson sampling and the
  release denominator D. ``learning_rate=None`` takes the optimizer's paper
  preset. The shared fields (ε, δ, C, seed, output and resume) are
  :class:`~dpmuon_jax.training.settings.RunSettings`; every field is checked
  when the config is made.
  """

  model: str = setting("cnn", choices=MODEL_NAMES, help="cnn: the small benchmark CNN; wrn16_4, "
                       "wrn28_10, resnet18 (GroupNorm); vit_small (LayerNorm)")
  dataset: str = setting("digits", help="'digits' (embedded, no download), a TFDS name "
                         f"({', '.join(TFDS_NAMES)}), or a path to an .npz with x_train, "
                         "y_train, x_test, y_test")
  data_dir: str | None = setting(None, help="TFDS data directory")
  optimizer: str = setting(
      "dp_muon", choices=lambda: tuple(optimizer_registry.OPTIMIZERS),  # as registered now
      help="a registered optimizer (dpmuon train --help lists them)")
  optimizer_options: dict = setting(  # checked with the optimizer: registry.check_options
      default_factory=dict, help="keyword arguments of the optimizer, as JSON "
      "(e.g. {\"weight_decay\": 0.01})")
  batch_size: int = setting(
      TRAIN_BATCH_SIZE, check=checks.check_positive_int,
      help="expected batch size qN of Poisson sampling (also the noise denominator)")
  epochs: float = setting(10.0, check=checks.check_positive, help="length of the run in passes "
                          "over the training set: about epochs/q releases of Poisson-sampled "
                          "batches")
  learning_rate: float | None = setting(  # 0 is refused: it would silently mean the preset
      None, check=checks.check_positive, aliases=("--lr",),
      help="peak learning rate (default: the optimizer's paper preset)")
  fallback_learning_rate: float | None = setting(
      None, check=checks.check_nonnegative, aliases=("--fallback-lr",),
      help="Muon family: peak learning rate of the group Muon does not take (biases, norm "
      "scales), on the same schedule (default: the preset's, DP-SGD's rate)")
  warmup_fraction: float = setting(
      0.05, check=lambda flag, v: checks.check_in_range(flag, v, 0.0, 1.0, True, False),
      help="linear warm-up over this fraction of the run, then cosine decay")
  clipping: str = setting("flat", choices=CLIPPING_STYLES,
                          help="how each example is scaled to norm ≤ C: one flat clip, per layer "
                          "(C/√L each), automatic (C·g/(‖g‖+0.01)), or automatic per layer")
  noise_multiplier: float | None = setting(
      None, check=checks.check_nonnegative, aliases=("--sigma",),
      help="fix σ instead of calibrating it; the run stops before ε would exceed --epsilon")
  augment: bool = setting(False, help="random crop and flip per example")
  model_overrides: dict = setting(
      default_factory=dict, help="model constructor arguments, as JSON (e.g. {\"groups\": 8})")
  init_weights: str | None = setting(
      None, help="public pretrained weights (flax.serialization msgpack of the params dict) to "
      "fine-tune from; default: from scratch")
  secure_noise: bool = setting(
      False, help="exact discrete Gaussian noise on an integer grid of the clipped sum, from OS "
      "entropy: resists floating-point attacks; one device; see docs/sharp-edges.md")

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
        # Added later: recorded only where it differs from what older checkpoints had.
        **({"privacy_unit": self.privacy_unit,
            "max_examples_per_user": self.max_examples_per_user}
           if self.privacy_unit == USER else {}),
        **self.noise_config(),
    }


def _validate(config: TrainConfig, data: ImageDataset) -> None:
  """What the fields' own checks cannot see: the data's size, two fields together, the
  optimizer's options."""
  if config.privacy_unit == USER:
    _check_user_level(data)
  units = _num_units(config, data)
  if config.batch_size > units:
    raise TrainingError(
        f"--batch-size must be in [1, {units}] (the training set's "
        f"{'users' if config.privacy_unit == USER else 'size'}), got {config.batch_size}."
    )
  if config.secure_noise and config.clipped_sum_method != "vmap":
    raise TrainingError("--secure-noise rounds every clipped query to its grid, which ghost "
                        "clipping never forms: use --clipped-sum-method vmap.")
  try:
    optimizer_registry.check_options(config.optimizer, config.optimizer_options,
                                     "optimizer_options")
  except ValueError as error:
    raise TrainingError(str(error)) from None


def _check_user_level(data: ImageDataset) -> None:
  if data.user_train is None:
    raise TrainingError("--privacy-unit user needs each training image's user: a "
                        "'user_train' array in the .npz (ImageDataset.user_train).")


def _num_units(config: TrainConfig, data: ImageDataset) -> int:
  """N of the accounting: training images, or their users at user level."""
  if config.privacy_unit != USER:
    return data.num_train
  return len(np.unique(np.asarray(data.user_train)))


def _user_table(config: TrainConfig, data: ImageDataset) -> UserGroups:
  """Each user's first ``max_examples_per_user`` image indices and their mask (U, m)."""
  groups = group_by_user({"index": np.arange(data.num_train, dtype=np.int32)},
                         np.asarray(data.user_train), config.max_examples_per_user)
  print(f"user-level DP: {groups.num_users} users, {groups.records_kept} images kept, "
        f"{groups.records_dropped} dropped past --max-examples-per-user "
        f"{config.max_examples_per_user}.", flush=True)
  return groups


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


def _make_user_batch_fn(data: ImageDataset, use_augment: bool, users: UserGroups) -> Callable:
  """Gathers a padded batch of USERS: (B, m) images, labels and ``record_mask``."""
  info = data.info
  x_train, y_train = jnp.asarray(data.x_train), jnp.asarray(data.y_train)
  table = jnp.asarray(users.arrays["index"])
  in_user = jnp.asarray(users.arrays[RECORD_MASK])

  @jax.jit
  def batch_fn(indices, mask, key):
    """Padding users and unfilled slots are zero dummies, masked out."""
    safe = jnp.where(mask, indices, 0)
    records = in_user[safe] & mask[:, None]
    rows = jnp.where(records, table[safe], 0)
    images = jnp.where(records[..., None, None, None], x_train[rows], 0)
    if use_augment:
      flat = images.reshape((-1,) + images.shape[2:])
      flat = augment(key, flat, crop_padding=info.crop_padding, hflip=info.hflip)
      images = flat.reshape(images.shape)
    return {"image": normalize(images, info.mean, info.std),
            "label": jnp.where(records, y_train[rows], 0), RECORD_MASK: records}

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


def _model_description(config: TrainConfig) -> dict:
  """The export certificate's public description of the model (no data, no secret)."""
  return {"architecture": config.model, "overrides": dict(config.model_overrides),
          "pretrained_initialisation": config.init_weights is not None}


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


# History columns -> TensorBoard tags; ``nonprivate_*`` columns go under ``nonprivate/``.
TRACKED = {"test_loss": "test/loss", "test_accuracy": "test/accuracy",
           "epsilon": "privacy/epsilon_spent", "learning_rate": "train/learning_rate",
           "epoch": "train/epoch"}
PLOTTED = (("test_accuracy", "test accuracy"), ("test_loss", "test loss"),
           ("epsilon", "ε spent"))


@dataclasses.dataclass
class ImageTask:
  """Image classification as a task of the one trainer (:mod:`dpmuon_jax.training.driver`)."""

  config: TrainConfig
  data: ImageDataset
  evaluation_fields: ClassVar[tuple[str, ...]] = ()  # eval_every is a run-control field

  def privacy_config(self) -> dict:
    return self.config.privacy_config(_num_units(self.config, self.data))

  def data_arrays(self) -> Sequence[np.ndarray]:
    if self.config.privacy_unit == USER:  # which images form each user's mean enters too
      users = _user_table(self.config, self.data).arrays
      return self.data.x_train, self.data.y_train, users["index"], users[RECORD_MASK]
    return self.data.x_train, self.data.y_train

  def build(self, root: RootKey, mesh: Mesh | None, rows_devices: int) -> Run:
    """Model, private setup (σ, sampler, release, ledger), optimizer and jitted step."""
    config, data = self.config, self.data
    model, loss_fn = model_and_loss(
        config.model, cast(int, data.num_classes), data.image_shape, seed=config.model_seed,
        tapped=config.clipped_sum_method != "vmap", **config.model_overrides,
    )
    units = _num_units(config, data)
    setup = make_private(
        target_epsilon=config.epsilon, target_delta=config.delta, dataset_size=units,
        expected_batch_size=config.batch_size, l2_clip_norm=config.clip, epochs=config.epochs,
        key=root, accountant=config.accountant, noise_multiplier=config.noise_multiplier,
        clipping=clipping_by_name(config.clipping, config.clip),
        secure_noise=config.secure_noise, privacy_unit=config.privacy_unit,
        noise=config.noise, bands=config.bands, buffers=config.buffers,
        # The padded batch must split evenly into devices × microbatches.
        capacity=sharded_capacity(
            units, config.batch_size / units, rows_devices, config.microbatch_size),
    )
    schedule = _learning_rate_schedule(config, setup.steps)
    optimizer = optimizer_registry.build(config.optimizer, schedule, setup.release_kwargs,
                                         **_optimizer_options(config, setup.steps))
    step_fn = make_private_step(optimizer, loss_fn, microbatch_size=config.microbatch_size,
                                mesh=mesh, clipped_sum_method=config.clipped_sum_method)
    batch_fn = (_make_batch_fn(data, config.augment) if config.privacy_unit != USER else
                _make_user_batch_fn(data, config.augment, _user_table(config, data)))
    augmentation_key, _ = stream_key(root, "augmentation")

    def to_chunks(padded, key_index):
      step_key = jax.random.fold_in(augmentation_key, key_index)
      chunks = []
      for i, chunk in enumerate(padded):
        mask = jnp.asarray(chunk.mask)
        batch = batch_fn(chunk.indices, mask, jax.random.fold_in(step_key, i))
        chunks.append((batch, mask) if mesh is None else shard_batch(mesh, batch, mask))
      return chunks

    test_metrics = evaluation_fn(model.apply, data.info, data.x_test, data.y_test)

    def evaluate(params) -> dict:
      test_loss, test_accuracy = test_metrics(params)
      return {"test_loss": test_loss, "test_accuracy": test_accuracy}

    steps_per_epoch = setup.sampler.steps_per_epoch
    return Run(setup, optimizer, step_fn, to_chunks,
               _initial_params(model.params, config.init_weights), steps_per_epoch,
               evaluate, self._results, {"learning_rate": schedule}, steps_per_epoch,
               TRACKED, PLOTTED, _model_description(config))

  def _results(self, params: PyTree, history: list[dict]) -> dict:
    del params  # the last history row is its evaluation
    init_weights = self.config.init_weights
    return {
        "final_test_accuracy": history[-1]["test_accuracy"],
        "best_test_accuracy": max(h["test_accuracy"] for h in history),
        "final_test_loss": history[-1]["test_loss"],
        "initialisation": (f"pretrained weights from {init_weights}" if init_weights
                           else "from scratch"),
    }


def train(config: TrainConfig, data: ImageDataset | None = None,
          callbacks: Sequence[Callable[[int], None]] = ()) -> dict:
  """Runs (or resumes) one private training run and returns its results.

  Writes ``results.json``, ``history.csv``, ``curves.png``, owner-only
  checkpoints, the release journal and ``export/`` (the parameters and the
  privacy certificate, nothing secret) under ``config.output_dir``. ``callbacks`` are
  called with the number of releases made after each release
  (:func:`~dpmuon_jax.training.driver.run_task`).
  """
  data = load_dataset(config.dataset, config.data_dir) if data is None else data
  _validate(config, data)
  return run_task(ImageTask(config, data), callbacks)
