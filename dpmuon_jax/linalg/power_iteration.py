"""σ₁ by warm-started power iteration (DP-Muon-S, paper 1 design 4).

For a matrix X with rows ≤ cols (the wide orientation, as in Newton–Schulz)
and a unit vector u on the short side, ::

    u ← X Xᵀ u / ‖X Xᵀ u‖    (k times),      σ̂₁ = ‖Xᵀ u‖ ≤ σ₁(X).

Each step contracts the angle to the top left singular vector by (σ₂/σ₁)², so
starting from the previous optimizer step's vector (the momentum buffer
changes slowly) a few iterations per step suffice. Paper 1 does not say how it
computes σ₁; the exact SVD is an option for checks.

A zero vector (the initial state) starts from the column of X with the largest
norm: a deterministic, data-derived start (X is post-processing of the
release, so this costs no privacy and needs no key).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_TINY = 1e-30


def _normalise(u: jax.Array) -> jax.Array:
  return u / jnp.maximum(jnp.linalg.norm(u), _TINY)


def _wide(x: jax.Array) -> jax.Array:
  return x.T if x.shape[0] > x.shape[1] else x


def start_vector(x: jax.Array) -> jax.Array:
  """The unit column of wide ``x`` with the largest norm (zero if ``x`` is zero)."""
  x = _wide(x)
  column = jnp.argmax(jnp.sum(jnp.square(x), axis=0))
  return _normalise(x[:, column])


def power_iteration(x: jax.Array, u: jax.Array, iterations: int) -> tuple[jax.Array, jax.Array]:
  """σ̂₁(x) and the updated unit vector after ``iterations`` warm-started steps.

  Args:
    x: a 2-D matrix (either orientation).
    u: the previous vector, of length min(x.shape); a zero vector restarts from
      :func:`start_vector`.
    iterations: k ≥ 1, fixed (static).

  Returns:
    (σ̂₁, u) in x's (float) dtype; σ̂₁ is a lower bound on σ₁.
  """
  if iterations < 1:
    raise ValueError(f"iterations must be >= 1, got {iterations}.")
  x = _wide(x)
  u = jnp.where(jnp.linalg.norm(u) > 0, u.astype(x.dtype), start_vector(x))

  def body(_, u):
    return _normalise(x @ (x.T @ u))

  u = jax.lax.fori_loop(0, iterations, body, u, unroll=True)
  return jnp.linalg.norm(x.T @ u), u


def exact_top_singular(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """σ₁(x) and its left singular vector on the short side, by SVD."""
  x = _wide(x)
  u, s, _ = jnp.linalg.svd(x, full_matrices=False)
  return s[0], u[:, 0]
