"""Secure noise: exact integer sums on the clipping grid plus discrete Gaussian noise.

The release draws its noise from OS entropy; these tests substitute a seeded
byte source so that they are reproducible.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

import dpmuon_jax as dm
from dpmuon_jax.distributed.mesh import data_mesh
from dpmuon_jax.privacy import release as release_module
from dpmuon_jax.privacy.accounting import compute_epsilon
from dpmuon_jax.privacy.clipping import Clipping, round_to_grid
from dpmuon_jax.privacy.discrete_gaussian import discrete_gaussian_noise_multiplier
from dpmuon_jax.privacy.release import DEFAULT_GRID_BITS, secure_noise_variance
from dpmuon_jax.training.step import make_private_step

C, SIGMA, D = 2.0, 1.3, 10.0
pytestmark = pytest.mark.filterwarnings("ignore:noise_multiplier=0")


@pytest.fixture(autouse=True)
def seeded_entropy(monkeypatch):
  monkeypatch.setattr(release_module, "_random_bytes", np.random.default_rng(7).bytes)


def _release(sigma=SIGMA, **kw):
  return dm.dp_release(C, sigma, D, key=0, secure_noise=True, **kw)


def test_secure_mode_puts_the_grid_on_the_clipping_rule():
  release = _release()
  assert release.release.secure_noise
  assert release.release.clipping.grid_bits == DEFAULT_GRID_BITS
  assert not dm.dp_release(C, SIGMA, D, key=0).release.secure_noise


def test_noise_variance_two_sided():
  # Zero queries: the release is Z·γ/D with Z ~ N_Z(0, σ_Z²) per coordinate.
  n = 40_000
  params = {"w": jnp.zeros((200, 200))}
  release = _release()
  out, _ = release.update({"w": jnp.zeros((1, 200, 200))}, release.init(params), params)
  rule = release.release.clipping
  expected_std = math.sqrt(secure_noise_variance(SIGMA, rule, n)) * rule.grid_step / D
  x = np.asarray(out["w"], np.float64).ravel() / expected_std
  # For N(0,1) samples (N_Z(0, σ_Z²) with σ_Z ≈ 8.5e4 has the same moments to double
  # precision) (n−1)s² ~ χ²_{n−1}; a two-sided test at level 1e-6 each side.
  chi2 = (n - 1) * np.var(x, ddof=1)
  assert stats.chi2.ppf(1e-6, n - 1) < chi2 < stats.chi2.isf(1e-6, n - 1)
  # The mean: |x̄| < 5 standard errors.
  assert abs(x.mean()) < 5 / math.sqrt(n)
  # Secure noise costs 1 + √d/2^(k+1) of the float mode's standard deviation.
  float_std = SIGMA * C / D
  assert expected_std / float_std == pytest.approx(1 + math.sqrt(n) / 2 ** (DEFAULT_GRID_BITS + 1),
                                                    rel=1e-6)


def test_accounting_equals_the_continuous_gaussian_within_the_stated_bound():
  for dim in (10, 10_000, 10_000_000):
    rule = Clipping(C, grid_bits=DEFAULT_GRID_BITS)
    variance = secure_noise_variance(SIGMA, rule, dim)
    multiplier = discrete_gaussian_noise_multiplier(
        math.sqrt(variance), rule.grid_sensitivity(dim), dim
    )
    # CKS 2020 (the multivariate discrete Gaussian): the multiplier the accountant may
    # use is σ_Z/Δ ≥ σ, and the ceiling of σ_Z² adds at most 1/(2(σΔ)²) relative.
    bound = 1 / (2 * (SIGMA * rule.grid_sensitivity(dim)) ** 2)
    assert SIGMA <= multiplier <= SIGMA * (1 + bound + 1e-12)
  # The ledger of a secure release accounts for σ itself: ε is the continuous Gaussian's.
  setup = dm.make_private(target_epsilon=4.0, target_delta=1e-5, dataset_size=1000,
                          expected_batch_size=50, l2_clip_norm=C, steps=30, key=0,
                          secure_noise=True)
  setup.ledger.record(setup.sampler, setup.release, count=30)
  assert setup.release.release.secure_noise
  assert setup.ledger.epsilon() == pytest.approx(
      compute_epsilon(setup.noise_multiplier, 0.05, 30, 1e-5), rel=1e-12
  )


def test_rounded_sum_is_exact_with_negative_values_and_many_examples():
  rule = Clipping(1.0, grid_bits=16)
  rng = np.random.default_rng(0)
  units = rng.integers(-(2**16), 2**16 + 1, size=(3000, 7))
  clipped = jnp.asarray(units / 2**16, jnp.float32)
  mask = jnp.asarray(rng.random(3000) < 0.9)
  grid = round_to_grid(clipped, mask, rule.grid_bits, rule.l2_clip_norm)
  exact = np.asarray(grid.hi, np.int64) * 256 + np.asarray(grid.lo, np.int64)
  np.testing.assert_array_equal(exact, (units * np.asarray(mask)[:, None]).sum(0))


def test_a_grid_sum_over_more_examples_than_its_limbs_hold_is_refused():
  """At k = 22 the high limbs of ~131k examples at ±C reach 2³¹: the sum is exact up to
  ``max_grid_examples`` and a release over more (where int32 would wrap) is refused."""
  rule = Clipping(C, grid_bits=22)
  n = rule.max_grid_examples
  grid = round_to_grid(jnp.full((n, 1), C, jnp.float32), jnp.ones(n, bool), 22, C)
  assert int(grid.hi[0]) * 256 + int(grid.lo[0]) == n * 2**22
  wraps = 2**31 // 2**14 + 2  # n·2¹⁴ > 2³¹ − 1
  release = _release(clipping=rule)
  params = {"w": jnp.zeros(1)}
  too_many = {"w": jnp.full((wraps, 1), C, jnp.float32)}
  with pytest.raises(ValueError, match="int32 limbs sum exactly"):
    release.update(too_many, release.init(params), params)
  with pytest.raises(ValueError, match="int32 limbs sum exactly"):  # a sum made beforehand
    release.update(dm.clip_and_sum(too_many, None, rule), release.init(params), params)


def test_adding_one_example_moves_the_release_by_at_most_the_grid_sensitivity():
  params = {"a": jnp.zeros((30, 4)), "b": jnp.zeros(4)}
  rng = np.random.default_rng(1)
  per_example = jax.tree.map(
      lambda p: jnp.asarray(rng.standard_normal((9,) + p.shape) * 3, jnp.float32), params
  )
  release = _release(sigma=0.0)
  state = release.init(params)
  with_all, _ = release.update(per_example, state, params)
  without, _ = release.update(per_example, state, params, mask=jnp.arange(9) < 8)
  diff = math.sqrt(sum(float(jnp.sum((x - y) ** 2)) for x, y in zip(
      jax.tree.leaves(with_all), jax.tree.leaves(without))))
  rule = release.release.clipping
  assert diff <= rule.grid_sensitivity(124) * rule.grid_step / D * (1 + 1e-6)
  assert diff > 0.9 * C / D  # the example was clipped to C: it did move the release


def _loss(params, batch):
  return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)


def test_private_step_runs_in_secure_mode_and_the_sharded_step_refuses():
  params = {"w": jnp.zeros((3, 2))}
  batch = {"x": jnp.ones((8, 3)), "y": jnp.ones((8, 2))}
  opt = dm.dp_sgd(0.1, l2_clip_norm=C, noise_multiplier=SIGMA, denominator=8.0, key=0,
                  clipping=Clipping(C, grid_bits=12))
  assert opt.release.secure_noise
  step = make_private_step(opt, _loss, microbatch_size=4)
  state = opt.init(params)
  out = step(params, state, [(batch, jnp.ones(8, bool)), (batch, jnp.arange(8) < 3)])
  assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(out.params))
  assert int(out.opt_state[0].count) == 1
  with pytest.raises(ValueError, match="one device"):
    make_private_step(opt, _loss, mesh=data_mesh(1))


def test_a_float_sum_is_refused_by_a_secure_release():
  params = {"w": jnp.zeros(3)}
  release = _release()
  float_sum = dm.clip_and_sum({"w": jnp.ones((2, 3))}, None, C)
  with pytest.raises(ValueError, match="grid"):
    release.update(float_sum, release.init(params), params)


def test_the_trainer_runs_with_secure_noise_and_certifies_it(tmp_path, tiny_data):
  from dpmuon_jax.training.export import load_exported
  from dpmuon_jax.training.trainer import TrainConfig, train

  config = TrainConfig(model="mlp", dataset="tiny", epsilon=3.0, delta=1e-3, batch_size=16,
                       epochs=1, max_steps=2, seed=3, output_dir=str(tmp_path / "run"),
                       progress=False, plot=False, learning_rate=0.1, secure_noise=True)
  results = train(config, tiny_data)
  assert results["secure_noise"] and results["clipping"]["grid_bits"] == DEFAULT_GRID_BITS
  certificate = load_exported(str(tmp_path / "run" / results["export"])).certificate
  assert certificate["secure_noise"] is True
  assert certificate["releases"] == 2
