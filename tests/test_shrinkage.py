"""Gavish–Donoho thresholds and shrinkage as a spectral step."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dpmuon_jax.analysis.polar_metrics import polar_error
from dpmuon_jax.transforms import shrinkage as sh
from dpmuon_jax.transforms.buffer_noise import BufferSpec
from dpmuon_jax.transforms.muon import scale_by_orthogonalization

# Reference values computed independently: β, λ*(β), μ_β, ω exact, ω poly.
TABLE = [
    (0.05, 1.506607, 0.983308, 1.519341, 1.518695),
    (0.10, 1.581648, 0.966565, 1.608772, 1.603060),
    (0.25, 1.758029, 0.916004, 1.836866, 1.834375),
    (0.50, 1.978599, 0.830466, 2.171185, 2.172500),
    (0.75, 2.156094, 0.742948, 2.501430, 2.496875),
    (1.00, 2.309401, 0.652776, 2.858362, 2.860000),
]


@pytest.mark.parametrize("beta, lam, mu, omega, omega_poly", TABLE)
def test_gavish_donoho_table(beta, lam, mu, omega, omega_poly):
  assert sh.optimal_hard_threshold_coef(beta) == pytest.approx(lam, abs=2e-6)
  assert sh.marchenko_pastur_median(beta) == pytest.approx(mu, abs=2e-6)
  assert sh.unknown_noise_threshold_coef(beta) == pytest.approx(omega, abs=2e-6)
  assert 0.56 * beta**3 - 0.95 * beta**2 + 1.82 * beta + 1.43 == pytest.approx(omega_poly, abs=1e-6)


def test_square_threshold_is_four_over_root_three():
  assert sh.optimal_hard_threshold_coef(1.0) == pytest.approx(4 / math.sqrt(3), rel=1e-12)
  assert sh.optimal_hard_threshold((50, 50), 0.1) == pytest.approx(4 / math.sqrt(3) * 0.1 *
                                                                   math.sqrt(50))


def test_frobenius_shrinker_matches_spiked_model_overlaps():
  beta, x = 0.25, 2.0
  y = sh.spiked_singular_value(x, beta)
  assert y == pytest.approx(2.3049, abs=1e-4)
  cos2_u = 1 - beta * (1 + x**2) / (x**2 * (x**2 + beta))
  cos2_v = 1 - (beta + x**2) / (x**2 * (x**2 + 1))
  assert float(sh.frobenius_shrinker(y, beta)) == pytest.approx(1.7083, abs=1e-4)
  assert float(sh.frobenius_shrinker(y, beta)) == pytest.approx(x * math.sqrt(cos2_u * cos2_v),
                                                                rel=1e-10)
  below = np.array([0.5, 1.0, 1.49])  # below the bulk edge 1 + √β = 1.5
  np.testing.assert_array_equal(sh.frobenius_shrinker(below, beta), 0.0)
  assert float(sh.frobenius_shrinker(jnp.asarray(y), beta)) == pytest.approx(1.7083, abs=1e-4)


def test_marchenko_pastur_density_integrates_to_one():
  beta = 0.25
  x = np.linspace(0.0, 3.0, 300_001)
  assert np.trapezoid(sh.marchenko_pastur_density(x, beta), x) == pytest.approx(1.0, abs=2e-3)


def test_noise_estimate_from_median_singular_value():
  rng = np.random.default_rng(0)
  y = 0.3 * rng.standard_normal((100, 400))
  est = sh.estimate_noise_std(np.linalg.svd(y, compute_uv=False), y.shape)
  assert est == pytest.approx(0.3, rel=0.02)


def _low_rank_plus_noise(rng, shape, rank, strength, noise_std):
  m, n = shape
  u = np.linalg.qr(rng.standard_normal((m, rank)))[0]
  v = np.linalg.qr(rng.standard_normal((n, rank)))[0]
  scale = strength * noise_std * (math.sqrt(m) + math.sqrt(n))
  clean = scale * (u * np.linspace(2.0, 1.0, rank)) @ v.T
  return clean, clean + noise_std * rng.standard_normal(shape)


@pytest.mark.parametrize("method", [sh.HARD, sh.FROBENIUS])
def test_thresholded_step_beats_plain_orthogonalization_at_low_rank(method):
  rng = np.random.default_rng(1)
  s = 0.01
  clean, noisy = _low_rank_plus_noise(rng, (96, 48), rank=2, strength=2.0, noise_std=s)
  tx = sh.scale_by_singular_value_shrinkage(s, method=method)
  params = {"w": jnp.zeros(noisy.shape)}
  out, _ = tx.update({"w": jnp.asarray(noisy, jnp.float32)}, tx.init(params))
  plain, _ = scale_by_orthogonalization().update({"w": jnp.asarray(noisy, jnp.float32)}, None)
  err_thr = polar_error(np.asarray(out["w"]), clean)
  err_plain = polar_error(np.asarray(plain["w"]), clean)
  assert err_thr < 0.35 < 2.0 < err_plain, (err_thr, err_plain)
  # The retained subspace is exactly rank 2 and orthonormal.
  sv = np.linalg.svd(np.asarray(out["w"], np.float64), compute_uv=False)
  np.testing.assert_allclose(sv[:2], 1.0, atol=1e-4)
  assert sv[2] < 1e-4


def test_shrunk_output_denoises_and_uses_per_step_buffer_noise():
  rng = np.random.default_rng(2)
  s0 = 0.02
  clean, noisy = _low_rank_plus_noise(rng, (40, 80), rank=3, strength=1.5, noise_std=s0)
  buffer = BufferSpec(0.9, "ema", True)
  tx = sh.scale_by_singular_value_shrinkage(s0, buffer, method=sh.HARD, output=sh.SHRUNK)
  state = tx.init({"w": jnp.zeros(noisy.shape)})
  update = jax.jit(tx.update)
  for step in (1, 2, 3):
    out, state = update({"w": jnp.asarray(noisy, jnp.float32)}, state)
    s_t = s0 * float(buffer.factor(step))
    sv = np.linalg.svd(noisy, compute_uv=False)
    expected_rank = int(np.sum(sv > sh.optimal_hard_threshold(noisy.shape, s_t)))
    out_sv = np.linalg.svd(np.asarray(out["w"], np.float64), compute_uv=False)
    assert int(np.sum(out_sv > 1e-5)) == expected_rank
    np.testing.assert_allclose(out_sv[:expected_rank], sv[:expected_rank], rtol=1e-4)
  assert int(state.count) == 3
  frob, _ = sh.scale_by_singular_value_shrinkage(s0, method=sh.FROBENIUS, output=sh.SHRUNK).update(
      {"w": jnp.asarray(noisy, jnp.float32)}, sh.ShrinkageState(jnp.zeros((), jnp.int32)))
  assert np.linalg.norm(np.asarray(frob["w"]) - clean) < 0.5 * np.linalg.norm(noisy - clean)


def test_invalid_options_raise():
  with pytest.raises(ValueError):
    sh.scale_by_singular_value_shrinkage(0.1, method="soft")
  with pytest.raises(ValueError):
    sh.optimal_hard_threshold_coef(1.5)
