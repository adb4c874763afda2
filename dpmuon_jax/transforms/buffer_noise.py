"""Per-entry noise of Muon's momentum buffer, in units of the release's noise.

Paper 1 ("Spectral Gradient Orthogonalization Improves Differentially Private
Training at Scale", Method, design 1) orthogonalises the momentum buffer of
:func:`dpmuon_jax.transforms.momentum.muon_momentum`, not the release G̃ itself.
The release's noise has i.i.d. entries of std s₀ = σC/D and the noises of
different releases are independent, so the buffer's noise is again i.i.d. with
std s₀ times an exact per-step factor, a function of public settings only (β,
the buffer kind, Nesterov). Post-processing that thresholds singular values
against the noise level (selective orthogonalization, Gavish–Donoho shrinkage)
and the diagnostics read it from here.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from dpmuon_jax.transforms.momentum import EMA, HEAVY_BALL


class BufferSpec(NamedTuple):
  """The momentum producing the matrix Newton–Schulz sees.

  Attributes:
    beta: β in [0, 1); β = 0 means no momentum (the release itself).
    buffer: ``"ema"`` (M = βM + (1−β)G̃) or ``"heavy_ball"`` (M = βM + G̃).
    nesterov: the output is the look-ahead (1−β)G̃ + βM (ema) / G̃ + βM (heavy-ball).
  """

  beta: float = 0.95
  buffer: str = EMA
  nesterov: bool = True

  def factor(self, step):
    """:func:`buffer_noise_factor` at release ``step`` (1-based; may be traced)."""
    return buffer_noise_factor(step, self.beta, self.buffer, self.nesterov)

  def steady_state_factor(self) -> float:
    """The t → ∞ limit of :meth:`factor`."""
    return buffer_noise_factor(math.inf, self.beta, self.buffer, self.nesterov)


NO_MOMENTUM = BufferSpec(0.0, EMA, False)
"""The release itself (factor 1 at every step)."""

DP_MUON_BUFFER = BufferSpec(0.95, EMA, True)
"""DP-Muon's Nesterov EMA at β = 0.95 (steady-state factor 0.174)."""


def buffer_noise_factor(step, beta: float, buffer: str = EMA, nesterov: bool = True):
  """Per-entry noise std of the buffer output at release t, in units of s₀ = σC/D.

  With w = 1−β (ema) or 1 (heavy-ball) and M₀ = 0, the output is
  a·G̃_t + b·M_{t−1} with (a, b) = (w, β), or (w(1+β), β²) with Nesterov, and
  Var M_{t−1} = w² s₀² (1 − β^{2(t−1)})/(1 − β²) since the release noises are
  independent across steps. Hence, exactly at every step t ≥ 1, ::

      factor_t² = a² + b² w² (1 − β^{2(t−1)}) / (1 − β²).

  Steady state (t → ∞): ema √((1−β)/(1+β)) (0.160 at β = 0.95);
  Nesterov ema (1−β)·√((1+β)² + β⁴/(1−β²)) (0.174); heavy-ball 1/√(1−β²).
  ``step`` may be a Python number (``math.inf`` for the steady state) or a
  traced array.
  """
  if buffer not in (EMA, HEAVY_BALL):
    raise ValueError(f"buffer must be {EMA!r} or {HEAVY_BALL!r}, got {buffer!r}.")
  if not 0.0 <= beta < 1.0:
    raise ValueError(f"beta must lie in [0, 1), got {beta}.")
  w = 1.0 - beta if buffer == EMA else 1.0
  a, b = (w * (1 + beta), beta**2) if nesterov else (w, beta)
  if isinstance(step, (int, float)) and math.isinf(step):
    decay = 0.0
  else:
    decay = beta ** (2 * (step - 1))
  return (a**2 + b**2 * w**2 * (1 - decay) / (1 - beta**2)) ** 0.5
