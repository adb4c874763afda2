"""Per-example clipping: the sensitivity of every release (privacy invariant 1, docs/design.md).

Each sampled example contributes ONE clipped query ḡ_i with ‖ḡ_i‖₂ ≤ C, where
the norm is taken in float32 over the vector that is actually summed.

* Flat clipping (default):  ḡ = g · min(1, C / ‖g‖₂), the norm over ALL
  parameter blocks concatenated (Abadi et al. 2016; paper 1, eq. 1).
* Per-layer clipping: block l is clipped to C_l with Σ_l C_l² = C², so the
  concatenated vector still has norm ≤ C.
* Automatic clipping (Bu et al., AUTO-S; paper 1, appendix K):
  ḡ = g · C / (‖g‖₂ + γ), whose norm is < C for every g; optionally per layer
  with the thresholds C_l above.

A per-example query with a non-finite entry contributes zero and is counted.

The privacy unit is part of the rule. ``unit="example"`` (default): each row
of a batch is one example, clipped as above. ``unit="user"`` (user-level DP):
each row is one user's records, and the user contributes ONE clipped vector,
the mean of their records' queries clipped to C
(:func:`~dpmuon_jax.privacy.query.clipped_sum`), so adding or removing a user
moves the sum by at most C. A sum clipped under one unit is never released
under the other: the release accepts a sum only when made with its own rule.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

PyTree = Any

EXAMPLE, USER = "example", "user"
PRIVACY_UNITS = (EXAMPLE, USER)
"""What one clipped row of a batch is: one example, or one user's records."""

# Guards C / ‖g‖ at ‖g‖ = 0, as Opacus does; keeps ‖ḡ‖ ≤ C up to float rounding.
_NORM_EPS = 1e-6


class ClippedExample(NamedTuple):
  """One example's clipped query and non-private statistics about it."""

  clipped: PyTree  # float32 leaves, L2 norm ≤ C
  norm: jax.Array  # ‖g‖₂ before clipping (non-private)
  is_clipped: jax.Array  # whether the factor was < 1 (non-private)
  is_finite: jax.Array  # False: the example contributes zero


def _as_float32(tree: PyTree) -> PyTree:
  return jax.tree.map(lambda g: jnp.asarray(g, jnp.float32), tree)


def _sq_norm(x: jax.Array) -> jax.Array:
  return jnp.sum(jnp.square(x))


def flat_norm(tree: PyTree) -> jax.Array:
  """‖g‖₂ of all leaves concatenated, in float32."""
  leaves = jax.tree.leaves(_as_float32(tree))
  return jnp.sqrt(sum(_sq_norm(x) for x in leaves))


def _zero_if_nonfinite(tree: PyTree, finite: jax.Array) -> PyTree:
  # jnp.where, not multiplication: 0 · inf is NaN.
  return jax.tree.map(lambda x: jnp.where(finite, x, jnp.zeros_like(x)), tree)


@dataclasses.dataclass(frozen=True)
class Clipping:
  """How each per-example query is bounded; ``l2_clip_norm`` is the sensitivity C.

  Build one with :func:`flat_clipping`, :func:`per_layer_clipping` or
  :func:`automatic_clipping`.

  Attributes:
    l2_clip_norm: the total L2 bound C of one example's contribution.
    per_layer: clip each leaf separately to C_l = C · w_l / ‖w‖ (``layer_weights``
      w_l, default all equal, i.e. C_l = C / √L).
    automatic: use g · C / (‖g‖ + gamma) instead of g · min(1, C / ‖g‖).
    gamma: the stabiliser of automatic clipping.
    layer_weights: optional pytree (same structure as the query) of positive
      relative thresholds for per-layer clipping.
    grid_bits: ``None`` (float clipped sums), or k: the secure-noise mode. Each
      clipped query is rounded to the grid of step γ = C·2⁻ᵏ and the rounded
      vectors are summed exactly in integers (:func:`round_to_grid`); the
      release then adds discrete Gaussian noise. Rounding can move a vector of
      norm ≤ C by up to √d/2 grid steps, so the sensitivity in grid units is
      2ᵏ + √d/2 (d coordinates), and the noise is scaled to that.
    unit: the privacy unit, ``"example"`` or ``"user"`` (one clipped vector per user:
      the mean of the user's records' queries).
  """

  l2_clip_norm: float
  per_layer: bool = False
  automatic: bool = False
  gamma: float = 0.01
  layer_weights: PyTree | None = None
  grid_bits: int | None = None
  unit: str = EXAMPLE

  def __post_init__(self):
    # Python floats: NumPy/JAX scalars would compare and serialise (describe()) differently.
    for name in ("l2_clip_norm", "gamma"):
      object.__setattr__(self, name, float(getattr(self, name)))
    if not (math.isfinite(self.l2_clip_norm) and self.l2_clip_norm > 0):
      raise ValueError(f"l2_clip_norm must be a positive finite number, got {self.l2_clip_norm}.")
    if self.automatic and not (math.isfinite(self.gamma) and self.gamma > 0):
      raise ValueError(f"automatic clipping needs a finite gamma > 0, got {self.gamma}.")
    if self.layer_weights is not None and not self.per_layer:
      raise ValueError("layer_weights only apply to per-layer clipping.")
    if self.layer_weights is not None:
      weights = [float(w) for w in jax.tree.leaves(self.layer_weights)]
      if not weights or not all(math.isfinite(w) and w > 0 for w in weights):
        raise ValueError(f"per-layer clipping weights must be positive finite numbers, got "
                         f"{weights}.")
    if self.grid_bits is not None and (
        isinstance(self.grid_bits, bool) or not isinstance(self.grid_bits, int)
        or not 8 <= self.grid_bits <= 22
    ):
      raise ValueError(f"grid_bits must be an int in [8, 22] or None, got {self.grid_bits!r}.")
    if self.unit not in PRIVACY_UNITS:
      raise ValueError(f"unit must be one of {', '.join(PRIVACY_UNITS)}, got {self.unit!r}.")

  @property
  def name(self) -> str:
    kind = "automatic" if self.automatic else "clip"
    return f"{'per_layer' if self.per_layer else 'flat'}_{kind}"

  def describe(self) -> dict[str, Any]:
    """The rule as JSON-able public settings (for records and the privacy certificate)."""
    out: dict[str, Any] = {"rule": self.name, "l2_clip_norm": self.l2_clip_norm}
    if self.automatic:
      out["gamma"] = self.gamma
    if self.layer_weights is not None:
      out["layer_weights"] = [float(w) for w in jax.tree.leaves(self.layer_weights)]
    if self.grid_bits is not None:
      out["grid_bits"] = self.grid_bits
    if self.unit != EXAMPLE:  # an example-level rule keeps the description it always had
      out["privacy_unit"] = self.unit
    return out

  @property
  def grid_step(self) -> float:
    """γ = C·2⁻ᵏ, the value of one grid unit (secure-noise mode)."""
    if self.grid_bits is None:
      raise ValueError("This clipping rule has no grid (grid_bits=None).")
    return self.l2_clip_norm / 2**self.grid_bits

  @property
  def max_grid_examples(self) -> int:
    """How many rounded queries one int32-limb grid sum holds exactly.

    A rounded coordinate is at most 2ᵏ + 1 in magnitude, so its high limb
    ⌊r/2⁸⌋ is at most 2ᵏ⁻⁸ + 1 and its low limb at most 255; n of them sum
    exactly while n·(2ᵏ⁻⁸ + 1) and n·255 stay below 2³¹ (131,063 at k = 22,
    8,355,967 at k = 16). A larger sum could wrap, so the release refuses it.
    """
    if self.grid_bits is None:
      raise ValueError("This clipping rule has no grid (grid_bits=None).")
    limit = 2**31 - 1
    return min(limit // (2 ** (self.grid_bits - LIMB_BITS) + 1), limit // (2**LIMB_BITS - 1))

  def grid_sensitivity(self, dim: int) -> float:
    """L2 sensitivity of one rounded clipped query in grid units: 2ᵏ + √d/2."""
    return 2.0**self.grid_bits + math.sqrt(dim) / 2  # pyright: ignore[reportOperatorIssue]

  def matches(self, other: Clipping) -> bool:
    """Whether ``other`` is the same rule (layer weights compared by value)."""
    return isinstance(other, Clipping) and self.describe() == other.describe() and (
        jax.tree.structure(self.layer_weights) == jax.tree.structure(other.layer_weights)
    )

  def layer_thresholds(self, tree: PyTree) -> PyTree:
    """C_l per leaf, with Σ_l C_l² = C² (per-layer clipping)."""
    if self.layer_weights is None:
      n = len(jax.tree.leaves(tree))
      return jax.tree.map(lambda _: self.l2_clip_norm / math.sqrt(n), tree)
    if jax.tree.structure(self.layer_weights) != jax.tree.structure(tree):
      raise ValueError(
          f"per-layer clipping weights must have the query's tree structure (one weight per "
          f"parameter leaf, {len(jax.tree.leaves(tree))} leaves), got "
          f"{jax.tree.structure(self.layer_weights)}."
      )
    weights = jax.tree.leaves(self.layer_weights)
    total = math.sqrt(sum(float(w) ** 2 for w in weights))
    return jax.tree.map(lambda w: self.l2_clip_norm * float(w) / total, self.layer_weights)

  def _factor(self, norm: jax.Array, bound: float | jax.Array) -> jax.Array:
    if self.automatic:
      return bound / (norm + self.gamma)
    return jnp.minimum(1.0, bound / (norm + _NORM_EPS))

  def clip(self, query: PyTree) -> ClippedExample:
    """Clips ONE example's query (a pytree without a batch axis)."""
    query = _as_float32(query)
    norm = flat_norm(query)
    finite = jnp.isfinite(norm)
    if self.per_layer:
      thresholds = self.layer_thresholds(query)
      factors = jax.tree.map(
          lambda g, c: self._factor(jnp.sqrt(_sq_norm(g)), c), query, thresholds
      )
      clipped = jax.tree.map(lambda g, f: g * f, query, factors)
      is_clipped = jnp.any(jnp.stack([f < 1.0 for f in jax.tree.leaves(factors)]))
    else:
      factor = self._factor(norm, self.l2_clip_norm)
      clipped = jax.tree.map(lambda g: g * factor, query)
      is_clipped = factor < 1.0
    clipped = _zero_if_nonfinite(clipped, finite)
    return ClippedExample(clipped, norm, is_clipped & finite, finite)

  def factors(self, leaf_sq_norms: PyTree) -> ClippedExample:
    """The factors :meth:`clip` would apply, from ONE example's per-leaf ‖g_l‖² alone.

    For clipping without materialising g (ghost clipping: Li et al. 2021,
    "Large Language Models Can Be Strong Differentially Private Learners",
    §4): ``clipped`` holds, per leaf, the scalar f_l with ḡ_l = f_l · g_l —
    one f = factor(‖g‖, C) for all leaves (flat), or factor(‖g_l‖, C_l) per
    leaf (per-layer), and 0 everywhere when ‖g‖ is not finite. Same rule and
    the same float32 norms as :meth:`clip`, so ‖ḡ‖ ≤ C as there.
    """
    sq = _as_float32(leaf_sq_norms)
    norm = jnp.sqrt(sum(jax.tree.leaves(sq)))
    finite = jnp.isfinite(norm)
    if self.per_layer:
      factors = jax.tree.map(
          lambda s, c: self._factor(jnp.sqrt(s), c), sq, self.layer_thresholds(sq))
      is_clipped = jnp.any(jnp.stack([f < 1.0 for f in jax.tree.leaves(factors)]))
    else:
      factor = self._factor(norm, self.l2_clip_norm)
      factors = jax.tree.map(lambda _: factor, sq)
      is_clipped = factor < 1.0
    factors = _zero_if_nonfinite(factors, finite)
    return ClippedExample(factors, norm, is_clipped & finite, finite)


def flat_clipping(l2_clip_norm: float) -> Clipping:
  """ḡ = g · min(1, C/‖g‖₂), norm over all leaves concatenated (the default)."""
  return Clipping(l2_clip_norm)


def per_layer_clipping(l2_clip_norm: float, layer_weights: PyTree | None = None) -> Clipping:
  """Each leaf clipped to C_l, Σ_l C_l² = C² (equal split C/√L by default)."""
  return Clipping(l2_clip_norm, per_layer=True, layer_weights=layer_weights)


def automatic_clipping(
    l2_clip_norm: float, gamma: float = 0.01, per_layer: bool = False
) -> Clipping:
  """ḡ = g · C/(‖g‖₂ + γ) (AUTO-S, paper 1 appendix K); per-layer with C_l if asked."""
  return Clipping(l2_clip_norm, per_layer=per_layer, automatic=True, gamma=gamma)


CLIPPING_STYLES = ("flat", "per_layer", "automatic", "automatic_per_layer")
"""Named clipping rules (``dpmuon train --clipping``); all have total bound C."""


def clipping_by_name(style: str, l2_clip_norm: float) -> Clipping:
  """The rule named ``style`` (one of :data:`CLIPPING_STYLES`) with total bound C.

  ``"automatic_per_layer"`` is paper 1's appendix style: AUTO-S
  g_l · C_l/(‖g_l‖₂ + γ) on every layer, C_l = C/√L.
  """
  if style not in CLIPPING_STYLES:
    raise ValueError(f"clipping must be one of {', '.join(CLIPPING_STYLES)}, got {style!r}.")
  if style == "flat":
    return flat_clipping(l2_clip_norm)
  if style == "per_layer":
    return per_layer_clipping(l2_clip_norm)
  return automatic_clipping(l2_clip_norm, per_layer=style == "automatic_per_layer")


def as_clipping(clipping: Clipping | float) -> Clipping:
  """A :class:`Clipping` from itself or from a bare C (flat clipping)."""
  if isinstance(clipping, Clipping):
    return clipping
  return flat_clipping(float(clipping))


# Rounded queries are summed as two int32 limbs, r = 2⁸·hi + lo with 0 ≤ lo < 2⁸,
# so sums over up to 2²³ examples are exact without 64-bit integers on the device.
LIMB_BITS = 8


class GridSum(NamedTuple):
  """An exact integer sum Σ_i r_i = 2⁸·hi + lo of rounded clipped queries (int32 limbs)."""

  hi: jax.Array
  lo: jax.Array


def round_to_grid(clipped: jax.Array, mask: jax.Array, grid_bits: int, l2_clip_norm: float
                  ) -> GridSum:
  """Σ_i mask_i · round(ḡ_i / γ) over the leading axis, exactly, as int32 limbs."""
  scale = 2.0**grid_bits / l2_clip_norm
  rounded = jnp.round(clipped * scale).astype(jnp.int32)
  keep = jnp.reshape(mask, mask.shape + (1,) * (rounded.ndim - 1))
  rounded = jnp.where(keep, rounded, 0)
  hi = jnp.right_shift(rounded, LIMB_BITS)  # arithmetic shift: floor division by 2⁸
  lo = jnp.bitwise_and(rounded, 2**LIMB_BITS - 1)
  return GridSum(jnp.sum(hi, axis=0), jnp.sum(lo, axis=0))


def zeros_grid_sum(shape: tuple[int, ...]) -> GridSum:
  return GridSum(jnp.zeros(shape, jnp.int32), jnp.zeros(shape, jnp.int32))
