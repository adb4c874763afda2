"""The mechanism paper 1 rests on, against random-matrix theory.

Rank-1 signal θ_raw·u vᵀ (m × n, c = m/n = 1/4) plus Gaussian noise with
per-entry std s (s = σC/D for a release). With θ = θ_raw/(s√n), the spiked
model (Benaych-Georges & Nadakuditi 2012) gives, for θ > c^{1/4}:

    σ₁/(s√n) → sqrt((1+θ²)(c+θ²))/θ
    cos²(ũ, u) → 1 − c(1+θ²)/(θ²(θ²+c)),   cos²(ṽ, v) → 1 − (c+θ²)/(θ²(θ²+1))

and overlaps → 0, σ₁/(s√n) → 1 + √c below it. Newton–Schulz keeps every
singular pair (ũ_k, ṽ_k) of the release, so the signal component uᵀ NS(G̃) v
is positive and grows with θ, and is ≈ 0 for noise alone.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dpmuon_jax.linalg.newton_schulz import newton_schulz, newton_schulz_polynomial

M, N = 100, 400
C_RATIO = M / N
NOISE_STD = 1.3 * 1.0 / 256.0  # s = σC/D
TRIALS = 24
_ns = jax.jit(jax.vmap(newton_schulz))


def _draw(theta, seed):
  """TRIALS releases G̃ = θ s√n · u vᵀ + s Z with random unit u, v."""
  rng = np.random.default_rng(seed)
  u = rng.standard_normal((TRIALS, M))
  v = rng.standard_normal((TRIALS, N))
  u /= np.linalg.norm(u, axis=1, keepdims=True)
  v /= np.linalg.norm(v, axis=1, keepdims=True)
  signal = theta * NOISE_STD * np.sqrt(N) * u[:, :, None] * v[:, None, :]
  return signal + NOISE_STD * rng.standard_normal((TRIALS, M, N)), u, v


def _mean_se(x):
  return x.mean(), x.std(ddof=1) / np.sqrt(len(x))


def _close(samples, expected, finite_size=0.01):
  mean, se = _mean_se(samples)
  assert abs(mean - expected) <= 4 * se + finite_size, (mean, se, expected)


@pytest.mark.parametrize("theta", [1.5, 3.0])
def test_leading_pair_overlaps_match_spiked_model(theta):
  g, u, v = _draw(theta, seed=int(10 * theta))
  uu, s, vt = np.linalg.svd(g, full_matrices=False)
  cos2_u = np.einsum("ri,ri->r", uu[:, :, 0], u) ** 2
  cos2_v = np.einsum("ri,ri->r", vt[:, 0], v) ** 2
  t2 = theta**2
  _close(cos2_u, 1 - C_RATIO * (1 + t2) / (t2 * (t2 + C_RATIO)))
  _close(cos2_v, 1 - (C_RATIO + t2) / (t2 * (t2 + 1)))
  _close(s[:, 0] / (NOISE_STD * np.sqrt(N)), np.sqrt((1 + t2) * (C_RATIO + t2)) / theta)
  if theta == 1.5:  # the limits at θ = 1.5 (a 400 × 1600 simulation gives 0.854, 0.656)
    assert 1 - C_RATIO * (1 + t2) / (t2 * (t2 + C_RATIO)) == pytest.approx(0.856, abs=1e-3)
    assert 1 - (C_RATIO + t2) / (t2 * (t2 + 1)) == pytest.approx(0.658, abs=1e-3)


def test_overlaps_vanish_below_detection_threshold():
  theta = 0.5  # < c^{1/4} ≈ 0.707
  g, u, v = _draw(theta, seed=5)
  uu, s, vt = np.linalg.svd(g, full_matrices=False)
  assert np.mean(np.einsum("ri,ri->r", uu[:, :, 0], u) ** 2) < 0.1
  assert np.mean(np.einsum("ri,ri->r", vt[:, 0], v) ** 2) < 0.1
  # σ₁ sticks to the bulk edge 1 + √c.
  _close(s[:, 0] / (NOISE_STD * np.sqrt(N)), 1 + np.sqrt(C_RATIO), finite_size=0.05)


def test_newton_schulz_keeps_the_noisy_leading_pair():
  g, _, _ = _draw(1.5, seed=7)
  out = np.asarray(_ns(jnp.asarray(g, jnp.float32)), np.float64)
  uu, s, vt = np.linalg.svd(g, full_matrices=False)
  gain = newton_schulz_polynomial(s[:, 0] / np.linalg.norm(g, axis=(1, 2)))
  image = np.einsum("rij,rj->ri", out, vt[:, 0])
  np.testing.assert_allclose(image, gain[:, None] * uu[:, :, 0], atol=1e-4)


def test_signal_component_positive_and_growing_with_theta():
  components = {}
  for i, theta in enumerate([0.0, 0.5, 1.5, 3.0]):
    g, u, v = _draw(theta, seed=100 + i)
    out = np.asarray(_ns(jnp.asarray(g, jnp.float32)), np.float64)
    components[theta] = _mean_se(np.einsum("ri,rij,rj->r", u, out, v))
  mean0, se0 = components[0.0]
  assert abs(mean0) <= 4 * se0 and abs(mean0) < 0.05  # noise only: ≈ 0
  means = [components[t][0] for t in (0.5, 1.5, 3.0)]
  assert all(m > 10 * components[t][1] for m, t in zip(means, (0.5, 1.5, 3.0), strict=True))
  assert means[0] < means[1] < means[2]
