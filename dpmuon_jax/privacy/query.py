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

import operator
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from dpmuon_jax.privacy.clipping import (
    ClippedExample,
    Clipping,
    as_clipping,
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


@jax.tree_util.register_pytree_node_class
class ClippedSum:
  """S = Σ_i clip_C(q_i) with its L2 sensitivity C attached as static data.

  Only the library's clipping code makes one (:func:`clip_and_sum`,
  :func:`clipped_sum`, :func:`zeros_clipped_sum`,
  :func:`clipped_sum_from_norms` for ghost clipping, and sums of those); calling
  ``ClippedSum(...)`` directly raises ``TypeError``, so a summed, unclipped
  gradient can never be released by accident as if it were clipped. The
  Gaussian release accepts a ``ClippedSum`` only when its sensitivity is the
  one the release was calibrated for.

  To release a sum clipped by your own code, say so explicitly with
  :meth:`assume_clipped`: you then guarantee the sensitivity yourself.

  With a grid (``grid_bits``, the secure-noise mode) every leaf of ``total``
  is a :class:`~dpmuon_jax.privacy.clipping.GridSum` of int32 limbs in grid
  units instead of a float32 array.
  """

  def __init__(self, total: PyTree, l2_sensitivity: float, stats: ClipStats, *, _origin=None,
               grid_bits: int | None = None):
    if _origin is not _FROM_CLIPPING:
      raise TypeError(
          "A ClippedSum comes from dpmuon_jax's clipping code (clip_and_sum, clipped_sum); "
          "to vouch for a sum you clipped yourself, use ClippedSum.assume_clipped(...)."
      )
    self.total = total
    self.l2_sensitivity = float(l2_sensitivity)
    self.stats = stats
    self.grid_bits = grid_bits

  @classmethod
  def assume_clipped(
      cls, total: PyTree, l2_sensitivity: float, stats: ClipStats | None = None
  ) -> ClippedSum:
    """Wraps a sum whose sensitivity YOU guarantee (no check is possible here).

    Use it only for a sum of per-example vectors each of L2 norm ≤
    ``l2_sensitivity`` (e.g. clipped by your own ghost-norm code). Releasing
    anything else with it voids the privacy guarantee.
    """
    return cls(total, l2_sensitivity, ClipStats.zeros() if stats is None else stats,
               _origin=_FROM_CLIPPING)

  def tree_flatten(self):
    return (self.total, self.stats), (self.l2_sensitivity, self.grid_bits)

  @classmethod
  def tree_unflatten(cls, aux, children):
    total, stats = children
    return cls(total, aux[0], stats, _origin=_FROM_CLIPPING, grid_bits=aux[1])

  def __add__(self, other: ClippedSum) -> ClippedSum:
    """Adds sums over DISJOINT example sets of the same release (e.g. overflow chunks)."""
    if (not isinstance(other, ClippedSum) or other.l2_sensitivity != self.l2_sensitivity
        or other.grid_bits != self.grid_bits):
      raise ValueError("Only clipped sums with the same sensitivity and grid can be added.")
    return ClippedSum(
        jax.tree.map(jnp.add, self.total, other.total),
        self.l2_sensitivity,
        self.stats + other.stats,
        _origin=_FROM_CLIPPING,
        grid_bits=self.grid_bits,
    )

  def psum(self, axis_name: str) -> ClippedSum:
    """Σ over a mapped axis of per-device sums of disjoint rows (max for ``norm_max``)."""
    s = self.stats
    total = jax.lax.psum(self.total, axis_name)
    summed = jax.lax.psum((s.num_examples, s.num_clipped, s.num_nonfinite, s.norm_sum), axis_name)
    stats = ClipStats(*summed, jax.lax.pmax(s.norm_max, axis_name))  # pyright: ignore[reportCallIssue]
    return ClippedSum(total, self.l2_sensitivity, stats, _origin=_FROM_CLIPPING,
                      grid_bits=self.grid_bits)

  def __repr__(self) -> str:
    return f"ClippedSum(l2_sensitivity={self.l2_sensitivity}, total={self.total!r})"


def zeros_clipped_sum(like: PyTree, clipping: Clipping | float) -> ClippedSum:
  """An empty clipped sum (no examples) shaped like ``like``, for ``clipping``'s bound and grid."""
  clipping = as_clipping(clipping)
  if clipping.grid_bits is None:
    total = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), like)
  else:
    total = jax.tree.map(lambda p: zeros_grid_sum(p.shape), like)
  return ClippedSum(total, clipping.l2_clip_norm, ClipStats.zeros(), _origin=_FROM_CLIPPING,
                    grid_bits=clipping.grid_bits)


def add_batch_axis(example: PyTree) -> PyTree:
  return jax.tree.map(lambda x: jnp.expand_dims(x, 0), example)


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
  return mask.astype(jnp.bool_)


def clip_and_sum(
    per_example: PyTree, mask: jax.Array | None, clipping: Clipping | float
) -> ClippedSum:
  """Σ_i mask_i · clip_C(q_i) for queries ``per_example`` on a leading batch axis."""
  clipping = as_clipping(clipping)
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
  return ClippedSum(total, clipping.l2_clip_norm, stats, _origin=_FROM_CLIPPING,
                    grid_bits=clipping.grid_bits)


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
  if clipping.grid_bits is not None:
    raise ValueError("Clipping from norms cannot round each clipped query to the grid "
                     "(grid_bits); use clipped_sum.")
  mask = _default_mask(_batch_size(leaf_sq_norms), mask)
  scaled = jax.vmap(clipping.factors)(leaf_sq_norms)
  keep = mask & scaled.is_finite
  factors = jax.tree.map(lambda f: jnp.where(keep, f, 0.0), scaled.clipped)
  total = _as_float32_tree(weighted_sum(factors, keep))
  return ClippedSum(total, clipping.l2_clip_norm, _stats(mask, scaled), _origin=_FROM_CLIPPING)


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
    clipping: a :class:`Clipping` or a bare C (flat clipping).
    microbatch_size: evaluate ``vmap(query)`` on this many examples at a time
      and accumulate, so memory is flat in B. Must divide B. ``None``: all at once.
  """
  batch_size = _batch_size(batch)
  mask = _default_mask(batch_size, mask)
  per_example = jax.vmap(query, in_axes=(None, 0))

  if microbatch_size is not None and (
      isinstance(microbatch_size, bool) or operator.index(microbatch_size) <= 0
  ):
    raise ValueError(f"microbatch_size must be a positive int or None, got {microbatch_size!r}.")
  if microbatch_size is None or microbatch_size >= batch_size:
    return clip_and_sum(per_example(query_inputs, batch), mask, clipping)

  if batch_size % microbatch_size:
    raise ValueError(
        f"microbatch_size={microbatch_size} must divide the padded batch size {batch_size}; "
        "choose a capacity that is a multiple of it."
    )
  num_chunks = batch_size // microbatch_size
  chunked = jax.tree.map(
      lambda x: x.reshape((num_chunks, microbatch_size) + x.shape[1:]), (batch, mask)
  )

  def accumulate(acc: ClippedSum, chunk):
    chunk_batch, chunk_mask = chunk
    return acc + clip_and_sum(per_example(query_inputs, chunk_batch), chunk_mask, clipping), None

  one_example = jax.tree.map(lambda x: x[0], batch)
  init = zeros_clipped_sum(jax.eval_shape(query, query_inputs, one_example), clipping)
  total, _ = jax.lax.scan(accumulate, init, chunked)
  return total
