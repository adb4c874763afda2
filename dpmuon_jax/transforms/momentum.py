"""Muon's momentum on the release G̃_t, without bias correction (paper 1, design 1).

::

    ``buffer="ema"``        M_t = β M_{t−1} + (1−β) G̃_t
    ``buffer="heavy_ball"`` M_t = β M_{t−1} + G̃_t
    output                  M_t, or with Nesterov look-ahead
                            M̂_t = (1−β) G̃_t + β M_t   (ema)
                            M̂_t = G̃_t + β M_t         (heavy_ball)

M₀ = 0. Unlike ``optax.contrib.muon`` there is no Adam-style bias correction:
it would amplify the first, noise-dominated steps, and neither Keller
Jordan's Muon nor paper 1 ("Spectral Gradient Orthogonalization Improves
Differentially Private Training at Scale") uses one. The scale of the buffer
does not matter before Newton–Schulz, which normalises by ‖·‖_F, but it does
for DP-Muon-S, which multiplies by σ₁ of the buffer.
"""

from __future__ import annotations

from typing import Any, Literal, NamedTuple, get_args

import jax
import jax.numpy as jnp
import optax

from dpmuon_jax import checks

PyTree = Any

Buffer = Literal["ema", "heavy_ball"]
"""The momentum buffer: M = βM + (1−β)G̃ (EMA) or M = βM + G̃ (heavy-ball)."""
EMA, HEAVY_BALL = get_args(Buffer)


class MuonMomentumState(NamedTuple):
  """The momentum buffer M_t (same tree as the parameters)."""

  mu: PyTree


def muon_momentum(
    beta: float = 0.95,
    nesterov: bool = True,
    buffer: Buffer = EMA,
    mu_dtype: jnp.dtype | None = None,
) -> optax.GradientTransformation:
  """Momentum M_t (or its Nesterov look-ahead M̂_t) of the updates, no bias correction.

  Args:
    beta: β in [0, 1).
    nesterov: output M̂_t instead of M_t.
    buffer: ``"ema"`` (paper 1: M = βM + (1−β)G̃) or ``"heavy_ball"``
      (M = βM + G̃, the un-normalised buffer).
    mu_dtype: dtype of the buffer; ``None``: the parameters' dtype.

  Returns:
    An ``optax.GradientTransformation``; outputs have the updates' dtypes.
  """
  checks.check_in_range("beta", beta, 0.0, 1.0, high_inclusive=False)
  if buffer not in (EMA, HEAVY_BALL):
    raise ValueError(f"buffer must be {EMA!r} or {HEAVY_BALL!r}, got {buffer!r}.")
  new_weight = 1.0 - beta if buffer == EMA else 1.0

  def init_fn(params):
    return MuonMomentumState(
        jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), mu_dtype or jnp.result_type(p)), params)
    )

  def update_fn(updates, state, params=None):
    del params
    mu = jax.tree.map(
        lambda m, g: (beta * m + new_weight * g).astype(m.dtype), state.mu, updates
    )
    out = mu
    if nesterov:
      out = jax.tree.map(lambda m, g: new_weight * g + beta * m, mu, updates)
    out = jax.tree.map(lambda o, g: o.astype(jnp.result_type(g)), out, updates)
    return out, MuonMomentumState(mu)

  return optax.GradientTransformation(init_fn, update_fn)
