"""The parameter history of inner momentum: past states θ_{t−1}, …, θ_{t−K} in the opt_state.

DP-Muon-IM (paper 2, "Inner Momentum for Differentially Private Muon", §4)
evaluates each example's gradient at recent model states. They are kept here,
as plain Optax post-processing: :func:`param_history`, placed in the private
optimizer's chain, stores the parameters it sees at update time (θ_t) in a
ring buffer of K slots. θ_t is a function of the releases before step t, so
keeping and reading it costs no privacy. :func:`find_history` reads the
buffer back out of a nested optimizer state for the query
(:mod:`dpmuon_jax.privacy.inner_momentum`), :func:`ordered_history` for
analysis.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

PyTree = Any


class ParamHistoryState(NamedTuple):
  """The last ``K`` parameter states θ_{t−1}, …, θ_{t−K} in a ring buffer.

  Attributes:
    states: pytree like the parameters, each leaf with a leading axis of K
      slots; slot ``(count − k) mod K`` holds θ_{t−k} for 1 ≤ k ≤ min(K, count).
    count: how many states have been stored (= releases made), int32.
  """

  states: PyTree
  count: jax.Array


def param_history(max_states: int) -> optax.GradientTransformation:
  """Stores the parameters θ_t it sees at update time; passes the updates through.

  Post-processing (no privacy cost): θ_t is a function of the releases before
  step t. Slots not yet written hold copies of θ₀ (so gradients there are
  finite); the query weights them zero.

  Args:
    max_states: K, the number of past states kept (0 keeps none).
  """
  if isinstance(max_states, bool) or int(max_states) != max_states or max_states < 0:
    raise ValueError(f"max_states must be a non-negative int, got {max_states!r}.")
  max_states = int(max_states)

  def init_fn(params):
    states = jax.tree.map(
        lambda p: jnp.broadcast_to(jnp.asarray(p), (max_states,) + jnp.shape(p)).copy(), params
    )
    return ParamHistoryState(states, jnp.zeros((), jnp.int32))

  def update_fn(updates, state, params=None):
    if params is None:
      raise ValueError("param_history needs the current params in update(updates, state, params).")
    if max_states == 0:
      return updates, ParamHistoryState(state.states, state.count + 1)
    slot = state.count % max_states
    states = jax.tree.map(
        lambda h, p: h.at[slot].set(jnp.asarray(p, h.dtype)), state.states, params
    )
    return updates, ParamHistoryState(states, state.count + 1)

  return optax.GradientTransformation(init_fn, update_fn)


def _search_history(opt_state: Any) -> ParamHistoryState | None:
  if isinstance(opt_state, ParamHistoryState):
    return opt_state
  if isinstance(opt_state, dict):
    children = tuple(opt_state.values())
  elif isinstance(opt_state, (tuple, list)):
    children = tuple(opt_state)
  else:
    children = ()
  for child in children:
    found = _search_history(child)
    if found is not None:
      return found
  return None


def find_history(opt_state: Any) -> ParamHistoryState:
  """The (first) :class:`ParamHistoryState` inside a nested optimizer state."""
  found = _search_history(opt_state)
  if found is None:
    raise LookupError("No ParamHistoryState in the optimizer state; chain param_history().")
  return found


def ordered_history(opt_state: Any) -> list[PyTree]:
  """[θ_{t−1}, θ_{t−2}, …, θ_{t−K_t}] from the ring buffer in ``opt_state``, most recent first."""
  history = find_history(opt_state)
  count = int(history.count)
  slots = jax.tree.leaves(history.states)[0].shape[0]
  return [jax.tree.map(lambda s, k=k: s[(count - k) % slots], history.states)
          for k in range(1, min(count, slots) + 1)]
