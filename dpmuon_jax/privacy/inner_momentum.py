"""Inner momentum: each example's query averaged over recent model states (paper 2, §4.1).

DP-Muon-IM (paper 2, "Inner Momentum for Differentially Private Muon", §4;
after Xiao et al. 2023 and DP-PMLF) changes the per-example QUERY, not the
post-processing::

    q_i = Σ_{k=0}^{K_t} w_k ∇ℓ(θ_{t−k}; x_i),   w_k = γ^k / Σ_{j=0}^{K_t} γ^j,   K_t = min(K, t)

then q_i is clipped as ONE vector (flat over all leaves, by the existing
:func:`~dpmuon_jax.privacy.query.clipped_sum`), summed, noised with σC and
divided by D, exactly as for DP-Muon. The current state gets the largest
weight (γ < 1), as in DP-PMLF's paper (Xu et al., "Enhancing DPSGD via
Per-Sample Momentum and Low-Pass Filtering", AAAI 2026, Algorithm 1; their
published code reverses it; we follow the paper). Before K states exist
(t < K) only the available states are averaged, renormalised over j ≤ t (our
choice; DP-PMLF pre-fills the history with copies of θ₀).

Groups (paper 2, appendix C.1): the Muon group and the fallback group may use
their own (K, γ). For each past state k the FULL per-example gradient is
evaluated once; each leaf then takes the weights of its group, and the
combined pytree is clipped as one vector. Whatever K, each sampled example
contributes ONE clipped query of norm ≤ C, so the release and its accounting
are unchanged.

Privacy (paper 2, appendix E "Privacy and implementation conditions"; see
also docs/design.md, "Inner momentum"): the past states θ_{t−k} are
functions of earlier releases and public settings only, so this is adaptive
composition of the same Poisson-sampled Gaussian mechanism.
The states live in the optimizer's post-processing state: the
:func:`param_history` transform, placed in the private optimizer's chain,
stores the parameters it sees at update time (θ_t) in a ring buffer of K
slots; the query's inputs are read from it by :func:`inner_momentum_spec`.

Cost: (K_max + 1) gradient evaluations per example at every step (static
shapes: before K states exist the missing terms are computed on copies of θ₀
and weighted zero) and K_max stored copies of the parameters.

Paper 2's presets (appendix C; GPT-2-small on E2E / DART; "paper2" routing,
Muon on hidden matrices, AdamW on the rest; C = 1, denominators 1025 / 1027):

=================  ===============  =================  ==========================
preset             Muon (K, γ)      AdamW (K, γ)       note
=================  ===============  =================  ==========================
``e2e``            (4, 0.5)         (3, 0.5)           E2E, ε ∈ {1, 2, 4}
``e2e_eps8``       (4, 0.5)         (2, 0.5)           E2E, ε = 8 (lr 0.002/0.0035)
``dart``           (3, 0.7)         (3, 0.5)           DART, ε ∈ {1, 2, 4}
``diagnostic``     (4, 0.9)         (4, 0.9)           §5.3 / appendix D probes
=================  ===============  =================  ==========================

Appendix D's probes use Muon-only history; the AdamW entry of ``diagnostic``
is our choice for a training run with the same (K, γ) everywhere.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from dpmuon_jax import checks
from dpmuon_jax.privacy.query import LossFn, QueryFn, QuerySpec, add_batch_axis
from dpmuon_jax.transforms.routing import MUON, Routing, muon_labels

PyTree = Any


class InnerMomentumSettings(NamedTuple):
  """(K, γ) of the Muon group and of the fallback group; keyword arguments of
  :func:`dpmuon_jax.dp_muon_im` (``dp_muon_im(..., **preset._asdict())``)."""

  history: int
  decay: float
  fallback_history: int
  fallback_decay: float


PAPER2_PRESETS: dict[str, InnerMomentumSettings] = {
    "e2e": InnerMomentumSettings(4, 0.5, 3, 0.5),
    "e2e_eps8": InnerMomentumSettings(4, 0.5, 2, 0.5),
    "dart": InnerMomentumSettings(3, 0.7, 3, 0.5),
    "diagnostic": InnerMomentumSettings(4, 0.9, 4, 0.9),
}
"""Paper 2's (K, γ) per group (appendix C); see the module docstring."""


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


def inner_momentum_weights(count: jax.Array, history: int, decay: float, slots: int) -> jax.Array:
  """(w_0, …, w_slots) with w_k = γ^k·[k ≤ K_t] / Σ_{j ≤ K_t} γ^j, K_t = min(K, count).

  ``slots`` ≥ K pads the vector with zeros (the longest history of all groups).
  """
  k = jnp.arange(slots + 1)
  available = k <= jnp.minimum(history, count)
  raw = jnp.where(available, jnp.asarray(decay, jnp.float32) ** k, 0.0)
  return raw / jnp.sum(raw)


def _validate(history: int, decay: float, prefix: str = "") -> None:
  """K an int >= 0 and γ in (0, 1]: the current state weighs most (γ = 1: a plain average)."""
  checks.check_nonnegative_int(f"{prefix}history", history)
  checks.check_in_range(f"{prefix}decay", decay, 0.0, 1.0, low_inclusive=False)


def _group_settings(
    history: int, decay: float, fallback_history: int | None, fallback_decay: float | None
) -> InnerMomentumSettings:
  """Both groups' (K, γ), the fallback's defaulting to the Muon group's, validated."""
  fallback_history = history if fallback_history is None else fallback_history
  fallback_decay = decay if fallback_decay is None else fallback_decay
  _validate(history, decay)
  _validate(fallback_history, fallback_decay, "fallback_")
  return InnerMomentumSettings(history, decay, fallback_history, fallback_decay)


class InnerMomentumInputs(NamedTuple):
  """The public inputs of the inner-momentum query: θ_t and the history."""

  params: PyTree
  history: ParamHistoryState


def inner_momentum_query(
    loss_fn: LossFn,
    history: int,
    decay: float,
    fallback_history: int | None = None,
    fallback_decay: float | None = None,
    routing: Routing = "paper1",
) -> QueryFn:
  """q_i = Σ_k w^{(g)}_k ∇ℓ(θ_{t−k}; x_i), per leaf with the weights of its group g.

  Args:
    loss_fn: ``loss_fn(params, batch) -> scalar``, called on one example.
    history, decay: (K, γ) of the Muon group.
    fallback_history, fallback_decay: (K, γ) of the fallback group; ``None``:
      the Muon group's.
    routing: which leaves are in the Muon group (see
      :mod:`dpmuon_jax.transforms.routing`); it must match the optimizer's.

  Returns:
    ``query(inputs, example)`` with ``inputs`` an :class:`InnerMomentumInputs`
    whose history has at least max(K, K′) slots. With K = K′ = 0 this is the
    plain gradient times 1.0, i.e. bit-identical to the standard query.
  """
  history, decay, fallback_history, fallback_decay = _group_settings(
      history, decay, fallback_history, fallback_decay
  )
  slots = max(history, fallback_history)
  grad_fn = jax.grad(loss_fn)

  def query(inputs: InnerMomentumInputs, example: PyTree) -> PyTree:
    params, past = inputs
    batch = add_batch_axis(example)
    count = past.count
    weights = {
        True: inner_momentum_weights(count, history, decay, slots),
        False: inner_momentum_weights(count, fallback_history, fallback_decay, slots),
    }
    in_muon = jax.tree.map(lambda label: label == MUON, muon_labels(params, routing))
    num_slots = jax.tree.leaves(past.states)[0].shape[0] if jax.tree.leaves(past.states) else 0
    if num_slots < slots:
      raise ValueError(f"The parameter history has {num_slots} slots; this query needs {slots}.")

    def weighted(grads, k):
      # jnp.where, not a product: a zero-weight term must not turn NaN into the sum.
      return jax.tree.map(
          lambda g, m: jnp.where(weights[m][k] > 0, weights[m][k] * g, jnp.zeros_like(g)),
          grads, in_muon,
      )

    total = weighted(grad_fn(params, batch), 0)
    for k in range(1, slots + 1):
      slot = (count - k) % num_slots
      state_k = jax.tree.map(lambda h, i=slot: h[i], past.states)
      total = jax.tree.map(jnp.add, total, weighted(grad_fn(state_k, batch), k))
    return total

  return query


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


def inner_momentum_spec(
    history: int,
    decay: float,
    fallback_history: int | None = None,
    fallback_decay: float | None = None,
    routing: Routing = "paper1",
) -> QuerySpec:
  """The :class:`~dpmuon_jax.privacy.query.QuerySpec` of DP-Muon-IM.

  Its inputs are (θ_t, the :class:`ParamHistoryState` found in the optimizer
  state): both post-processing of earlier releases, never the noise stream.
  """
  _group_settings(history, decay, fallback_history, fallback_decay)  # validate eagerly
  make_query: Callable[[LossFn], QueryFn] = lambda loss_fn: inner_momentum_query(
      loss_fn, history, decay, fallback_history, fallback_decay, routing
  )
  inputs = lambda params, opt_state: InnerMomentumInputs(params, find_history(opt_state))
  return QuerySpec(make_query, inputs)
