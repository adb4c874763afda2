"""Every experiment config builds, and runs one step on tiny shapes (configs cannot rot)."""

import csv
import dataclasses

import numpy as np
import pytest

from experiments.configs import EXPERIMENTS
from experiments.sweep import STAND_IN_SHAPES, run, stand_in_data


def test_cpu_scale_configs_say_how_they_were_scaled_down():
  for exp in EXPERIMENTS.values():
    assert exp.scale in ("full", "cpu")
    assert bool(exp.scaling) == (exp.scale == "cpu"), exp.name
    assert all(exp.learning_rate(name) > 0 for name in exp.optimizers), exp.name
    assert len(exp.seeds) >= 3


# The full-size WRN-28-10 (36.5M parameters) is the slow variant: one step of it took 140
# CPU s and 7 GB here, most of the suite's peak memory; its CPU-scale twin pins the same
# model builder and sweep path at a fraction of that.
SLOW_CONFIGS = {"architecture_wrn28_10"}


@pytest.mark.parametrize("name", [
    pytest.param(name, marks=pytest.mark.slow) if name in SLOW_CONFIGS else name
    for name in sorted(EXPERIMENTS)])
def test_every_config_builds_and_runs_one_step(tmp_path, name):
  rows = run(EXPERIMENTS[name], str(tmp_path), tiny=True)
  assert len(rows) == 1 and rows[0]["releases"] == 1
  with open(tmp_path / "runs.csv") as f:
    written = list(csv.DictReader(f))
  assert float(written[0]["epsilon_spent"]) > 0
  assert (tmp_path / "accuracy_vs_batch.png").exists()


@pytest.mark.parametrize("name, shape, classes, train, test", [
    ("cifar100_crossover_cpu", (32, 32, 3), 100, 5_000, 1_000),
    ("svhn_cpu", (32, 32, 3), 10, 5_000, 1_000),
])
def test_stand_in_has_the_real_shapes_after_the_subset(name, shape, classes, train, test):
  exp = EXPERIMENTS[name]
  data = stand_in_data(exp)
  assert data.name == f"stand-in-{exp.dataset}"
  assert data.image_shape == shape and data.num_classes == classes
  assert (data.num_train, data.num_test) == (train, test)
  assert data.x_train.dtype == np.uint8 and data.y_train.max() < classes


def test_stand_in_sizes_and_unknown_datasets():
  assert STAND_IN_SHAPES["svhn_cropped"][2:] == (73_257, 26_032)  # full splits without a subset
  assert STAND_IN_SHAPES["cifar100"][2:] == (50_000, 10_000)
  with pytest.raises(ValueError, match="No stand-in"):
    stand_in_data(dataclasses.replace(EXPERIMENTS["svhn_cpu"], dataset="mnist"))
