"""Layer-wise selective orthogonalisation, decided from the release alone."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dpmuon_jax.transforms import selective as sel
from dpmuon_jax.transforms.buffer_noise import DP_MUON_BUFFER, NO_MOMENTUM
from dpmuon_jax.transforms.muon import scale_by_orthogonalization

S = 0.01  # per-entry noise std of the release
SHAPE = (48, 24)


def _inputs(seed=0):
  """A strong rank-1 signal plus noise on "signal", noise alone on "noise"."""
  rng = np.random.default_rng(seed)
  m, n = SHAPE
  edge = S * (math.sqrt(m) + math.sqrt(n))
  u, v = rng.standard_normal(m), rng.standard_normal(n)
  spike = 3 * edge * np.outer(u / np.linalg.norm(u), v / np.linalg.norm(v))
  return {
      "signal": jnp.asarray(spike + S * rng.standard_normal(SHAPE), jnp.float32),
      "noise": jnp.asarray(S * rng.standard_normal(SHAPE), jnp.float32),
  }


@pytest.mark.parametrize("test", [sel.GAP, sel.EDGE])
def test_orthogonalizes_only_layers_above_threshold(test):
  updates = _inputs()
  tx = sel.selective_orthogonalization(S, NO_MOMENTUM, test=test, margin=1.0 if test == sel.GAP
                                       else 1.05)
  out, state = tx.update(updates, tx.init(updates))
  ortho, _ = scale_by_orthogonalization().update(updates, None)
  np.testing.assert_array_equal(np.asarray(out["signal"]), np.asarray(ortho["signal"]))
  np.testing.assert_array_equal(np.asarray(out["noise"]), np.asarray(updates["noise"]))
  assert bool(state.orthogonalized["signal"][0]) and not bool(state.orthogonalized["noise"][0])


def test_decision_uses_only_the_release_and_per_step_buffer_noise():
  """A noiseless rank-1 input with gap g between s₀f(1)·edge and s₀f(2)·edge: passes at
  step 1, fails at step 2 (the EMA-Nesterov factor grows from 0.0975 towards 0.174)."""
  m, n = SHAPE
  edge = S * (math.sqrt(m) + math.sqrt(n))
  f1, f2 = float(DP_MUON_BUFFER.factor(1)), float(DP_MUON_BUFFER.factor(2))
  gap = 0.5 * (f1 + f2) * edge
  x = jnp.zeros(SHAPE).at[0, 0].set(gap)
  tx = sel.selective_orthogonalization(S, DP_MUON_BUFFER)
  update = jax.jit(tx.update)
  state = tx.init({"w": x})
  params_a = {"w": jnp.zeros(SHAPE)}
  params_b = {"w": jnp.full(SHAPE, 7.0)}
  out1, state = update({"w": x}, state, params_a)
  assert bool(state.orthogonalized["w"][0])
  out1b, _ = update({"w": x}, tx.init({"w": x}), params_b)  # params never enter the decision
  np.testing.assert_array_equal(np.asarray(out1["w"]), np.asarray(out1b["w"]))
  out2, state = update({"w": x}, state, params_a)
  assert not bool(state.orthogonalized["w"][0])
  np.testing.assert_array_equal(np.asarray(out2["w"]), np.asarray(x))
  assert int(state.count) == 2


def test_both_branches_advance_every_step():
  updates = _inputs(1)
  fallback = optax.trace(decay=0.9)
  tx = sel.selective_orthogonalization(S, NO_MOMENTUM, fallback=fallback)
  state = tx.init(updates)
  ref_state = fallback.init(updates)
  for _ in range(3):
    out, state = tx.update(updates, state)
    ref, ref_state = fallback.update(updates, ref_state)
  np.testing.assert_array_equal(np.asarray(out["noise"]), np.asarray(ref["noise"]))
  for a, b in zip(jax.tree.leaves(state.fallback), jax.tree.leaves(ref_state)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_batched_matrices_decide_separately():
  from optax.contrib import MuonDimensionNumbers

  inputs = _inputs(2)
  stacked = {"w": jnp.stack([inputs["signal"], inputs["noise"]])}  # (2, 48, 24)
  dims = MuonDimensionNumbers(reduction_axis=1, output_axis=2)
  tx = sel.selective_orthogonalization(S, NO_MOMENTUM, dimension_numbers=dims)
  out, state = tx.update(stacked, tx.init(stacked))
  np.testing.assert_array_equal(np.asarray(state.orthogonalized["w"]), [True, False])
  np.testing.assert_array_equal(np.asarray(out["w"][1]), np.asarray(stacked["w"][1]))
  sv = np.linalg.svd(np.asarray(out["w"][0], np.float64), compute_uv=False)
  assert sv.min() > 0.3  # orthogonalised: all singular values pushed towards 1


def test_invalid_options_raise():
  with pytest.raises(ValueError):
    sel.selective_orthogonalization(S, test="median")
  with pytest.raises(ValueError):
    sel.selective_orthogonalization(-1.0)
