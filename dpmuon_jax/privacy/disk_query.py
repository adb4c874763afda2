"""DiSK's per-example query (Zhang et al., ICLR 2025, arXiv 2410.03883, §3).

::

    q_i = c · ∇ℓ(θ_t + γ d_t; x_i) + (1−c) · ∇ℓ(θ_t; x_i),    c = (1−κ) / (κγ)

d_t is the update applied at the previous step (d_0 = 0). This module holds
the query's math on explicit inputs (θ_t, d_t); the optimizer's post-processing
keeps d_t (``record_applied_update`` in :mod:`dpmuon_jax.transforms.filters`),
and the DiSK optimizers' ``QuerySpec`` reads it from there. θ_t and d_t are
functions of earlier releases, so using them is post-processing. The combined
vector q_i is clipped as ONE vector by the shared
:func:`~dpmuon_jax.privacy.query.clipped_sum`, so each example still
contributes norm ≤ C and the release adds exactly σC of noise: the accounting
is DP-SGD's (q, σ, T).

The reference code (Opacus ``KF_DPOptimizer``, KalmanDP ``init_utils``)
instead divides σ by √(c² + (1−c)²) when c ≠ 1. That is not
part of the method; :func:`disk_noise_multiplier` reproduces it only behind an
explicit compatibility flag.

One gradient per example suffices when the two points coincide or one weight
vanishes:

* c = 1 (γ = (1−κ)/κ): q_i = ∇ℓ(θ_t + γ d_t; x_i);
* c = 0 (κ = 1, plain DP-SGD query): q_i = ∇ℓ(θ_t; x_i);
* γ = 0: both points are θ_t, so q_i = ∇ℓ(θ_t; x_i) whatever c. (The DiSK
  authors' code instead reads γ = 0 as "use γ = (1−κ)/κ"; pass that γ for it.)
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from dpmuon_jax.privacy.query import GradientTerm, LossFn, QueryFn, terms_query

PyTree = Any

CURRENT = 0  # index of θ_t in the query inputs
EXTRAPOLATED = 1  # index of θ_t + γ d_t


class DiskPreset(NamedTuple):
  """DiSK's gain κ and extrapolation γ."""

  kappa: float
  gamma: float


DISK_PRESETS: dict[str, DiskPreset] = {
    # The DiSK paper / Opacus README defaults.
    "disk": DiskPreset(0.7, 0.5),
    # Paper 1's "Kalman (κ = 1.5)" (Table 15; paper 1 is "Spectral Gradient Orthogonalization
    # Improves Differentially Private Training at Scale") with γ INFERRED, since paper 1 gives
    # none: the DiSK authors' CLI defaults (KalmanDP init_utils.py, κ = 1.5, γ = −1). Then
    # q_i = (2/3)∇ℓ(θ_t) + (1/3)∇ℓ(θ_{t−1}) and g_t = 1.5 G̃_t − 0.5 g_{t−1}. To first order
    # q_i = ∇ℓ(θ_t) − (1/3)H d_t, as with their code's older reading of γ ≤ 0 as
    # γ = (1−κ)/κ = −1/3 (the one point θ_t − d_t/3). Their lr 0.01 is a normalised step
    # length, not DiSK-SGD's η (see dpmuon_jax.optimizers.filters).
    "paper1": DiskPreset(1.5, -1.0),
    # Paper 2's KF baseline (App. C): κ = 0.5, "extrapolation coefficient 0.8", read as γ = 0.8.
    "paper2": DiskPreset(0.5, 0.8),
}
"""DiSK's (κ, γ) by name: the DiSK paper's defaults, paper 1's and paper 2's Kalman baselines."""


def disk_weight(kappa: float, gamma: float) -> float:
  """c = (1−κ)/(κγ), the weight of the extrapolated gradient (``inf`` when γ = 0)."""
  kappa, gamma = float(kappa), float(gamma)
  if not (math.isfinite(kappa) and math.isfinite(gamma)) or kappa == 0:
    raise ValueError(f"DiSK needs finite kappa != 0 and finite gamma, got {kappa}, {gamma}.")
  return math.inf if gamma == 0 else (1.0 - kappa) / (kappa * gamma)


def single_point(kappa: float, gamma: float) -> int | None:
  """Which input (:data:`CURRENT` or :data:`EXTRAPOLATED`) alone gives the query, if one does.

  ``None`` when the query needs both gradients. c = 1 is detected up to float
  rounding of (1−κ)/(κγ) (relative 1e-12).
  """
  c = disk_weight(kappa, gamma)
  if gamma == 0 or c == 0:
    return CURRENT
  if math.isclose(c, 1.0, rel_tol=1e-12, abs_tol=0.0):
    return EXTRAPOLATED
  return None


def disk_noise_multiplier(
    noise_multiplier: float, kappa: float, gamma: float, reference_noise_rescaling: bool = False
) -> float:
  """σ the release adds: σ itself, or the reference code's σ/√(c²+(1−c)²).

  The rescaling is not DiSK's method (the combined vector is clipped as a
  whole, sensitivity C); it is offered only to reproduce runs of the reference
  code. The ledger then sees, and accounts, the noise actually added.
  """
  if not reference_noise_rescaling or single_point(kappa, gamma) is not None:
    return float(noise_multiplier)
  c = disk_weight(kappa, gamma)
  return float(noise_multiplier) / math.sqrt(c * c + (1.0 - c) ** 2)


def disk_query(loss_fn: LossFn, kappa: float, gamma: float) -> QueryFn:
  """``query((θ_t, θ_t + γ d_t), x) -> c·∇ℓ(θ_t + γ d_t; x) + (1−c)·∇ℓ(θ_t; x)``.

  The per-example form of :func:`disk_terms`: ONE gradient per example when
  :func:`single_point` allows, two otherwise (combined in float32, cast to
  the parameters' dtypes).
  """
  return terms_query(loss_fn, disk_terms(kappa, gamma))


def disk_terms(kappa: float, gamma: float):
  """``(θ_t, θ_t + γ d_t) -> terms`` of :func:`disk_query` as a weighted sum of gradients.

  (c at θ_t + γ d_t, 1 − c at θ_t), or the one point of :func:`single_point`
  with weight 1: the :class:`~dpmuon_jax.privacy.query.GradientTerm` form that
  ghost clipping computes. c may be negative or above 1 (paper 2's κ = 0.5,
  γ = 0.8 gives c = 1.25).
  """
  point = single_point(kappa, gamma)
  c = disk_weight(kappa, gamma)

  def terms(inputs: tuple[PyTree, PyTree]) -> tuple[GradientTerm, ...]:
    if point is not None:
      return (GradientTerm(inputs[point]),)
    return (GradientTerm(inputs[EXTRAPOLATED], c), GradientTerm(inputs[CURRENT], 1.0 - c))

  return terms


def disk_points(params: PyTree, applied_update: PyTree, gamma: float) -> tuple[PyTree, PyTree]:
  """(θ_t, θ_t + γ d_t), the inputs of :func:`disk_query` (sums in float32, cast back)."""
  gamma = float(gamma)
  extrapolated = jax.tree.map(
      lambda p, u: (p.astype(jnp.float32) + gamma * u.astype(jnp.float32)).astype(p.dtype),
      params,
      applied_update,
  )
  return params, extrapolated
