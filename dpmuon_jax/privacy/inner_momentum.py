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
``param_history`` transform (:mod:`dpmuon_jax.transforms.history`), placed in
the private optimizer's chain, stores the parameters it sees at update time
(θ_t) in a ring buffer of K slots. This module holds the query's math on
explicit inputs (θ_t, that ring buffer, the weights, which leaves form the
Muon group); DP-Muon-IM's ``QuerySpec`` (``dpmuon_jax.optimizers.paper2``) reads
the inputs out of the optimizer state and the routing.

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

from dpmuon_jax import checks
from dpmuon_jax.privacy.query import GradientTerm, LossFn, QueryFn, terms_query

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


def inner_momentum_settings(
    history: int, decay: float, fallback_history: int | None, fallback_decay: float | None
) -> InnerMomentumSettings:
  """Both groups' (K, γ), the fallback's defaulting to the Muon group's, validated."""
  fallback_history = history if fallback_history is None else fallback_history
  fallback_decay = decay if fallback_decay is None else fallback_decay
  _validate(history, decay)
  _validate(fallback_history, fallback_decay, "fallback_")
  return InnerMomentumSettings(history, decay, fallback_history, fallback_decay)


class InnerMomentumInputs(NamedTuple):
  """The public inputs of the inner-momentum query: θ_t and the history.

  Attributes:
    params: θ_t.
    history: the ring buffer of past states, with ``states`` (a pytree like
      the parameters, each leaf with a leading axis of K slots; slot
      ``(count − k) mod K`` holds θ_{t−k} for 1 ≤ k ≤ min(K, count)) and
      ``count`` (states stored so far), e.g. the
      :class:`~dpmuon_jax.transforms.history.ParamHistoryState` of
      ``param_history``.
  """

  params: PyTree
  history: Any


MuonGroup = Callable[[PyTree], PyTree]
"""``in_muon_group(params)``: a pytree like ``params`` of Python bools, True for
the leaves that take the Muon group's (K, γ)."""


def grouped_inner_momentum_query(
    loss_fn: LossFn,
    in_muon_group: MuonGroup,
    history: int,
    decay: float,
    fallback_history: int | None = None,
    fallback_decay: float | None = None,
) -> QueryFn:
  """q_i = Σ_k w^{(g)}_k ∇ℓ(θ_{t−k}; x_i), per leaf with the weights of its group g.

  Args:
    loss_fn: ``loss_fn(params, batch) -> scalar``, called on one example.
    in_muon_group: which leaves are in the Muon group (a :data:`MuonGroup`,
      evaluated on θ_t); it must match the optimizer's routing.
    history, decay: (K, γ) of the Muon group.
    fallback_history, fallback_decay: (K, γ) of the fallback group; ``None``:
      the Muon group's.

  Returns:
    ``query(inputs, example)`` with ``inputs`` an :class:`InnerMomentumInputs`
    whose history has at least max(K, K′) slots: the per-example form of
    :func:`inner_momentum_terms` (summed in float32, cast to the parameters'
    dtypes). With K = K′ = 0 this is the plain gradient times 1.0, i.e.
    bit-identical to the standard query for float32 parameters.
  """
  terms = inner_momentum_terms(in_muon_group, history, decay, fallback_history, fallback_decay)
  return terms_query(loss_fn, terms)


def inner_momentum_terms(
    in_muon_group: MuonGroup,
    history: int,
    decay: float,
    fallback_history: int | None = None,
    fallback_decay: float | None = None,
) -> Callable[[InnerMomentumInputs], tuple[GradientTerm, ...]]:
  """``inputs -> terms`` of :func:`grouped_inner_momentum_query` as a weighted sum of gradients.

  One :class:`~dpmuon_jax.privacy.query.GradientTerm` per state θ_{t−k},
  0 ≤ k ≤ max(K, K′), each leaf weighted by its group's w_k (zero past the
  stored history): the form that ghost clipping computes.
  """
  settings = inner_momentum_settings(history, decay, fallback_history, fallback_decay)
  slots = max(settings.history, settings.fallback_history)

  def terms(inputs: InnerMomentumInputs) -> tuple[GradientTerm, ...]:
    params, past = inputs
    weights = {
        True: inner_momentum_weights(past.count, settings.history, settings.decay, slots),
        False: inner_momentum_weights(past.count, settings.fallback_history,
                                      settings.fallback_decay, slots),
    }
    num_slots = jax.tree.leaves(past.states)[0].shape[0] if jax.tree.leaves(past.states) else 0
    if num_slots < slots:
      raise ValueError(f"The parameter history has {num_slots} slots; this query needs {slots}.")
    in_muon = in_muon_group(params)
    out = [GradientTerm(params, jax.tree.map(lambda m: weights[m][0], in_muon))]
    for k in range(1, slots + 1):
      state = jax.tree.map(lambda h, i=(past.count - k) % num_slots: h[i], past.states)
      out.append(GradientTerm(state, jax.tree.map(lambda m, k=k: weights[m][k], in_muon)))
    return tuple(out)

  return terms
