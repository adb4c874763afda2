"""Private learning-rate selection with the image trainer (``dpmuon tune``).

The best of a random number K of private training runs (Papernot & Steinke,
"Hyperparameter Tuning with Renyi Differential Privacy", ICLR 2022; the
bounds are in :mod:`dpmuon_jax.privacy.tuning`). Each run is ::

    lr ~ Uniform(grid) ─► train(lr, σ) on the training part ─► exported parameters
      ─► accuracy on the validation part + N(0, score_std²) ─► released score

and only the run with the best released score is kept. The validation part is
the LAST ``validation_size`` examples of the training split, fixed by position
before anything private runs; neighbouring datasets add or remove one record
in one of the two parts. The accuracy over n_val examples has add/remove
sensitivity 1/n_val, so its noise multiplier is σ_s = score_std·n_val. The
accounting composes each run's T training releases with its score release and
applies the tuning bound; the σ of every run is calibrated so that the WHOLE
procedure spends at most the target ε.

Published, and covered by the tuned (ε, δ): ``tuning.json`` (the chosen
learning rate, its noisy score, the guarantee) and ``selected_run/`` (what
``dpmuon train`` writes for that run; its checkpoints are SECRET as always,
its ``export/`` is public). Each run's folder holds the search's record
(``search.json``: the tuned ε, δ and the search's settings) before the run's
first release, and the run keeps it in its checkpoints, so its
``results.json``, history and every export of it (``dpmuon export``, a
resume) state the tuned ε and guarantee, the run's own ε kept as
``training_epsilon_per_run`` (:func:`~dpmuon_jax.training.export.certified`):
the model never travels with an ε that the search exceeds. K, the other runs
and their scores stay hidden: they are deleted as soon as they are beaten.
``show_all_runs`` adds them to ``tuning.json`` under ``nonprivate_runs``,
outside the guarantee; so is the running time, which grows with K.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import tempfile
from collections.abc import Callable
from typing import NamedTuple, cast

import numpy as np

from dpmuon_jax import checks
from dpmuon_jax.data.images import ImageDataset
from dpmuon_jax.models.registry import model_and_loss
from dpmuon_jax.privacy.accounting import compute_epsilon
from dpmuon_jax.privacy.tuning import (
    Poisson,
    RunCount,
    RunPrivacy,
    ScoreRelease,
    TuningResult,
    calibrate_tuned_noise_multiplier,
    expected_runs,
    noisy_score,
    private_tune,
    tuned_epsilon,
)
from dpmuon_jax.training.export import load_exported, search_guarantee, write_search
from dpmuon_jax.training.trainer import TrainConfig, TrainingError, evaluation_fn, train

SUMMARY_FILE = "tuning.json"
SELECTED_DIR = "selected_run"


def learning_rate_grid(center: float, size: int, factor: float = 3.0) -> tuple[float, ...]:
  """``size`` learning rates spaced by ×``factor``, geometrically centred on ``center``."""
  checks.check_positive("learning rate", center)
  checks.check_positive_int("grid size", size)
  checks.check_in_range("grid factor", factor, 1.0, math.inf, low_inclusive=False)
  return tuple(float(center * factor ** (i - (size - 1) / 2)) for i in range(size))


def holdout(data: ImageDataset, size: int) -> tuple[ImageDataset, np.ndarray, np.ndarray]:
  """The training split without its last ``size`` examples, and those examples (validation)."""
  checks.check_positive_int("validation size", size)
  if size >= data.num_train:
    raise ValueError(
        f"validation size must be below the training set size {data.num_train}, got {size}."
    )
  cut = data.num_train - size
  train_part = ImageDataset(data.x_train[:cut], data.y_train[:cut], data.x_test, data.y_test,
                            num_classes=data.num_classes, name=data.name)
  return train_part, data.x_train[cut:], data.y_train[cut:]


class TuneOptions(NamedTuple):
  """How ``dpmuon tune`` searches (the trainer settings come in a :class:`TrainConfig`).

  Attributes:
    learning_rates: the public grid.
    distribution: the law of the number of runs K.
    validation_size: n_val, held out from the end of the training split.
    score_std: standard deviation of the noise on each run's validation accuracy.
    seed: makes K, the grid draws, the score noise and the runs reproducible
      (recorded as seeded); ``None``: OS entropy.
    show_all_runs: also write every run's learning rate and score (NON-private).
  """

  learning_rates: tuple[float, ...]
  distribution: RunCount
  validation_size: int
  score_std: float
  seed: int | None = None
  show_all_runs: bool = False


class _Plan(NamedTuple):
  run: RunPrivacy
  score: ScoreRelease
  run_epsilon: float  # each run's training releases alone, the trainer's ledger budget
  epsilon: float  # the whole search


def _plan(config: TrainConfig, train_part: ImageDataset, options: TuneOptions) -> _Plan:
  """q and T as the trainer derives them, σ calibrated for the whole tuning procedure."""
  if config.noise_multiplier is not None:
    raise TrainingError("dpmuon tune calibrates σ itself; do not fix the noise multiplier.")
  if config.accountant != "rdp":
    raise TrainingError("dpmuon tune accounts with RDP (its bounds are RDP bounds).")
  if config.noise != "iid":
    raise TrainingError(f"dpmuon tune's bounds are for independent noise with Poisson "
                        f"sampling; --noise {config.noise} is not covered by them.")
  if not 0 < config.batch_size <= train_part.num_train:
    raise TrainingError(
        f"--batch-size must be in [1, {train_part.num_train}] (the training part), "
        f"got {config.batch_size}."
    )
  checks.check_positive("--epochs", config.epochs)
  checks.check_positive("--score-std", options.score_std)
  q = config.batch_size / train_part.num_train
  steps = max(1, round(config.epochs / q))
  n_val = options.validation_size
  score = noisy_score(1.0 / n_val, options.score_std * n_val)
  sigma = calibrate_tuned_noise_multiplier(
      config.epsilon, config.delta, q, steps, options.distribution, score)
  run = RunPrivacy(sigma, q, steps)
  return _Plan(run, score, compute_epsilon(sigma, q, steps, config.delta),
               tuned_epsilon(run, options.distribution, score, config.delta))


def _train_fn(config: TrainConfig, train_part: ImageDataset,
              validation: tuple[np.ndarray, np.ndarray], plan: _Plan, search: dict,
              runs_dir: str) -> Callable:
  """One private run for a learning rate, made with the ``search`` record in its folder:
  (validation accuracy, its run record)."""
  model, _ = model_and_loss(config.model, cast(int, train_part.num_classes),
                            train_part.image_shape,
                            seed=config.model_seed, **config.model_overrides)

  def train_fn(learning_rate: float, seed: int | None) -> tuple[float, dict]:
    run_dir = tempfile.mkdtemp(prefix="run-", dir=runs_dir)
    write_search(run_dir, {**search, "tuning": {**search["tuning"],
                                                "learning_rate": learning_rate}})
    run_config = dataclasses.replace(
        config, learning_rate=learning_rate, seed=seed, output_dir=run_dir, resume=False,
        noise_multiplier=plan.run.noise_multiplier, epsilon=plan.run_epsilon)
    results = train(run_config, train_part)
    if (results["releases"] > plan.run.steps
        or results["noise_multiplier"] != plan.run.noise_multiplier
        or results["sampling_rate"] != plan.run.sampling_rate):
      raise RuntimeError(f"A tuning run released more than accounted for: {results}.")
    params = load_exported(os.path.join(run_dir, results["export"]), like=model.params).params
    _, accuracy = evaluation_fn(model.apply, train_part.info, *validation)(params)
    return accuracy, {"dir": run_dir, "learning_rate": learning_rate, "results": results}

  return train_fn


def _distribution_json(distribution: RunCount) -> dict:
  if isinstance(distribution, Poisson):
    return {"law": "poisson", "mu": distribution.mu, "expected_runs": distribution.mu}
  return {"law": "truncated_negative_binomial", "eta": distribution.eta,
          "gamma": distribution.gamma, "expected_runs": expected_runs(distribution)}


def _search(config: TrainConfig, options: TuneOptions, plan: _Plan) -> dict:
  """The search's record in each run's folder (``search.json``; the run adds its learning
  rate): what the run's results, history and exports state (export.certified)."""
  return {"epsilon": plan.epsilon, "delta": config.delta, "target_epsilon": config.epsilon,
          "seeded": options.seed is not None,
          "tuning": {"learning_rates": list(options.learning_rates),
                     "distribution": _distribution_json(options.distribution),
                     "validation_size": options.validation_size,
                     "score_std": options.score_std}}


def _summary(config: TrainConfig, options: TuneOptions, plan: _Plan, out: TuningResult,
             selected_dir: str | None) -> dict:
  """The contents of tuning.json."""
  summary = {
      "optimizer": config.optimizer,
      "learning_rate": out.candidate,
      "score": out.score,
      "epsilon": out.epsilon,
      "delta": out.delta,
      "target_epsilon": config.epsilon,
      "guarantee": search_guarantee(out.epsilon, out.delta, out.seeded),
      "seeded": out.seeded,
      "learning_rates": list(options.learning_rates),
      "distribution": _distribution_json(options.distribution),
      "validation_size": options.validation_size,
      "score_std": options.score_std,
      "noise_multiplier": plan.run.noise_multiplier,
      "sampling_rate": plan.run.sampling_rate,
      "steps_per_run": plan.run.steps,
      "training_epsilon_per_run": plan.run_epsilon,
      "selected_run": None,
  }
  if out.result is not None:
    results = out.result["results"]
    summary["selected_run"] = {
        "dir": selected_dir, "releases": results["releases"],
        "final_test_accuracy": results["final_test_accuracy"],
        "best_test_accuracy": results["best_test_accuracy"],
    }
  if options.show_all_runs:
    summary["nonprivate_runs"] = [
        {"learning_rate": r.candidate, "score": r.score} for r in out.nonprivate_runs]
  return summary


def _relocate_results(run_dir: str, old_dir: str) -> None:
  """Rewrites the paths in a moved run's ``results.json`` from ``old_dir`` to ``run_dir``,
  so that the selected run's record points at its files, not at the deleted temporary run."""
  path = os.path.join(run_dir, "results.json")
  if not os.path.exists(path):
    return
  prefixes = ((os.path.abspath(old_dir), os.path.abspath(run_dir)), (old_dir, run_dir))

  def moved(value):
    if isinstance(value, dict):
      return {k: moved(v) for k, v in value.items()}
    if isinstance(value, list):
      return [moved(v) for v in value]
    for old, new in prefixes:
      if isinstance(value, str) and (value == old or value.startswith(old + os.sep)):
        return new + value[len(old):]
    return value

  with open(path) as f:
    results = json.load(f)
  with open(path, "w") as f:
    json.dump(moved(results), f, indent=2)


def tune_learning_rate(config: TrainConfig, data: ImageDataset, options: TuneOptions) -> dict:
  """Selects a learning rate privately; writes and returns the summary (see the module doc).

  ``config`` holds the trainer settings shared by every run; its ``epsilon``
  and ``delta`` are the target of the WHOLE procedure, its ``output_dir``
  receives ``tuning.json`` and ``selected_run/``. Its ``learning_rate``,
  ``seed`` and ``noise_multiplier`` are set per run.
  """
  train_part, val_x, val_y = holdout(data, options.validation_size)
  plan = _plan(config, train_part, options)
  selected_dir = os.path.join(config.output_dir, SELECTED_DIR)
  summary_path = os.path.join(config.output_dir, SUMMARY_FILE)
  if os.path.exists(summary_path) or os.path.exists(selected_dir):
    raise TrainingError(f"{config.output_dir} already holds a tuning run; choose another "
                        "--output-dir.")
  os.makedirs(config.output_dir, exist_ok=True)
  search = _search(config, options, plan)
  runs_dir = tempfile.mkdtemp(prefix=".tuning-runs-", dir=config.output_dir)
  try:
    out = private_tune(
        _train_fn(config, train_part, (val_x, val_y), plan, search, runs_dir),
        options.learning_rates,
        run=plan.run, distribution=options.distribution, score=plan.score,
        target_delta=config.delta, seed=options.seed,
        discard=lambda result: shutil.rmtree(result["dir"], ignore_errors=True))
    if (out.epsilon, out.delta, out.seeded) != (plan.epsilon, config.delta, search["seeded"]):
      raise RuntimeError(f"The search spent (ε, δ) = ({out.epsilon}, {out.delta}), seeded "
                         f"{out.seeded}; its runs recorded {search}.")
    if out.result is not None:
      os.replace(out.result["dir"], selected_dir)
      _relocate_results(selected_dir, out.result["dir"])
  finally:
    shutil.rmtree(runs_dir, ignore_errors=True)
  summary = _summary(config, options, plan, out, selected_dir if out.result else None)
  with open(summary_path, "w") as f:
    json.dump(summary, f, indent=2)
  return summary
