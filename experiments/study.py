"""Studies whose learning rates are chosen on a validation split, restartably.

A :class:`Study` is a list of :class:`Arm` s (optimizer × expected batch size
× training length × clipping style). Every arm gets the same learning-rate
rule: a ×``grid_factor``-spaced grid of ``grid_points`` rates around the arm's
``lr_center``, each trained once (the selection seed) and scored by the final
accuracy on a validation split held out from the training images; while the
best rate lies on the grid's edge the grid grows by one step on that side (at
most ``max_extensions`` times). The chosen rate is then trained with the
reported seeds. With ``Study.selection_seed`` set, that seed selects and is
never reported; without it (the earlier protocol) ``seeds[0]`` selects and is
reported too. Test accuracy is measured once, on the final parameters of
every run, and never used for a choice.

An arm with a ``learning_rate`` fixed in advance (e.g. the rate an earlier
study chose) trains no grid: its reported seeds run at that rate. An arm's
own ``seeds`` replace the study's reported seeds for that arm (e.g. fresh
seeds for a replication).

Two choices beyond the learning rate:

* arms that differ only in their ``variant`` (e.g. DiSK's κ) form one
  selection group: each runs its own grid, and only the variant whose chosen
  rate scored best on validation trains the reported seeds;
* an arm with ``fallback_lr_from`` (a Muon-family arm) gives the group Muon
  does not take (biases, norm scales) the rate chosen for that other arm
  (e.g. DP-SGD's at the same B: paper 1 keeps DP-SGD with momentum for the
  1-D parameters); it starts once that rate is chosen.

The selection reads the validation split, which is part of the private
training data: the per-run (ε, δ) of each row does NOT cover the search.
:func:`dpmuon_jax.privacy.tuning` selects privately; an arm with
``tuning="private"`` runs that procedure instead, and its row's ε covers the
whole tuning.

Restartable: every finished run is appended to ``runs.csv`` at once, and a
rerun skips the runs already recorded (a run interrupted half-way resumes from
its checkpoint). ``--workers 2`` trains two runs side by side.
"""

from __future__ import annotations

import concurrent.futures as futures
import csv
import dataclasses
import math
import multiprocessing
import os
import shutil
import time
from collections.abc import Iterable, Iterator

import numpy as np

RUN_FIELDS = (
    "arm", "optimizer", "batch_size", "clipping", "epochs", "learning_rate", "seed",
    "noise_multiplier", "epsilon_spent", "delta", "releases", "final_val_accuracy",
    "best_val_accuracy", "test_accuracy", "seconds", "fallback_learning_rate",
)


@dataclasses.dataclass(frozen=True)
class Arm:
  """One row of a study: an optimizer at one batch size, length and clipping style.

  ``epochs`` fixes the training length; ``releases`` instead fixes the number
  of releases T (then epochs = T·B/N). ``options`` go to the optimizer
  factory (e.g. ``{"buffer": "ema"}``). ``variant`` names an option setting
  that competes with the arm's other variants (see the module docstring);
  ``fallback_lr_from`` names the arm whose chosen rate the 1-D group runs
  (filled into ``fallback_learning_rate`` when known); arms of lower
  ``priority`` train first. ``learning_rate``: a rate fixed in advance, so no
  grid is trained (``lr_center`` is then unused); ``seeds``: this arm's
  reported seeds (``None``: the study's). ``noise`` and ``bands``: the release's noise
  (``"iid"``, or ``"bandmf"`` with b bands, under b-cyclic Poisson sampling).
  """

  optimizer: str
  batch_size: int
  lr_center: float
  epochs: float | None = None
  releases: int | None = None
  clipping: str = "flat"
  options: tuple[tuple[str, object], ...] = ()
  label: str = "main"
  variant: str = ""
  fallback_lr_from: str | None = None
  fallback_learning_rate: float | None = None
  priority: int = 0
  learning_rate: float | None = None
  seeds: tuple[int, ...] | None = None
  noise: str = "iid"
  bands: int | None = None

  @property
  def name(self) -> str:
    suffix = "" if self.label == "main" else f"_{self.label}"
    variant = f"_{self.variant}" if self.variant else ""
    return f"{self.optimizer}_B{self.batch_size}{suffix}{variant}"

  @property
  def group(self) -> tuple:
    """The selection group: arms equal in all but their variant."""
    return self.optimizer, self.batch_size, self.label, self.clipping, self.epochs, self.releases

  def training_epochs(self, num_train: int) -> float:
    if (self.epochs is None) == (self.releases is None):
      raise ValueError(f"{self.name}: give exactly one of epochs and releases.")
    if self.epochs is not None:
      return self.epochs
    return self.releases * self.batch_size / num_train


@dataclasses.dataclass(frozen=True)
class PrivatelyTunedArm(Arm):
  """An arm whose learning rate is chosen by private selection, once per seed.

  Each seed runs :func:`dpmuon_jax.training.selection.tune_learning_rate`:
  K ~ TNB(η = 1, E[K] = ``mean_runs``) runs, rates drawn from the arm's first
  grid, scored by noisy validation accuracy; σ is calibrated so the WHOLE
  procedure spends ε. Its row's ``epsilon_spent`` is that total, its
  ``final_val_accuracy`` the released (noisy) score.
  """

  mean_runs: float = 3.0
  score_std: float = 0.01


@dataclasses.dataclass(frozen=True)
class Study:
  """Arms trained on one dataset and model at one (ε, δ); see the module docstring.

  ``gap_change_rule`` = (label, B_low, B_high): the report also decides how the
  paired DP-Muon − DP-SGD gap of that label's arms changes from B_low to B_high
  (``gap_change.csv``); ``reference`` names a study whose results folder is a
  sibling of this one's, whose "main" arms at B_low and B_high place this
  study's "main" arms between them there.
  """

  name: str
  description: str
  arms: tuple[Arm, ...]
  dataset: str = "cifar10.npz"
  model: str = "cnn"
  model_overrides: tuple[tuple[str, object], ...] = ()
  validation_size: int = 5_000
  epsilon: float = 4.0
  delta: float = 1e-5
  clip: float = 1.0
  seeds: tuple[int, ...] = (42, 43, 44)
  selection_seed: int | None = None
  grid_points: int = 3
  grid_factor: float = 3.0
  max_extensions: int = 2
  microbatch_size: int | None = 256
  warmup_fraction: float = 0.05
  scale: str = "cpu"
  gap_change_rule: tuple[str, int, int] | None = None
  reference: str | None = None


# ---------------------------------------------------------------------------
# The learning-rate rule (pure: from recorded runs to the next runs).


def _lr(center: float, factor: float, k: int) -> float:
  return float(f"{center * factor ** k:.4g}")


def selection_seed(study: Study) -> int:
  """The seed every grid point trains with."""
  return study.seeds[0] if study.selection_seed is None else study.selection_seed


def reported_seeds(study: Study, arm: Arm | None = None) -> tuple[int, ...]:
  """The seeds the chosen rate trains with (the selection seed only in the earlier protocol);
  ``arm``'s own ``seeds`` where it has them."""
  if arm is not None and arm.seeds is not None:
    return arm.seeds
  return tuple(s for s in study.seeds if study.selection_seed is None or s != study.selection_seed)


def grid_state(study: Study, arm: Arm, rows: list[dict]) -> tuple[list[float], float | None]:
  """(rates still to train at the selection seed, the chosen rate or ``None`` yet).

  The grid starts at offsets −(p−1)/2 … (p−1)/2 around ``lr_center``; while the
  best validation accuracy is at an edge it extends by one step on that side.
  An arm with a fixed ``learning_rate`` has no grid: ``([], learning_rate)``.
  """
  if arm.learning_rate is not None:
    return [], arm.learning_rate
  half = (study.grid_points - 1) // 2
  offsets = list(range(-half, study.grid_points - half))
  scores = {float(r["learning_rate"]): float(r["final_val_accuracy"]) for r in rows
            if r["arm"] == arm.name and int(r["seed"]) == selection_seed(study)}
  for _ in range(study.max_extensions + 1):
    rates = {k: _lr(arm.lr_center, study.grid_factor, k) for k in offsets}
    missing = [lr for lr in rates.values() if lr not in scores]
    if missing:
      return missing, None
    best = max(offsets, key=lambda k: (scores[rates[k]], -abs(k)))
    if best == offsets[0]:
      offsets.insert(0, offsets[0] - 1)
    elif best == offsets[-1]:
      offsets.append(offsets[-1] + 1)
    else:
      return [], rates[best]
  return [], rates[best]  # still on the edge after every extension: said in the summary


def find_arm(study: Study, name: str) -> Arm:
  """The study's arm called ``name``."""
  for arm in study.arms:
    if arm.name == name:
      return arm
  raise ValueError(f"{study.name} has no arm {name!r}.")


def resolved(study: Study, arm: Arm, rows: list[dict]) -> Arm | None:
  """``arm`` with its 1-D group's rate filled in (``None`` while that rate is not chosen)."""
  if arm.fallback_lr_from is None:
    return arm
  _, chosen = grid_state(study, find_arm(study, arm.fallback_lr_from), rows)
  return None if chosen is None else dataclasses.replace(arm, fallback_learning_rate=chosen)


def _selection_score(study: Study, arm: Arm, chosen: float, rows: list[dict]) -> float:
  return max(float(r["final_val_accuracy"]) for r in rows
             if r["arm"] == arm.name and int(r["seed"]) == selection_seed(study)
             and float(r["learning_rate"]) == chosen)


def selected_variant(study: Study, arm: Arm, rows: list[dict]) -> Arm | None:
  """The arm of ``arm``'s selection group whose chosen rate scored best (``None``: not yet).

  Ties go to the arm listed first. An arm without a variant is its own group.
  """
  if not arm.variant:
    return arm
  best, best_score = None, -math.inf
  for other in study.arms:
    if other.group != arm.group or not other.variant:
      continue
    _, chosen = grid_state(study, other, rows)
    if chosen is None:
      return None
    score = _selection_score(study, other, chosen, rows)
    if score > best_score:
      best, best_score = other, score
  return best


def ready_runs(study: Study, rows: list[dict]) -> Iterator[tuple[Arm, float, int]]:
  """Every (arm, learning rate, seed) that can be trained now, in arm order.

  A privately tuned arm yields (arm, ``math.nan``, seed): its rate is chosen inside the run.
  An arm waiting for its 1-D group's rate yields nothing yet; the yielded arm carries that
  rate in ``fallback_learning_rate``.
  """
  for arm in study.arms:
    if isinstance(arm, PrivatelyTunedArm):
      done = {int(r["seed"]) for r in rows if r["arm"] == arm.name}
      yield from ((arm, math.nan, seed) for seed in study.seeds if seed not in done)
      continue
    ready = resolved(study, arm, rows)
    if ready is None:
      continue
    pending, chosen = grid_state(study, arm, rows)
    for lr in pending:
      yield ready, lr, selection_seed(study)
    if chosen is not None and selected_variant(study, arm, rows) == arm:
      done = {int(r["seed"]) for r in rows
              if r["arm"] == arm.name and float(r["learning_rate"]) == chosen}
      for seed in reported_seeds(study, arm):
        if seed not in done:
          yield ready, chosen, seed


# ---------------------------------------------------------------------------
# Data and one run (in a worker process).


def load_data(study: Study, data_dir: str | None):
  """The study's whole dataset (relative ``.npz`` paths are under ``data_dir``)."""
  from dpmuon_jax.data.loaders import load_dataset

  spec = study.dataset
  if spec.endswith(".npz") and data_dir and not os.path.isabs(spec):
    spec = os.path.join(data_dir, spec)
  return load_dataset(spec, data_dir)


def split_data(study: Study, data_dir: str | None):
  """(train-minus-validation with validation as its eval set, the same with the test set).

  The validation split is the last ``validation_size`` training examples, as
  :func:`dpmuon_jax.training.selection.holdout` (and so ``dpmuon tune``) takes it.
  """
  from dpmuon_jax.data.images import ImageDataset
  from dpmuon_jax.training.selection import holdout

  with_test, val_x, val_y = holdout(load_data(study, data_dir), study.validation_size)
  with_val = ImageDataset(with_test.x_train, with_test.y_train, val_x, val_y,
                          with_test.num_classes, with_test.name)
  return with_val, with_test


def run_dir(out: str, arm: Arm, lr: float, seed: int) -> str:
  if isinstance(arm, PrivatelyTunedArm):
    return os.path.join(out, "runs", arm.name, f"s{seed}")
  return os.path.join(out, "runs", arm.name, f"lr{lr:g}_s{seed}")


def _config(study: Study, arm: Arm, lr: float | None, seed: int, directory: str,
            num_train: int, resume: bool, max_steps: int | None):
  from dpmuon_jax.training.trainer import TrainConfig

  return TrainConfig(
      model=study.model, dataset=study.dataset, optimizer=arm.optimizer,
      optimizer_options=dict(arm.options), epsilon=study.epsilon, delta=study.delta,
      batch_size=arm.batch_size, epochs=arm.training_epochs(num_train),
      learning_rate=lr, fallback_learning_rate=arm.fallback_learning_rate,
      warmup_fraction=study.warmup_fraction, clip=study.clip,
      clipping=arm.clipping, seed=seed, output_dir=directory, resume=resume,
      noise=arm.noise, bands=arm.bands,
      microbatch_size=study.microbatch_size, progress=False, plot=False, max_steps=max_steps,
      model_overrides=dict(study.model_overrides),
  )


def tune_one(study: Study, arm: PrivatelyTunedArm, seed: int, out: str, data_dir: str | None,
             max_steps: int | None = None) -> dict:
  """One whole private selection (a seeded rerun after a crash repeats it exactly)."""
  from dpmuon_jax.privacy.tuning import truncated_negative_binomial
  from dpmuon_jax.training.selection import TuneOptions, learning_rate_grid, tune_learning_rate

  full = load_data(study, data_dir)  # tune_learning_rate holds out the same validation split
  directory = run_dir(out, arm, math.nan, seed)
  shutil.rmtree(directory, ignore_errors=True)  # an interrupted selection restarts whole
  num_train = full.num_train - study.validation_size
  config = _config(study, arm, None, seed, directory, num_train, False, max_steps)
  options = TuneOptions(
      learning_rate_grid(arm.lr_center, study.grid_points, study.grid_factor),
      truncated_negative_binomial(arm.mean_runs, eta=1.0), study.validation_size,
      arm.score_std, seed=seed)
  start = time.perf_counter()
  summary = tune_learning_rate(config, full, options)
  selected = summary["selected_run"]
  return {
      "arm": arm.name, "optimizer": arm.optimizer, "batch_size": arm.batch_size,
      "clipping": arm.clipping, "epochs": config.epochs,
      "learning_rate": summary["learning_rate"], "seed": seed,
      "noise_multiplier": summary["noise_multiplier"], "epsilon_spent": summary["epsilon"],
      "delta": summary["delta"], "releases": selected["releases"],
      "final_val_accuracy": summary["score"], "best_val_accuracy": summary["score"],
      "test_accuracy": selected["final_test_accuracy"],
      "seconds": time.perf_counter() - start, "fallback_learning_rate": "",
  }


def train_one(study: Study, arm: Arm, lr: float, seed: int, out: str,
              data_dir: str | None, max_steps: int | None = None) -> dict:
  """Trains one run (resuming an interrupted one) and returns its CSV row."""
  from dpmuon_jax.training.trainer import JOURNAL_NAME, train

  if isinstance(arm, PrivatelyTunedArm):
    return tune_one(study, arm, seed, out, data_dir, max_steps)
  with_val, with_test = split_data(study, data_dir)
  directory = run_dir(out, arm, lr, seed)
  started = os.path.exists(os.path.join(directory, JOURNAL_NAME))
  config = _config(study, arm, lr, seed, directory, with_val.num_train, started, max_steps)
  start = time.perf_counter()
  results = train(config, with_val)
  seconds = time.perf_counter() - start
  test_accuracy = evaluate_export(study, os.path.join(directory, "export"), with_test)
  shutil.rmtree(os.path.join(directory, "checkpoints"), ignore_errors=True)  # export/ stays
  return {
      "arm": arm.name, "optimizer": arm.optimizer, "batch_size": arm.batch_size,
      "clipping": arm.clipping, "epochs": config.epochs, "learning_rate": lr, "seed": seed,
      "noise_multiplier": results["noise_multiplier"], "epsilon_spent": results["epsilon_spent"],
      "delta": study.delta, "releases": results["releases"],
      "final_val_accuracy": results["final_test_accuracy"],
      "best_val_accuracy": results["best_test_accuracy"], "test_accuracy": test_accuracy,
      "seconds": seconds, "fallback_learning_rate": arm.fallback_learning_rate or "",
  }


def initial_model(study: Study, data):
  """The study's model at its public initialisation (every run starts there) and its loss."""
  from dpmuon_jax.models.registry import model_and_loss

  return model_and_loss(study.model, data.num_classes, data.image_shape, seed=0,
                        **dict(study.model_overrides))


def final_params(study: Study, export_dir: str, data):
  """The model's apply function and the parameters saved in ``export_dir``."""
  from dpmuon_jax.training.export import load_exported

  model, loss_fn = initial_model(study, data)
  return model, loss_fn, load_exported(export_dir, like=model.params).params


def evaluate_export(study: Study, export_dir: str, data) -> float:
  """Accuracy of the exported parameters on ``data``'s evaluation split."""
  from dpmuon_jax.training.trainer import evaluation_fn

  model, _, params = final_params(study, export_dir, data)
  _, accuracy = evaluation_fn(model.apply, data.info, data.x_test, data.y_test)(params)
  return accuracy


# ---------------------------------------------------------------------------
# The restartable driver.


def read_rows(path: str) -> list[dict]:
  if not os.path.exists(path):
    return []
  with open(path, newline="") as f:
    return list(csv.DictReader(f))


def append_row(path: str, row: dict) -> None:
  """Appends one finished run to ``runs.csv``, durably (``records.append_csv_row``).

  A file written before a column existed keeps its header (the new column is dropped).
  """
  from dpmuon_jax.training.records import append_csv_row

  fields = RUN_FIELDS
  if os.path.exists(path):
    with open(path, newline="") as f:
      fields = tuple(next(csv.reader(f), RUN_FIELDS))
  append_csv_row(path, {k: v for k, v in row.items() if k in fields}, fields)


def _key(arm: Arm, lr: float, seed: int) -> tuple[str, str, int]:
  return arm.name, f"{lr:g}", seed


def _worker_init() -> None:
  os.environ.setdefault("JAX_PLATFORMS", "cpu")


def restart_first(runs: Iterable[tuple[Arm, float, int]],
                  selecting: int | None = None) -> list[tuple[Arm, float, int]]:
  """The ready runs: private selections first, then by arm ``priority``, stable otherwise.

  A training run resumes from its checkpoint after an interruption; a private
  selection restarts whole. Starting those first loses the least work when a
  sitting ends mid-study. Within a priority, the grid points (seed
  ``selecting``) come before the reported seeds, so that every choice of that
  priority is made before its reported runs.
  """
  return sorted(runs, key=lambda run: (not isinstance(run[0], PrivatelyTunedArm),
                                       run[0].priority, run[2] != selecting))


def run_study(study: Study, out: str, data_dir: str | None, workers: int = 1,
              max_steps: int | None = None, max_runs: int | None = None) -> list[dict]:
  """Trains every run not yet in ``out/runs.csv``, ``workers`` at a time."""
  os.makedirs(out, exist_ok=True)
  path = os.path.join(out, "runs.csv")
  rows = read_rows(path)
  context = multiprocessing.get_context("spawn")
  started = 0
  running: dict[futures.Future, tuple[str, str, int]] = {}
  with futures.ProcessPoolExecutor(workers, mp_context=context,
                                   initializer=_worker_init) as pool:
    while True:
      busy = set(running.values())
      for arm, lr, seed in restart_first(ready_runs(study, rows), selection_seed(study)):
        if len(running) >= workers or (max_runs is not None and started >= max_runs):
          break
        if _key(arm, lr, seed) in busy:
          continue
        job = pool.submit(train_one, study, arm, lr, seed, out, data_dir, max_steps)
        running[job] = _key(arm, lr, seed)
        busy.add(_key(arm, lr, seed))
        started += 1
      if not running:
        return rows
      done, _ = futures.wait(running, return_when=futures.FIRST_COMPLETED)
      for job in done:
        del running[job]
        row = job.result()
        append_row(path, row)
        rows.append({k: str(v) for k, v in row.items()})
        print(f"[{len(rows)}] {row['arm']} lr={row['learning_rate']:g} seed={row['seed']}: "
              f"val {row['final_val_accuracy']:.4f} test {row['test_accuracy']:.4f} "
              f"ε={row['epsilon_spent']:.3f} {row['seconds']:.0f} s", flush=True)


def finished(study: Study, rows: list[dict]) -> bool:
  return next(ready_runs(study, rows), None) is None


def mean_std(values: list[float]) -> tuple[float, float]:
  mean = float(np.mean(values))
  return mean, float(np.std(values, ddof=1)) if len(values) > 1 else math.nan
