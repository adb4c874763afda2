"""Gavish–Donoho singular-value thresholding and shrinkage.

Paper 1 names "optimal singular value shrinkage (e.g. Gavish–Donoho)" as future
work; this module offers it as an alternative spectral step. Model: the matrix
actually transformed is Y = X + s·Z (m × n, Z i.i.d. N(0, 1)), with β = m/n ≤ 1
after transposing so that m ≤ n. Under DP the per-entry noise s is KNOWN: s₀ =
σC/D for the release G̃, times the momentum-buffer factor of
:func:`dpmuon_jax.transforms.buffer_noise.buffer_noise_factor` for a buffer. So
the known-noise rules apply, at no privacy cost (post-processing).

* Optimal hard threshold (Gavish & Donoho 2014, arXiv 1305.5870)::

      τ* = λ*(β)·√n·s,   λ*(β) = sqrt(2(β+1) + 8β / ((β+1) + sqrt(β² + 14β + 1)))

  λ*(1) = 4/√3. With unknown noise, τ̂ = ω(β)·y_med, ω(β) = λ*(β)/√μ_β, μ_β the
  median of the Marchenko–Pastur law of ratio β.
* Frobenius-optimal shrinker (Gavish & Donoho 2017), in units of s√n::

      η(y) = sqrt((y² − β − 1)² − 4β) / y   for y ≥ 1 + √β,   0 otherwise.

The spectral step :func:`scale_by_singular_value_shrinkage` applies either rule
to each matrix and returns the orthogonalised retained subspace U_r V_rᵀ (the
default, a Muon-like step without the noise directions) or the denoised matrix
U η(Σ) Vᵀ.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dpmuon_jax.linalg.scaling import (
    DP_MUON_MAX_ASPECT_RATIO,
    DimensionNumbers,
    aspect_factor,
    dimension_numbers_fn,
    matrix_view,
    path_names,
)
from dpmuon_jax.transforms.buffer_noise import NO_MOMENTUM, BufferSpec

PyTree = Any

HARD = "hard"
FROBENIUS = "frobenius"
ORTHOGONAL = "orthogonal"
SHRUNK = "shrunk"

_QUADRATURE_POINTS = 2049


def _check_beta(beta: float) -> float:
  beta = float(beta)
  if not 0.0 < beta <= 1.0:
    raise ValueError(f"beta = m/n must lie in (0, 1], got {beta}.")
  return beta


def aspect_beta(shape: tuple[int, int]) -> float:
  """β = min(m, n)/max(m, n) of a matrix shape."""
  m, n = shape
  return min(m, n) / max(m, n)


def optimal_hard_threshold_coef(beta: float) -> float:
  """λ*(β) of the known-noise optimal hard threshold τ* = λ*(β)·√n·s; λ*(1) = 4/√3."""
  beta = _check_beta(beta)
  return math.sqrt(2 * (beta + 1) + 8 * beta / ((beta + 1) + math.sqrt(beta**2 + 14 * beta + 1)))


def marchenko_pastur_density(x: np.ndarray, beta: float) -> np.ndarray:
  """Density √((β₊−x)(x−β₋))/(2πβx) on [β₋, β₊], β± = (1 ± √β)².

  The law of the eigenvalues of Z Zᵀ/n for an m × n standard Gaussian Z, β = m/n ≤ 1.
  """
  beta = _check_beta(beta)
  x = np.asarray(x, np.float64)
  lo, hi = (1 - math.sqrt(beta)) ** 2, (1 + math.sqrt(beta)) ** 2
  inside = (x > lo) & (x < hi)
  safe = np.where(inside, x, 1.0)
  dens = np.sqrt(np.clip((hi - safe) * (safe - lo), 0.0, None)) / (2 * math.pi * beta * safe)
  return np.where(inside, dens, 0.0)


def _mp_cdf_at_angle(phi: float, beta: float) -> float:
  """MP CDF at x(φ) = β₋ + (β₊−β₋)(1−cos φ)/2 by Simpson's rule in φ (smooth integrand)."""
  lo, hi = (1 - math.sqrt(beta)) ** 2, (1 + math.sqrt(beta)) ** 2
  half = (hi - lo) / 2
  t = np.linspace(0.0, phi, _QUADRATURE_POINTS)
  # density·dx/dφ = half² sin²φ / (2πβx), written with sin²φ = (1−cos φ)(1+cos φ)
  # so that it stays finite at x = 0 when β = 1 (β₋ = 0).
  rise = half * (1 - np.cos(t))
  ratio = np.ones_like(t) if lo == 0 else rise / (lo + rise)
  f = half * (1 + np.cos(t)) * ratio / (2 * math.pi * beta)
  h = t[1] - t[0]
  return float(h / 3 * (f[0] + f[-1] + 4 * f[1:-1:2].sum() + 2 * f[2:-1:2].sum()))


def marchenko_pastur_median(beta: float) -> float:
  """μ_β, the median of the Marchenko–Pastur law of ratio β (bisection on its CDF)."""
  beta = _check_beta(beta)
  lo_phi, hi_phi = 0.0, math.pi
  for _ in range(60):
    mid = (lo_phi + hi_phi) / 2
    if _mp_cdf_at_angle(mid, beta) < 0.5:
      lo_phi = mid
    else:
      hi_phi = mid
  phi = (lo_phi + hi_phi) / 2
  lo = (1 - math.sqrt(beta)) ** 2
  return lo + ((1 + math.sqrt(beta)) ** 2 - lo) * (1 - math.cos(phi)) / 2


def unknown_noise_threshold_coef(beta: float) -> float:
  """ω(β) = λ*(β)/√μ_β of the unknown-noise threshold τ̂ = ω(β)·median singular value."""
  return optimal_hard_threshold_coef(beta) / math.sqrt(marchenko_pastur_median(beta))


def estimate_noise_std(singular_values: np.ndarray, shape: tuple[int, int]) -> float:
  """ŝ = y_med / √(n·μ_β) from the singular values of an m × n noisy matrix (n = max dim)."""
  n = max(shape)
  y_med = float(np.median(np.asarray(singular_values, np.float64)))
  return y_med / math.sqrt(n * marchenko_pastur_median(aspect_beta(shape)))


def optimal_hard_threshold(shape: tuple[int, int], noise_std: float | jax.Array):
  """τ* = λ*(β)·√n·s for an m × n matrix with known per-entry noise std s."""
  return optimal_hard_threshold_coef(aspect_beta(shape)) * math.sqrt(max(shape)) * noise_std


def spiked_singular_value(x: float, beta: float) -> float:
  """y(x) = sqrt((1+x²)(β+x²))/x: where a spike of strength x > β^{1/4} lands (units of s√n)."""
  beta = _check_beta(beta)
  return math.sqrt((1 + x**2) * (beta + x**2)) / x


def frobenius_shrinker(y, beta: float):
  """η(y) = sqrt((y² − β − 1)² − 4β)/y for y ≥ 1 + √β, else 0 (y in units of s√n).

  Works on numpy or jax arrays. For a spike of strength x the observed value
  is y(x) = :func:`spiked_singular_value` (x, β), and η(y(x)) = x·cos∠(ũ,u)·cos∠(ṽ,v):
  for x = 2, β = 0.25 (y = 2.3049) both give 1.7083 (``tests/test_shrinkage.py``).
  """
  beta = _check_beta(beta)
  xp = jnp if isinstance(y, jax.Array) else np
  y = xp.asarray(y)
  keep = y >= 1 + math.sqrt(beta)
  safe = xp.where(keep, y, 2.0 + math.sqrt(beta))
  value = xp.sqrt(xp.maximum((safe**2 - beta - 1) ** 2 - 4 * beta, 0.0)) / safe
  return xp.where(keep, value, 0.0)


def _check_options(method: str, output: str) -> None:
  if method not in (HARD, FROBENIUS):
    raise ValueError(f"method must be {HARD!r} or {FROBENIUS!r}, got {method!r}.")
  if output not in (ORTHOGONAL, SHRUNK):
    raise ValueError(f"output must be {ORTHOGONAL!r} or {SHRUNK!r}, got {output!r}.")


def shrink_singular_values(
    x: jax.Array, noise_std: jax.Array | float, method: str = HARD, output: str = ORTHOGONAL
) -> jax.Array:
  """U f(Σ) Vᵀ for one 2-D matrix ``x`` = X + s·Z with known per-entry noise std s.

  Args:
    x: an m × n matrix.
    noise_std: s (may be traced).
    method: ``"hard"`` (keep σ > τ* = λ*(β)√n·s) or ``"frobenius"`` (η above).
    output: ``"orthogonal"``: f = 1 on the retained singular values (U_r V_rᵀ,
      zero when nothing is retained); ``"shrunk"``: f = the rule's value
      (σ·1[σ > τ*] or s√n·η(σ/(s√n))), the denoised estimate of X.
  """
  _check_options(method, output)
  shape = x.shape
  beta = aspect_beta(shape)  # pyright: ignore[reportArgumentType]  # x is a matrix
  compute = x.astype(jnp.promote_types(x.dtype, jnp.float32))
  u, s, vt = jnp.linalg.svd(compute, full_matrices=False)
  unit = math.sqrt(max(shape)) * noise_std
  if method == HARD:
    keep = s > optimal_hard_threshold_coef(beta) * unit
    value = jnp.where(keep, s, 0.0)
  else:
    value = unit * frobenius_shrinker(s / jnp.maximum(unit, 1e-30), beta)
    keep = value > 0
  f = keep.astype(s.dtype) if output == ORTHOGONAL else value
  return ((u * f[None, :]) @ vt).astype(x.dtype)


class ShrinkageState(NamedTuple):
  """Number of steps taken (int32): selects the exact per-step buffer noise factor."""

  count: jax.Array


def scale_by_singular_value_shrinkage(
    noise_std: float,
    buffer: BufferSpec = NO_MOMENTUM,
    method: str = HARD,
    output: str = ORTHOGONAL,
    dimension_numbers: DimensionNumbers = None,
    max_aspect_ratio: float | None = DP_MUON_MAX_ASPECT_RATIO,
) -> optax.GradientTransformation:
  """Gavish–Donoho thresholding/shrinkage as a spectral step.

  For every (rank ≥ 2) leaf U, viewed as fan_in × fan_out matrices, at step t
  (1-based)::

      s_t = noise_std · buffer.factor(t),       Ĝ = a · U_U f(Σ_U) V_Uᵀ

  with f from :func:`shrink_singular_values` and a = sqrt(min(r_max,
  max(1, fan_out/fan_in))) for ``output="orthogonal"`` (as DP-Muon; 1 for
  ``"shrunk"``). Chain it after the momentum whose buffer it transforms and
  pass that momentum as ``buffer`` so s_t is the noise level of the matrix
  actually transformed. Post-processing of the release: no privacy cost.

  Args:
    noise_std: s₀ = σC/D, the per-coordinate noise std of the release.
    buffer: the momentum that produced the input (:class:`BufferSpec`);
      default none (the input is the release itself).
    method: ``"hard"`` (optimal hard threshold) or ``"frobenius"``.
    output: ``"orthogonal"`` (default) or ``"shrunk"``.
    dimension_numbers: per-leaf matrix views (:mod:`dpmuon_jax.linalg.scaling`).
    max_aspect_ratio: r_max of the aspect factor (orthogonal output only).
  """
  if not (math.isfinite(noise_std) and noise_std >= 0):
    raise ValueError(f"noise_std must be >= 0 and finite, got {noise_std}.")
  _check_options(method, output)
  spec_fn = dimension_numbers_fn(dimension_numbers)

  def leaf_update(path, g, s):
    if jnp.ndim(g) < 2:
      raise ValueError(f"Leaf {'/'.join(path_names(path))} has rank < 2; route it elsewhere.")
    view = matrix_view(jnp.shape(g), spec_fn(path_names(path), g))
    out = jax.vmap(lambda m: shrink_singular_values(m, s, method, output))(view.to_matrices(g))
    scale = 1.0
    if output == ORTHOGONAL:
      scale = aspect_factor(view.fan_in, view.fan_out, max_aspect_ratio)
    return view.from_matrices(scale * out).astype(g.dtype)

  def init_fn(params):
    del params
    return ShrinkageState(jnp.zeros((), jnp.int32))

  def update_fn(updates, state, params=None):
    del params
    count = state.count + 1
    s = noise_std * buffer.factor(count)
    out = jax.tree_util.tree_map_with_path(lambda p, g: leaf_update(p, g, s), updates)
    return out, ShrinkageState(count)

  return optax.GradientTransformation(init_fn, update_fn)
