"""DP-Muon-IM: the inner-momentum query, its weights, history, clipping and release."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from problems import history_after, quadratic_loss, random_tree, regression, release_noise_rms
from stats import std_interval

from dpmuon_jax.optimizers.muon import dp_muon
from dpmuon_jax.optimizers.options import Fallback
from dpmuon_jax.optimizers.paper2 import dp_muon_im, inner_momentum_query
from dpmuon_jax.privacy.clipping import flat_clipping, flat_norm
from dpmuon_jax.privacy.inner_momentum import (
    PAPER2_PRESETS,
    InnerMomentumInputs,
    inner_momentum_weights,
)
from dpmuon_jax.privacy.query import GRADIENT_QUERY, clipped_sum
from dpmuon_jax.privacy.release import privatize
from dpmuon_jax.training.step import make_private_step
from dpmuon_jax.transforms.history import find_history, param_history


def _weighted(states_newest_first, weights, x):
  return jax.tree.map(
      lambda xi, *thetas: sum(w * (t - xi) for w, t in zip(weights, thetas)),
      x, *states_newest_first,
  )


def test_k2_weights_current_state_first_and_hand_computed_query():
  g = 0.5
  w = np.array([1.0, g, g * g]) / (1 + g + g * g)
  np.testing.assert_allclose(inner_momentum_weights(jnp.asarray(7), 2, g, 2), w, rtol=1e-6)
  # Five states stored in a ring of 2 slots (wraps around); the current one is θ₅.
  thetas = [random_tree(i) for i in range(6)]
  hist = history_after(thetas[:5], 2)
  assert int(hist.count) == 5
  x = random_tree(10)
  query = jax.jit(inner_momentum_query(quadratic_loss, 2, g))
  got = query(InnerMomentumInputs(thetas[5], hist), x)
  want = _weighted([thetas[5], thetas[4], thetas[3]], w, x)
  chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-6)
  wrong_order = _weighted([thetas[3], thetas[4], thetas[5]], w, x)
  assert not np.allclose(got["w"], wrong_order["w"], atol=1e-3)


@pytest.mark.parametrize("stored", [0, 1, 2])
def test_before_k_states_only_available_ones_are_averaged(stored):
  g, k_max = 0.7, 4
  thetas = [random_tree(i) for i in range(stored + 1)]
  hist = history_after(thetas[:stored], k_max) if stored else param_history(k_max).init(thetas[0])
  x = random_tree(10)
  got = inner_momentum_query(quadratic_loss, k_max, g)(InnerMomentumInputs(thetas[-1], hist), x)
  raw = np.array([g**k for k in range(stored + 1)])
  want = _weighted(thetas[::-1], raw / raw.sum(), x)
  chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-6)


def test_groups_use_their_own_history_and_decay():
  """Rank-2 leaf ``w`` is in the Muon group ("paper1"), ``b`` in the fallback group."""
  thetas = [random_tree(i) for i in range(4)]
  hist = history_after(thetas[:3], 3)
  x = random_tree(10)
  query = inner_momentum_query(quadratic_loss, 3, 0.5, fallback_history=1, fallback_decay=0.9)
  got = query(InnerMomentumInputs(thetas[3], hist), x)
  wm = np.array([1, 0.5, 0.25, 0.125]) / 1.875
  wf = np.array([1, 0.9]) / 1.9
  np.testing.assert_allclose(
      got["w"], sum(wm[k] * (thetas[3 - k]["w"] - x["w"]) for k in range(4)), rtol=1e-5)
  np.testing.assert_allclose(
      got["b"], sum(wf[k] * (thetas[3 - k]["b"] - x["b"]) for k in range(2)), rtol=1e-5)


def test_the_average_is_clipped_not_each_term():
  """Per-state gradients a (current) and −2a (previous), ‖a‖ = 10 ≫ C = 1, weights
  (2/3, 1/3): the average is 0, so its clipped version is ~0; clipping each term
  first would give (2/3 − 1/3)·C·â, of norm C/3."""
  a = random_tree(1)
  a = jax.tree.map(lambda v: 10.0 * v / flat_norm(a), a)
  x = {k: jnp.zeros((1,) + v.shape) for k, v in a.items()}  # one example: x = 0
  current, previous = a, jax.tree.map(lambda v: -2.0 * v, a)  # ∇ℓ(θ; x) = θ
  hist = history_after([previous], 1)
  query = inner_momentum_query(quadratic_loss, 1, 0.5)
  total = clipped_sum(query, InnerMomentumInputs(current, hist), x, None, 1.0)
  assert float(flat_norm(total.total)) < 1e-5
  clip = flat_clipping(1.0).clip
  per_term = jax.tree.map(lambda u, v: 2 / 3 * u + 1 / 3 * v,
                          clip(current).clipped, clip(previous).clipped)
  np.testing.assert_allclose(float(flat_norm(per_term)), 1 / 3, rtol=1e-4)


def test_k_ge_1_each_example_clipped_to_c_and_release_noise_std_is_sigma_c_over_d():
  """Everything routed to a momentum-free SGD fallback with lr 1, so the step is
  θ_{t+1} = θ_t − G̃_t and D·(θ_t − θ_{t+1}) − S_t is exactly the noise on the sum."""
  c, sigma, d = 1.0, 2.0, 50.0
  params, batch, loss = regression()
  opt = dp_muon_im(1.0, c, sigma, d, key=5, history=2, decay=0.5,
                   routing=lambda path, leaf: False, fallback=Fallback(momentum=0.0))
  step = make_private_step(opt, loss)
  state = opt.init(params)
  mask = jnp.ones(64, bool)
  for _ in range(2):  # fill the history (t = 2: three states averaged)
    params, state, _ = step(params, state, [(batch, mask)])
  assert int(find_history(state).count) == 2
  for i in range(4):  # each example alone: one clipped query of norm ≤ C
    one = step.clipped_sum(params, state, batch, jnp.arange(64) == i)
    assert float(one.stats.num_clipped) == 1.0  # the query exceeded C before clipping
    assert float(flat_norm(one.total)) <= c * (1 + 1e-5)
  total = step.clipped_sum(params, state, batch, mask)
  new_params, _, _ = step(params, state, [(batch, mask)])
  rms = release_noise_rms(params, new_params, total.total, d)
  size = sum(x.size for x in jax.tree.leaves(params))
  lo, hi = std_interval(size, sigma * c)
  assert lo < rms < hi, (lo, rms, hi)


def test_k0_equals_dp_muon_bit_for_bit():
  params, batch, loss = regression(n=16, d_in=8, d_out=6)
  mask = jnp.ones(16, bool)
  out = []
  for opt in (dp_muon(0.05, 1.0, 1.0, 16.0, key=9),
              dp_muon_im(0.05, 1.0, 1.0, 16.0, key=9, history=0, fallback_history=0)):
    step, p = make_private_step(opt, loss), params
    s = opt.init(p)
    for _ in range(3):
      p, s, _ = step(p, s, [(batch, mask)])
    out.append(p)
  chex.assert_trees_all_equal(out[0], out[1])
  assert not np.array_equal(out[0]["dense"]["kernel"], params["dense"]["kernel"])


def test_history_k1_changes_the_trajectory():
  params, batch, loss = regression(n=16, d_in=8, d_out=6)
  mask = jnp.ones(16, bool)
  out = []
  for k in (0, 1):
    opt = dp_muon_im(0.05, 1.0, 0.5, 16.0, key=9, history=k)
    step, p = make_private_step(opt, loss), params
    s = opt.init(p)
    for _ in range(3):
      p, s, _ = step(p, s, [(batch, mask)])
    out.append(p)
  assert not np.allclose(out[0]["dense"]["kernel"], out[1]["dense"]["kernel"])


def test_post_processing_chained_after_dp_muon_im_keeps_its_query():
  params, batch, loss = regression(n=16, d_in=8, d_out=6)
  mask = jnp.ones(16, bool)
  im = dp_muon_im(0.05, 1.0, 0.5, 16.0, key=9, history=1)
  chained = privatize(dp_muon_im(0.05, 1.0, 0.5, 16.0, key=9, history=1), optax.identity())
  assert chained.query is not GRADIENT_QUERY
  out = []
  for opt in (im, chained):
    step, p = make_private_step(opt, loss), params
    s = opt.init(p)
    for _ in range(3):
      p, s, _ = step(p, s, [(batch, mask)])
    out.append(p)
  chex.assert_trees_all_close(out[0], out[1], rtol=1e-6)
  with pytest.raises(ValueError, match="already privatises a query of its own"):
    privatize(im, optax.identity(), query=GRADIENT_QUERY)


def test_presets_and_validation():
  assert PAPER2_PRESETS["e2e"]._asdict() == dict(
      history=4, decay=0.5, fallback_history=3, fallback_decay=0.5)
  assert tuple(PAPER2_PRESETS["dart"]) == (3, 0.7, 3, 0.5)
  assert tuple(PAPER2_PRESETS["e2e_eps8"]) == (4, 0.5, 2, 0.5)
  opt = dp_muon_im(0.002, 1.0, 1.0, 1025.0, key=0, routing="paper2",
                   fallback=Fallback(kind="adamw", learning_rate=0.0035),
                   **PAPER2_PRESETS["e2e"]._asdict())
  state = opt.init({"h": {"kernel": jnp.zeros((4, 4))}, "head": {"kernel": jnp.zeros((4, 2))}})
  assert jax.tree.leaves(find_history(state).states)[0].shape[0] == 4  # max(K, K′) slots
  with pytest.raises(ValueError, match="history"):
    inner_momentum_query(quadratic_loss, -1, 0.5)
  with pytest.raises(ValueError, match="decay"):
    inner_momentum_query(quadratic_loss, 1, -0.5)
  with pytest.raises(LookupError):
    find_history((1, {"a": 2}))
