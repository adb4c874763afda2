"""Muon post-processing of the release (paper 1, §Method; docs/design.md "The optimizers").

Paper 1 is "Spectral Gradient Orthogonalization Improves Differentially Private
Training at Scale".

No privacy cost: these transforms only read the release G̃_t. They carry no
``dp_`` prefix; chain them after a release (:func:`dpmuon_jax.dp_release`) or
use the complete private optimizers :func:`dpmuon_jax.dp_muon` /
:func:`dpmuon_jax.dp_muon_s`.

DP-Muon (``scale_by_muon``)::

    M_t = β M_{t−1} + (1−β) G̃_t,   M̂_t = (1−β) G̃_t + β M_t        (Nesterov)
    Ĝ_t = sqrt(min(4, max(1, fan_out/fan_in))) · NS_K(M̂_t)

DP-Muon-S (``scale_by_muon_s``, paper 1 design 4, by default with design 1's M_t)::

    M_t = β M_{t−1} + (1−β) G̃_t        (or the un-normalised β M_{t−1} + G̃_t)
    Ĝ_t = σ₁(M_t) · sqrt(max(1, fan_out/fan_in)) · NS_K(M_t)

with σ₁ from power iteration warm-started at the previous step's vector. Every
leaf these transforms see must have rank ≥ 2 (route the others elsewhere, see
:mod:`dpmuon_jax.transforms.routing`); each is viewed as fan_in × fan_out
matrices (:mod:`dpmuon_jax.linalg.scaling`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from dpmuon_jax import checks
from dpmuon_jax.linalg.newton_schulz import (
    DEFAULT_NS_COEFFS,
    CoeffsLike,
    coefficient_schedule,
    newton_schulz,
)
from dpmuon_jax.linalg.power_iteration import exact_top_singular, power_iteration
from dpmuon_jax.linalg.scaling import (
    DP_MUON_MAX_ASPECT_RATIO,
    DimensionNumbers,
    aspect_factor,
    dimension_numbers_fn,
    matrix_view,
    path_names,
)
from dpmuon_jax.transforms.momentum import EMA, HEAVY_BALL, Buffer, muon_momentum

PyTree = Any


def _view(path, leaf, spec_fn):
  if jnp.ndim(leaf) < 2:
    raise ValueError(
        f"Leaf {'/'.join(path_names(path))} of shape {jnp.shape(leaf)} reached a Muon transform; "
        "Muon needs rank >= 2. Route it to the fallback optimizer."
    )
  return matrix_view(jnp.shape(leaf), spec_fn(path_names(path), leaf))


def check_newton_schulz(
    ns_steps: int, ns_coeffs: CoeffsLike, eps: float, max_aspect_ratio: float | None = None
) -> None:
  """Refuses Newton–Schulz settings that cannot orthogonalise, with a one-line ``ValueError``.

  ``ns_steps`` an int >= 1, ``eps`` > 0 (it keeps X₀ = M / (s‖M‖_F + ε)
  finite for M = 0), finite coefficients with a safety factor s > 0, and
  ``max_aspect_ratio`` ``None`` or > 0.
  """
  steps = checks.check_positive_int("ns_steps", ns_steps)
  checks.check_positive("eps", eps)
  rows, safety = coefficient_schedule(ns_coeffs, steps)
  for row in rows:
    for coeff in row:
      checks.check_finite("ns_coeffs", coeff)
  checks.check_positive("ns_coeffs safety factor", safety)
  if max_aspect_ratio is not None:
    checks.check_positive("max_aspect_ratio", max_aspect_ratio)


def scale_by_orthogonalization(
    ns_steps: int = 5,
    ns_coeffs: CoeffsLike = DEFAULT_NS_COEFFS,
    eps: float = 1e-7,
    dimension_numbers: DimensionNumbers = None,
    ns_dtype: jnp.dtype | None = None,
    precision: jax.lax.PrecisionLike = None,
    max_aspect_ratio: float | None = DP_MUON_MAX_ASPECT_RATIO,
) -> optax.GradientTransformation:
  """Ĝ = sqrt(min(r_max, max(1, fan_out/fan_in))) · NS_K(U) for every (rank ≥ 2) leaf U.

  Args:
    ns_steps, ns_coeffs, eps, ns_dtype, precision: see
      :func:`dpmuon_jax.newton_schulz` (``ns_dtype`` is its ``dtype``).
    dimension_numbers: per-leaf matrix views (see
      :mod:`dpmuon_jax.linalg.scaling`); ``None``: (in…, out) layouts.
    max_aspect_ratio: r_max (4 for DP-Muon); ``None``: no cap.
  """
  check_newton_schulz(ns_steps, ns_coeffs, eps, max_aspect_ratio)
  spec_fn = dimension_numbers_fn(dimension_numbers)

  def leaf_update(path, g):
    view = _view(path, g, spec_fn)
    x = newton_schulz(view.to_matrices(g), ns_steps, ns_coeffs, eps, ns_dtype, precision)
    scale = aspect_factor(view.fan_in, view.fan_out, max_aspect_ratio)
    return view.from_matrices(scale * x).astype(g.dtype)

  def update_fn(updates, state, params=None):
    del params
    return jax.tree_util.tree_map_with_path(leaf_update, updates), state

  return optax.GradientTransformation(optax.init_empty_state, update_fn)


class SpectralScaleState(NamedTuple):
  """Per leaf, the power-iteration vectors, shape (batch, min(fan_in, fan_out)), float32."""

  vectors: PyTree


def scale_by_spectral_orthogonalization(
    power_iterations: int = 3,
    exact_svd: bool = False,
    ns_steps: int = 5,
    ns_coeffs: CoeffsLike = DEFAULT_NS_COEFFS,
    eps: float = 1e-7,
    dimension_numbers: DimensionNumbers = None,
    ns_dtype: jnp.dtype | None = None,
    precision: jax.lax.PrecisionLike = None,
    max_aspect_ratio: float | None = None,
) -> optax.GradientTransformation:
  """Ĝ = σ₁(U) · sqrt(max(1, fan_out/fan_in)) · NS_K(U) for every (rank ≥ 2) leaf U.

  σ₁ of each matrix comes from ``power_iterations`` steps of power iteration
  warm-started at the previous call's vector (kept in the state), or from an
  exact SVD if ``exact_svd``. The aspect factor is uncapped by default, as
  paper 1 (design 4) states DP-Muon-S.
  """
  checks.check_positive_int("power_iterations", power_iterations)
  check_newton_schulz(ns_steps, ns_coeffs, eps, max_aspect_ratio)
  spec_fn = dimension_numbers_fn(dimension_numbers)

  def init_leaf(path, p):
    view = _view(path, p, spec_fn)
    return jnp.zeros((view.batch, min(view.fan_in, view.fan_out)), jnp.float32)

  def init_fn(params):
    return SpectralScaleState(jax.tree_util.tree_map_with_path(init_leaf, params))

  def top_singular(m, u):
    if exact_svd:
      return exact_top_singular(m)
    return power_iteration(m, u, power_iterations)

  def leaf_update(path, g, u):
    view = _view(path, g, spec_fn)
    m = view.to_matrices(g)
    sigma, u = jax.vmap(top_singular)(m.astype(jnp.promote_types(m.dtype, jnp.float32)), u)
    x = newton_schulz(m, ns_steps, ns_coeffs, eps, ns_dtype, precision)
    scale = aspect_factor(view.fan_in, view.fan_out, max_aspect_ratio)
    out = view.from_matrices((scale * sigma[:, None, None]) * x).astype(g.dtype)
    return out, u.astype(jnp.float32)

  def update_fn(updates, state, params=None):
    del params
    leaves, treedef = jax.tree_util.tree_flatten_with_path(updates)
    vectors = treedef.flatten_up_to(state.vectors)
    results = [leaf_update(p, g, u) for (p, g), u in zip(leaves, vectors, strict=True)]
    out = treedef.unflatten([r[0] for r in results])
    return out, SpectralScaleState(treedef.unflatten([r[1] for r in results]))

  return optax.GradientTransformation(init_fn, update_fn)


def scale_by_muon(
    beta: float = 0.95,
    *,
    nesterov: bool = True,
    ns_steps: int = 5,
    ns_coeffs: CoeffsLike = DEFAULT_NS_COEFFS,
    eps: float = 1e-7,
    dimension_numbers: DimensionNumbers = None,
    ns_dtype: jnp.dtype | None = None,
    precision: jax.lax.PrecisionLike = None,
    mu_dtype: jnp.dtype | None = None,
) -> optax.GradientTransformation:
  """DP-Muon's post-processing: EMA momentum (Nesterov), NS_K, capped aspect factor.

  Defaults are paper 1's (β = 0.95, Nesterov, K = 5, Keller Jordan's
  coefficients, ε = 1e-7). Learning rate and weight decay are not included:
  chain ``optax.add_decayed_weights`` and ``optax.scale_by_learning_rate``.
  The options after ``beta`` are keyword-only: ``optax.contrib.scale_by_muon``
  orders its positional arguments differently (``ns_coeffs`` first).
  """
  return optax.chain(
      muon_momentum(beta, nesterov, EMA, mu_dtype),
      scale_by_orthogonalization(
          ns_steps, ns_coeffs, eps, dimension_numbers, ns_dtype, precision,
          DP_MUON_MAX_ASPECT_RATIO,
      ),
  )


def scale_by_muon_s(
    beta: float = 0.9,
    *,
    buffer: Buffer = HEAVY_BALL,
    power_iterations: int = 3,
    exact_svd: bool = False,
    ns_steps: int = 5,
    ns_coeffs: CoeffsLike = DEFAULT_NS_COEFFS,
    eps: float = 1e-7,
    dimension_numbers: DimensionNumbers = None,
    ns_dtype: jnp.dtype | None = None,
    precision: jax.lax.PrecisionLike = None,
    mu_dtype: jnp.dtype | None = None,
) -> optax.GradientTransformation:
  """DP-Muon-S's post-processing: Ĝ = σ₁(M_t)·sqrt(max(1, fan_out/fan_in))·NS_K(M_t).

  Args:
    beta: β (paper 1's preset: 0.9).
    buffer: ``"heavy_ball"`` (default: paper 1 design 4 defines σ₁ on "the
      heavy-ball momentum matrix" M_t = βM_{t−1} + G̃_t) or ``"ema"``
      (M_t = βM_{t−1} + (1−β)G̃_t, the buffer of paper 1's DP-Muon). No
      look-ahead either way. Because σ₁ carries the buffer's scale,
      ``"heavy_ball"`` steps are ≈ 1/(1−β) times larger (10× at β = 0.9), so
      learning rates do not transfer between the two.
    power_iterations: warm-started iterations per step for σ₁.
    exact_svd: compute σ₁ by SVD instead (for checks; slow on large layers).
    ns_steps, ns_coeffs, eps, dimension_numbers, ns_dtype, precision, mu_dtype: as in
      :func:`scale_by_muon`.
  """
  return optax.chain(
      muon_momentum(beta, False, buffer, mu_dtype),
      scale_by_spectral_orthogonalization(
          power_iterations, exact_svd, ns_steps, ns_coeffs, eps, dimension_numbers, ns_dtype,
          precision, None,
      ),
  )
