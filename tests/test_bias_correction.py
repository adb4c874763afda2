"""DP-Muon-BC (noise-bias-corrected Newton–Schulz) and DP-AdamBC."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dpmuon_jax.linalg.newton_schulz import newton_schulz
from dpmuon_jax.optimizers.paper2 import dp_adam_bc, dp_muon_bc
from dpmuon_jax.privacy.keys import stream_key
from dpmuon_jax.privacy.query import ClippedSum
from dpmuon_jax.privacy.release import dp_release
from dpmuon_jax.transforms.bias_correction import (
    KIM_FAN_NS_COEFFS,
    BiasCorrectionState,
    buffer_noise_variance,
    scale_by_adam_bc,
    scale_by_bias_corrected_orthogonalization,
)


def _coefficients(t, beta, w, nesterov):
  """Coefficients of G̃_1..G̃_t in M_t (or M̂_t), by running the recursion."""
  mu = np.zeros(t)
  for i in range(t):
    g = np.eye(t)[i]
    mu = beta * mu + w * g
  return w * np.eye(t)[t - 1] + beta * mu if nesterov else mu


@pytest.mark.parametrize("buffer, w", [("heavy_ball", 1.0), ("ema", 0.05)])
@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("t", [1, 2, 7])
def test_buffer_noise_variance_is_exact_at_every_step(buffer, w, nesterov, t):
  want = np.sum(_coefficients(t, 0.95, w, nesterov) ** 2)
  got = float(buffer_noise_variance(t, 0.95, buffer, nesterov))
  np.testing.assert_allclose(got, want, rtol=1e-5)
  assert float(buffer_noise_variance(0, 0.95, buffer, nesterov)) == 0.0


def test_buffer_noise_variance_matches_its_steady_state_formula():
  # steady state: std 0.160 s₀ (EMA) and 0.174 s₀ (Nesterov look-ahead) at β = 0.95
  assert abs(float(buffer_noise_variance(10_000, 0.95, "ema")) ** 0.5 - 0.160) < 1e-3
  assert abs(float(buffer_noise_variance(10_000, 0.95, "ema", True)) ** 0.5 - 0.174) < 1e-3
  np.testing.assert_allclose(float(buffer_noise_variance(10_000, 0.9)), 1 / (1 - 0.81), rtol=1e-5)


def test_bias_correction_reduces_monte_carlo_bias_of_newton_schulz():
  """E[NS(M + N)] vs NS(M) on a fixed rank-2 M, N with i.i.d. N(0, s²) entries.

  The bias is measured on the signal block UᵀXV (outside it the Monte-Carlo
  error of the mean dominates); β = 0 and t = 1 make s_t = s exactly.
  """
  rng = np.random.default_rng(0)
  n, s, draws = 16, 0.1, 1000
  u = np.linalg.qr(rng.standard_normal((n, 2)))[0]
  v = np.linalg.qr(rng.standard_normal((n, 2)))[0]
  m = jnp.asarray(u @ np.diag([3.0, 2.0]) @ v.T, jnp.float32)
  u, v = jnp.asarray(u, jnp.float32), jnp.asarray(v, jnp.float32)
  noise = jnp.asarray(s * rng.standard_normal((draws, n, n)), jnp.float32)
  ns = lambda x: newton_schulz(x, 5, KIM_FAN_NS_COEFFS)
  transform = scale_by_bias_corrected_orthogonalization(s, 0.0, key=1)
  keys = jax.vmap(jax.random.key_data)(jax.random.split(jax.random.key(2), draws))

  def corrected(x, key):
    state = BiasCorrectionState(jnp.zeros((), jnp.int32), key)
    return transform.update({"w": x}, state)[0]["w"]

  raw = jax.jit(jax.vmap(ns))(m + noise)
  fixed = jax.jit(jax.vmap(corrected))(m + noise, keys)
  block = jax.vmap(lambda x: u.T @ x @ v)
  target = u.T @ ns(m) @ v
  bias_raw = float(jnp.linalg.norm(block(raw).mean(0) - target))
  bias_bc = float(jnp.linalg.norm(block(fixed).mean(0) - target))
  stderr_raw = float(jnp.linalg.norm(block(raw).std(0))) / draws**0.5
  assert bias_raw > 10 * stderr_raw  # the heat-smoothing bias is really there
  assert bias_bc < 0.35 * bias_raw, (bias_raw, bias_bc)


def test_correction_randomness_is_the_postprocessing_stream_not_noise():
  transform = scale_by_bias_corrected_orthogonalization(0.1, 0.0, key=123)  # β = 0: s_t = s
  state = transform.init({"w": jnp.zeros((4, 4))})
  np.testing.assert_array_equal(state.key, stream_key(123, "postprocessing")[0])
  assert not np.array_equal(state.key, stream_key(123, "noise")[0])
  x = {"w": jnp.asarray(np.random.default_rng(0).standard_normal((4, 4)), jnp.float32)}
  out1, state = transform.update(x, state)
  out2, _ = transform.update(x, state)
  assert not np.array_equal(out1["w"], out2["w"])  # fresh Z at every step


def test_no_noise_means_no_correction():
  x = {"w": jnp.asarray(np.random.default_rng(1).standard_normal((6, 4)), jnp.float32)}
  transform = scale_by_bias_corrected_orthogonalization(0.0, 0.9, key=0, max_aspect_ratio=None)
  out, _ = transform.update(x, transform.init(x))
  np.testing.assert_allclose(out["w"], newton_schulz(x["w"], 5, KIM_FAN_NS_COEFFS), atol=1e-5)


def _adam_bc_reference(grads, phi, b1=0.9, b2=0.999, eps_root=1e-8):
  m = v = np.zeros_like(grads[0])
  out = []
  for t, g in enumerate(grads, start=1):
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    m_hat, v_hat = m / (1 - b1**t), v / (1 - b2**t)
    out.append(m_hat / np.sqrt(np.maximum(v_hat - phi, eps_root)))
  return out


def test_adam_bc_matches_official_formula_by_hand():
  """Step 1: m̂ = g, v̂ = g², so the update is g / sqrt(max(g² − Φ, eps_root))."""
  phi = 0.04
  g1 = np.array([1.0, 0.1, -0.3, -0.19], np.float32)  # g² − Φ: 0.96, < 0, 0.05, < 0
  want1 = np.array([1 / 0.96**0.5, 0.1 / 1e-4, -0.3 / 0.05**0.5, -0.19 / 1e-4])
  transform = scale_by_adam_bc(phi, eps_root=1e-8)
  state = transform.init(jnp.zeros(4))
  out1, state = transform.update(jnp.asarray(g1), state)
  np.testing.assert_allclose(out1, want1, rtol=2e-3)
  g2 = np.array([0.5, 0.5, 0.5, -0.5], np.float32)
  out2, _ = transform.update(jnp.asarray(g2), state)
  np.testing.assert_allclose(out2, _adam_bc_reference([g1, g2], phi)[1], rtol=2e-3)


def test_dp_adam_bc_subtracts_the_release_noise_variance():
  c, sigma, d, lr = 2.0, 1.5, 40.0, 0.1
  rng = np.random.default_rng(3)
  total = {"w": jnp.asarray(rng.standard_normal(50) * 20, jnp.float32)}
  clipped = ClippedSum.assume_clipped(total, c, num_examples=100)  # ‖total‖ ≈ 141 ≤ 100c
  release = dp_release(c, sigma, d, key=11)
  released, _ = release.update(clipped, release.init(total), total)  # same key: same noise
  opt = dp_adam_bc(lr, c, sigma, d, key=11)
  updates, _ = opt.update(clipped, opt.init(total), total)
  want = -lr * _adam_bc_reference([np.asarray(released["w"])], (sigma * c / d) ** 2)[0]
  np.testing.assert_allclose(updates["w"], want, rtol=2e-3)


def test_dp_muon_bc_runs_and_validates():
  opt = dp_muon_bc(0.05, 1.0, 1.0, 8.0, key=0)
  params = {"dense": {"kernel": jnp.zeros((5, 3)), "bias": jnp.zeros(3)}}
  grads = jax.tree.map(lambda p: jnp.ones((4,) + p.shape), params)
  updates, _ = opt.update(grads, opt.init(params), params, mask=jnp.ones(4, bool))
  assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(updates))
  with pytest.raises(ValueError, match="num_samples"):
    scale_by_bias_corrected_orthogonalization(0.1, 0.9, key=0, num_samples=0)
  with pytest.raises(ValueError, match="eps_root"):
    scale_by_adam_bc(0.1, eps_root=0.0)
