"""Every experiment config builds, and runs one step on tiny shapes (configs cannot rot)."""

import csv

import pytest

from experiments.configs import EXPERIMENTS
from experiments.sweep import run


def test_cpu_scale_configs_say_how_they_were_scaled_down():
  for exp in EXPERIMENTS.values():
    assert exp.scale in ("full", "cpu")
    assert bool(exp.scaling) == (exp.scale == "cpu"), exp.name
    assert set(exp.optimizers) <= set(exp.learning_rates), exp.name
    assert len(exp.seeds) >= 3


@pytest.mark.parametrize("name", sorted(EXPERIMENTS))
def test_every_config_builds_and_runs_one_step(tmp_path, name):
  rows = run(EXPERIMENTS[name], str(tmp_path), tiny=True)
  assert len(rows) == 1 and rows[0]["releases"] == 1
  with open(tmp_path / "runs.csv") as f:
    written = list(csv.DictReader(f))
  assert float(written[0]["epsilon_spent"]) > 0
  assert (tmp_path / "accuracy_vs_batch.png").exists()
