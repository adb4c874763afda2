"""Every experiment config builds, and runs one step on tiny shapes (configs cannot rot)."""

import csv
import dataclasses

import numpy as np
import pytest

from experiments.configs import EXPERIMENTS
from experiments.sweep import STAND_IN_SHAPES, check_buildable, run, stand_in_data


def test_cpu_scale_configs_say_how_they_were_scaled_down():
  for exp in EXPERIMENTS.values():
    assert exp.scale in ("full", "cpu")
    assert bool(exp.scaling) == (exp.scale == "cpu"), exp.name
    assert all(exp.learning_rate(name) > 0 for name in exp.optimizers), exp.name
    assert len(exp.seeds) >= 3


# One step of training per config runs in the fast job only for one config per distinct
# model build (model, size overrides, augmentation): the others train the very same network
# on the same tiny data, so the fast run of the config named here pins their training path,
# and test_every_config_builds_every_run (below, fast) still builds each of their runs.
# The full-size WRN-28-10 (36.5M parameters; one step took 140 CPU s and 7 GB), ResNet-18
# and ViT-Small are slow for the same reason: their CPU-scale twins build the same model
# builder and take the same sweep path at a fraction of the cost.
SLOW_CONFIGS = {
    "architecture_wrn28_10": "architecture_wrn28_10_cpu",
    "architecture_resnet18": "architecture_resnet18_cpu",
    "vit_small_cifar100": "vit_small_cifar100_cpu",
    "svhn": "main_table",  # full WRN-16-4 with augmentation, first run DP-SGD
    "temporal_ablation": "main_table",
    "cifar100_crossover": "main_table",
    "svhn_cpu": "cpu_phase_transition",  # the CPU-scale CNN, first run DP-SGD
    "temporal_ablation_cpu": "cpu_phase_transition",
    "cifar100_crossover_cpu": "cpu_phase_transition",
}


def _same_training(a, b):
  return (a.model, a.model_overrides, a.augment, a.optimizers[0]) == (
      b.model, b.model_overrides, b.augment, b.optimizers[0])


def test_each_slow_config_has_a_fast_twin_that_trains_the_same_way():
  for slow, fast in SLOW_CONFIGS.items():
    assert fast not in SLOW_CONFIGS and fast in EXPERIMENTS, slow
    if EXPERIMENTS[slow].scale == "full" and EXPERIMENTS[fast].scale == "cpu":
      assert EXPERIMENTS[slow].model == EXPERIMENTS[fast].model, slow  # same builder, smaller
    else:
      assert _same_training(EXPERIMENTS[slow], EXPERIMENTS[fast]), slow


@pytest.mark.parametrize("name", sorted(EXPERIMENTS))
def test_every_config_builds_every_run(tmp_path, name):
  check_buildable(EXPERIMENTS[name], str(tmp_path))


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


def test_the_user_level_check_compares_per_user_against_per_record():
  from experiments.user_level_check import USERS_PER_RELEASE, comparison

  common = {"noise_multiplier": 0.54, "releases": 400, "epsilon_spent": 7.99}
  example = {**common, "sampling_rate": 256 / 31_575, "valid_nll": 1.38, "test_bleu": 42.5,
             "test_rouge_l": 51.9}
  user = {**common, "sampling_rate": USERS_PER_RELEASE / 3641, "valid_nll": 1.6,
          "test_bleu": 40.0, "test_rouge_l": 50.0}
  rows = comparison(example, user, 3641, 31_575)
  assert [r["privacy_unit"] for r in rows] == ["example", "user", "user − example"]
  assert rows[0]["denominator"] == pytest.approx(256)
  assert rows[1]["denominator"] == pytest.approx(32)
  assert rows[2]["valid_nll"] == pytest.approx(0.22) and rows[2]["test_bleu"] == pytest.approx(-2.5)
