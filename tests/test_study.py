"""The study driver: the learning-rate rule, restartability and the report."""

from __future__ import annotations

import csv
import math
import os

import numpy as np
import pytest

from experiments.study import (
    Arm,
    PrivatelyTunedArm,
    Study,
    grid_state,
    ready_runs,
    restart_first,
    run_study,
)
from experiments.study_report import write_report

ARM = Arm("dp_sgd", 32, 0.1, epochs=1.0)
STUDY = Study("t", "test", (ARM,), seeds=(1, 2), grid_points=3, max_extensions=2)


def _row(lr, acc, seed=1, arm=ARM):
  return {"arm": arm.name, "learning_rate": str(lr), "seed": str(seed),
          "final_val_accuracy": str(acc)}


def test_grid_starts_as_three_rates_spaced_by_three():
  pending, chosen = grid_state(STUDY, ARM, [])
  assert chosen is None
  np.testing.assert_allclose(sorted(pending), [0.1 / 3, 0.1, 0.3], rtol=1e-3)


def test_interior_best_is_chosen_then_remaining_seeds_run():
  rows = [_row(0.03333, 0.2), _row(0.1, 0.5), _row(0.3, 0.4)]
  assert grid_state(STUDY, ARM, rows) == ([], 0.1)
  assert list(ready_runs(STUDY, rows)) == [(ARM, 0.1, 2)]


def test_edge_best_extends_the_grid_one_step_on_that_side():
  rows = [_row(0.03333, 0.2), _row(0.1, 0.3), _row(0.3, 0.4)]
  pending, chosen = grid_state(STUDY, ARM, rows)
  assert chosen is None and pending == [0.9]
  rows.append(_row(0.9, 0.35))
  assert grid_state(STUDY, ARM, rows) == ([], 0.3)
  rows = [_row(0.03333, 0.6), _row(0.1, 0.3), _row(0.3, 0.4)]
  assert grid_state(STUDY, ARM, rows)[0] == [0.01111]


def test_extensions_stop_after_max_extensions():
  rows = [_row(lr, acc) for lr, acc in
          ((0.03333, 0.1), (0.1, 0.2), (0.3, 0.3), (0.9, 0.4), (2.7, 0.5))]
  assert grid_state(STUDY, ARM, rows) == ([], 2.7)


def test_fixed_releases_arm_sets_epochs_from_t():
  arm = Arm("dp_sgd", 4096, 0.3, releases=66)
  epochs = arm.training_epochs(45_000)
  assert round(epochs / (4096 / 45_000)) == 66
  with pytest.raises(ValueError, match="exactly one"):
    Arm("dp_sgd", 256, 0.3).training_epochs(100)


def test_private_selections_start_first_as_they_cannot_resume():
  tuned = PrivatelyTunedArm("dp_sgd", 32, 0.1, epochs=1.0)
  study = Study("t", "test", (ARM, tuned), seeds=(1, 2))
  ordered = restart_first(ready_runs(study, []))
  assert [arm.name for arm, _, _ in ordered[:2]] == [tuned.name] * 2
  assert ordered[2:] == [(ARM, lr, 1) for lr in grid_state(study, ARM, [])[0]]


@pytest.fixture
def tiny_npz(tmp_path):
  rng = np.random.default_rng(0)
  path = tmp_path / "tiny.npz"
  images = rng.integers(0, 256, (120, 8, 8, 3), dtype=np.uint8)
  labels = rng.integers(0, 3, 120)
  np.savez(path, x_train=images[:96], y_train=labels[:96], x_test=images[96:],
           y_test=labels[96:])
  return str(path)


def test_study_restarts_where_it_stopped_and_writes_its_report(tiny_npz, tmp_path):
  arm = Arm("dp_sgd", 16, 0.1, epochs=1.0)
  study = Study("tiny", "test", (arm,), dataset=tiny_npz, validation_size=32, seeds=(1, 2),
                max_extensions=0, microbatch_size=None)
  out = str(tmp_path / "out")
  rows = run_study(study, out, None, workers=1, max_steps=1, max_runs=2)
  assert len(rows) == 2
  rows = run_study(study, out, None, workers=1, max_steps=1)  # skips the two recorded runs
  with open(os.path.join(out, "runs.csv")) as f:
    recorded = list(csv.DictReader(f))
  keys = [(r["arm"], float(r["learning_rate"]), int(r["seed"])) for r in recorded]
  assert len(keys) == len(set(keys)) == 4  # 3 grid rates at seed 1, the chosen one at seed 2
  assert all(float(r["epsilon_spent"]) <= 4.0 for r in recorded)
  assert all(0.0 <= float(r["test_accuracy"]) <= 1.0 for r in recorded)
  write_report(study, rows, out, None)
  with open(os.path.join(out, "summary.csv")) as f:
    (summary,) = list(csv.DictReader(f))
  assert summary["seeds"] == "2" and summary["chosen_learning_rate"]
  assert os.path.exists(os.path.join(out, "accuracy_vs_batch.png"))


def test_privately_tuned_arm_runs_one_selection_per_seed(tiny_npz, tmp_path):
  arm = PrivatelyTunedArm("dp_sgd", 16, 0.1, epochs=1.0, mean_runs=1.5, score_std=0.5,
                          label="private_tuning")
  study = Study("tiny", "test", (arm,), dataset=tiny_npz, validation_size=32, seeds=(3,),
                microbatch_size=None)
  assert list(ready_runs(study, [])) and all(math.isnan(lr) for _, lr, _ in ready_runs(study, []))
  out = str(tmp_path / "out")
  (row,) = run_study(study, out, None, workers=1, max_steps=1)
  assert float(row["epsilon_spent"]) <= 4.0 + 1e-9  # the WHOLE selection's ε
  assert any(math.isclose(float(row["learning_rate"]), lr) for lr in (0.1 / 3, 0.1, 0.3))
  assert run_study(study, out, None, workers=1, max_steps=1) == [row]  # recorded: skipped
