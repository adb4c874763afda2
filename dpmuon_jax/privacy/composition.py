"""Composing per-example queries that are weighted sums of gradients.

Inner momentum ("Inner Momentum for DP-Muon", §4) averages an example's
gradients at the current and recent states, q_i = Σ_k w_k ∇ℓ(θ_{t−k}; x_i).
DiSK (Zhang et al., ICLR 2025, §3) replaces the gradient at θ_t by the
two-point query c ∇ℓ(θ_t + γ d_t; x_i) + (1 − c) ∇ℓ(θ_t; x_i). Their joint
query, the Kalman-filter + inner-momentum ablation of paper 2 (appendix C),
substitutes DiSK's query for the current-state term of inner momentum::

    q_i = w_0 [c ∇ℓ(θ_t + γ d_t; x_i) + (1 − c) ∇ℓ(θ_t; x_i)] + Σ_{k≥1} w_k ∇ℓ(θ_{t−k}; x_i)

(paper 2 does not write the joint query out; this is the reading where each
method keeps its own meaning: DiSK predicts the current gradient, inner
momentum averages it with the past ones). Both inputs are public
post-processing of earlier releases, and q_i is clipped as ONE vector by the
shared clipping code: sensitivity C, the accounting of one Gaussian release
per step, unchanged.

:func:`substitute_current` builds the joint :class:`~dpmuon_jax.privacy.query.QuerySpec`
from the two specs, as terms (:class:`~dpmuon_jax.privacy.query.GradientTerm`),
so the per-example path (:func:`~dpmuon_jax.privacy.query.terms_query`) and
ghost clipping compute the same query from one description.
"""

from __future__ import annotations

from typing import Any

import jax

from dpmuon_jax.privacy.query import GradientTerm, QuerySpec, terms_query

PyTree = Any


def _times(a: Any, b: Any) -> Any:
  """The product of two term weights, each a scalar or a pytree of per-leaf scalars."""
  a_leaf = jax.tree_util.treedef_is_leaf(jax.tree.structure(a))
  b_leaf = jax.tree_util.treedef_is_leaf(jax.tree.structure(b))
  if a_leaf and b_leaf:
    return a * b
  if a_leaf:
    return jax.tree.map(lambda w: a * w, b)
  if b_leaf:
    return jax.tree.map(lambda w: w * b, a)
  return jax.tree.map(lambda u, v: u * v, a, b)


def substitute_current(outer: QuerySpec, inner: QuerySpec) -> QuerySpec:
  """``outer``'s query with its gradient at θ_t replaced by ``inner``'s query.

  Args:
    outer: a spec with terms whose FIRST term is the gradient at the current
      parameters θ_t (the gradient query, inner momentum).
    inner: a spec with terms, a query that stands in for ∇ℓ(θ_t; x) (DiSK's).

  Returns:
    The joint spec: inputs ``(outer inputs, inner inputs)``, terms
    ``w_0 · inner terms`` followed by ``outer``'s other terms, and the
    per-example query built from those terms. With ``inner`` the gradient
    query this is ``outer``'s query; with ``outer`` the gradient query it is
    ``inner``'s.
  """
  if outer.terms is None or inner.terms is None:
    raise ValueError("Only queries given as weighted sums of gradients (QuerySpec.terms) "
                     "compose.")
  outer_terms, inner_terms = outer.terms, inner.terms

  def terms(inputs: tuple[PyTree, PyTree]) -> tuple[GradientTerm, ...]:
    (_, current_weight), *rest = outer_terms(inputs[0])
    substituted = tuple(GradientTerm(state, _times(current_weight, weight))
                        for state, weight in inner_terms(inputs[1]))
    return substituted + tuple(rest)

  def read_inputs(params: PyTree, opt_state: Any) -> tuple[PyTree, PyTree]:
    return outer.inputs(params, opt_state), inner.inputs(params, opt_state)

  return QuerySpec(lambda loss_fn: terms_query(loss_fn, terms), read_inputs, terms)
