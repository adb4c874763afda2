"""One jit-compiled private training step (docs/design.md, "One training step").

::

    padded batch + mask ─► per-example query ─► clipped sum ─► release ─► optimizer

The padded batch has a static shape (the sampler's capacity), so the step
compiles once however many examples were sampled. When Poisson sampling draws
more examples than the capacity, the sampler returns extra chunks; their
clipped sums are computed by :attr:`PrivateStep.clipped_sum` and passed in as
``overflow``, so every sampled example enters the ONE release of the step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, cast

import jax
import optax
from jax.sharding import Mesh, PartitionSpec

from dpmuon_jax.distributed.mesh import DATA_AXIS, replicated
from dpmuon_jax.distributed.sharding import MODEL_AXIS, constrain_train_state
from dpmuon_jax.privacy.clipping import Clipping
from dpmuon_jax.privacy.ghost import select_clipped_sum
from dpmuon_jax.privacy.query import (
    GRADIENT_QUERY,
    ClippedSum,
    ClipStats,
    LossFn,
    QueryFn,
    clipped_sum,
    zeros_clipped_sum,
)
from dpmuon_jax.privacy.release import PrivateTransformation, optimizer_clipping

PyTree = Any


class StepOutput(NamedTuple):
  params: PyTree
  opt_state: optax.OptState
  stats: ClipStats  # NON-PRIVATE: for logging only


class PrivateStep(NamedTuple):
  """``step(params, opt_state, batch, mask, overflow)`` and its chunk helper.

  Attributes:
    sealed_step: jitted ``(params, opt_state, batch, mask, overflow) -> (StepOutput,
      seal)``; ``seal`` is the released clipped sum's (SECRET: a digest of the
      private sum; the trainer journals it owner-only, so that a resumed run
      redoes a lost release with its noise key only on the same sum).
    clipped_sum: jitted ``(params, opt_state, batch, mask) -> ClippedSum`` for
      one chunk.
    empty_overflow: ``(params) -> ClippedSum`` of zeros.
  """

  sealed_step: Callable[..., tuple[StepOutput, jax.Array]]
  clipped_sum: Callable[[PyTree, optax.OptState, PyTree, jax.Array], ClippedSum]
  empty_overflow: Callable[[PyTree], ClippedSum]

  def step(self, params: PyTree, opt_state: optax.OptState, batch: PyTree, mask: jax.Array,
           overflow: ClippedSum) -> StepOutput:
    """One release of ``(batch, mask)`` plus ``overflow``, a :class:`ClippedSum` of extra
    chunks (use :attr:`empty_overflow` when there are none)."""
    return self.sealed_step(params, opt_state, batch, mask, overflow)[0]

  def released(
      self, params: PyTree, opt_state: optax.OptState, chunks: Sequence[tuple[PyTree, jax.Array]]
  ) -> tuple[StepOutput, jax.Array]:
    """:meth:`__call__` and the seal of the clipped sum it released (SECRET)."""
    (batch, mask), *extra = _checked_chunks(chunks)
    overflow = self.empty_overflow(params)
    for extra_batch, extra_mask in extra:
      overflow = overflow.add_disjoint(self.clipped_sum(params, opt_state, extra_batch, extra_mask))
    return self.sealed_step(params, opt_state, batch, mask, overflow)

  def __call__(
      self, params: PyTree, opt_state: optax.OptState, chunks: Sequence[tuple[PyTree, jax.Array]]
  ) -> StepOutput:
    """Runs one release over all ``(batch, mask)`` chunks of a Poisson sample."""
    return self.released(params, opt_state, chunks)[0]


def _checked_chunks(chunks: Any) -> Sequence[tuple[PyTree, jax.Array]]:
  """``chunks`` if it is a non-empty list of ``(batch, mask)`` pairs, else a one-line error."""
  if not (isinstance(chunks, (list, tuple)) and chunks
          and all(isinstance(c, (list, tuple)) and len(c) == 2 for c in chunks)):
    raise TypeError(
        "A private step takes a non-empty list of (batch, mask) chunks, e.g. [(batch, mask)], "
        "or [(dm.gather(data, b), b.mask) for b in sampler.sample(t)] for a Poisson sample."
    )
  return chunks


def _query_and_inputs(optimizer: PrivateTransformation, loss_fn, query):
  """The per-example query and how to read its public inputs from (params, opt_state)."""
  if (loss_fn is None) == (query is None):
    raise ValueError("Give exactly one of loss_fn and query.")
  if query is None:
    return optimizer.query.make_query(loss_fn), optimizer.query.inputs
  return query, GRADIENT_QUERY.inputs


def _sum_over_mesh(chunk_sum: Callable, mesh: Mesh) -> Callable:
  """Each device clips and sums its rows; the per-device sums are added once (psum)."""
  if DATA_AXIS not in mesh.axis_names:
    raise ValueError(f"The mesh needs a {DATA_AXIS!r} axis, got {mesh.axis_names}.")
  # Manual over 'data' only: a 'model' axis stays XLA's to partition (sharded parameters).
  return jax.shard_map(
      lambda inputs, batch, mask: chunk_sum(inputs, batch, mask).psum(DATA_AXIS),
      mesh=mesh,
      in_specs=(PartitionSpec(), PartitionSpec(DATA_AXIS), PartitionSpec(DATA_AXIS)),
      out_specs=PartitionSpec(),
      axis_names=frozenset({DATA_AXIS}),
      # The microbatch scan starts from a replicated zero carry; the per-device
      # sums are combined explicitly by the psum.
      check_vma=False,
  )


def _rows_whole(mesh: Mesh) -> bool:
  """Whether every device of the mesh sees every row: a (1, model) mesh.

  There is nothing to add over 'data' then, and XLA's partitioner refuses a
  size-1 manual axis beside an automatic one.
  """
  return MODEL_AXIS in mesh.axis_names and dict(mesh.shape).get(DATA_AXIS) == 1


def make_private_step(
    optimizer: PrivateTransformation,
    loss_fn: LossFn | None = None,
    *,
    query: QueryFn | None = None,
    clipping: Clipping | None = None,
    microbatch_size: int | None = None,
    mesh: Mesh | None = None,
    clipped_sum_method: str = "vmap",
) -> PrivateStep:
  """Builds the jitted private step for a ``dp_*`` optimizer, on one device or a mesh.

  Args:
    optimizer: a complete private optimizer (contains the release).
    loss_fn: ``loss_fn(params, batch) -> scalar``; the optimizer's query
      (``optimizer.query``: the gradient, or DiSK's / inner momentum's
      combination) is built from it. Give either this or ``query``.
    query: a per-example query ``query(params, example) -> pytree`` used
      instead of the optimizer's (its inputs are the current parameters).
    clipping: the optimizer's own clipping rule (``optimizer.release.clipping``)
      is used; passing a different one is an error.
    microbatch_size: accumulate the clipped sum in chunks of this size (per
      device on a mesh).
    mesh: ``None`` for one device, or a mesh with a ``'data'`` axis
      (:func:`~dpmuon_jax.distributed.mesh.data_mesh`): batches and masks are
      split on their rows (place them with
      :func:`~dpmuon_jax.distributed.mesh.shard_batch`, or pass host arrays),
      each device clips and sums its rows, the sums are added once, and the
      release and the optimizer run replicated, so the noise is drawn once
      and added to the global sum. The padded batch's rows must be a multiple
      of the device count (and of ``n_devices·microbatch_size``): see
      :func:`~dpmuon_jax.distributed.mesh.sharded_capacity`.
    clipped_sum_method: ``"vmap"`` (per-example gradients), ``"ghost"``
      (ghost norms and book-keeping, no per-example gradients; same sum and
      sensitivity: :func:`~dpmuon_jax.privacy.ghost.ghost_clipped_sum`) or
      ``"automatic"`` (ghost when every matrix is tapped). Ghost needs
      ``loss_fn`` and an optimizer whose query is a weighted sum of gradients
      (``optimizer.query.terms``: every ``dp_*`` optimizer here, DiSK's
      two-point and inner momentum's K-state queries included); build the
      model with :func:`~dpmuon_jax.models.taps.tapped` to profit from it.
  """
  if not isinstance(optimizer, PrivateTransformation):
    raise TypeError("make_private_step needs a private optimizer (a dp_* transformation).")
  terms = optimizer.query.terms if query is None else None  # a custom query has no terms
  query, read_inputs = _query_and_inputs(optimizer, loss_fn, query)
  clipping = optimizer_clipping(optimizer, clipping)
  if mesh is not None and optimizer.release.secure_noise:
    raise ValueError("secure_noise draws its noise on the host of a single device; use one device.")

  def vmap_sum(inputs, batch, mask) -> ClippedSum:
    return clipped_sum(query, inputs, batch, mask, clipping, microbatch_size)

  local_sum = select_clipped_sum(
      clipped_sum_method, vmap_sum, loss_fn,
      terms, clipping, microbatch_size)

  summed = local_sum if mesh is None or _rows_whole(mesh) else _sum_over_mesh(local_sum, mesh)

  def chunk_sum(params, opt_state, batch, mask) -> ClippedSum:
    return summed(read_inputs(params, opt_state), batch, mask)

  def step(params, opt_state, batch, mask, overflow: ClippedSum) -> tuple[StepOutput, jax.Array]:
    total = chunk_sum(params, opt_state, batch, mask).add_disjoint(overflow)
    # Replicated from here on: ONE noise draw from the release's key, on the global sum.
    updates, opt_state = optimizer.update(  # the release takes the ClippedSum
        total, opt_state, params)  # pyright: ignore[reportArgumentType]
    seal = cast(jax.Array, total.seal)  # a ClippedSum the library made is always sealed
    return StepOutput(optax.apply_updates(params, updates), opt_state, total.stats), seal

  @jax.jit  # one program, not ~100 eager ones (the seal is a function of the zeros alone)
  def empty_overflow(params) -> ClippedSum:
    return zeros_clipped_sum(params, clipping)

  return PrivateStep(*_jitted(step, chunk_sum, mesh), empty_overflow)


def _jitted(step: Callable, chunk_sum: Callable, mesh: Mesh | None) -> tuple[Callable, Callable]:
  """``jit`` of the step and the chunk sum, with the mesh's layouts of params and state.

  A data mesh keeps them replicated; a ``(data, model)`` mesh keeps every leaf
  where :mod:`~dpmuon_jax.distributed.sharding`'s rule puts it, on the way in
  and on the way out, and XLA partitions the release and the post-processing
  over ``'model'`` accordingly (the noise is the same array on any mesh).
  """
  if mesh is None:
    return jax.jit(step), jax.jit(chunk_sum)
  if MODEL_AXIS not in mesh.axis_names:
    out = replicated(mesh)
    return jax.jit(step, out_shardings=out), jax.jit(chunk_sum, out_shardings=out)

  def sharded_step(params, opt_state, batch, mask,
                   overflow: ClippedSum) -> tuple[StepOutput, jax.Array]:
    params, opt_state = constrain_train_state(mesh, params, opt_state)
    out, seal = step(params, opt_state, batch, mask, overflow)
    params, opt_state = constrain_train_state(mesh, out.params, out.opt_state)
    stats, seal = jax.lax.with_sharding_constraint((out.stats, seal), replicated(mesh))
    return StepOutput(params, opt_state, stats), seal

  def sharded_sum(params, opt_state, batch, mask) -> ClippedSum:
    return chunk_sum(*constrain_train_state(mesh, params, opt_state), batch, mask)

  return jax.jit(sharded_step), jax.jit(sharded_sum)
