"""Quintic Newton–Schulz orthogonalisation (paper 1, §Method; docs/design.md "The optimizers").

::

    X₀ = M / (s·‖M‖_F + ε),    X ← a X + b (X Xᵀ) X + c (X Xᵀ)² X    (K times)

Each step applies the odd polynomial p(x) = a x + b x³ + c x⁵ to every
singular value of X and keeps the singular vectors, so ::

    NS_K(M) = U · p_K ∘ … ∘ p_1(Σ / (s·‖M‖_F + ε)) · Vᵀ    for M = U Σ Vᵀ.

The iteration runs on the orientation whose Gram matrix X Xᵀ is the smaller
one (rows ≤ cols); since NS(Mᵀ) = NS(M)ᵀ this does not change the result.
The default (a, b, c) = (3.4445, −4.7750, 2.0315) (Keller Jordan's Muon, used by
paper 1) maps singular values in [1e-3, 1] into about [0.47, 1.20] after five
steps: the output is U S′ Vᵀ, not exactly U Vᵀ (``tests/test_newton_schulz.py``
checks these ranges). Paper 1 ("Spectral Gradient Orthogonalization Improves
Differentially Private Training at Scale", Method, design 2) prints the last
term as "c X (XXᵀ)²", which is ill-typed for non-square X; c (XXᵀ)² X is the
intended form.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import NamedTuple, cast

import jax
import jax.numpy as jnp
import numpy as np

from dpmuon_jax import checks
from dpmuon_jax.linalg.scaling import DimensionNumbers

Coeffs = tuple[float, float, float]

DEFAULT_NS_COEFFS: Coeffs = (3.4445, -4.7750, 2.0315)


class NewtonSchulzSchedule(NamedTuple):
  """A per-step coefficient schedule with its pre-scaling safety factor s.

  Attributes:
    coeffs: one (a, b, c) triple per step.
    safety: s in X₀ = M / (s·‖M‖_F + ε); s > 1 keeps every singular value of
      X₀ strictly below 1, which schedules tuned to [0, 1] need in low precision.
  """

  coeffs: tuple[Coeffs, ...]
  safety: float = 1.0


# Polar Express (Amsel et al. 2025, arXiv 2505.16932), the coefficients of
# modded-nanogpt / nanochat: num_iters=5, safety_factor=2e-2, cushion=2, with
# the pre-scaling X₀ = X / (1.02·‖X‖_F + ε).
POLAR_EXPRESS = NewtonSchulzSchedule(
    coeffs=(
        (8.156554524902461, -22.48329292557795, 15.878769915207462),
        (4.042929935166739, -2.808917465908714, 0.5000178451051316),
        (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
        (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
        (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
    ),
    safety=1.02,
)

CoeffsLike = Coeffs | Sequence[Coeffs] | NewtonSchulzSchedule


def coefficient_schedule(coeffs: CoeffsLike, steps: int) -> tuple[tuple[Coeffs, ...], float]:
  """The (steps, 3) schedule and safety factor that :func:`newton_schulz` runs.

  A single triple is used at every step. A per-step schedule of K rows uses its
  first ``steps`` rows; if ``steps`` > K the last row is repeated.
  """
  safety = 1.0
  if isinstance(coeffs, NewtonSchulzSchedule):
    coeffs, safety = coeffs.coeffs, coeffs.safety
  table = np.asarray(coeffs, dtype=np.float64)
  if table.ndim == 1:
    table = table[None, :]
  if table.ndim != 2 or table.shape[-1] != 3 or table.shape[0] == 0:
    raise ValueError(f"coeffs must have shape (3,) or (K, 3), got {table.shape}.")
  if steps < 0:
    raise ValueError(f"steps must be >= 0, got {steps}.")
  rows = [tuple(float(v) for v in table[min(k, len(table) - 1)]) for k in range(steps)]
  return cast("tuple[Coeffs, ...]", tuple(rows)), float(safety)  # rows of 3


def _ns_matrix(
    x: jax.Array,
    schedule: tuple[Coeffs, ...],
    safety: float,
    eps: float,
    dtype: jnp.dtype,
    precision: jax.lax.PrecisionLike,
) -> jax.Array:
  """NS on one 2-D matrix, iterating on the wide orientation."""
  transposed = x.shape[0] > x.shape[1]
  if transposed:
    x = x.T
  norm = jnp.linalg.norm(x.astype(jnp.promote_types(x.dtype, jnp.float32)))
  x = (x / (safety * norm + eps)).astype(dtype)
  mm = lambda p, q: jnp.matmul(p, q, precision=precision)
  for a, b, c in schedule:
    gram = mm(x, x.T)
    poly = b * gram + c * mm(gram, gram)
    x = a * x + mm(poly, x)
  return x.T if transposed else x


def newton_schulz(
    x: jax.Array,
    steps: int = 5,
    coeffs: CoeffsLike = DEFAULT_NS_COEFFS,
    eps: float = 1e-7,
    dtype: jnp.dtype | None = None,
    precision: jax.lax.PrecisionLike = None,
) -> jax.Array:
  """Approximate polar factor of ``x`` by K quintic Newton–Schulz steps.

  Args:
    x: an array of shape (..., m, n); leading axes are independent matrices
      (mapped with ``vmap``).
    steps: K, the number of steps.
    coeffs: one (a, b, c) triple, a (K, 3) per-step schedule, or a
      :class:`NewtonSchulzSchedule` such as :data:`POLAR_EXPRESS`.
    eps: ε in X₀ = M / (s·‖M‖_F + ε) (Keller Jordan: 1e-7).
    dtype: compute dtype of the iteration. ``None``: at least float32 (float64
      inputs stay float64). ``jnp.bfloat16`` is the usual choice on GPU/TPU.
      The Frobenius norm is always taken in at least float32.
    precision: matmul precision, e.g. ``jax.lax.Precision.HIGHEST`` for true
      float32 matmuls on TPU.

  Returns:
    NS_K(x), same shape and dtype as ``x``.
  """
  x = jnp.asarray(x)
  if x.ndim < 2:
    raise ValueError(f"newton_schulz needs an array of rank >= 2, got shape {x.shape}.")
  if not jnp.issubdtype(x.dtype, jnp.floating):
    # NS_K(x) has entries in (-1, 1): cast back to an integer dtype it would be all zeros.
    raise TypeError(f"newton_schulz needs a floating-point array, got dtype {x.dtype}.")
  schedule, safety = coefficient_schedule(coeffs, steps)
  compute_dtype = jnp.promote_types(x.dtype, jnp.float32) if dtype is None else jnp.dtype(dtype)
  fn = lambda m: _ns_matrix(m, schedule, safety, eps, compute_dtype, precision)
  batch_shape, matrix_shape = x.shape[:-2], x.shape[-2:]
  if batch_shape:
    flat = x.reshape((math.prod(batch_shape),) + matrix_shape)
    out = jax.vmap(fn)(flat).reshape(x.shape)
  else:
    out = fn(x)
  return out.astype(x.dtype)


def newton_schulz_polynomial(s: jax.Array | np.ndarray, steps: int = 5,
                             coeffs: CoeffsLike = DEFAULT_NS_COEFFS) -> np.ndarray:
  """p_K ∘ … ∘ p_1(s) for scalar singular values s (already normalised), in float64.

  The exact action of :func:`newton_schulz` on the normalised spectrum; used by
  tests and diagnostics.
  """
  schedule, _ = coefficient_schedule(coeffs, steps)
  s = np.asarray(s, np.float64)
  for a, b, c in schedule:
    s = a * s + b * s**3 + c * s**5
  return s


def check_newton_schulz(steps: int, coeffs: CoeffsLike, eps: float) -> None:
  """Refuses settings that cannot orthogonalise, with a one-line ``ValueError``.

  ``steps`` an int >= 1, ``eps`` > 0 (it keeps X₀ = M / (s‖M‖_F + ε) finite for
  M = 0), finite coefficients with a safety factor s > 0.
  """
  steps = checks.check_positive_int("ns_steps", steps)
  checks.check_positive("eps", eps)
  rows, safety = coefficient_schedule(coeffs, steps)
  for row in rows:
    for coeff in row:
      checks.check_finite("ns_coeffs", coeff)
  checks.check_positive("ns_coeffs safety factor", safety)


@dataclasses.dataclass(frozen=True)
class NewtonSchulz:
  """NS_K(M): K steps X ← aX + b(XXᵀ)X + c(XXᵀ)²X from X₀ = M / (s‖M‖_F + ε).

  The one object every orthogonalising transform and optimizer takes as
  ``ns``. Paper 1 (§Method) uses K = 5 with Keller Jordan's (3.4445, −4.7750,
  2.0315).

  Attributes:
    steps: K, an int >= 1.
    coeffs: (a, b, c), one triple per step, or a schedule (see
      :func:`newton_schulz`); ``None``: the transform's default, Keller
      Jordan's coefficients (:data:`DEFAULT_NS_COEFFS`), except DP-Muon-BC's
      convergent quintic
      (:data:`~dpmuon_jax.transforms.bias_correction.KIM_FAN_NS_COEFFS`).
    eps: ε > 0, keeps X₀ finite for M = 0.
    dtype: the dtype the iteration runs in; ``None``: the buffer's.
    precision: matmul precision of the iteration.
    dimension_numbers: per-leaf matrix views (:mod:`dpmuon_jax.linalg.scaling`);
      ``None``: (in…, out) layouts.
  """

  steps: int = 5
  coeffs: CoeffsLike | None = None
  eps: float = 1e-7
  dtype: jnp.dtype | None = None
  precision: jax.lax.PrecisionLike = None
  dimension_numbers: DimensionNumbers = None

  def __post_init__(self):
    check_newton_schulz(self.steps, DEFAULT_NS_COEFFS if self.coeffs is None else self.coeffs,
                        self.eps)

  def orthogonalize(self, x: jax.Array,
                    default_coeffs: CoeffsLike = DEFAULT_NS_COEFFS) -> jax.Array:
    """NS_K(x) with these settings (``default_coeffs`` where ``coeffs`` is ``None``).

    A method, not ``__call__``: ``optax.inject_hyperparams`` calls every
    callable argument as a schedule.
    """
    coeffs = default_coeffs if self.coeffs is None else self.coeffs
    return newton_schulz(x, self.steps, coeffs, self.eps, self.dtype, self.precision)
