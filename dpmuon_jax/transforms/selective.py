"""Layer-wise selective orthogonalisation (paper 1's "future work").

Paper 1 is "Spectral Gradient Orthogonalization Improves Differentially Private
Training at Scale"; this is a direction its "Limitations & Future Work" names.

Paper 1's Prop. 1 says orthogonalisation helps a layer only above the recovery
threshold σ₁(G) − σ₂(G) > ‖N‖₂ ≈ s(√m+√n). This transform decides, for every
matrix at every step, FROM THE MATRIX IT IS GIVEN ALONE (post-processing of the
release: no privacy cost, no probe data), whether to orthogonalise it::

    s_t  = noise_std · buffer.factor(t)        (known noise std of the input)
    edge = s_t (√m + √n)
    test "gap":  σ₁(Y) − σ₂(Y) > margin · edge      (Prop. 1 evaluated on the input Y)
    test "edge": σ₁(Y) > margin · edge              (a spike above the Marchenko–Pastur edge)

A passing matrix takes the ``orthogonal`` branch's output (default
:func:`~dpmuon_jax.transforms.muon.scale_by_orthogonalization`), a failing one the
``fallback`` branch's (default the input itself: a momentum-SGD step). Both
branches run on every step, so their states advance identically whatever the
decisions. The "gap" test is conservative: for pure noise σ₁ − σ₂ is a small
fraction of the edge, and a clean gap g raises it by about g.

Chain it after the momentum whose buffer it transforms, e.g.
``optax.chain(muon_momentum(0.95, True), selective_orthogonalization(σC/D,
BufferSpec(0.95, "ema", True)))``, so the input is the matrix Newton–Schulz
sees and s_t its exact per-step noise std. Branch outputs usually have
different scales (NS output vs gradient scale): put a relative scale in the
``fallback`` branch (e.g. ``optax.scale(η′/η)``).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from dpmuon_jax import checks
from dpmuon_jax.linalg.newton_schulz import NewtonSchulz
from dpmuon_jax.linalg.scaling import (
  DimensionNumbers,
  dimension_numbers_fn,
  matrix_view,
  path_names,
)
from dpmuon_jax.transforms.buffer_noise import DP_MUON_BUFFER, BufferSpec
from dpmuon_jax.transforms.muon import scale_by_orthogonalization

PyTree = Any

GAP = "gap"
EDGE = "edge"


class SelectiveState(NamedTuple):
  """Step count, both branches' states, and the last decisions (public: from the release)."""

  count: jax.Array  # int32
  orthogonal: optax.OptState
  fallback: optax.OptState
  orthogonalized: PyTree  # per leaf, bool (batch,) of the last step's decisions


def _top_two(m: jax.Array) -> tuple[jax.Array, jax.Array]:
  s = jnp.linalg.svd(m.astype(jnp.promote_types(m.dtype, jnp.float32)), compute_uv=False)
  return s[0], (s[1] if s.shape[0] > 1 else jnp.zeros_like(s[0]))


def _check_test(test: str) -> None:
  if test not in (GAP, EDGE):
    raise ValueError(f"test must be {GAP!r} or {EDGE!r}, got {test!r}.")


def orthogonalization_test(
    matrix: jax.Array, noise_std: jax.Array | float, test: str = GAP, margin: float = 1.0
) -> jax.Array:
  """Whether one 2-D matrix passes the release-only threshold test (see the module doc)."""
  _check_test(test)
  m, n = matrix.shape
  edge = margin * noise_std * (math.sqrt(m) + math.sqrt(n))
  s1, s2 = _top_two(matrix)
  return (s1 - s2 if test == GAP else s1) > edge


def selective_orthogonalization(
    noise_std: float,
    buffer: BufferSpec = DP_MUON_BUFFER,
    orthogonal: optax.GradientTransformation | None = None,
    fallback: optax.GradientTransformation | None = None,
    test: str = GAP,
    margin: float = 1.0,
    dimension_numbers: DimensionNumbers = None,
) -> optax.GradientTransformation:
  """Orthogonalise only the matrices that pass the threshold test; the rest take ``fallback``.

  Args:
    noise_std: s₀ = σC/D of the release (public).
    buffer: the momentum that produced the input (default DP-Muon's Nesterov
      EMA, β = 0.95); :data:`dpmuon_jax.transforms.buffer_noise.NO_MOMENTUM` if
      the input is the release itself.
    orthogonal: the spectral step (default ``scale_by_orthogonalization()``).
    fallback: the step for failing matrices (default identity).
    test: ``"gap"`` (default) or ``"edge"``.
    margin: multiplies the edge s_t(√m+√n); finite and >= 0.
    dimension_numbers: per-leaf matrix views; every leaf must have rank ≥ 2.
  """
  checks.check_nonnegative("noise_std", noise_std)
  checks.check_nonnegative("margin", margin)
  _check_test(test)
  orthogonal = orthogonal or scale_by_orthogonalization(
      NewtonSchulz(dimension_numbers=dimension_numbers))
  fallback = fallback or optax.identity()
  spec_fn = dimension_numbers_fn(dimension_numbers)

  def view_of(path, leaf):
    if jnp.ndim(leaf) < 2:
      raise ValueError(f"Leaf {'/'.join(path_names(path))} has rank < 2; route it elsewhere.")
    return matrix_view(jnp.shape(leaf), spec_fn(path_names(path), leaf))

  def init_fn(params):
    decisions = jax.tree_util.tree_map_with_path(
        lambda p, x: jnp.zeros((view_of(p, x).batch,), jnp.bool_), params)
    return SelectiveState(jnp.zeros((), jnp.int32), orthogonal.init(params), fallback.init(params),
                          decisions)

  def update_fn(updates, state, params=None):
    count = state.count + 1
    s = noise_std * buffer.factor(count)

    def decide(path, g):
      mats = view_of(path, g).to_matrices(g)
      return jax.vmap(lambda m: orthogonalization_test(m, s, test, margin))(mats)

    decisions = jax.tree_util.tree_map_with_path(decide, updates)
    ortho, ortho_state = orthogonal.update(updates, state.orthogonal, params)
    other, fallback_state = fallback.update(updates, state.fallback, params)

    def select(path, g, o, f, d):
      view = view_of(path, g)
      chosen = jnp.where(d[:, None, None], view.to_matrices(o), view.to_matrices(f))
      return view.from_matrices(chosen).astype(g.dtype)

    out = jax.tree_util.tree_map_with_path(select, updates, ortho, other, decisions)
    return out, SelectiveState(count, ortho_state, fallback_state, decisions)

  return optax.GradientTransformation(init_fn, update_fn)
