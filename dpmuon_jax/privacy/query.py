"""Per-example queries and their clipped sum (docs/design.md, "One training step").

A *query* maps shared, public inputs (usually the parameters θ_t; for DiSK or
inner momentum also earlier or extrapolated states) and ONE example to a
pytree q_i. The standard query is the gradient ∇ℓ(θ_t; x_i), computed for
every example at once with ``vmap(grad)``. The clipped sum ::

    S = Σ_i mask_i · clip_C(q_i)

is what the Gaussian release privatises. Every query goes through the same
clipping and summing code, so a new query cannot change the sensitivity.

The sum can be accumulated in microbatches so memory does not grow with the
batch size; the result equals the unchunked sum up to float summation order.
The chunks run in a rolled ``lax.scan`` (compile time and memory independent
of the number of chunks). On XLA:CPU, convolution kernel gradients inside a
rolled loop are slow (a generic loop instead of the Eigen kernel, ~10× at
B = 1024 on the benchmark CNN); models whose convolutions use
:func:`dpmuon_jax.models.cnn.patch_conv` avoid this, and then the chunked sum is
as fast as one vmap over the whole batch (``benchmarks/bench_release.py``).
"""

from __future__ import annotations

import hashlib
import json
import math
import operator
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from dpmuon_jax.privacy.clipping import (
    LIMB_BITS,
    USER,
    ClippedExample,
    Clipping,
    GridSum,
    as_clipping,
    flat_norm,
    round_to_grid,
    zeros_grid_sum,
)

PyTree = Any
QueryFn = Callable[[PyTree, PyTree], PyTree]
LossFn = Callable[[PyTree, PyTree], jax.Array]


class ClipStats(NamedTuple):
  """NON-PRIVATE statistics of a clipped sum, for logging only.

  They depend on which examples were sampled and on their gradients, so they
  are not covered by the privacy guarantee and must never feed back into
  training (docs/sharp-edges.md, "What the guarantee does not cover").
  """

  num_examples: jax.Array  # real (unmasked) rows
  num_clipped: jax.Array
  num_nonfinite: jax.Array  # rows whose query was non-finite; they contributed zero
  norm_sum: jax.Array  # Σ ‖q_i‖ over finite real rows
  norm_max: jax.Array

  @classmethod
  def zeros(cls) -> ClipStats:
    z = jnp.zeros((), jnp.float32)
    return cls(z, z, z, z, z)

  def __add__(self, other: ClipStats) -> ClipStats:  # type: ignore[override]
    return ClipStats(
        self.num_examples + other.num_examples,
        self.num_clipped + other.num_clipped,
        self.num_nonfinite + other.num_nonfinite,
        self.norm_sum + other.norm_sum,
        jnp.maximum(self.norm_max, other.norm_max),
    )

  @property
  def clip_fraction(self) -> jax.Array:
    return self.num_clipped / jnp.maximum(self.num_examples, 1.0)

  @property
  def mean_norm(self) -> jax.Array:
    return self.norm_sum / jnp.maximum(self.num_examples - self.num_nonfinite, 1.0)


# Held only by this module: a ClippedSum built with it came from the clipping code below.
_FROM_CLIPPING = object()

# A release refuses a sum whose norm exceeds n · (one example's bound) by more than float32
# rounding can explain: BOUND_RTOL for the norms, plus n·2⁻²⁴, the worst-case relative error
# of a float32 sum of n terms in any order (Higham, "Accuracy and Stability of Numerical
# Algorithms", §4.2), so that a genuine sum is never refused.
BOUND_RTOL = 1e-4
BOUND_ATOL = 1e-6  # in units of one example's bound: an empty sum is exactly zero

# Odd multipliers of the seal's mixing (MurmurHash3's finaliser) and its position and leaf keys.
_FMIX = (0x85EBCA6B, 0xC2B2AE35)
_POSITION_KEY, _LEAF_KEY = 0x9E3779B9, 0x7F4A7C15
_BROKEN_SEAL = 0x5EA1


def _words(x: Any) -> jax.Array:
  """The bits of ``x`` as a flat uint32 vector (other widths first cast to 32 bits)."""
  x = jnp.asarray(x)
  if x.dtype.itemsize != 4 or x.dtype == jnp.bool_:
    x = x.astype(jnp.float32 if jnp.issubdtype(x.dtype, jnp.floating) else jnp.int32)
  return jax.lax.bitcast_convert_type(x, jnp.uint32).reshape(-1)


def _fmix32(x: jax.Array) -> jax.Array:
  x = x ^ (x >> 16)
  x = x * jnp.uint32(_FMIX[0])
  x = x ^ (x >> 13)
  x = x * jnp.uint32(_FMIX[1])
  return x ^ (x >> 16)


def fingerprint(tree: PyTree) -> jax.Array:
  """A (2,) uint32 fingerprint of the exact bits of every leaf of ``tree``.

  Each 32-bit word w_j at global position j (leaves concatenated) of leaf l is
  mixed as h_j = fmix32(w_j ⊕ (j·k₁ + l·k₂)) (MurmurHash3's finaliser), and the
  two lanes are Σ_j h_j and Σ_j h_j·(2j + 1), with wrap-around
  uint32 sums: O(d) integer operations, no randomness. It is not a
  cryptographic MAC: it detects accidental changes, not a deliberate forgery.
  The leaves of one size are mixed in one vectorised pass (the sums wrap
  around mod 2³², so their order does not change the lanes), compiled once per
  size rather than once per leaf.
  """
  words = [_words(leaf) for leaf in jax.tree.leaves(tree)]
  offsets = np.cumsum([0] + [w.size for w in words], dtype=np.int64)
  by_size: dict[int, list[int]] = {}
  for index, w in enumerate(words):
    by_size.setdefault(w.size, []).append(index)
  lanes = jnp.zeros((2,), jnp.uint32)
  for size, indices in by_size.items():
    start = jnp.asarray(offsets[indices] % 2**32, jnp.uint32)[:, None]
    leaf_salt = jnp.asarray([index * _LEAF_KEY % 2**32 for index in indices], jnp.uint32)
    pos = jnp.arange(size, dtype=jnp.uint32)[None, :] + start
    salt = pos * jnp.uint32(_POSITION_KEY) + leaf_salt[:, None]
    h = _fmix32(jnp.stack([words[index] for index in indices]) ^ salt)
    odd = pos * jnp.uint32(2) + jnp.uint32(1)
    lanes = lanes + jnp.stack([
        jnp.sum(h, dtype=jnp.uint32),
        jnp.sum(h * odd, dtype=jnp.uint32),
    ])
  return lanes


class _Rule:
  """A :class:`Clipping` as hashable pytree aux data: equal when :meth:`Clipping.matches`.

  ``words`` are two uint32 words of SHA-256 of the rule's description, mixed
  into the seal of every sum clipped with it, so the leaves of a sum clipped
  with one rule (say C = 10) do not make a sealed sum under another (C = 1).
  """

  __slots__ = ("clipping", "_key", "words")

  def __init__(self, clipping: Clipping):
    self.clipping = clipping
    self._key = (json.dumps(clipping.describe(), sort_keys=True),
                 str(jax.tree.structure(clipping.layer_weights)))
    digest = hashlib.sha256("\n".join(self._key).encode()).digest()
    self.words = (int.from_bytes(digest[:4], "big"), int.from_bytes(digest[4:8], "big"))

  def __eq__(self, other: object) -> bool:
    return isinstance(other, _Rule) and self._key == other._key

  def __hash__(self) -> int:
    return hash(self._key)


@jax.tree_util.register_pytree_node_class
class ClippedSum:
  """S = Σ_i clip_C(q_i), with the clipping rule that bounds it and a seal of its bits.

  Only the library's clipping code makes one (:func:`clip_and_sum`,
  :func:`clipped_sum`, :func:`zeros_clipped_sum`,
  :func:`clipped_sum_from_norms` for ghost clipping, :meth:`add_disjoint` and
  :meth:`psum` of those); calling ``ClippedSum(...)`` directly raises
  ``TypeError``, so a summed, unclipped gradient can never be released by
  accident as if it were clipped. The Gaussian release accepts a
  ``ClippedSum`` only when it was made with the release's clipping rule
  (hence its sensitivity C), its seal matches its bits and
  ‖total‖₂ ≤ num_examples · C (privacy invariant 8, docs/design.md).

  The seal is a :func:`fingerprint` of ``total`` and ``stats``, mixed with a
  digest of the clipping rule, computed when the library makes the sum. It is
  a pytree leaf, but ``tree_unflatten`` does not recompute it:
  ``jax.tree.map(f, s)``, or ``jax.tree.unflatten`` with other leaves (those
  of a sum clipped with another rule included), gives a ``ClippedSum`` whose
  seal no longer matches, and the release refuses it. ``s + s`` and
  ``s.add_disjoint(s)`` are refused, and so is the sum of ``s`` with a copy of
  itself (equal seals); sums over DISJOINT example sets are added with
  :meth:`add_disjoint`, and per-device sums with :meth:`psum`, which refuses
  copies of one sum on several devices the same way. Sums over overlapping
  but unequal example sets cannot be told apart from disjoint ones: that is
  the caller's promise.

  To release a sum clipped by your own code, say so explicitly with
  :meth:`assume_clipped`: you then guarantee the sensitivity yourself.

  With a grid (``clipping.grid_bits``, the secure-noise mode) every leaf of
  ``total`` is a :class:`~dpmuon_jax.privacy.clipping.GridSum` of int32 limbs
  in grid units instead of a float32 array.
  """

  def __init__(self, total: PyTree, clipping: Clipping | _Rule, stats: ClipStats, *,
               seal: jax.Array | None = None, _origin=None):
    if _origin is not _FROM_CLIPPING:
      raise TypeError(
          "A ClippedSum comes from dpmuon_jax's clipping code (clip_and_sum, clipped_sum); "
          "to vouch for a sum you clipped yourself, use ClippedSum.assume_clipped(...)."
      )
    self.total = total
    self.stats = stats
    self.seal = seal
    self._rule = clipping if isinstance(clipping, _Rule) else _Rule(clipping)

  @property
  def clipping(self) -> Clipping:
    """The rule every summed query was clipped with."""
    return self._rule.clipping

  @property
  def l2_sensitivity(self) -> float:
    return self.clipping.l2_clip_norm

  @property
  def grid_bits(self) -> int | None:
    return self.clipping.grid_bits

  @classmethod
  def assume_clipped(
      cls, total: PyTree, l2_sensitivity: float | Clipping, stats: ClipStats | None = None, *,
      num_examples: int | None = None,
  ) -> ClippedSum:
    """Wraps a sum whose sensitivity YOU guarantee (no check is possible here).

    Use it only for a sum of ``num_examples`` per-example vectors each clipped
    by the rule ``l2_sensitivity`` (a :class:`Clipping`, or a bound C: flat
    clipping), e.g. by your own ghost-norm code. Releasing anything else with
    it voids the privacy guarantee. The release still checks
    ‖total‖₂ ≤ num_examples · C, so the count is required (or ``stats`` that
    carry it).
    """
    if (stats is None) == (num_examples is None):
      raise ValueError("assume_clipped needs exactly one of num_examples (how many clipped "
                       "vectors were summed) and stats.")
    if stats is None:
      stats = ClipStats.zeros()._replace(num_examples=jnp.asarray(num_examples, jnp.float32))
    total = jax.tree.map(jnp.asarray, total)
    return _sealed(total, as_clipping(l2_sensitivity), stats)

  def tree_flatten(self):
    return (self.total, self.stats, self.seal), self._rule

  @classmethod
  def tree_unflatten(cls, aux, children):
    total, stats, seal = children
    return cls(total, aux, stats, seal=seal, _origin=_FROM_CLIPPING)

  def seal_holds(self) -> jax.Array:
    """Whether the seal still matches ``total``, ``stats`` and the rule (a bool scalar)."""
    return jnp.all(jnp.asarray(self.seal) == _seal_of(self.total, self.stats, self._rule))

  def norm_and_bound(self) -> tuple[jax.Array, jax.Array]:
    """‖total‖₂ and n·Δ·(1 + rtol + n·2⁻²⁴) + Δ·atol, n = num_examples, Δ one example's bound.

    Δ = C (float sums) or 2ᵏ + √d/2 grid units (secure-noise mode, where the
    norm is that of the exact integer sum; a grid sum over more examples than
    :attr:`~dpmuon_jax.privacy.clipping.Clipping.max_grid_examples` gets the
    bound −1, which no norm meets, since its limbs may have wrapped).
    """
    if self.grid_bits is None:
      per_example, total = self.l2_sensitivity, self.total
    else:
      total = jax.tree.map(
          lambda g: g.hi.astype(jnp.float32) * 2**LIMB_BITS + g.lo.astype(jnp.float32),
          self.total, is_leaf=lambda x: isinstance(x, GridSum))
      dim = sum(math.prod(jnp.shape(x)) for x in jax.tree.leaves(total))
      per_example = self.clipping.grid_sensitivity(dim)
    n = self.stats.num_examples
    bound = n * per_example * (1 + BOUND_RTOL + n * 2.0**-24) + per_example * BOUND_ATOL
    if self.grid_bits is not None:  # more examples than the limbs hold exactly: no bound
      bound = jnp.where(n <= self.clipping.max_grid_examples, bound, -1.0)
    return flat_norm(total), bound

  def __add__(self, other: Any) -> ClippedSum:
    raise TypeError("ClippedSum + ClippedSum is refused (a sum added to itself has sensitivity "
                    "2C); add sums over DISJOINT example sets with a.add_disjoint(b).")

  __radd__ = __add__

  def add_disjoint(self, other: ClippedSum) -> ClippedSum:
    """The sum over the union of two DISJOINT example sets of one release (e.g. chunks).

    Both must come from the same clipping rule. The sensitivity stays C only
    because no example is in both; adding a sum to itself (or to one that
    shares examples) voids the guarantee. If either operand's seal fails, so
    does the result's, and the release refuses it. Two non-empty sums with
    equal seals (a sum and its copy, or the same sum passed twice to a jitted
    function) are one sum over the same examples: the result's seal fails too
    (sums of zero queries only excepted: their copies add nothing).
    """
    if not isinstance(other, ClippedSum) or other._rule != self._rule:
      raise ValueError("Only clipped sums with the same clipping rule (bound and grid) can "
                       "be added.")
    if other is self:
      raise ValueError("s.add_disjoint(s) adds every example twice (sensitivity 2C); add "
                       "sums over DISJOINT example sets.")
    return _sealed(
        jax.tree.map(jnp.add, self.total, other.total),
        self.clipping,
        self.stats + other.stats,
        valid=self.seal_holds() & other.seal_holds() & ~self._same_nonzero_sum(other),
    )

  def _same_nonzero_sum(self, other: ClippedSum) -> jax.Array:
    """Whether both seals are equal and both sums add a nonzero query: a copy of one sum, not
    a disjoint one (disjoint sums are bit-identical only if every summed vector is).

    Sums of zero queries only (no example, or zero gradients) are never copies that matter:
    k copies of a zero sum are the zero sum, so they add freely.
    """
    same = jnp.all(jnp.asarray(self.seal) == jnp.asarray(other.seal))
    return same & (self.stats.norm_max > 0) & (other.stats.norm_max > 0)

  def psum(self, axis_name: str) -> ClippedSum:
    """Σ over a mapped axis of per-device sums of DISJOINT rows (max for ``norm_max``).

    What it sees: a part whose seal fails breaks the result's seal, and so do
    two parts with equal seals that add a nonzero query, i.e. copies of one sum
    (a batch replicated over the axis instead of sharded, ``vmap`` over
    copies): k copies would otherwise be released as k times the sum, with
    noise for sensitivity C. Copies of a sum of zero queries (no example, or
    zero gradients) are the zero sum and pass. What it cannot see: parts over
    overlapping but unequal example sets (the same example on two devices
    beside different ones); that the rows are disjoint is the caller's
    promise, as for :meth:`add_disjoint`. Disjoint parts are refused only if bit-identical
    (every summed vector equal), as :meth:`add_disjoint` refuses them.
    """
    s = self.stats
    total = jax.lax.psum(self.total, axis_name)
    summed = jax.lax.psum((s.num_examples, s.num_clipped, s.num_nonfinite, s.norm_sum), axis_name)
    stats = ClipStats(*summed, jax.lax.pmax(s.norm_max, axis_name))  # pyright: ignore[reportCallIssue]
    intact = jax.lax.pmin(self.seal_holds().astype(jnp.int32), axis_name) == 1
    seals = jax.lax.all_gather(jnp.asarray(self.seal), axis_name)
    adds = jax.lax.all_gather(s.norm_max, axis_name) > 0
    return _sealed(total, self.clipping, stats, valid=intact & ~_has_copies(seals, adds))

  def __repr__(self) -> str:
    return f"ClippedSum(clipping={self.clipping.describe()}, total={self.total!r})"


def _has_copies(seals: jax.Array, adds: jax.Array) -> jax.Array:
  """Whether two parts (rows of ``seals``, shape (k, 2)) that ``adds`` a nonzero query have
  equal seals."""
  same = jnp.all(seals[:, None, :] == seals[None, :, :], axis=-1)
  pairs = same & adds[:, None] & adds[None, :] & ~jnp.eye(seals.shape[0], dtype=bool)
  return jnp.any(pairs)


def _seal_of(total: PyTree, stats: ClipStats, rule: _Rule) -> jax.Array:
  """fingerprint((total, stats)) ⊕ the rule's digest words."""
  return fingerprint((total, stats)) ^ jnp.asarray(rule.words, jnp.uint32)


def _sealed(total: PyTree, clipping: Clipping, stats: ClipStats,
            valid: jax.Array | None = None) -> ClippedSum:
  """A ClippedSum sealed with ``(total, stats)`` and its rule; a broken seal where not ``valid``.

  The optimisation barrier makes the sealed bits those of ONE materialised
  value, so a consumer can never see a recomputation of ``total`` that XLA
  rounded differently (e.g. fused with an FMA).
  """
  total, stats = jax.lax.optimization_barrier((total, stats))
  rule = _Rule(clipping)
  seal = _seal_of(total, stats, rule)
  if valid is not None:
    seal = jnp.where(valid, seal, seal ^ jnp.uint32(_BROKEN_SEAL))
  return ClippedSum(total, rule, stats, seal=seal, _origin=_FROM_CLIPPING)


def _zero_total(like: PyTree, clipping: Clipping) -> PyTree:
  if clipping.grid_bits is None:
    return jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), jnp.float32), like)
  return jax.tree.map(lambda p: zeros_grid_sum(jnp.shape(p)), like)


def zeros_clipped_sum(like: PyTree, clipping: Clipping | float) -> ClippedSum:
  """An empty clipped sum (no examples) shaped like ``like``, for ``clipping``'s bound and grid."""
  clipping = as_clipping(clipping)
  return _sealed(_zero_total(like, clipping), clipping, ClipStats.zeros())


def _sum_over_chunks(
    chunk_sum: Callable[[Any], ClippedSum], chunks: PyTree, like: PyTree, clipping: Clipping
) -> ClippedSum:
  """Σ_k chunk_sum(chunks[k]) over disjoint chunks (leading axis), in a rolled ``lax.scan``.

  ``chunk_sum`` must be the library's clipping code (:func:`clip_and_sum`,
  ghost clipping): the chunks' totals are accumulated as arrays and sealed
  once, so the parts' seals are not checked (and XLA drops them).
  """

  def accumulate(acc, chunk):
    part = chunk_sum(chunk)
    return (jax.tree.map(jnp.add, acc[0], part.total), acc[1] + part.stats), None

  init = (_zero_total(like, clipping), ClipStats.zeros())
  (total, stats), _ = jax.lax.scan(accumulate, init, chunks)
  return _sealed(total, clipping, stats)


def add_batch_axis(example: PyTree) -> PyTree:
  return jax.tree.map(lambda x: jnp.expand_dims(x, 0), example)


RECORD_MASK = "record_mask"
"""The field of a user-grouped batch that marks each user's real records (user-level DP)."""


def per_user_query(query: QueryFn) -> QueryFn:
  """A user's query: the mean of ``query`` over the user's real records.

  One row of a user-grouped batch (:func:`~dpmuon_jax.data.users.group_by_user`) is a dict
  whose fields have a leading axis of the user's (at most m) records and whose
  ``record_mask`` marks the real ones::

      q_u = Σ_j mask_j · q(θ; x_uj) / max(1, Σ_j mask_j)

  Clipped once to C, q_u is the user's whole contribution to the sum. Masked records
  contribute exactly zero, even where their query is not finite (e.g. a padded text with
  no target token).
  """

  def query_of_user(inputs: PyTree, user: PyTree) -> PyTree:
    if not isinstance(user, dict) or RECORD_MASK not in user:
      raise ValueError(f"A user-level clipped sum needs batches grouped by user: a dict with "
                       f"a {RECORD_MASK!r} field (dpmuon_jax.data.users.group_by_user).")
    mask = jnp.asarray(user[RECORD_MASK], bool)
    records = {k: v for k, v in user.items() if k != RECORD_MASK}
    per_record = jax.vmap(query, in_axes=(None, 0))(inputs, records)
    weight = mask.astype(jnp.float32) / jnp.maximum(1.0, jnp.sum(mask.astype(jnp.float32)))

    def mean(q: jax.Array) -> jax.Array:
      kept = jnp.where(mask.reshape((-1,) + (1,) * (q.ndim - 1)), q, 0.0)
      return jnp.tensordot(weight, kept, axes=1)

    return jax.tree.map(mean, per_record)

  return query_of_user


def gradient_query(loss_fn: LossFn) -> QueryFn:
  """The standard query q_i = ∇_θ ℓ(θ; x_i).

  Args:
    loss_fn: ``loss_fn(params, batch) -> scalar``; it is called on a batch of
      one example (leading axis of size 1).
  """

  def query(params: PyTree, example: PyTree) -> PyTree:
    return jax.grad(loss_fn)(params, add_batch_axis(example))

  return query


class GradientTerm(NamedTuple):
  """w · ∇ℓ(state; x): one term of a query that is a weighted sum of gradients.

  Attributes:
    state: a public parameter state (θ_t, an earlier or an extrapolated state).
    weight: one scalar for every leaf, or a pytree like ``state`` of scalars
      (each leaf's own weight, as inner momentum's per-group weights).
  """

  state: PyTree
  weight: Any = 1.0


class QuerySpec(NamedTuple):
  """Which per-example query a private optimizer releases, and its public inputs.

  Attributes:
    make_query: ``loss_fn -> query``, where ``query(inputs, example)`` returns
      one example's (unclipped) query.
    inputs: ``(params, opt_state) -> inputs``. The inputs may only depend on
      the parameters and the optimizer's post-processing state (both functions
      of earlier releases and public settings), never on the noise stream.
    terms: ``inputs -> (GradientTerm, ...)`` when the query is a weighted sum
      of gradients at public states, q_i = Σ_k w_k ∇ℓ(θ_k; x_i), as the
      gradient, DiSK's and inner momentum's queries are; ghost clipping
      (:mod:`dpmuon_jax.privacy.ghost`) computes such a query's clipped sum
      without per-example gradients. ``None`` for any other query.

  The standard query is :data:`GRADIENT_QUERY`; DiSK and inner momentum
  evaluate gradients at other (earlier or extrapolated) parameter states.
  Whatever the query, each example contributes ONE clipped vector.
  """

  make_query: Callable[[LossFn], QueryFn]
  inputs: Callable[[PyTree, Any], PyTree]
  terms: Callable[[PyTree], tuple[GradientTerm, ...]] | None = None


def _weighted(grad: jax.Array, weight: Any) -> jax.Array:
  # jnp.where, not a product: a zero-weight term must not turn NaN into the sum.
  grad = grad.astype(jnp.float32)
  return jnp.where(weight != 0, weight * grad, jnp.zeros_like(grad))


def _per_leaf(weight: Any, like: PyTree) -> PyTree:
  """A term's weight as a float32 scalar per leaf of ``like``."""
  if jax.tree_util.treedef_is_leaf(jax.tree.structure(weight)):
    return jax.tree.map(lambda _: jnp.asarray(weight, jnp.float32), like)
  return jax.tree.map(lambda w: jnp.asarray(w, jnp.float32), weight)


def stack_terms(parts: tuple[GradientTerm, ...]) -> tuple[PyTree, PyTree]:
  """The terms' states stacked leafwise (n, …) and their weights as (n,) float32 per leaf."""
  like = parts[0].state
  stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *(p.state for p in parts))
  weights = jax.tree.map(lambda *ws: jnp.stack(ws), *(_per_leaf(p.weight, like) for p in parts))
  return stacked, weights


def terms_query(loss_fn: LossFn, terms: Callable[[PyTree], tuple[GradientTerm, ...]]) -> QueryFn:
  """``query(inputs, example) = Σ_k w_k ∇ℓ(θ_k; x)`` for ``(θ_k, w_k)`` in ``terms(inputs)``.

  The per-example form of a :attr:`QuerySpec.terms` description: one gradient
  per term, summed in float32 and cast to the parameters' dtypes. Several
  terms are summed by a ``lax.scan`` over the stacked states, so one term's
  gradient is live at a time: under ``vmap`` the memory is that of one
  per-example gradient and its activations, whatever the number of terms.
  """
  grad_fn = jax.grad(loss_fn)

  def query(inputs: PyTree, example: PyTree) -> PyTree:
    batch = add_batch_axis(example)
    parts = terms(inputs)
    like = parts[0].state
    if len(parts) == 1:
      total = jax.tree.map(_weighted, grad_fn(like, batch), _per_leaf(parts[0].weight, like))
    else:
      stacked, weights = stack_terms(parts)

      def add_term(acc, term):
        state, weight = term
        return jax.tree.map(lambda a, g, w: a + _weighted(g, w), acc,
                            grad_fn(state, batch), weight), None

      zeros = jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), jnp.float32), like)
      total, _ = jax.lax.scan(add_term, zeros, (stacked, weights))
    return jax.tree.map(lambda t, p: t.astype(p.dtype), total, like)

  return query


def _current_params(params: PyTree, opt_state: Any) -> PyTree:
  del opt_state
  return params


GRADIENT_QUERY = QuerySpec(gradient_query, _current_params, lambda params: (GradientTerm(params),))
"""q_i = ∇ℓ(θ_t; x_i), the query of DP-SGD, DP-Adam and DP-Muon."""


def _batch_size(batch: PyTree) -> int:
  sizes = {jnp.shape(x)[0] for x in jax.tree.leaves(batch)}
  if len(sizes) != 1:
    raise ValueError(f"All batch leaves need the same leading (batch) axis, got sizes {sizes}.")
  return sizes.pop()


def _default_mask(batch_size: int, mask: jax.Array | None) -> jax.Array:
  if mask is None:
    return jnp.ones((batch_size,), jnp.bool_)
  mask = jnp.asarray(mask)
  if mask.shape != (batch_size,):
    raise ValueError(f"mask must have shape ({batch_size},), got {mask.shape}.")
  if mask.dtype != jnp.bool_:
    raise ValueError(
        f"mask must be boolean (True for a real example, False for padding), got dtype "
        f"{mask.dtype}: a clipped sum counts every real example once and weights none (labels "
        "passed as the mask would drop every example of class 0)."
    )
  return mask


def pad_to_multiple(batch: PyTree, mask: jax.Array, multiple: int) -> tuple[PyTree, jax.Array]:
  """``batch`` and ``mask`` with padding rows appended up to a multiple of ``multiple`` rows.

  The padding rows are zeros, like the sampler's padding
  (:func:`~dpmuon_jax.privacy.sampling.gather`): dummies, never copies of a
  real example. They are masked out, so they add nothing to a clipped sum:
  padding changes the cost, never the sum.
  """
  extra = -mask.shape[0] % multiple
  if not extra:
    return batch, mask
  padded = jax.tree.map(
      lambda x: jnp.concatenate([x, jnp.zeros((extra,) + x.shape[1:], x.dtype)]), batch)
  return padded, jnp.concatenate([mask, jnp.zeros((extra,), jnp.bool_)])


def clip_and_sum(
    per_example: PyTree, mask: jax.Array | None, clipping: Clipping | float
) -> ClippedSum:
  """Σ_i mask_i · clip_C(q_i) for queries ``per_example`` on a leading batch axis.

  Example-level rules only: a user-level sum is made by :func:`clipped_sum`, which averages
  each user's records before clipping (a vector of your own per user:
  :meth:`ClippedSum.assume_clipped`).
  """
  clipping = as_clipping(clipping)
  if clipping.unit == USER:
    raise ValueError("A user-level clipped sum clips each user's mean query: make it with "
                     "clipped_sum over batches grouped by user (group_by_user), not from "
                     "per-example queries.")
  return _clip_and_sum(per_example, mask, clipping)


def _clip_and_sum(per_example: PyTree, mask: jax.Array | None, clipping: Clipping
                  ) -> ClippedSum:
  mask = _default_mask(_batch_size(per_example), mask)
  clipped = jax.vmap(clipping.clip)(per_example)
  weight = mask.astype(jnp.float32)
  if clipping.grid_bits is None:
    total = jax.tree.map(lambda c: jnp.tensordot(weight, c, axes=1), clipped.clipped)
  else:
    bits = clipping.grid_bits
    total = jax.tree.map(
        lambda c: round_to_grid(c, mask, bits, clipping.l2_clip_norm),
        clipped.clipped,
    )
  real_finite = mask & clipped.is_finite
  stats = ClipStats(
      num_examples=jnp.sum(weight),
      num_clipped=jnp.sum(mask & clipped.is_clipped).astype(jnp.float32),
      num_nonfinite=jnp.sum(mask & ~clipped.is_finite).astype(jnp.float32),
      norm_sum=jnp.sum(jnp.where(real_finite, clipped.norm, 0.0)),
      norm_max=jnp.max(jnp.where(real_finite, clipped.norm, 0.0), initial=0.0),
  )
  return _sealed(total, clipping, stats)


def _stats(mask: jax.Array, clipped: ClippedExample) -> ClipStats:
  real_finite = mask & clipped.is_finite
  return ClipStats(
      num_examples=jnp.sum(mask.astype(jnp.float32)),
      num_clipped=jnp.sum(mask & clipped.is_clipped).astype(jnp.float32),
      num_nonfinite=jnp.sum(mask & ~clipped.is_finite).astype(jnp.float32),
      norm_sum=jnp.sum(jnp.where(real_finite, clipped.norm, 0.0)),
      norm_max=jnp.max(jnp.where(real_finite, clipped.norm, 0.0), initial=0.0),
  )


def clipped_sum_from_norms(
    leaf_sq_norms: PyTree,
    mask: jax.Array | None,
    clipping: Clipping | float,
    weighted_sum: Callable[[PyTree, jax.Array], PyTree],
) -> ClippedSum:
  """Σ_i mask_i · clip_C(q_i) for queries known through their norms (ghost clipping).

  ``leaf_sq_norms`` has the query's structure with (B,) leaves ‖q_{i,l}‖²; the
  factors are :meth:`Clipping.factors` (the rule :func:`clip_and_sum`
  applies). ``weighted_sum(factors, keep)`` returns Σ_i factors_{i,l} · q_{i,l}
  per leaf over the rows where ``keep`` (real and finite) is True; factors are
  0 elsewhere. Its caller vouches that those q_i are the vectors whose norms
  were given, as :func:`clip_and_sum`'s caller vouches for its rows. No grid
  (secure-noise) mode: it rounds every clipped query, so it needs them.
  """
  clipping = as_clipping(clipping)
  if clipping.unit == USER:
    raise ValueError("Ghost clipping clips each example's gradient from its norms; user-level "
                     "DP clips each user's mean gradient: use clipped_sum_method='vmap'.")
  if clipping.grid_bits is not None:
    raise ValueError("Clipping from norms cannot round each clipped query to the grid "
                     "(grid_bits); use clipped_sum.")
  mask = _default_mask(_batch_size(leaf_sq_norms), mask)
  scaled = jax.vmap(clipping.factors)(leaf_sq_norms)
  keep = mask & scaled.is_finite
  factors = jax.tree.map(lambda f: jnp.where(keep, f, 0.0), scaled.clipped)
  total = _as_float32_tree(weighted_sum(factors, keep))
  return _sealed(total, clipping, _stats(mask, scaled))


def _as_float32_tree(tree: PyTree) -> PyTree:
  return jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), tree)


def clipped_sum(
    query: QueryFn,
    query_inputs: PyTree,
    batch: PyTree,
    mask: jax.Array | None,
    clipping: Clipping | float,
    microbatch_size: int | None = None,
) -> ClippedSum:
  """Σ_i mask_i · clip_C(query(query_inputs, x_i)) over a (padded) batch.

  Args:
    query: the per-example query, e.g. :func:`gradient_query`.
    query_inputs: public inputs shared by all examples (parameters, states).
    batch: pytree of arrays with a leading batch axis; padding rows are dummies.
    mask: boolean ``(B,)``; False rows contribute nothing. ``None``: all real.
    clipping: a :class:`Clipping` or a bare C (flat clipping). A user-level rule
      (``unit="user"``) takes a batch grouped by user (one row per user, its records and
      ``record_mask``) and clips each user's mean query (:func:`per_user_query`): x_i is
      then user i, and the sum's sensitivity C is per user.
    microbatch_size: evaluate ``vmap(query)`` on this many examples at a time
      and accumulate, so memory is flat in B. A batch it does not divide gets
      masked-out padding rows (:func:`pad_to_multiple`). ``None``: all at once.
  """
  clipping = as_clipping(clipping)
  if clipping.unit == USER:  # one row per user: the mean of their records' queries
    query = per_user_query(query)
  batch_size = _batch_size(batch)
  mask = _default_mask(batch_size, mask)
  per_example = jax.vmap(query, in_axes=(None, 0))

  if microbatch_size is not None and (
      isinstance(microbatch_size, bool) or operator.index(microbatch_size) <= 0
  ):
    raise ValueError(f"microbatch_size must be a positive int or None, got {microbatch_size!r}.")
  if microbatch_size is None or microbatch_size >= batch_size:
    return _clip_and_sum(per_example(query_inputs, batch), mask, clipping)

  batch, mask = pad_to_multiple(batch, mask, microbatch_size)
  num_chunks = mask.shape[0] // microbatch_size
  chunked = jax.tree.map(
      lambda x: x.reshape((num_chunks, microbatch_size) + x.shape[1:]), (batch, mask)
  )

  def chunk_sum(chunk) -> ClippedSum:
    chunk_batch, chunk_mask = chunk
    return _clip_and_sum(per_example(query_inputs, chunk_batch), chunk_mask, clipping)

  one_example = jax.tree.map(lambda x: x[0], batch)
  like = jax.eval_shape(query, query_inputs, one_example)
  return _sum_over_chunks(chunk_sum, chunked, like, clipping)
