"""Matrix views, aspect factors, momentum, DP-Muon / DP-Muon-S post-processing, power iteration."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from optax.contrib import MuonDimensionNumbers

from dpmuon_jax.linalg.newton_schulz import newton_schulz as _newton_schulz
from dpmuon_jax.linalg.power_iteration import exact_top_singular, power_iteration
from dpmuon_jax.linalg.scaling import aspect_factor, matrix_view
from dpmuon_jax.optimizers.classic import dp_sgd
from dpmuon_jax.optimizers.muon import dp_muon, dp_muon_s
from dpmuon_jax.optimizers.options import Fallback, NewtonSchulz
from dpmuon_jax.privacy.release import dp_release
from dpmuon_jax.transforms.momentum import muon_momentum
from dpmuon_jax.transforms.muon import (
  scale_by_muon,
  scale_by_muon_s,
  scale_by_orthogonalization,
)


def _normal(shape, seed):
  """Standard normal float32 test input (numpy: eager jax.random compiles per shape)."""
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


newton_schulz = jax.jit(_newton_schulz)  # one compile per shape instead of one per primitive

# ----------------------------------------------------------------------------- views and scaling


@pytest.mark.parametrize(
    "shape, fan_in, fan_out, factor",
    [
        ((64, 1024), 64, 1024, 2.0),  # ratio 16, capped at 4
        ((1024, 64), 1024, 64, 1.0),
        ((3, 3, 16, 64), 144, 64, 1.0),
        ((64, 128), 64, 128, math.sqrt(2.0)),
    ],
)
def test_aspect_factor_of_flax_layouts(shape, fan_in, fan_out, factor):
  view = matrix_view(shape)
  assert (view.batch, view.fan_in, view.fan_out) == (1, fan_in, fan_out)
  assert aspect_factor(view.fan_in, view.fan_out) == pytest.approx(factor)


def test_uncapped_aspect_factor_for_muon_s():
  assert aspect_factor(64, 1024, max_ratio=None) == pytest.approx(4.0)
  assert aspect_factor(1024, 64, max_ratio=None) == 1.0


def test_conv_view_is_kh_kw_cin_by_cout_and_round_trips():
  x = jnp.arange(3 * 3 * 2 * 5.0).reshape(3, 3, 2, 5)
  view = matrix_view(x.shape)
  m = view.to_matrices(x)
  assert m.shape == (1, 18, 5)
  np.testing.assert_array_equal(m[0], x.reshape(18, 5))
  np.testing.assert_array_equal(view.from_matrices(m), x)


def test_dimension_numbers_override_with_batch_axis():
  # Attention-style kernel (heads, d_in, d_out): axis 0 is a batch of matrices.
  x = _normal((3, 8, 12), 0)
  spec = MuonDimensionNumbers(reduction_axis=1, output_axis=2)
  view = matrix_view(x.shape, spec)
  assert (view.batch, view.fan_in, view.fan_out) == (3, 8, 12)
  np.testing.assert_array_equal(view.from_matrices(view.to_matrices(x)), x)
  tx = scale_by_orthogonalization(NewtonSchulz(dimension_numbers={"w": spec}))
  out, _ = jax.jit(tx.update)({"w": x}, tx.init({"w": x}))
  factor = math.sqrt(12 / 8)
  for h in range(3):
    np.testing.assert_allclose(out["w"][h], factor * newton_schulz(x[h]), atol=1e-6)
  # Output axis first: (out, in) storage gives the physical fan_out/fan_in.
  view = matrix_view((1024, 64), MuonDimensionNumbers(reduction_axis=1, output_axis=0))
  assert aspect_factor(view.fan_in, view.fan_out) == 2.0


def test_rank_one_leaf_is_refused_with_a_routing_hint():
  tx = scale_by_orthogonalization()
  with pytest.raises(ValueError, match="fallback"):
    tx.update({"bias": jnp.ones(3)}, tx.init({"bias": jnp.ones(3)}))


# ----------------------------------------------------------------------------- momentum


def _run(tx, grads):
  state = tx.init(grads[0])
  outs = []
  for g in grads:
    out, state = tx.update(g, state)
    outs.append(float(out))
  return outs, state


@pytest.mark.parametrize(
    "buffer, nesterov, expected",
    [
        ("ema", False, [0.5, 1.25, 2.125]),  # M = βM + (1−β)g
        ("ema", True, [0.75, 1.625, 2.5625]),  # (1−β)g + βM
        ("heavy_ball", False, [1.0, 2.5, 4.25]),  # M = βM + g
        ("heavy_ball", True, [1.5, 3.25, 5.125]),  # g + βM
    ],
)
def test_momentum_against_hand_computed_sequence(buffer, nesterov, expected):
  grads = [jnp.asarray(1.0), jnp.asarray(2.0), jnp.asarray(3.0)]
  outs, state = _run(muon_momentum(0.5, nesterov, buffer), grads)
  np.testing.assert_allclose(outs, expected, rtol=1e-6)
  assert float(state.mu) == pytest.approx({"ema": 2.125, "heavy_ball": 4.25}[buffer])


def test_momentum_has_no_bias_correction():
  # optax.contrib.muon would divide by (1 − β^t); paper 1 does not.
  out, _ = _run(muon_momentum(0.95, nesterov=False), [jnp.asarray(1.0)])
  assert out[0] == pytest.approx(0.05)


def test_momentum_buffer_dtype():
  tx = muon_momentum(mu_dtype=jnp.float32)
  g = jnp.ones((2, 2), jnp.bfloat16)
  out, state = tx.update(g, tx.init(g))
  assert state.mu.dtype == jnp.float32 and out.dtype == jnp.bfloat16


# ----------------------------------------------------------------------------- DP-Muon, DP-Muon-S


def _grads(shape, steps, seed=0):
  return [_normal(shape, 1000 * seed + k) for k in range(steps)]


def test_scale_by_muon_matches_hand_computed_pipeline():
  beta, shape = 0.9, (8, 32)  # fan_out/fan_in = 4 → factor 2
  grads = _grads(shape, 3)
  tx = scale_by_muon(beta=beta)
  state, update = tx.init(grads[0]), jax.jit(tx.update)
  m = np.zeros(shape)
  for g in grads:
    out, state = update(g, state)
    m = beta * m + (1 - beta) * np.asarray(g)
    look_ahead = (1 - beta) * np.asarray(g) + beta * m
    ref = 2.0 * newton_schulz(jnp.asarray(look_ahead, jnp.float32))
    np.testing.assert_allclose(out, ref, atol=1e-5)


@pytest.mark.parametrize("buffer", ["ema", "heavy_ball"])
def test_scale_by_muon_s_matches_hand_computed_recursion(buffer):
  beta, shape = 0.9, (4, 64)  # ratio 16, uncapped → factor 4
  grads = _grads(shape, 3, seed=1)
  tx = scale_by_muon_s(beta=beta, buffer=buffer, exact_svd=True)
  state, update = tx.init(grads[0]), jax.jit(tx.update)
  m = np.zeros(shape)
  new_weight = 1 - beta if buffer == "ema" else 1.0
  for g in grads:
    out, state = update(g, state)
    m = beta * m + new_weight * np.asarray(g, np.float64)
    sigma1 = np.linalg.svd(m, compute_uv=False)[0]
    ref = sigma1 * 4.0 * newton_schulz(jnp.asarray(m, jnp.float32))
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-5)


def test_muon_s_default_buffer_is_paper1_heavy_ball():
  """Paper 1 design 4 defines σ₁ on the heavy-ball matrix M_t = βM_{t−1} + G̃_t."""
  shape = (8, 16)
  grads = _grads(shape, 3, seed=4)
  default = scale_by_muon_s(exact_svd=True)
  heavy = scale_by_muon_s(buffer="heavy_ball", exact_svd=True)
  ema = scale_by_muon_s(buffer="ema", exact_svd=True)
  states = [tx.init(grads[0]) for tx in (default, heavy, ema)]
  for g in grads:
    outs = []
    for i, tx in enumerate((default, heavy, ema)):
      out, states[i] = tx.update(g, states[i])
      outs.append(np.asarray(out))
  np.testing.assert_allclose(outs[0], outs[1], rtol=1e-6)
  assert np.linalg.norm(outs[0]) > 5 * np.linalg.norm(outs[2])  # ≈ 1/(1−β) = 10× larger


def test_muon_s_power_iteration_state_tracks_sigma1():
  shape = (32, 16)
  base = _normal(shape, 2)
  tx = scale_by_muon_s(beta=0.5, power_iterations=2)
  state, update = tx.init(base), jax.jit(tx.update)
  for k in range(8):
    g = base + 0.05 * _normal(shape, 10 + k)
    out, state = update(g, state)
  m = np.asarray(state[0].mu, np.float64)
  sigma1 = np.linalg.svd(m, compute_uv=False)[0]
  x_k = newton_schulz(jnp.asarray(m, jnp.float32))
  sigma_hat = float(jnp.linalg.norm(out) / jnp.linalg.norm(x_k))
  assert sigma_hat == pytest.approx(sigma1, rel=1e-2)
  assert state[1].vectors.shape == (1, 16)


def _spectrum_matrix(m, n, ratio, seed):
  rng = np.random.default_rng(seed)
  u, _ = np.linalg.qr(rng.standard_normal((m, n)))
  v, _ = np.linalg.qr(rng.standard_normal((n, n)))
  s = np.concatenate([[1.0, ratio], np.linspace(0.85, 0.1, n - 2)])
  return (u * s) @ v.T, rng


@pytest.mark.parametrize("seed", [0, 2])
def test_power_iteration_warm_start_within_one_percent(seed):
  # σ₂/σ₁ = 0.9, 2 iterations per step on a slowly drifting matrix: restarting
  # cold every step stays > 1% off; warm starts are within 1% after 4 steps.
  base, rng = _spectrum_matrix(48, 32, 0.9, seed)
  iterate = jax.jit(lambda m, u: power_iteration(m, u, 2))
  u = jnp.zeros(32)
  warm, cold = [], []
  for _ in range(8):
    mt = base + 0.01 * rng.standard_normal(base.shape)
    s1 = np.linalg.svd(mt, compute_uv=False)[0]
    sigma, u = iterate(jnp.asarray(mt, jnp.float32), u)
    warm.append(abs(float(sigma) / s1 - 1))
    sigma, _ = iterate(jnp.asarray(mt, jnp.float32), jnp.zeros(32))
    cold.append(abs(float(sigma) / s1 - 1))
  assert min(cold) > 0.01
  assert max(warm[4:]) < 0.01


def test_power_iteration_lower_bound_and_exact_svd():
  m = _normal((20, 12), 3)
  s1 = np.linalg.svd(np.asarray(m), compute_uv=False)[0]
  for k in (1, 2, 5):
    sigma, u = power_iteration(m, jnp.zeros(12), k)
    assert float(sigma) <= s1 * (1 + 1e-6)
    assert float(jnp.linalg.norm(u)) == pytest.approx(1.0, abs=1e-5)
  sigma, u = exact_top_singular(m)
  assert float(sigma) == pytest.approx(s1, rel=1e-5)
  sigma, u = power_iteration(jnp.zeros((4, 6)), jnp.zeros(4), 3)
  assert float(sigma) == 0.0 and not np.any(np.isnan(np.asarray(u)))


# ----------------------------------------------------------------------------- private optimizers

C, D = 1.0, 8.0
PARAMS = {"dense": {"kernel": jnp.ones((6, 4)), "bias": jnp.zeros(4)}}


def _per_example(seed=0, batch=8):
  seeds = iter(range(seed, seed + 2))
  return jax.tree.map(lambda p: _normal((batch,) + p.shape, next(seeds)), PARAMS)


@pytest.mark.parametrize("make", [dp_muon, dp_muon_s])
def test_one_release_over_whole_tree_before_partition(make):
  # The optimizer's output equals: ONE dp_release on the full tree (same key),
  # then Muon on the kernel and DP-SGD momentum on the bias.
  opt = make(0.1, C, 1.0, D, key=7)
  release = dp_release(C, 1.0, D, key=7)
  assert opt.release == release.release
  per_example = _per_example()
  updates, _ = jax.jit(opt.update)(per_example, opt.init(PARAMS), PARAMS)
  g, _ = release.update(per_example, release.init(PARAMS), PARAMS)
  post = scale_by_muon() if make is dp_muon else scale_by_muon_s()
  kernel, _ = post.update(g["dense"]["kernel"], post.init(g["dense"]["kernel"]))
  np.testing.assert_allclose(updates["dense"]["kernel"], -0.1 * kernel, rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(updates["dense"]["bias"], -0.1 * g["dense"]["bias"], rtol=1e-6)


@pytest.mark.parametrize("make", [dp_muon, dp_muon_s])
def test_1d_group_is_dp_sgd_at_its_own_learning_rate(make):
  # Paper 1 keeps DP-SGD with momentum for the 1-D leaves: with the fallback at DP-SGD's
  # η′ and β′, the bias updates of DP-Muon(-S) equal DP-SGD's on the same releases, step
  # after step, whatever the Muon group's η (here 0.02 against η′ = 0.9).
  opt = make(0.02, C, 1.0, D, key=7, fallback=Fallback(learning_rate=0.9, momentum=0.9))
  sgd = dp_sgd(0.9, C, 1.0, D, key=7, momentum=0.9)
  states = opt.init(PARAMS), sgd.init(PARAMS)
  for step in range(3):
    per_example = _per_example(seed=10 * step)
    updates, state = opt.update(per_example, states[0], PARAMS)
    expected, sgd_state = sgd.update(per_example, states[1], PARAMS)
    states = state, sgd_state
    np.testing.assert_allclose(updates["dense"]["bias"], expected["dense"]["bias"],
                               rtol=1e-6, atol=1e-8)
    assert not np.allclose(updates["dense"]["kernel"], expected["dense"]["kernel"])


def test_decoupled_weight_decay_and_schedule():
  # Zero gradients and no noise: the Muon buffer stays 0, so the update is −η_t·λ·θ.
  schedule = optax.linear_schedule(0.1, 0.0, 10)
  with pytest.warns(UserWarning, match="no noise"):
    opt = dp_muon(schedule, C, 0.0, D, key=0, weight_decay=0.5)
  zeros = jax.tree.map(lambda p: jnp.zeros((2,) + p.shape), PARAMS)
  state = opt.init(PARAMS)
  for lr in (0.1, 0.09):
    updates, state = opt.update(zeros, state, PARAMS)
    np.testing.assert_allclose(updates["dense"]["kernel"], -lr * 0.5 * PARAMS["dense"]["kernel"],
                               rtol=1e-6)
    np.testing.assert_array_equal(updates["dense"]["bias"], 0.0)


def test_paper2_needs_fallback_learning_rate():
  with pytest.raises(ValueError, match="fallback_learning_rate"):
    dp_muon(0.02, C, 1.0, D, routing="paper2")
  with pytest.raises(ValueError, match="routing"):
    dp_muon(0.02, C, 1.0, D, routing="unknown")
