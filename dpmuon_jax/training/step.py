"""One jit-compiled private training step (docs/design.md, "One training step").

    padded batch + mask ─► per-example query ─► clipped sum ─► release ─► optimizer

The padded batch has a static shape (the sampler's capacity), so the step
compiles once however many examples were sampled. When Poisson sampling draws
more examples than the capacity, the sampler returns extra chunks; their
clipped sums are computed by :attr:`PrivateStep.clipped_sum` and passed in as
``overflow``, so every sampled example enters the ONE release of the step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import optax

from dpmuon_jax.privacy.clipping import Clipping
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
    step: jitted; ``overflow`` is a :class:`ClippedSum` of extra chunks (use
      :attr:`empty_overflow` when there are none).
    clipped_sum: jitted ``(params, opt_state, batch, mask) -> ClippedSum`` for
      one chunk.
    empty_overflow: ``(params) -> ClippedSum`` of zeros.
  """

  step: Callable[..., StepOutput]
  clipped_sum: Callable[[PyTree, optax.OptState, PyTree, jax.Array], ClippedSum]
  empty_overflow: Callable[[PyTree], ClippedSum]

  def __call__(
      self, params: PyTree, opt_state: optax.OptState, chunks: Sequence[tuple[PyTree, jax.Array]]
  ) -> StepOutput:
    """Runs one release over all ``(batch, mask)`` chunks of a Poisson sample."""
    (batch, mask), *extra = chunks
    overflow = self.empty_overflow(params)
    for extra_batch, extra_mask in extra:
      overflow = overflow + self.clipped_sum(params, opt_state, extra_batch, extra_mask)
    return self.step(params, opt_state, batch, mask, overflow)


def make_private_step(
    optimizer: PrivateTransformation,
    loss_fn: LossFn | None = None,
    *,
    query: QueryFn | None = None,
    clipping: Clipping | None = None,
    microbatch_size: int | None = None,
) -> PrivateStep:
  """Builds the jitted private step for a ``dp_*`` optimizer.

  Args:
    optimizer: a complete private optimizer (contains the release).
    loss_fn: ``loss_fn(params, batch) -> scalar``; the optimizer's query
      (``optimizer.query``: the gradient, or DiSK's / inner momentum's
      combination) is built from it. Give either this or ``query``.
    query: a per-example query ``query(params, example) -> pytree`` used
      instead of the optimizer's (its inputs are the current parameters).
    clipping: the optimizer's own clipping rule (``optimizer.release.clipping``)
      is used; passing a different one is an error.
    microbatch_size: accumulate the clipped sum in chunks of this size.
  """
  if not isinstance(optimizer, PrivateTransformation):
    raise TypeError("make_private_step needs a private optimizer (a dp_* transformation).")
  if (loss_fn is None) == (query is None):
    raise ValueError("Give exactly one of loss_fn and query.")
  if query is None:
    spec = optimizer.query
    query = spec.make_query(loss_fn)
  else:
    spec = GRADIENT_QUERY
  clipping = optimizer_clipping(optimizer, clipping)

  def chunk_sum(params, opt_state, batch, mask) -> ClippedSum:
    inputs = spec.inputs(params, opt_state)
    return clipped_sum(query, inputs, batch, mask, clipping, microbatch_size)

  def step(params, opt_state, batch, mask, overflow: ClippedSum) -> StepOutput:
    total = chunk_sum(params, opt_state, batch, mask) + overflow
    updates, opt_state = optimizer.update(total, opt_state, params)
    return StepOutput(optax.apply_updates(params, updates), opt_state, total.stats)

  def empty_overflow(params) -> ClippedSum:
    return zeros_clipped_sum(params, clipping)

  return PrivateStep(jax.jit(step), jax.jit(chunk_sum), empty_overflow)
