"""Meaningless numeric options are refused when the optimizer or the run is built, in one line."""

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dpmuon_jax import checks, dp_release, privatize
from dpmuon_jax.optimizers import registry as optimizer_registry
from dpmuon_jax.optimizers.classic import dp_adam, dp_adamw, dp_sgd
from dpmuon_jax.optimizers.filters import (
    dp_disk_muon,
    dp_disk_sgd,
    dp_doppler_muon,
    dp_doppler_sgd,
)
from dpmuon_jax.optimizers.muon import dp_muon, dp_muon_s, fallback_optimizer, muon
from dpmuon_jax.optimizers.options import Fallback, NewtonSchulz
from dpmuon_jax.optimizers.paper2 import dp_adam_bc, dp_muon_bc, dp_muon_im
from dpmuon_jax.privacy.disk_query import DISK_PRESETS
from dpmuon_jax.text.train import LMTrainConfig, validate_config
from dpmuon_jax.training.trainer import TrainConfig, TrainingError, train
from dpmuon_jax.transforms.filters import DOPPLER_PRESETS
from dpmuon_jax.transforms.muon import scale_by_orthogonalization
from dpmuon_jax.transforms.selective import selective_orthogonalization

RELEASE = dict(l2_clip_norm=1.0, noise_multiplier=1.0, denominator=8.0, key=0)
NAMES = list(optimizer_registry.OPTIMIZERS)


def _refused(match, make, *args, **kwargs) -> str:
  with pytest.raises(ValueError, match=match) as info:
    make(*args, **kwargs)
  message = str(info.value)
  assert "\n" not in message
  return message


# ------------------------------------------------------------------------------- learning rates


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("lr", [math.nan, math.inf, -1.0, -1e-9])
def test_every_optimizer_refuses_a_bad_learning_rate(name, lr):
  message = _refused("learning_rate", optimizer_registry.build, name, lr, RELEASE)
  assert repr(lr) in message and ">= 0" in message


@pytest.mark.parametrize("name", NAMES)
def test_every_optimizer_refuses_a_bad_schedule_and_accepts_good_ones(name):
  _refused("learning_rate.*nan at step 0", optimizer_registry.build, name,
           lambda t: math.nan, RELEASE)
  _refused("learning_rate.*at step 1000", optimizer_registry.build, name,
           lambda t: 0.1 - 1e-3 * t, RELEASE)  # negative after 100 steps
  warmup = optax.warmup_cosine_decay_schedule(0.0, 0.1, 10, 100)
  for good in (0.0, 0.1, warmup, lambda t: 0.1):
    optimizer_registry.build(name, good, RELEASE)


# ------------------------------------------------------------------------ other options per family


@pytest.mark.parametrize(
    "make, kwargs, match",
    [
        (dp_sgd, dict(momentum=1.0), "momentum"),
        (dp_sgd, dict(momentum=-0.1), "momentum"),
        (dp_adam, dict(b1=1.5), "b1"),
        (dp_adam, dict(b2=math.nan), "b2"),
        (dp_adam, dict(eps=-1e-8), "eps"),
        (dp_adamw, dict(weight_decay=-1e-4), "weight_decay"),
        (dp_muon, dict(beta=1.5), "beta"),
        (dp_muon, dict(weight_decay=-0.1), "weight_decay"),
        (dp_muon, dict(routing="paper2"), "fallback_learning_rate"),  # AdamW needs its own
        (dp_muon_s, dict(power_iterations=0), "power_iterations"),
        (dp_muon_s, dict(beta=-0.5), "beta"),
        (dp_disk_sgd, dict(kappa=0.0), "kappa"),
        (dp_disk_sgd, dict(kappa=3.0), "kappa"),  # |1 − κ| > 1: the filter diverges
        (dp_disk_sgd, dict(gamma=math.nan), "gamma"),
        (dp_doppler_sgd, dict(a=(1.0, -1.5), b=(0.1,)), "poles"),
        (dp_doppler_sgd, dict(a=(1.0, math.inf)), "finite"),
        (dp_doppler_muon, dict(weight_decay=-1.0), "weight_decay"),
        (dp_muon_im, dict(history=-1), "history"),
        (dp_muon_im, dict(history=1.5), "history"),
        (dp_muon_im, dict(decay=1.5), "decay"),
        (dp_muon_im, dict(decay=0.0), "decay"),
        (dp_muon_im, dict(fallback_decay=math.nan), "fallback_decay"),
        (dp_muon_bc, dict(num_samples=0), "num_samples"),
        (dp_muon_bc, dict(beta=1.0), "beta"),
        (dp_adam_bc, dict(b2=1.0), "b2"),
        (dp_adam_bc, dict(eps_root=math.nan), "eps_root"),
        (dp_adam_bc, dict(weight_decay=-1.0), "weight_decay"),
    ],
)
def test_bad_options_are_refused_with_their_names(make, kwargs, match):
  _refused(match, make, 0.02, **RELEASE, **kwargs)


@pytest.mark.parametrize(
    "group, kwargs, match",
    [
        (NewtonSchulz, dict(steps=0), "ns_steps"),
        (NewtonSchulz, dict(steps=2.5), "ns_steps"),
        (NewtonSchulz, dict(steps=-1), "ns_steps"),
        (NewtonSchulz, dict(eps=0.0), "eps"),
        (NewtonSchulz, dict(coeffs=(math.nan, 1.0, 1.0)), "ns_coeffs"),
        (Fallback, dict(kind="adam"), "fallback"),
        (Fallback, dict(learning_rate=math.nan), "fallback_learning_rate"),
        (Fallback, dict(momentum=1.0), "fallback_momentum"),
        (Fallback, dict(weight_decay=math.inf), "fallback_weight_decay"),
        (Fallback, dict(b2=1.0), "fallback_b2"),
    ],
)
def test_bad_option_groups_are_refused_with_their_names(group, kwargs, match):
  _refused(match, group, **kwargs)


@pytest.mark.parametrize(
    "make, kwargs",
    [
        (dp_sgd, dict(momentum=0.0)),
        (dp_muon, dict(beta=0.0, fallback=Fallback(momentum=0.0), weight_decay=0.0)),
        (dp_disk_muon, dict(ns=NewtonSchulz(steps=1, coeffs=(1.5, -0.5, 0.0)))),
        (dp_disk_sgd, dict(kappa=1.5, gamma=-1.0)),  # paper 1's preset: γ = −1 stays valid
        (dp_disk_sgd, dict(kappa=2.0, gamma=0.0)),
        (dp_disk_muon, DISK_PRESETS["paper2"]._asdict()),
        (dp_doppler_sgd, dict(a=(1.0, -1.0), b=(1.0,))),  # running mean: a pole on the circle
        (dp_muon_im, dict(history=0, decay=1.0)),
        (dp_muon_s, dict(exact_svd=True, buffer="heavy_ball")),
    ],
)
def test_unusual_but_meaningful_values_are_accepted(make, kwargs):
  make(0.02, **RELEASE, **kwargs)


@pytest.mark.parametrize("name", sorted(DOPPLER_PRESETS))
def test_every_doppler_preset_is_accepted(name):
  dp_doppler_muon(0.02, **RELEASE, **DOPPLER_PRESETS[name]._asdict())


def test_public_transforms_check_their_own_options():
  _refused("momentum", fallback_optimizer, "sgd", 0.1, momentum=1.0)
  _refused("learning_rate", fallback_optimizer, "adamw", -0.1)
  _refused("max_aspect_ratio", scale_by_orthogonalization, max_aspect_ratio=-1.0)
  _refused("margin", selective_orthogonalization, 0.1, margin=math.nan)


def test_traced_values_pass_unchecked():
  """Under ``jit`` (e.g. ``optax.inject_hyperparams``) a value cannot be inspected."""

  @jax.jit
  def build(beta, lr):
    assert checks.check_in_range("beta", beta, 0.0, 1.0) is beta
    assert checks.check_learning_rate("learning_rate", lr) is lr
    return beta

  build(jnp.float32(2.0), jnp.float32(-1.0))


# ------------------------------------------------------------ optax.inject_hyperparams


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("setting", ["l2_clip_norm", "noise_multiplier", "denominator"])
def test_every_optimizer_refuses_a_release_setting_held_as_an_array(name, setting):
  """C, σ or D in an optimizer state (as inject_hyperparams keeps them) could change unaccounted."""
  release = {**RELEASE, setting: jnp.float32(RELEASE[setting])}
  with pytest.raises(TypeError, match=f"{setting} must be a Python number.*inject"):
    optimizer_registry.build(name, 0.1, release)


@pytest.mark.parametrize("make", [dp_sgd, dp_muon], ids=["dp_sgd", "dp_muon"])
def test_injecting_a_dp_optimizer_names_the_supported_pattern(make):
  injected = optax.inject_hyperparams(make)(0.02, 1.0, 1.0, 8.0, key=0)
  with pytest.raises(TypeError, match=r"inject the post-processing only"):
    injected.init({"w": jnp.zeros((4, 2))})


def test_an_injected_learning_rate_scales_the_private_update():
  """The supported pattern: the release outside, inject_hyperparams on the post-processing."""
  params = {"w": jnp.ones((4, 2))}
  per_example = {"w": jax.random.normal(jax.random.key(1), (8, 4, 2))}
  optimizer = privatize(dp_release(1.0, 1.0, 8.0, key=0),
                        optax.inject_hyperparams(muon)(learning_rate=0.02))
  state = optimizer.init(params)
  update = jax.jit(optimizer.update)
  first, _ = update(per_example, state, params)
  release_state, injected = state
  learning_rate = injected.hyperparams["learning_rate"]
  doubled = injected._replace(hyperparams={**injected.hyperparams,
                                           "learning_rate": 2 * learning_rate})
  second, _ = update(per_example, (release_state, doubled), params)
  chex.assert_trees_all_close(second, jax.tree.map(lambda u: 2 * u, first), rtol=1e-6)


def test_check_messages_name_option_value_and_range():
  cases = [
      (lambda: checks.check_in_range("beta", 1.0, 0.0, 1.0, True, False),
       "beta must be in [0, 1), got 1.0."),
      (lambda: checks.check_positive("eps", math.inf), "eps must be a finite number > 0, got inf."),
      (lambda: checks.check_positive_int("ns_steps", True),
       "ns_steps must be an int >= 1, got True."),
      (lambda: checks.check_nonnegative("lr", np.float32(-2)),
       "lr must be a finite number >= 0, got -2.0."),
  ]
  for call, expected in cases:
    with pytest.raises(ValueError) as info:
      call()
    assert str(info.value) == expected
  assert checks.check_positive_int("steps", 3.0) == 3 and checks.check_finite("x", -1) == -1.0


# -------------------------------------------------------------------------------- run configs


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("learning_rate", math.nan, "--learning-rate"),
        ("learning_rate", -1.0, "--learning-rate"),
        ("learning_rate", 0.0, "--learning-rate"),
        ("warmup_fraction", 1.0, "--warmup-fraction"),
        ("warmup_fraction", -0.1, "--warmup-fraction"),
        ("noise_multiplier", -1.0, "--noise-multiplier"),
        ("noise_multiplier", math.inf, "--noise-multiplier"),
        ("microbatch_size", 0, "--microbatch-size"),
        ("eval_every", 0, "--eval-every"),
        ("checkpoint_every", -5, "--checkpoint-every"),
        ("max_steps", 2.5, "--max-steps"),
        ("model_seed", 0.5, "--model-seed"),
        ("seed", math.nan, "--seed"),
        ("devices", 0, "--devices"),
        ("epsilon", math.nan, "--epsilon"),
        ("delta", math.nan, "--delta"),
        ("epochs", math.inf, "--epochs"),
        ("clip", math.nan, "--clip"),
    ],
)
def test_train_config_refuses_bad_values_when_it_is_made(tmp_path, field, value, match):
  out = tmp_path / "run"
  settings = dict(model="mlp", dataset="tiny", optimizer="dp_sgd", batch_size=16, epochs=2,
                  seed=3, output_dir=str(out), progress=False, plot=False)
  message = _refused(match, TrainConfig, **{**settings, field: value})
  assert message.startswith(f"{match} must be")
  assert not out.exists()


def test_a_batch_larger_than_the_data_is_refused_before_any_work(tmp_path, tiny_data):
  out = tmp_path / "run"
  config = TrainConfig(model="mlp", dataset="tiny", optimizer="dp_sgd", batch_size=10**6,
                       output_dir=str(out), progress=False, plot=False)
  with pytest.raises(TrainingError, match="--batch-size must be in"):
    train(config, tiny_data)
  assert not out.exists()


def _lm_config(**kw) -> LMTrainConfig:
  return LMTrainConfig(data_dir="unused", **kw)


@pytest.mark.parametrize(
    "field, value",
    [
        ("learning_rate", math.nan), ("learning_rate", -0.002), ("fallback_learning_rate", 0.0),
        ("epsilon", math.nan), ("delta", 1.0), ("sampling_rate", 0.0), ("sampling_rate", 1.5),
        ("steps", 0), ("denominator", -1.0), ("clip", math.inf), ("model_seed", 1.5),
        ("microbatch_size", 0), ("eval_every", -1), ("beam_size", 0), ("max_new_tokens", 2.5),
        ("capacity", 0), ("diagnostic_steps", (-1,)),
    ],
)
def test_lm_config_refuses_bad_values(field, value):
  flag = "--" + field.replace("_", "-")
  assert _refused(flag, _lm_config, **{field: value}).startswith(f"{flag} must be")


def test_lm_config_defaults_are_valid():
  validate_config(_lm_config())


@pytest.mark.parametrize("lr", ["nan", "-1", "inf"])
def test_cli_reports_a_bad_learning_rate_in_one_line(tmp_path, capsys, lr):
  from dpmuon_jax.cli import main

  out = tmp_path / "run"
  code = main(["train", "--lr", lr, "--output-dir", str(out), "--no-progress", "--no-plot"])
  err = capsys.readouterr().err
  assert code != 0
  assert err.count("\n") == 1 and "--learning-rate" in err and "Traceback" not in err
  assert not out.exists()


# ------------------------------------------------------------------------ setup and accounting


_SETUP = dict(target_epsilon=2.0, target_delta=1e-5, dataset_size=1000, expected_batch_size=10,
              l2_clip_norm=1.0)


@pytest.mark.parametrize("epochs", [math.inf, math.nan, 0, -5])
def test_make_private_refuses_bad_epochs(epochs):
  from dpmuon_jax.privacy.setup import make_private

  message = _refused("epochs", make_private, **_SETUP, epochs=epochs)
  assert message.startswith("epochs must be a finite number > 0")


@pytest.mark.parametrize("steps", [0, -5, 2.5, math.inf, True])
def test_make_private_refuses_bad_steps_and_accepts_numpy_ints(steps):
  from dpmuon_jax.privacy.setup import make_private

  _refused("steps must be an int >= 1", make_private, **_SETUP, steps=steps)
  assert make_private(**_SETUP, steps=np.int64(5)).steps == 5


@pytest.mark.parametrize("dataset_size", [0, -5])
def test_calibration_refuses_a_bad_dataset_size(dataset_size):
  from dpmuon_jax.privacy.accounting import calibrate_noise_multiplier, compute_epsilon

  _refused("dataset_size", calibrate_noise_multiplier, 2.0, 1e-5, 0.01, 100,
           dataset_size=dataset_size)
  _refused("dataset_size", compute_epsilon, 1.0, 0.01, 100, 1e-5, dataset_size=dataset_size)


def test_compute_epsilon_refuses_an_infinite_noise_multiplier():
  from dpmuon_jax.privacy.accounting import compute_epsilon

  _refused("noise_multiplier must be a finite number >= 0", compute_epsilon, math.inf, 0.01,
           100, 1e-5)
