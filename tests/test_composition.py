"""KF + IM: DiSK's query substituted for inner momentum's current term, one clip, one release."""

import chex
import jax
import jax.numpy as jnp
import pytest
from problems import history_after, quadratic_loss, random_tree, regression, release_noise_rms
from stats import std_interval

from dpmuon_jax.optimizers.filters import disk_query_spec
from dpmuon_jax.optimizers.options import Fallback
from dpmuon_jax.optimizers.paper2 import dp_disk_muon_im, inner_momentum_spec
from dpmuon_jax.privacy.clipping import flat_norm
from dpmuon_jax.privacy.composition import substitute_current
from dpmuon_jax.privacy.disk_query import disk_points, disk_weight
from dpmuon_jax.privacy.inner_momentum import InnerMomentumInputs
from dpmuon_jax.privacy.query import GRADIENT_QUERY, QuerySpec, gradient_query
from dpmuon_jax.training.step import make_private_step
from dpmuon_jax.transforms.history import find_history

KAPPA, GAMMA = 0.5, 0.8  # paper 2's KF baseline: c = 1.25


def _inputs(theta, past, update):
  inner = InnerMomentumInputs(theta, history_after(past, len(past)))
  return inner, disk_points(theta, update, GAMMA)


def test_joint_query_matches_the_hand_computed_formula():
  """K = 1, γ_IM = 0.5: w = (2/3, 1/3) and
  q = w_0 [c (θ + γd − x) + (1 − c)(θ − x)] + w_1 (θ_{t−1} − x)."""
  theta, previous, update, x = random_tree(1), random_tree(2), random_tree(3, 0.1), random_tree(4)
  joint = substitute_current(inner_momentum_spec(1, 0.5), disk_query_spec(KAPPA, GAMMA))
  got = joint.make_query(quadratic_loss)(_inputs(theta, [previous], update), x)
  c = disk_weight(KAPPA, GAMMA)
  want = jax.tree.map(
      lambda t, p, d, xi: 2 / 3 * (c * (t + GAMMA * d - xi) + (1 - c) * (t - xi))
      + 1 / 3 * (p - xi), theta, previous, update, x)
  chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-6)


def test_composing_with_the_gradient_query_changes_nothing():
  theta, previous, update, x = random_tree(1), random_tree(2), random_tree(3, 0.1), random_tree(4)
  im = inner_momentum_spec(1, 0.5)
  inputs = InnerMomentumInputs(theta, history_after([previous], 1))
  plain_inner = substitute_current(im, GRADIENT_QUERY)
  chex.assert_trees_all_close(plain_inner.make_query(quadratic_loss)((inputs, theta), x),
                              im.make_query(quadratic_loss)(inputs, x), rtol=1e-6)
  disk = disk_query_spec(KAPPA, GAMMA)
  points = disk_points(theta, update, GAMMA)
  plain_outer = substitute_current(GRADIENT_QUERY, disk)
  chex.assert_trees_all_close(plain_outer.make_query(quadratic_loss)((theta, points), x),
                              disk.make_query(quadratic_loss)(points, x), rtol=1e-6)


def test_queries_without_terms_do_not_compose():
  custom = QuerySpec(gradient_query, GRADIENT_QUERY.inputs)
  with pytest.raises(ValueError, match="terms"):
    substitute_current(custom, disk_query_spec(KAPPA, GAMMA))


def _trained(opt, loss, params, batch, steps=2):
  step = make_private_step(opt, loss)
  state, mask = opt.init(params), jnp.ones(64, bool)
  for _ in range(steps):
    params, state, _ = step(params, state, [(batch, mask)])
  return step, params, state


def test_each_example_is_one_query_clipped_to_c():
  """After two releases (history filled, d_t ≠ 0: three gradients per example, DiSK's
  current-point weight 1 − c = −0.25 negative), each example alone moves the clipped
  sum by ≤ C, and its query did exceed C."""
  params, batch, loss = regression()
  opt = dp_disk_muon_im(0.02, 1.0, 1.0, 50.0, key=5, history=1, kappa=KAPPA, gamma=GAMMA)
  step, params, state = _trained(opt, loss, params, batch)
  assert int(find_history(state).count) == 2
  for i in range(4):
    one = step.clipped_sum(params, state, batch, jnp.arange(64) == i)
    assert float(one.stats.num_clipped) == 1.0
    assert float(flat_norm(one.total)) <= 1.0 * (1 + 1e-5)


def test_the_release_adds_sigma_c_noise_once():
  """κ = 1 makes DiSK's filter the identity (g_t = G̃_t) and a momentum-free SGD
  fallback with lr 1 takes every leaf, so D·(θ_t − θ_{t+1}) − S_t is exactly the
  noise on the sum: N(0, (σC)²) per coordinate (two-sided χ² interval)."""
  c, sigma, d = 1.0, 2.0, 50.0
  params, batch, loss = regression()
  opt = dp_disk_muon_im(1.0, c, sigma, d, key=5, history=1, kappa=1.0, gamma=GAMMA,
                        routing=lambda path, leaf: False, fallback=Fallback(momentum=0.0))
  step, params, state = _trained(opt, loss, params, batch)
  mask = jnp.ones(64, bool)
  total = step.clipped_sum(params, state, batch, mask)
  new_params, _, _ = step(params, state, [(batch, mask)])
  rms = release_noise_rms(params, new_params, total.total, d)
  size = sum(x.size for x in jax.tree.leaves(params))
  lo, hi = std_interval(size, sigma * c)
  assert lo < rms < hi, (lo, rms, hi)
