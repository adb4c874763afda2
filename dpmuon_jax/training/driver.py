"""The one trainer: any task, on one device, a mesh, or several processes.

::

    task.build(root, mesh) ─► Run: setup (σ, sampler, release, ledger), optimizer, step,
                              how a sample becomes a batch, evaluation, final results
    resume point (checkpoint + release journal)
    for each release: budget ─► journal ─► task's probe ─► release ─► seal ─► ledger
                      ─► evaluate / log ─► callbacks ─► checkpoint
    final evaluation, results.json, history.csv, plot, export/

Control goes one way: this module's loop calls the task's named functions
(:class:`Run`'s) and :func:`~dpmuon_jax.training.loop.release`; nothing it
calls calls back into it.

What a run trains is a :class:`Task`: the image classifier
(:mod:`dpmuon_jax.training.trainer`) and GPT-2 table-to-text
(:mod:`dpmuon_jax.text.train`) are the two. Everything else is this module's
and the same for both:

* the privacy ledger records every release; the run stops, saves and says so
  before a release that would cross the ε budget;
* checkpoints (orbax) hold the parameters, optimizer state, step, root key and
  ledger, and are therefore SECRET; resuming is refused when the privacy
  configuration changed; the release journal replays or charges releases made
  after the last checkpoint (:mod:`dpmuon_jax.training.journal`);
* several processes (:mod:`dpmuon_jax.distributed.multihost`): one root key,
  so one Poisson sample and one noise draw for the whole group, each process
  feeding only its devices' rows; process 0 alone writes checkpoints, journal
  and outputs, and every process resumes from the same checkpoint;
* ``export/`` holds the parameters and their privacy certificate, nothing secret;
* a run made in a search (``dpmuon tune``) finds the search's record in its
  folder and keeps it in every checkpoint: its results, history and export
  state the search's ε (:func:`~dpmuon_jax.training.export.certified`), and a
  resume without the record is refused.

A task's ``config`` is a :class:`~dpmuon_jax.training.settings.RunSettings`
(its privacy settings and run control, each field checked when it is made)
with the task's own fields.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.metadata
import json
import math
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, ClassVar, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh

from dpmuon_jax.distributed.mesh import DATA_AXIS, data_mesh
from dpmuon_jax.distributed.multihost import (
    agree_on_root,
    check_same_everywhere,
    gather_to_host,
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
from dpmuon_jax.extras import pyplot, requires
from dpmuon_jax.privacy.accounting import PrivacyLedger
from dpmuon_jax.privacy.keys import RootKey, root_key
from dpmuon_jax.privacy.release import PrivateTransformation, noise_stream, with_noise_counter
from dpmuon_jax.privacy.setup import PrivateSetup
from dpmuon_jax.training.checkpoint import (
    TrainingCheckpoint,
    latest_good_step,
    restore_checkpoint,
    restore_metadata,
    save_checkpoint,
)
from dpmuon_jax.training.export import (
    certified,
    certified_epsilon,
    export_run,
    guarantee,
    read_search,
)
from dpmuon_jax.training.journal import (
    JOURNAL_NAME,
    JournalEntry,
    any_seeded,
    append_entry,
    append_seal,
    check_settings,
    mend_torn_line,
    plan_resume,
    read_records,
    read_seals,
)
from dpmuon_jax.training.loop import BUDGET, COMPLETED, LoopState, host_words, release
from dpmuon_jax.training.records import write_csv
from dpmuon_jax.training.settings import RunSettings
from dpmuon_jax.training.step import PrivateStep, StepOutput
from dpmuon_jax.training.tracking import history_tags, tensorboard_writer

PyTree = Any

RESULTS_NAME = "results.json"
CURVES = "curves.png"  # the run's plot (with ``plot``)
_FINISHED = ("completed", "budget")
# Run-control fields: they change neither the clipped sums nor the trajectory.
_NOT_FINGERPRINTED = (
    "output_dir", "resume", "progress", "plot", "eval_every", "checkpoint_every",
    "max_steps", "log_clip_stats", "log_dir",
)


class TrainingError(ValueError):
  """A configuration or resume problem, reported to the user in one line."""


class Run(NamedTuple):
  """What a task builds for one run (public settings and functions, no secrets).

  Attributes:
    setup: σ, the Poisson sampler, the release and a fresh ledger.
    optimizer: the private optimizer (one release, then post-processing).
    step_fn: the jitted private step.
    to_chunks: ``(padded_batches, key_index) -> [(batch, mask), …]``, placed on the mesh.
    initial_params: the public starting point (placed on the mesh by the trainer).
    steps_per_epoch: round(N/B) releases (the sampler's ``steps_per_epoch``); the default
      checkpoint interval.
    evaluate: ``params -> {metric: value}`` on held-out data, a history row's metrics.
    results: ``(params, history) -> {key: value}``, the task's part of ``results.json``
      (e.g. final accuracy, decoded-text scores).
    rates: the learning-rate schedules recorded in each history row, by column name.
    eval_every: the default evaluation interval in releases (``config.eval_every`` wins).
    tracked: history columns -> TensorBoard tags.
    plotted: ``(column, title)`` panels of ``curves.png``.
    model: the public description of the model trained (``architecture``, its shape or
      overrides, ``pretrained_initialisation``): the export certificate's ``model``.
    before_release: ``state -> None`` before each release (e.g. a NON-PRIVATE probe).
    print_records: print each history row as a JSON line (process 0).
    write_extra: ``(output_dir, results) -> None``, process 0 only, before results.json.
  """

  setup: PrivateSetup
  optimizer: PrivateTransformation
  step_fn: PrivateStep
  to_chunks: Callable
  initial_params: PyTree
  steps_per_epoch: int
  evaluate: Callable[[PyTree], dict]
  results: Callable[[PyTree, list[dict]], dict]
  rates: Mapping[str, optax.Schedule]
  eval_every: int
  tracked: Mapping[str, str]
  plotted: Sequence[tuple[str, str]]
  model: Mapping[str, Any]
  before_release: Callable[[LoopState], None] | None = None
  print_records: bool = False
  write_extra: Callable[[str, dict], None] | None = None


class Task(Protocol):
  """What a private training run trains: its settings, private data, model and outputs."""

  @property
  def config(self) -> RunSettings:
    """The run's settings: the shared ones, and the task's own fields (fingerprinted too)."""
    ...

  # Config fields that change only what is evaluated or decoded, never a release.
  evaluation_fields: ClassVar[tuple[str, ...]]

  def privacy_config(self) -> dict:
    """What must not change between a checkpoint and its resumption."""
    ...

  def data_arrays(self) -> Sequence[np.ndarray]:
    """The private training arrays; their :func:`data_digest` enters the fingerprint."""
    ...


  def build(self, root: RootKey, mesh: Mesh | None, rows_devices: int) -> Run:
    """The run's parts; ``rows_devices`` devices split each padded batch's rows."""
    ...


def run_fingerprint(config: RunSettings, data_sha256: str, stream: np.ndarray,
                    evaluation_fields: Sequence[str] = ()) -> str:
  """A digest of everything that determines the releases of a run, the data included.

  Two runs with equal fingerprints, resumed from the same checkpoint on the
  same backend, make bit-identical releases; the release journal replays lost
  releases only then. ``data_sha256`` is
  :func:`~dpmuon_jax.training.driver.data_digest` of the private training arrays.
  ``stream`` is the noise stream the releases draw from
  (:func:`~dpmuon_jax.privacy.release.noise_stream`): a lost release redone
  from another stream would be a second release of the same sum, never a
  replay, whatever the settings say. ``evaluation_fields`` (the task's) are left out
  with the run-control fields: a resume that changes them still replays.
  """
  left_out = (*_NOT_FINGERPRINTED, *evaluation_fields)
  settings = {k: v for k, v in dataclasses.asdict(config).items() if k not in left_out}
  digest = hashlib.sha256()
  digest.update(json.dumps(settings, sort_keys=True, default=str).encode())
  digest.update(np.asarray(stream, np.uint32).tobytes())
  digest.update(data_sha256.encode())
  digest.update(f"{jax.__version__} {jax.default_backend()} {_library_version()}".encode())
  # The key -> noise map depends on it: a replay under the other setting would add other noise.
  digest.update(f"threefry_partitionable={jax.config.values['jax_threefry_partitionable']}".encode())
  if is_multi_process():  # another summation order: a release would not replay bit for bit
    digest.update(f"processes={jax.process_count()} devices={jax.device_count()}".encode())
  return digest.hexdigest()


def data_digest(data_arrays: Sequence[np.ndarray]) -> str:
  """SHA-256 of the private training arrays (dtype, shape and bytes of each, in order)."""
  digest = hashlib.sha256()
  for array in data_arrays:
    array = np.ascontiguousarray(array)
    digest.update(f"{array.dtype}{array.shape}".encode())
    digest.update(array.tobytes())
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


def _resume_point(task: Task, ckpt_dir: str, journal_path: str, data_sha256: str
                  ) -> tuple[int | None, dict | None]:
  """The checkpoint step and metadata to resume from (``None`` for a new run).

  The privacy configuration, the seed and the training data (its digest, where the
  checkpoint records one) must be the checkpoint's.
  """
  config = task.config
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
  # As the checkpoint's JSON holds it (a tuple reads back as a list).
  saved, current = metadata["privacy_config"], json.loads(json.dumps(task.privacy_config()))
  if saved != current:
    changed = {k: (saved.get(k), v) for k, v in current.items() if saved.get(k) != v}
    raise TrainingError(f"Refusing to resume: the privacy configuration changed {changed}.")
  if metadata.get("data_sha256", data_sha256) != data_sha256:
    raise TrainingError("Refusing to resume: the training data differ from the run's "
                        "(another file, subset or tokenisation); resume on the run's own data.")
  saved_seed = metadata["config"].get("seed")
  if config.seed is not None and config.seed != saved_seed:
    raise TrainingError(
        f"Refusing to resume: --seed {config.seed} differs from the run's "
        f"{'seed ' + str(saved_seed) if saved_seed is not None else 'OS-entropy root key'}; "
        "resume without --seed or with the same one."
    )
  return step, metadata


def _outputs_written(output_dir: str) -> bool:
  """Whether a run's final outputs exist (the last thing :func:`_finish` writes is results)."""
  return os.path.exists(os.path.join(output_dir, RESULTS_NAME))


class _Placed(NamedTuple):
  """A run with where it runs: its mesh, the release it stops before and the record of
  the search it was made in (``None``: none), which its outputs state."""

  run: Run
  mesh: Mesh | None
  end: int
  search: dict | None = None


def _train_mesh(config: RunSettings, num_devices: int) -> Mesh | None:
  """``--mesh DATAxMODEL`` over every device, else the data mesh of ``--devices`` (or none)."""
  if config.mesh is None:
    return data_mesh(num_devices) if num_devices > 1 else None
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


def _num_devices(config: RunSettings) -> int:
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


def _search(output_dir: str, metadata: dict | None) -> dict | None:
  """The record of the search the run was made in: its folder's, which must be the one its
  checkpoint holds (:func:`~dpmuon_jax.training.export.read_search`)."""
  try:
    return read_search(output_dir, None if metadata is None else metadata.get("search"))
  except ValueError as error:
    raise TrainingError(f"Refusing to resume: {error}" if metadata else str(error)) from None


def _build(task: Task, root: RootKey, search: dict | None) -> _Placed:
  """The task's run on the mesh of ``--mesh`` or ``--devices`` (none for one device)."""
  config = task.config
  mesh = _train_mesh(config, _num_devices(config) if config.mesh is None else 1)
  rows_devices = 1 if mesh is None else dict(mesh.shape)[DATA_AXIS]
  run = task.build(root, mesh, rows_devices)
  try:  # an optimizer releasing at another σ (or C, D, relation) than σ was set for
    run.setup.ledger.check(run.setup.sampler, run.optimizer)
  except ValueError as error:
    raise TrainingError(f"{config.optimizer}: {error}") from None
  _check_layouts(mesh, run.initial_params)
  steps = run.setup.steps
  return _Placed(run, mesh, steps if config.max_steps is None else min(steps, config.max_steps),
                 search)


def _metadata(task: Task, placed: _Placed, root: RootKey, ledger: PrivacyLedger,
              key_index: int, stop: str | None, history, data_sha256: str) -> dict:
  """What a checkpoint records besides the arrays (SECRET: holds the root key)."""
  run = placed.run
  return {
      "privacy_config": task.privacy_config(),
      "data_sha256": data_sha256,
      "ledger": ledger.to_json(),
      "root_key": np.asarray(root.key).tolist(),
      "seeded": bool(root.seeded),
      "key_index": key_index,
      "stop_reason": stop,
      "clipping": run.optimizer.release.clipping.describe(),
      "secure_noise": run.optimizer.release.secure_noise,
      "model": dict(run.model),
      "history": history,
      "config": dataclasses.asdict(task.config),
      "search": placed.search,
  }


def _resumed_ledger(run: Run, metadata: dict | None) -> PrivacyLedger:
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


def _starting_point(placed: _Placed, ckpt_dir, metadata, resume_step):
  """(params, opt_state, step, history) of a new run or of its checkpoint."""
  params = placed.run.initial_params
  opt_state = placed.run.optimizer.init(params)
  if metadata is None:
    return (*_placed(placed.mesh, params, opt_state), 0, [])
  restored = restore_checkpoint(ckpt_dir, TrainingCheckpoint(params, opt_state, 0, {}),
                                resume_step)
  params, opt_state = restored.params, restored.opt_state
  sharded = placed.mesh is not None and MODEL_AXIS in placed.mesh.axis_names
  if is_multi_process() and not sharded:  # each process read its own copy: one replicated state
    params, opt_state = replicate(data_mesh(), (params, opt_state))
  return (*_placed(placed.mesh, params, opt_state), restored.step, metadata["history"])


def _placed(mesh: Mesh | None, params: PyTree, opt_state: PyTree) -> tuple[PyTree, PyTree]:
  """The state split over a (data, model) mesh's 'model' axis; as it is otherwise."""
  if mesh is None or MODEL_AXIS not in mesh.axis_names:
    return params, opt_state
  return shard_train_state(mesh, params, opt_state)


def _plan_keys(run: Run, ledger, journal_path, fingerprint, start, metadata, root, seals):
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
      replayable=(metadata is not None or root.seeded) and not run.optimizer.release.secure_noise,
      sealed=seals.keys(),
  )
  if plan.key_index > start:  # the lost releases cannot be replayed: fresh noise from here
    refuse_fresh_noise(ledger)
  if plan.charge_now:  # a seeded start's releases keep their caveat under a fresh root
    ledger.record(run.setup.sampler, run.optimizer, count=plan.charge_now,
                  seeded=any_seeded(lost))
    print(
        f"{plan.charge_now} release(s) made after the last checkpoint cannot be replayed "
        f"exactly: charged to the ledger (ε = {ledger.epsilon():.4f}), fresh noise from here."
    )
  return plan


class _Clock:
  """The run's time in releases and evaluations, wall and CPU, checkpoint writes left out.

  A resumed run's clock goes on from the time its checkpoint recorded, so
  ``elapsed`` covers releases ``first + 1`` onwards with ``first = 0`` (the
  releases redone after a crash are counted once, a resumption's compilation
  is counted); from a checkpoint that recorded no time, ``first`` is its step.
  """

  def __init__(self, wall: float = 0.0, cpu: float = 0.0, first: int = 0):
    self.first = first
    self._offset = (wall, cpu)
    self._started = (time.perf_counter(), time.process_time())

  @classmethod
  def resumed(cls, metadata: dict | None, start: int) -> _Clock:
    """The clock of a run starting at step ``start`` from ``metadata`` (``None``: a new run)."""
    if metadata is None:
      return cls()
    if "elapsed" not in metadata:
      return cls(first=start)
    return cls(*metadata["elapsed"])

  def elapsed(self) -> tuple[float, float]:
    return (self._offset[0] + time.perf_counter() - self._started[0],
            self._offset[1] + time.process_time() - self._started[1])

  @contextlib.contextmanager
  def paused(self) -> Iterator[None]:
    """Leaves what runs inside (a checkpoint write) out of the elapsed time."""
    stopped = self.elapsed()
    try:
      yield
    finally:
      self._offset = stopped
      self._started = (time.perf_counter(), time.process_time())


@dataclasses.dataclass
class _Session:
  """One run in progress: what its loop writes to (journal, ledger, history, progress,
  TensorBoard, checkpoints) and the per-release calls it makes, top to bottom."""

  task: Task
  placed: _Placed
  ledger: PrivacyLedger
  root: RootKey
  history: list[dict]
  clock: _Clock
  ckpt_dir: str
  journal_path: str
  fingerprint: str
  data_sha256: str
  seals: Mapping[int, Sequence[int]]  # SECRET: the digest of each released clipped sum
  replay_until: int
  callbacks: Sequence[Callable[[int], None]]
  bar: Any = None
  tracker: Any = None

  def journal_release(self, state: LoopState) -> None:
    """The journal entry of a release, written (process 0) before the release is made."""
    if is_primary():
      append_entry(self.journal_path, JournalEntry(
          state.step, state.key_index, self.fingerprint, self.ledger.config._asdict(),
          bool(self.root.seeded)))

  def is_recorded_sum(self, state: LoopState, seal) -> bool:
    """A replayed release must release a clipped sum of the seal recorded before the crash."""
    expected = self.seals.get(state.key_index) if state.key_index < self.replay_until else None
    return expected is None or host_words(seal) == tuple(expected)

  def journal_seal(self, state: LoopState, seal) -> None:
    """The release's seal, journaled at once, before anything of the release can be seen."""
    words = host_words(seal)  # on every process: the step ends here, as on process 0
    if is_primary():
      append_seal(self.journal_path, state.key_index, words)

  def after_release(self, state: LoopState, out: StepOutput) -> None:
    """Evaluates and logs (every ``eval_every`` releases and at the end), calls the
    caller's callbacks, checkpoints (every ``checkpoint_every``, not at the end)."""
    config, run, done = self.task.config, self.placed.run, state.step
    if done % (config.eval_every or run.eval_every) == 0 or done == self.placed.end:
      self.log(_record(self.placed, self.ledger, done, state.params, self.clock), out)
    if self.bar is not None:
      self.bar.update(1)
    for callback in self.callbacks:
      callback(done)
    if done % (config.checkpoint_every or run.steps_per_epoch) == 0 and done != self.placed.end:
      with self.clock.paused():
        self.save(state)

  def log(self, record: dict, out: StepOutput | None = None) -> None:
    """A history row: the NON-PRIVATE clip statistics with ``log_clip_stats``, printed (where
    the task asks), to TensorBoard and the progress bar."""
    run = self.placed.run
    if out is not None and self.task.config.log_clip_stats:
      record["nonprivate_clip_fraction"] = float(out.stats.clip_fraction)
      record["nonprivate_mean_grad_norm"] = float(out.stats.mean_norm)
    self.history.append(record)
    _print_record(run, record)
    if self.tracker is not None:
      self.tracker.scalars(record["step"], history_tags(record, run.tracked))
    if self.bar is not None:
      self.bar.set_postfix({k: f"{record[k]:.3f}" for k, _ in run.plotted})

  def save(self, state: LoopState, stop: str | None = None) -> None:
    """A checkpoint of ``state`` (SECRET), written by process 0."""
    meta = {**_metadata(self.task, self.placed, self.root, self.ledger, state.key_index, stop,
                        self.history, self.data_sha256), "elapsed": self.clock.elapsed()}
    # Several processes: each gathers the leaves split over them; process 0 writes.
    params, opt_state = gather_to_host((state.params, state.opt_state))
    if is_primary():
      save_checkpoint(self.ckpt_dir, TrainingCheckpoint(params, opt_state, state.step, meta))


def run_task(task: Task, callbacks: Sequence[Callable[[int], None]] = ()) -> dict:
  """Runs (or resumes) one private training run of ``task`` and returns its results.

  Writes ``results.json``, ``history.csv``, ``curves.png`` (with ``plot``),
  owner-only checkpoints, the release journal and ``export/`` (the parameters
  and the privacy certificate, nothing secret) under ``config.output_dir``.
  ``callbacks`` are called with the number of releases made after each release
  and its evaluation, before its checkpoint, on every process (e.g. to measure
  memory: ``benchmarks/_peak_memory.py``); they see no private value.
  """
  config = task.config
  if config.plot and is_primary():
    pyplot(CURVES)  # a missing extra fails here, not after the last release
  os.makedirs(config.output_dir, exist_ok=True)
  ckpt_dir = os.path.join(config.output_dir, "checkpoints")
  journal_path = os.path.join(config.output_dir, JOURNAL_NAME)
  data_sha256 = data_digest(task.data_arrays())
  resume_step, metadata = _resume_point(task, ckpt_dir, journal_path, data_sha256)
  search = _search(config.output_dir, metadata)
  # Several processes: process 0's root everywhere (and a barrier: all have read the run dir).
  root = agree_on_root(root_key(config.seed) if metadata is None else RootKey(
      jnp.asarray(metadata["root_key"], jnp.uint32), metadata["seeded"]))
  placed = _build(task, root, search)
  ledger = _resumed_ledger(placed.run, metadata)
  if metadata is not None and metadata.get("stop_reason") in _FINISHED:
    return _finished(task, placed, ledger, root, ckpt_dir, metadata, resume_step)
  params, opt_state, start, history = _starting_point(placed, ckpt_dir, metadata, resume_step)
  fingerprint = run_fingerprint(config, data_sha256, noise_stream(opt_state),
                                task.evaluation_fields)
  seals = read_seals(journal_path)
  plan = _plan_keys(placed.run, ledger, journal_path, fingerprint, start, metadata, root, seals)
  check_same_everywhere("the run and its resume point", f"{fingerprint} {start} {plan}")
  state = LoopState(params, with_noise_counter(opt_state, plan.key_index), start, plan.key_index)
  if is_primary():  # a line torn by the crash would run into the next one
    mend_torn_line(journal_path)
  session = _Session(task, placed, ledger, root, history, _Clock.resumed(metadata, start),
                     ckpt_dir, journal_path, fingerprint, data_sha256, seals, plan.replay_until,
                     callbacks, bar=_progress(placed.end, start, config.progress and is_primary()),
                     tracker=_open_tracker(config.log_dir if is_primary() else None, start))
  state, stop_reason = _settled(placed, ledger, plan.replay_until, *_releases(session, state),
                                config.epsilon)
  if session.bar is not None:
    session.bar.close()
  elapsed = session.clock.elapsed()  # the releases' time, without the final checkpoint and outputs
  session.save(state, stop_reason)
  results = _finish(task, placed, ledger, history, state, stop_reason, session.clock, elapsed,
                    root.seeded)
  _close_tracker(session.tracker, history, placed.run.tracked)
  return results


def _releases(session: _Session, state: LoopState) -> tuple[LoopState, str]:
  """The run's loop: budget → journal → the task's probe → one release → its seal → the
  ledger → evaluation, callbacks, checkpoint.

  A replayed release whose clipped sum is not the recorded one is discarded unseen; it
  and the lost releases after it are charged, their keys skipped, and the run goes on
  with fresh keys.
  """
  placed, ledger = session.placed, session.ledger
  run = placed.run
  while state.step < placed.end:
    if not ledger.can_release(1):
      return state, BUDGET
    session.journal_release(state)
    if run.before_release is not None:
      run.before_release(state)
    released = release(run.step_fn, state, sampler=run.setup.sampler, to_chunks=run.to_chunks)
    if not session.is_recorded_sum(state, released.seal):  # another sum under a used key
      refuse_fresh_noise(ledger)
      state = _skip_lost(run, ledger, state, session.replay_until)
      print(f"The release at step {state.step + 1} recomputed after the crash differs from "
            f"the one made before it: the lost releases are charged (ε = "
            f"{ledger.epsilon():.4f}), fresh noise from here.")
      continue
    session.journal_seal(state, released.seal)
    ledger.record(run.setup.sampler, run.optimizer)
    state = released.state
    session.after_release(state, released.out)
  return state, COMPLETED


def refuse_fresh_noise(ledger: PrivacyLedger) -> None:
  """Refuses to go on with fresh noise after lost releases, under cyclic sampling or
  correlated noise.

  Fresh noise from the checkpoint makes a second branch of releases beside the lost ones.
  With independent noise and Poisson sampling each branch's releases are more compositions,
  which the ledger charges. Under b-cyclic sampling the ledger counts ⌈T/b⌉ participations
  of one pass over the releases, and a BandMF or BLT release's noise is one pass over its
  strategy C: the second branch re-samples the same groups at the same steps and re-uses the
  checkpoint's noise buffers, which that accounting does not cover.

  Raises:
    TrainingError: for such a run; the lost releases stay in the journal, which
      ``dpmuon export`` charges.
  """
  c = ledger.config
  if c.cycle_length > 1 or c.bands > 1 or c.blt_steps:
    raise TrainingError(
        "Refusing to go on with fresh noise: releases made after the last checkpoint cannot "
        "be replayed exactly, and under cyclic sampling or correlated noise (BandMF, BLT) the "
        "accounting covers one pass over the run's releases, not a second branch from the "
        "checkpoint. The lost releases are in the journal and `dpmuon export` charges them. "
        "Resume with the run's own settings and code to replay them exactly, or start a new "
        "--output-dir.")


def _skip_lost(run: Run, ledger: PrivacyLedger, state: LoopState,
               replay_until: int) -> LoopState:
  """Charges the lost releases from ``state.key_index`` up to ``replay_until``, skips their keys."""
  ledger.record(run.setup.sampler, run.optimizer, count=replay_until - state.key_index)
  return state._replace(opt_state=with_noise_counter(state.opt_state, replay_until),
                        key_index=replay_until)


def _settled(placed: _Placed, ledger: PrivacyLedger, replay_until: int, state: LoopState,
             stop_reason: str, epsilon: float) -> tuple[LoopState, str]:
  """The state and stop reason to save once the loop ended (``max_steps``, ``budget``,
  ``completed``), with lost releases that were not redone charged and their keys skipped."""
  run = placed.run
  if stop_reason == COMPLETED and placed.end < run.setup.steps:
    stop_reason = "max_steps"
  if stop_reason == BUDGET:
    print(f"Stopped before step {state.step + 1}: one more release would exceed "
          f"ε = {epsilon} (spent {ledger.epsilon():.4f}). Checkpoint saved.")
  if state.key_index < replay_until:
    # Lost releases this run did not redo still happened: charge them, skip their keys.
    state = _skip_lost(run, ledger, state, replay_until)
  return state, stop_reason


def _finished(task: Task, placed: _Placed, ledger: PrivacyLedger, root: RootKey,
              ckpt_dir: str, metadata: dict, resume_step: int | None) -> dict:
  """The results of a run that already ended (completed or stopped by its budget).

  A run stopped after its final checkpoint but before its outputs writes them now,
  from that checkpoint, without another release.
  """
  output_dir = task.config.output_dir
  if not _outputs_written(output_dir):
    params, opt_state, start, history = _starting_point(placed, ckpt_dir, metadata, resume_step)
    state = LoopState(params, opt_state, start, metadata["key_index"])
    clock = _Clock.resumed(metadata, start)
    return _finish(task, placed, ledger, history, state, metadata["stop_reason"], clock,
                   clock.elapsed(), root.seeded)
  print(
      f"The run in {output_dir} already finished ({metadata['stop_reason']}) after "
      f"{ledger.count} releases, ε = {certified_epsilon(ledger.epsilon(), placed.search):.4f}; "
      "nothing to do."
  )
  with open(os.path.join(output_dir, RESULTS_NAME)) as f:
    return json.load(f)


def _progress(total: int, initial: int, enabled: bool):
  if not enabled:
    return None
  with requires("train", "The progress bar"):
    from tqdm.auto import tqdm

  return tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True)


def _open_tracker(log_dir: str | None, start: int):
  """The run's TensorBoard writer (``None`` without ``--log-dir``).

  Resumed from step ``start``, it first drops what an interrupted run logged after it.
  """
  return tensorboard_writer(log_dir, purge_step=start + 1 if start else None)


def _close_tracker(tracker, history: list[dict], tracked: Mapping[str, str]) -> None:
  """Writes the final evaluation when the hook did not, and closes the event files."""
  if tracker is None:
    return
  if history and history[-1]["step"] != tracker.last_step:
    tracker.scalars(history[-1]["step"], history_tags(history[-1], tracked))
  tracker.close()


def _print_record(run: Run, record: dict) -> None:
  """A history row as one JSON line on standard output, where the task asks (process 0)."""
  if run.print_records and is_primary():
    print(json.dumps(record), flush=True)


def _record(placed: _Placed, ledger: PrivacyLedger, step: int, params: PyTree,
            clock: _Clock) -> dict:
  """One history row: the step, ε spent (the search's, the run's own beside it, for a run
  made in a search), the task's held-out metrics, the rates, the time."""
  run, own = placed.run, ledger.epsilon()
  seconds, cpu_seconds = clock.elapsed()
  spent = {"epsilon": certified_epsilon(own, placed.search)}
  if placed.search is not None:
    spent["training_epsilon_per_run"] = own
  return {"step": step, "epoch": step / run.steps_per_epoch, **spent,
          **run.evaluate(params),
          **{name: float(np.asarray(rate(step))) for name, rate in run.rates.items()},
          "seconds": seconds, "cpu_seconds": cpu_seconds}


def _finish(task: Task, placed: _Placed, ledger, history, state: LoopState, stop_reason,
            clock: _Clock, elapsed: tuple[float, float], seeded) -> dict:
  """Final evaluation, results.json, history.csv, the plot and the export.

  ``elapsed``: the wall and CPU seconds of the releases after ``clock.first`` (and their
  evaluations), the run's whole time unless it resumed a checkpoint that recorded none.
  """
  config, run = task.config, placed.run
  if not history or history[-1]["step"] != state.step:
    history.append(_record(placed, ledger, state.step, state.params, clock))
    _print_record(run, history[-1])
  seconds, cpu_seconds = elapsed
  results = {**run.results(state.params, history),
             **_results(config, placed, ledger, stop_reason, seconds, cpu_seconds,
                        state.step - clock.first, seeded)}
  if is_primary():
    export_run(config.output_dir)  # parameters + certificate, no secrets, in export/
    if run.write_extra is not None:
      run.write_extra(config.output_dir, results)
    _write_outputs(config.output_dir, results, history, run.plotted if config.plot else ())
  sync("dpmuon train: outputs written")  # several processes: none returns before they exist
  return results


def _results(config: RunSettings, placed: _Placed, ledger: PrivacyLedger, stop_reason,
             seconds: float, cpu_seconds: float, steps_run: int, seeded) -> dict:
  """What every run reports: the guarantee spent (:func:`~dpmuon_jax.training.export.
  certified`: its search's, if it was made in one), how it was made, and its cost."""
  run = placed.run
  setup = run.setup
  seeded = bool(seeded or ledger.seeded)  # a charged release from a seeded root included
  return certified({
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
      "train_seconds": seconds,
      "train_cpu_seconds": cpu_seconds,
      "seconds_per_epoch": seconds / steps_run * run.steps_per_epoch if steps_run else None,
      "guarantee": guarantee(ledger.epsilon(), config.delta, ledger.config.neighbouring,
                             seeded, ledger.config.privacy_unit),
      "privacy_unit": ledger.config.privacy_unit,
      "ledger": ledger.to_dict(),  # public settings and counts: what composes it with others
      # The seed is the root key of a seeded run: it stays in the owner-only checkpoints.
      "config": {**dataclasses.asdict(config), "seed": None},
      "export": "export",  # relative to the run's folder, which may be moved
  }, placed.search, "epsilon_spent")


def _write_outputs(output_dir: str, results: dict, history: list[dict],
                   plotted: Sequence[tuple[str, str]]) -> None:
  """history.csv, the plot, then results.json (atomically, last: it marks the outputs done)."""
  fields = sorted({k for h in history for k in h}, key=lambda k: (k != "step", k))
  write_csv(os.path.join(output_dir, "history.csv"), history, fields)
  if plotted:
    _plot(output_dir, history, plotted)
  path = os.path.join(output_dir, RESULTS_NAME)
  with open(path + ".tmp", "w") as f:
    json.dump(results, f, indent=2, default=float)
  os.replace(path + ".tmp", path)


def _plot(output_dir: str, history: list[dict], plotted: Sequence[tuple[str, str]]) -> None:
  """``curves.png``: one panel per ``(column, title)``, against the step."""
  plt = pyplot(CURVES)
  steps = [h["step"] for h in history]
  fig, axes = plt.subplots(1, len(plotted), figsize=(4 * len(plotted), 3.2))
  for ax, (key, label) in zip(np.atleast_1d(axes), plotted):
    ax.plot(steps, [h[key] for h in history], marker="o", ms=3)
    ax.set_xlabel("step")
    ax.set_title(label)
    if key == "epsilon" and any(math.isfinite(h[key]) for h in history):
      ax.set_ylim(bottom=0)
  fig.tight_layout()
  fig.savefig(os.path.join(output_dir, CURVES), dpi=110)
  plt.close(fig)
