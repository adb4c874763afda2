"""DiSK (query, Kalman filter) and DOPPLER (IIR low-pass) and their private optimizers."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from stats import std_interval

from dpmuon_jax.optimizers.classic import dp_sgd
from dpmuon_jax.optimizers.filters import (
    disk_query_spec,
    dp_disk_muon,
    dp_disk_sgd,
    dp_doppler_muon,
    dp_doppler_sgd,
)
from dpmuon_jax.privacy.clipping import as_clipping
from dpmuon_jax.privacy.disk_query import (
    DISK_PRESETS,
    disk_noise_multiplier,
    disk_query,
    disk_terms,
    disk_weight,
)
from dpmuon_jax.privacy.query import add_batch_axis, clipped_sum, zeros_clipped_sum
from dpmuon_jax.training.step import make_private_step
from dpmuon_jax.transforms.filters import (
    DOPPLER_PRESETS,
    AppliedUpdateState,
    applied_update,
    kalman_filter,
    low_pass_filter,
)
from dpmuon_jax.transforms.muon import scale_by_orthogonalization


def _run(transform, inputs):
  """Outputs of ``transform`` on the scalar-leaf sequence ``inputs`` (as {'w': (1,)})."""
  state = transform.init({"w": jnp.zeros(1)})
  update = jax.jit(transform.update)
  outs = []
  for x in inputs:
    out, state = update({"w": jnp.full(1, x, jnp.float32)}, state)
    outs.append(float(out["w"][0]))
  return np.array(outs)


# ------------------------------------------------------------------------------------ the filters


@pytest.mark.parametrize(
    "kappa, expected",
    [
        (0.7, [1.0, 0.3 * 1 + 0.7 * 2, 0.3 * 1.7 + 0.7 * 4]),
        (1.5, [1.0, -0.5 * 1 + 1.5 * 2, -0.5 * 2.5 + 1.5 * 4]),  # κ > 1 extrapolates
    ],
)
def test_kalman_filter_matches_recursion(kappa, expected):
  np.testing.assert_allclose(_run(kalman_filter(kappa), [1.0, 2.0, 4.0]), expected, rtol=1e-6)


@pytest.mark.parametrize(
    "a, b, bias_correction, expected",
    [
        # EMA(0.9): m = 0.1, 0.29, 0.561; c = 0.1, 0.19, 0.271.
        ((1, -0.9), (0.1,), False, [0.1, 0.29, 0.561]),
        ((1, -0.9), (0.1,), True, [1.0, 0.29 / 0.19, 0.561 / 0.271]),
        ((2, -1.8), (0.2,), True, [1.0, 0.29 / 0.19, 0.561 / 0.271]),  # divided by a_0
        # 2nd order: m = 0.05, 0.185, 0.3895; c = 0.05, 0.135, 0.2045 (b_1 enters c from t = 1).
        ((1, -0.7, -0.2), (0.05, 0.05), False, [0.05, 0.185, 0.3895]),
        ((1, -0.7, -0.2), (0.05, 0.05), True, [1.0, 0.185 / 0.135, 0.3895 / 0.2045]),
        # FIR only (n_a = 0): m = 0.5, 0.5·2 − 0.1·1 = 0.9; c = 0.5, 0.4.
        ((1,), (0.5, -0.1), True, [1.0, 0.9 / 0.4, (1.5 - 0.2) / 0.4]),
    ],
)
def test_low_pass_filter_matches_hand_computed_recursion(a, b, bias_correction, expected):
  out = _run(low_pass_filter(a, b, bias_correction), [1.0, 2.0, 3.0])
  np.testing.assert_allclose(out, expected, rtol=1e-5)


def _lfilter_reference(a, b, xs):
  """Direct-form lfilter with zero initial conditions (scipy.signal.lfilter)."""
  a, b = np.asarray(a, float) / a[0], np.asarray(b, float) / a[0]
  m, c = [], []
  for t in range(len(xs)):
    mt = sum(b[j] * xs[t - j] for j in range(len(b)) if t - j >= 0)
    mt -= sum(a[i] * m[t - i] for i in range(1, len(a)) if t - i >= 0)
    ct = sum(b[j] for j in range(len(b)) if t - j >= 0)
    ct -= sum(a[i] * c[t - i] for i in range(1, len(a)) if t - i >= 0)
    m.append(mt)
    c.append(ct)
  return np.array(m), np.array(c)


@pytest.mark.parametrize("name", sorted(DOPPLER_PRESETS))
def test_low_pass_presets_match_lfilter_and_map_a_constant_to_itself(name):
  a, b = DOPPLER_PRESETS[name]
  xs = np.random.default_rng(0).standard_normal(12)
  m, c = _lfilter_reference(a, b, xs)
  np.testing.assert_allclose(_run(low_pass_filter(a, b, False), xs), m, rtol=2e-4, atol=1e-7)
  np.testing.assert_allclose(_run(low_pass_filter(a, b), xs), m / c, rtol=2e-4, atol=1e-6)
  constant = _run(low_pass_filter(a, b), [-2.5] * 40)
  np.testing.assert_allclose(constant, -2.5, rtol=1e-4)


def test_filters_validate_arguments():
  with pytest.raises(ValueError, match="kappa"):
    kalman_filter(0.0)
  with pytest.raises(ValueError, match="a\\[0\\]"):
    low_pass_filter((0.0, 1.0), (1.0,))
  with pytest.raises(ValueError, match="b\\[0\\]"):
    low_pass_filter((1.0, -0.5), (0.0, 0.5))
  low_pass_filter((1.0, -0.5), (0.0, 0.5), bias_correction=False)
  with pytest.raises(ValueError, match="composition"):
    dp_doppler_muon(0.02, 1.0, 1.0, 8.0, key=0, composition="bogus")


# ------------------------------------------------------------------------------------ DiSK query


def _linear_problem(batch_size=6, seed=0):
  rng = np.random.default_rng(seed)
  params = {"w": jnp.asarray(rng.standard_normal((4, 3)), jnp.float32),
            "b": jnp.asarray(rng.standard_normal(3), jnp.float32)}
  batch = {"x": jnp.asarray(rng.standard_normal((batch_size, 4)), jnp.float32),
           "y": jnp.asarray(rng.standard_normal((batch_size, 3)), jnp.float32)}
  return params, batch


def _loss(params, batch):
  pred = jnp.tanh(batch["x"] @ params["w"] + params["b"])
  return 0.5 * jnp.mean(jnp.sum(jnp.square(pred - batch["y"]), axis=-1))


def _example(batch, i):
  return jax.tree.map(lambda x: x[i], batch)


@pytest.mark.parametrize(
    "kappa, gamma, evaluations",
    [(0.7, 0.5, 2), (1.5, -1.0, 2), (0.5, 1.0, 1), (0.7, 0.3 / 0.7, 1), (0.7, 0.0, 1),
     (1.0, 2.0, 1)],
)
def test_disk_query_gradient_evaluations_and_two_point_form(kappa, gamma, evaluations):
  """c = 1 (γ = (1−κ)/κ), c = 0 (κ = 1) and γ = 0 evaluate ONE gradient per example and equal
  the two-point form c·∇ℓ(θ+γd) + (1−c)·∇ℓ(θ) (c·∇ℓ(θ) + (1−c)·∇ℓ(θ) = ∇ℓ(θ) when γ = 0)."""
  params, batch = _linear_problem()
  d = jax.tree.map(lambda p: 0.3 * jnp.ones_like(p), params)
  extrapolated = jax.tree.map(lambda p, u: p + gamma * u, params, d)
  query = disk_query(_loss, kappa, gamma)
  got = jax.jit(jax.vmap(query, in_axes=(None, 0)))((params, extrapolated), batch)
  assert len(disk_terms(kappa, gamma)((params, extrapolated))) == evaluations  # one per term

  c = disk_weight(kappa, gamma)
  for i in range(3):
    example = add_batch_axis(_example(batch, i))
    g_ext = jax.grad(_loss)(extrapolated, example)
    g_cur = jax.grad(_loss)(params, example)
    want = g_cur if gamma == 0 else jax.tree.map(
        lambda e, g: c * e + (1 - c) * g, g_ext, g_cur)
    for k in params:
      np.testing.assert_allclose(got[k][i], want[k], rtol=1e-5, atol=1e-6)


def test_disk_per_example_contribution_is_one_clipped_vector():
  """Each example's combined query is clipped as a whole: norm ≤ C, and a combination
  of two gradients of norm > C that nearly cancel is NOT clipped."""
  params, batch = _linear_problem(batch_size=8)
  spec = disk_query_spec(1.5, -1.0)  # c = 1/3: q = (1/3)∇ℓ(θ−d) + (2/3)∇ℓ(θ)
  state = AppliedUpdateState({k: 0.5 * jnp.ones_like(v) for k, v in params.items()})
  inputs = spec.inputs(params, state)
  query = spec.make_query(_loss)
  per_example = jax.jit(jax.vmap(query, in_axes=(None, 0)))(inputs, batch)
  clip = 0.05
  clipped = jax.jit(jax.vmap(as_clipping(clip).clip))(per_example)
  norms = jnp.sqrt(sum(jnp.sum(jnp.square(x), axis=tuple(range(1, x.ndim)))
                       for x in jax.tree.leaves(clipped.clipped)))
  assert bool(jnp.all(clipped.is_clipped)) and float(jnp.max(norms)) <= clip * (1 + 1e-5)
  total = jax.jit(lambda i, b: clipped_sum(query, i, b, None, clip))(inputs, batch)
  for k in params:
    np.testing.assert_allclose(total.total[k], clipped.clipped[k].sum(0), rtol=1e-5, atol=1e-7)

  # q = c·(θ+γd − x) + (1−c)·(θ − x) = θ − x + cγ·d for ℓ = ½‖θ − x‖²: with c = 2, γ = 1,
  # d = −(θ − x)/2 both gradients are large but q = 0 is unclipped (κ = 1/3: c = (2/3)/(1/3)).
  def quad(p, ex):
    return 0.5 * jnp.sum(jnp.square(p["v"] - ex["x"][0]))

  theta, x = {"v": jnp.full(5, 10.0)}, {"x": jnp.zeros((1, 5))}
  spec = disk_query_spec(1 / 3, 1.0)
  inputs = spec.inputs(theta, AppliedUpdateState({"v": -theta["v"] / 2}))
  total = clipped_sum(spec.make_query(quad), inputs, x, None, 1.0)
  assert float(jnp.linalg.norm(total.total["v"])) < 1e-4
  assert float(total.stats.num_clipped) == 0


def test_disk_inputs_need_exactly_one_recorded_update():
  params, _ = _linear_problem()
  with pytest.raises(ValueError, match="exactly one AppliedUpdateState"):
    disk_query_spec(0.7, 0.5).inputs(params, dp_sgd(0.1, 1.0, 1.0, 8.0, key=0).init(params))
  with pytest.raises(ValueError, match="kappa"):
    disk_query_spec(0.0, 0.5)


def test_disk_release_adds_exactly_sigma_c_noise():
  """Two-point DiSK (c ≠ 1): the release's noise std is σC/D (not the reference σ rescaling);
  at step 0 the filter and SGD (lr 1) return −G̃₀."""
  C, sigma, D, n = 2.0, 1.5, 4.0, 40_000
  kappa, gamma = DISK_PRESETS["paper1"]
  opt = dp_disk_sgd(1.0, C, sigma, D, key=7, kappa=kappa, gamma=gamma)
  assert opt.release.noise_multiplier == sigma and opt.release.noise_std == sigma * C / D
  params = {"w": jnp.zeros((200, 200))}
  updates, _ = opt.update(zeros_clipped_sum(params, C), opt.init(params), params)
  rms = float(jnp.sqrt(jnp.mean(jnp.square(updates["w"]))))
  lo, hi = std_interval(n, sigma * C / D)
  assert lo < rms < hi, (lo, rms, hi)

  c = disk_weight(kappa, gamma)
  rescaled = dp_disk_sgd(1.0, C, sigma, D, key=7, kappa=kappa, gamma=gamma,
                         reference_noise_rescaling=True)
  assert rescaled.release.noise_multiplier == pytest.approx(sigma / math.hypot(c, 1 - c))
  assert disk_noise_multiplier(sigma, 0.5, 1.0, True) == sigma  # c = 1: no rescaling


def test_disk_step_via_make_private_step_uses_previous_applied_update():
  """Step 2 equals the hand-built DiSK step from θ₁ and d₁ = θ₁ − θ₀."""
  params0, batch = _linear_problem(batch_size=8, seed=1)
  kappa, gamma, lr, C, D = 0.7, 0.5, 0.3, 0.5, 8.0
  with pytest.warns(UserWarning, match="no noise"):
    opt = dp_disk_sgd(lr, C, 0.0, D, key=0, kappa=kappa, gamma=gamma)
  step = make_private_step(opt, _loss)
  mask = jnp.ones(8, bool)
  empty = step.empty_overflow(params0)
  params1, state1, _ = step.step(params0, opt.init(params0), batch, mask, empty)
  d1 = jax.tree.map(jnp.subtract, params1, params0)
  chex_close = lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-7)
  jax.tree.map(chex_close, applied_update(state1), d1)
  params2, _, stats = step.step(params1, state1, batch, mask, empty)

  c = disk_weight(kappa, gamma)
  clipping = as_clipping(C)
  extrapolated = jax.tree.map(lambda p, u: p + gamma * u, params1, d1)

  @jax.jit
  def release(theta_ext, theta):
    total = jax.tree.map(jnp.zeros_like, params0)
    for i in range(8):
      ex = add_batch_axis(_example(batch, i))
      g_e, g_c = jax.grad(_loss)(theta_ext, ex), jax.grad(_loss)(theta, ex)
      q = jax.tree.map(lambda e, g: c * e + (1 - c) * g, g_e, g_c)
      total = jax.tree.map(jnp.add, total, clipping.clip(q).clipped)
    return jax.tree.map(lambda s: s / D, total)

  g0 = release(params0, params0)  # d₀ = 0
  g1 = jax.tree.map(lambda a, b: (1 - kappa) * a + kappa * b, g0, release(extrapolated, params1))
  jax.tree.map(chex_close, params2, jax.tree.map(lambda p, g: p - lr * g, params1, g1))
  assert float(stats.num_clipped) > 0  # the clipping mattered


@pytest.mark.parametrize("composition", ["feed", "replace"])
def test_disk_muon_records_the_applied_update(composition):
  rng = np.random.default_rng(2)
  params = {"dense": {"kernel": jnp.asarray(rng.standard_normal((4, 3)), jnp.float32),
                      "bias": jnp.zeros(3)}}
  batch = {"x": jnp.asarray(rng.standard_normal((8, 4)), jnp.float32),
           "y": jnp.asarray(rng.standard_normal((8, 3)), jnp.float32)}

  def loss(p, b):
    pred = b["x"] @ p["dense"]["kernel"] + p["dense"]["bias"]
    return 0.5 * jnp.mean(jnp.sum(jnp.square(pred - b["y"]), axis=-1))

  opt = dp_disk_muon(0.02, 1.0, 1.0, 8.0, key=3, composition=composition)
  step = make_private_step(opt, loss)
  state = opt.init(params)
  current = params
  for _ in range(2):
    new, state, _ = step.step(current, state, batch, jnp.ones(8, bool),
                              step.empty_overflow(params))
    jax.tree.map(lambda d, a, b: np.testing.assert_allclose(d, a - b, atol=1e-6),
                 applied_update(state), new, current)
    current = new


def test_doppler_muon_replace_orthogonalises_the_filter_output():
  """composition="replace": the Muon leaf's update is −η·NS₅(m̂_t) (no Muon momentum),
  the rank-1 bias takes −η·m̂_t (fallback momentum 0); "feed" differs from step 2 on."""
  rng = np.random.default_rng(3)
  params = {"kernel": jnp.zeros((5, 3)), "bias": jnp.zeros(3)}
  grads = [jax.tree.map(lambda p: jnp.asarray(rng.standard_normal((1,) + p.shape), jnp.float32),
                        params) for _ in range(2)]
  a, b, lr = (1.0, -0.9), (0.1,), 0.02
  outs = {}
  for composition in ("replace", "feed"):
    with pytest.warns(UserWarning, match="no noise"):
      opt = dp_doppler_muon(lr, 1e6, 0.0, 1.0, key=0, a=a, b=b, composition=composition)
    state = opt.init(params)
    for g in grads:
      out, state = opt.update(g, state, params)
    outs[composition] = out
  g0, g1 = (jax.tree.map(lambda x: x[0], g) for g in grads)
  filtered = jax.tree.map(lambda x, y: (0.09 * x + 0.1 * y) / 0.19, g0, g1)
  ns, _ = scale_by_orthogonalization().update({"kernel": filtered["kernel"]}, optax.EmptyState())
  np.testing.assert_allclose(outs["replace"]["kernel"], -lr * ns["kernel"], rtol=1e-4, atol=1e-6)
  np.testing.assert_allclose(outs["replace"]["bias"], -lr * filtered["bias"], rtol=1e-5)
  assert not np.allclose(outs["feed"]["kernel"], outs["replace"]["kernel"], atol=1e-4)


def test_doppler_sgd_is_bias_corrected_ema_step():
  with pytest.warns(UserWarning, match="no noise"):
    opt = dp_doppler_sgd(3.0, 1e6, 0.0, 1.0, key=0)
  params = {"w": jnp.zeros(4)}
  state = opt.init(params)
  g = {"w": jnp.arange(1.0, 5.0)[None]}
  for _ in range(3):
    out, state = opt.update(g, state, params)
    np.testing.assert_allclose(out["w"], -3.0 * g["w"][0], rtol=1e-5)  # constant input
