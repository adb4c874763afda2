"""Newton–Schulz: NS_K(M) = U·p^{∘K}(Σ/‖M‖_F)·Vᵀ, transposition, agreement with optax.contrib."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from optax.contrib import _muon as optax_muon

from dpmuon_jax.linalg.newton_schulz import (
    DEFAULT_NS_COEFFS,
    POLAR_EXPRESS,
    coefficient_schedule,
    newton_schulz,
    newton_schulz_polynomial,
)

orthogonalize_via_newton_schulz = optax_muon.orthogonalize_via_newton_schulz
# Optax's own coefficient sets: the standard quintic, and Dion's where optax has it (>= 0.2.8).
OPTAX_COEFFS = {"std": DEFAULT_NS_COEFFS}
if hasattr(optax_muon, "_DION_NS_COEFFS"):
  OPTAX_COEFFS["dion"] = tuple(optax_muon._DION_NS_COEFFS)


def _normal(shape, seed):
  """Standard normal float32 test input (numpy: eager jax.random compiles per shape)."""
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def _matrix(shape, seed, smin=0.05):
  """A random matrix with singular values spread over [smin, 1]."""
  rng = np.random.default_rng(seed)
  m, n = shape
  k = min(m, n)
  u, _ = np.linalg.qr(rng.standard_normal((m, k)))
  v, _ = np.linalg.qr(rng.standard_normal((n, k)))
  s = np.linspace(1.0, smin, k)
  return (u * s) @ v.T


def _svd_reference(m, steps, coeffs, eps):
  """U · p^{∘K}(Σ / (s‖M‖_F + ε)) · Vᵀ in float64."""
  schedule, safety = coefficient_schedule(coeffs, steps)
  u, s, vt = np.linalg.svd(m, full_matrices=False)
  scaled = s / (safety * np.linalg.norm(m) + eps)
  return (u * newton_schulz_polynomial(scaled, steps, coeffs)) @ vt


@pytest.mark.parametrize("shape", [(16, 24), (24, 16), (20, 20)])
@pytest.mark.parametrize("coeffs", [DEFAULT_NS_COEFFS, POLAR_EXPRESS], ids=["keller", "polar"])
def test_ns_equals_polynomial_of_singular_values_float64(shape, coeffs):
  m = _matrix(shape, seed=sum(shape))
  with jax.enable_x64(True):
    out = np.asarray(newton_schulz(jnp.asarray(m, jnp.float64), coeffs=coeffs, eps=1e-7))
  ref = _svd_reference(m, 5, coeffs, 1e-7)
  np.testing.assert_allclose(out, ref, atol=1e-10)


@pytest.mark.parametrize("steps", [1, 3, 5, 7])
def test_ns_equals_polynomial_float32(steps):
  m = _matrix((32, 48), seed=steps)
  out = np.asarray(newton_schulz(jnp.asarray(m, jnp.float32), steps=steps))
  ref = _svd_reference(m, steps, DEFAULT_NS_COEFFS, 1e-7)
  np.testing.assert_allclose(out, ref, atol=2e-4)
  # The polynomial output is not the polar factor: singular values stay spread out.
  s = np.linalg.svd(out, compute_uv=False)
  if steps == 5:
    assert 0.6 < s.min() < 0.95 and 1.0 < s.max() < 1.25


@pytest.mark.parametrize(
    "coeffs, scale, lo, hi",
    [(DEFAULT_NS_COEFFS, 1.0, 0.4705, 1.2024), (POLAR_EXPRESS, 1.02, 0.8466, 1.1411)],
    ids=["keller", "polar"],
)
def test_scalar_ranges_of_the_quintic_iteration(coeffs, scale, lo, hi):
  # Range of p^{∘5} over normalised singular values in [1e-3, 1].
  out = newton_schulz_polynomial(np.geomspace(1e-3, 1.0, 20001) / scale, 5, coeffs)
  assert out.min() == pytest.approx(lo, abs=2e-4) and out.max() == pytest.approx(hi, abs=2e-4)


def test_polar_express_is_closer_to_orthogonal_than_keller():
  m = _matrix((64, 96), seed=3, smin=1e-2)
  x = jnp.asarray(m, jnp.float32)
  spread = lambda o: np.ptp(np.linalg.svd(np.asarray(o), compute_uv=False))
  assert spread(newton_schulz(x, coeffs=POLAR_EXPRESS)) < 0.75 * spread(newton_schulz(x))


def test_transposition_commutes():
  m = jnp.asarray(_matrix((24, 40), seed=5), jnp.float32)
  np.testing.assert_allclose(newton_schulz(m.T), newton_schulz(m).T, atol=1e-6)


@pytest.mark.parametrize("shape", [(64, 32), (32, 64), (48, 48), (576, 64)])
@pytest.mark.parametrize("coeffs", list(OPTAX_COEFFS.values()), ids=list(OPTAX_COEFFS))
def test_agrees_with_optax_contrib(shape, coeffs):
  x = _normal(shape, sum(shape))
  ours = newton_schulz(x, steps=5, coeffs=coeffs, eps=1e-8)
  theirs = orthogonalize_via_newton_schulz(x, jnp.asarray(coeffs), ns_steps=5, eps=1e-8)
  np.testing.assert_allclose(ours, theirs, atol=2e-5)


def test_batched_leading_axes_match_per_matrix():
  x = _normal((2, 3, 8, 12), 0)
  out = jax.jit(newton_schulz)(x)
  assert out.shape == x.shape
  single = jax.jit(newton_schulz)
  for i in range(2):
    for j in range(3):
      np.testing.assert_allclose(out[i, j], single(x[i, j]), atol=1e-6)


def test_bfloat16_compute_is_close_and_keeps_input_dtype():
  x = _normal((64, 128), 1)
  f32 = newton_schulz(x)
  bf16 = newton_schulz(x, dtype=jnp.bfloat16)
  assert bf16.dtype == jnp.float32
  assert float(jnp.max(jnp.abs(bf16 - f32))) < 0.05
  assert float(jnp.max(jnp.abs(bf16 - f32))) > 0  # it really ran in bfloat16
  assert newton_schulz(x.astype(jnp.bfloat16)).dtype == jnp.bfloat16


def test_precision_option_runs_under_jit():
  x = _normal((16, 8), 2)
  fn = jax.jit(lambda m: newton_schulz(m, precision=jax.lax.Precision.HIGHEST))
  # On CPU HIGHEST is float32, the default: the jitted and the eager programs differ only in
  # how XLA fuses and rounds, which five NS steps amplify to ~10 float32 ulps of an O(1) entry.
  np.testing.assert_allclose(fn(x), newton_schulz(x), atol=1e-5)


def test_zero_matrix_maps_to_zero():
  assert not np.any(np.asarray(newton_schulz(jnp.zeros((4, 6)))))


def test_an_integer_matrix_is_refused_not_rounded_to_zeros():
  with pytest.raises(TypeError, match="floating-point"):
    newton_schulz(jnp.arange(6).reshape(2, 3))


def test_coefficient_schedule_rows():
  rows, safety = coefficient_schedule(DEFAULT_NS_COEFFS, 3)
  assert rows == (DEFAULT_NS_COEFFS,) * 3 and safety == 1.0
  rows, safety = coefficient_schedule(POLAR_EXPRESS, 7)
  assert safety == 1.02
  assert rows[:5] == POLAR_EXPRESS.coeffs and rows[5] == rows[6] == POLAR_EXPRESS.coeffs[-1]
  assert coefficient_schedule(POLAR_EXPRESS, 2)[0] == POLAR_EXPRESS.coeffs[:2]
  with pytest.raises(ValueError):
    coefficient_schedule((1.0, 2.0), 5)
  with pytest.raises(ValueError):
    newton_schulz(jnp.ones(3))
