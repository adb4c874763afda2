"""Paper 1's diagnostics (noise edge, SNR, recovery threshold) and paper 2's polar metrics."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from stats import chi2_quantile

from dpmuon_jax.analysis import diagnostics as dg
from dpmuon_jax.analysis import polar_metrics as pm
from dpmuon_jax.optimizers.muon import dp_muon
from dpmuon_jax.training.step import make_private_step
from dpmuon_jax.transforms import buffer_noise as bn
from dpmuon_jax.transforms.momentum import muon_momentum

BATCH = 16


def _problem(seed=0):
  rng = np.random.default_rng(seed)
  params = {
      "dense": {"kernel": jnp.asarray(0.3 * rng.standard_normal((8, 6)), jnp.float32),
                "bias": jnp.zeros((6,), jnp.float32)},
      "out": {"kernel": jnp.asarray(0.3 * rng.standard_normal((6, 3)), jnp.float32)},
  }
  x = rng.standard_normal((BATCH, 8))
  y = x[:, :3] + 0.1 * rng.standard_normal((BATCH, 3))
  return params, {"x": jnp.asarray(x, jnp.float32), "y": jnp.asarray(y, jnp.float32)}


def _loss(params, batch):
  hidden = batch["x"] @ params["dense"]["kernel"] + params["dense"]["bias"]
  return 0.5 * jnp.mean(jnp.sum(jnp.square(hidden @ params["out"]["kernel"] - batch["y"]), -1))


@pytest.mark.parametrize("beta, buffer, nesterov", [
    (0.95, "ema", True), (0.9, "ema", False), (0.9, "heavy_ball", False),
    (0.8, "heavy_ball", True), (0.0, "ema", False),
])
def test_buffer_noise_factor_is_exact_per_step(beta, buffer, nesterov):
  """The output at step t is Σ_j c_{t,j} G̃_j; with independent noises its std is
  s₀·sqrt(Σ_j c²). Feed unit impulses G̃_j = e_j through the real momentum transform."""
  steps = 7
  tx = muon_momentum(beta, nesterov, buffer)
  state = tx.init(jnp.zeros((steps,)))
  spec = bn.BufferSpec(beta, buffer, nesterov)
  for t in range(1, steps + 1):
    out, state = tx.update(jnp.eye(steps, dtype=jnp.float32)[t - 1], state)
    coeffs = np.asarray(out, np.float64)
    assert float(spec.factor(t)) == pytest.approx(math.sqrt(np.sum(coeffs**2)), rel=1e-5)
    assert float(spec.factor(jnp.asarray(t))) == pytest.approx(float(spec.factor(t)), rel=1e-6)
  assert float(spec.factor(400)) == pytest.approx(spec.steady_state_factor(), rel=1e-9)


def test_steady_state_factors_match_their_closed_form():
  assert bn.BufferSpec(0.95, "ema", False).steady_state_factor() == pytest.approx(0.160, abs=5e-4)
  assert bn.DP_MUON_BUFFER.steady_state_factor() == pytest.approx(0.174, abs=5e-4)
  assert bn.BufferSpec(0.9, "heavy_ball", False).steady_state_factor() == pytest.approx(
      1 / math.sqrt(1 - 0.81))
  assert bn.NO_MOMENTUM.factor(5) == 1.0


@pytest.mark.parametrize("shape", [(100, 400), (120, 120)])
def test_noise_operator_norm_matches_simulation(shape):
  rng = np.random.default_rng(sum(shape))
  sigma, c, d = 1.3, 1.0, 256.0
  predicted = dg.noise_operator_norm(shape, sigma, c, d)
  assert predicted == pytest.approx(sigma * c * (math.sqrt(shape[0]) + math.sqrt(shape[1])) / d)
  norms = [np.linalg.norm(sigma * c / d * rng.standard_normal(shape), 2) for _ in range(6)]
  # Gordon: E‖Z‖₂ ≤ √m+√n; Cor. 5.35: P(‖Z‖ > √m+√n+t) ≤ 2e^{-t²/2}; finite-size edge ≈ −m^{-1/6}.
  t = math.sqrt(2 * math.log(2 * 6 / 1e-6)) * sigma * c / d
  assert max(norms) <= predicted + t
  assert min(norms) >= 0.93 * predicted
  buffered = dg.noise_operator_norm(shape, sigma, c, d, bn.DP_MUON_BUFFER.steady_state_factor())
  assert buffered == pytest.approx(0.1743 * predicted, rel=1e-3)


def test_snr_and_fixed_sigma_threshold():
  shape, sigma, c = (64, 256), 2.0, 1.0
  gap = 0.05
  edge = sigma * c * (8 + 16)
  assert dg.snr(gap, shape, sigma, c, 1024.0) == pytest.approx(gap * 1024 / edge)
  b_star = dg.threshold_batch_size_at_fixed_sigma(gap, shape, sigma, c)
  assert b_star == pytest.approx(edge / gap)
  assert dg.snr(gap, shape, sigma, c, b_star) == pytest.approx(1.0)


class _SqrtBudget(dg.PrivacyBudget):
  """σ(B) = 0.05·√B: the shape of the real curve, without the accountant's cost."""

  def noise_multiplier(self, batch_size):
    return 0.05 * math.sqrt(batch_size)


def test_recovery_threshold_bisection_is_minimal_and_monotone():
  budget = _SqrtBudget(4.0, 1e-5, 50_000, 10)
  shape = (64, 576)
  found = []
  for gap in (0.02, 0.05, 0.1, 0.3):
    b = dg.recovery_threshold_batch_size(gap, shape, 1.0, budget)
    edge = math.sqrt(64) + math.sqrt(576)
    assert b > budget.noise_multiplier(b) * edge / gap
    assert not b - 1 > budget.noise_multiplier(b - 1) * edge / gap
    assert b == math.ceil((0.05 * edge / gap) ** 2) + (1 if (0.05 * edge / gap) ** 2 % 1 == 0
                                                        else 0)
    found.append(b)
  assert found == sorted(found, reverse=True)  # bigger gap → smaller threshold
  # What NS sees (buffer factor < 1) needs a smaller batch.
  assert dg.recovery_threshold_batch_size(0.05, shape, 1.0, budget, 0.174) < found[1]
  assert dg.recovery_threshold_batch_size(1e-6, shape, 1.0, budget) is None


def test_recovery_threshold_with_the_real_accountant_on_a_grid():
  budget = dg.PrivacyBudget(4.0, 1e-5, 50_000, 50)
  grid = (256, 1024, 4096)
  sigmas = [budget.noise_multiplier(b) for b in grid]
  assert sigmas == sorted(sigmas)  # σ grows with B at fixed ε and epochs
  shape, edge = (512, 4608), math.sqrt(512) + math.sqrt(4608)
  # A gap between the 1024 and 4096 thresholds: the answer is 4096.
  gap = 0.5 * (sigmas[1] * edge / 1024 + sigmas[2] * edge / 4096)
  assert dg.recovery_threshold_batch_size(gap, shape, 1.0, budget, batch_sizes=grid) == 4096
  assert dg.recovery_threshold_batch_size(1e-9, shape, 1.0, budget, batch_sizes=grid) is None


def test_mean_clipped_gradient_and_spectrum():
  params, batch = _problem()
  c = 0.5
  mean = dg.nonprivate_mean_clipped_gradient(_loss, params, batch, c)
  grads = jax.vmap(jax.grad(_loss), in_axes=(None, 0))(
      params, jax.tree.map(lambda x: x[:, None], batch))
  flat = np.concatenate([np.asarray(g, np.float64).reshape(BATCH, -1)
                         for g in jax.tree.leaves(grads)], 1)
  factors = np.minimum(1.0, c / np.linalg.norm(flat, axis=1))
  assert np.mean(factors) < 1  # the probe actually clips
  expected = jax.tree.map(lambda g: np.tensordot(factors, np.asarray(g, np.float64), 1) / BATCH,
                          grads)
  for a, b in zip(jax.tree.leaves(mean), jax.tree.leaves(expected)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7)
  spec = dg.spectrum_summary(np.array([3.0, 1.0, 0.0]))
  assert spec.gap == 2.0 and spec.signal_energy == 10.0
  assert spec.stable_rank == pytest.approx(10 / 9)
  assert spec.effective_rank == pytest.approx(math.exp(-(0.75 * math.log(0.75)
                                                         + 0.25 * math.log(0.25))))


def test_layer_report_rows_and_table():
  params, batch = _problem()
  sigma, c, d = 1.0, 0.5, 64.0
  rows = dg.nonprivate_layer_report(_loss, params, batch, c, sigma, d, step=3)
  assert [r.path for r in rows] == ["dense/kernel", "out/kernel"]
  factor = float(bn.DP_MUON_BUFFER.factor(3))
  for r in rows:
    assert r.noise_norm == pytest.approx(dg.noise_operator_norm(r.shape, sigma, c, d))
    assert r.buffer_noise_norm == pytest.approx(factor * r.noise_norm)
    assert r.snr == pytest.approx(r.spectrum.gap / r.noise_norm)
    assert r.above_threshold == (r.snr > 1) == (d > r.threshold_batch_size)
    assert r.recovery_batch_size is None
  text = dg.format_report(rows)
  assert "dense/kernel" in text and "8×6" in text and "matrices above threshold" in text


def test_diagnostics_leave_training_bit_identical():
  params0, batch = _problem(1)
  mask = jnp.ones((BATCH,), bool)

  def run(with_diagnostics):
    opt = dp_muon(0.02, 0.5, 1.0, float(BATCH), key=11)
    step = make_private_step(opt, _loss)
    params, state = params0, opt.init(params0)
    for t in range(1, 4):
      if with_diagnostics:
        rows = dg.nonprivate_layer_report(_loss, params, batch, 0.5, 1.0, float(BATCH), step=t)
        dg.format_report(rows)
      params, state, _ = step(params, state, [(batch, mask)])
    return params, state

  on, off = run(True), run(False)
  for a, b in zip(jax.tree.leaves(on), jax.tree.leaves(off)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_plot_spectrum_writes_png(tmp_path):
  pytest.importorskip("matplotlib")
  rng = np.random.default_rng(3)
  x = 0.1 * rng.standard_normal((30, 90))
  path = dg.plot_spectrum(x, 0.1, str(tmp_path / "spec.png"), clean_singular_values=[2.0])
  with open(path, "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"


# ------------------------------------------------------------------ paper 2 metrics


def _per_example(rng, size=64):
  scales = np.exp(rng.uniform(-1.5, 1.5, size))[:, None, None]
  mean = rng.standard_normal((6, 4))
  return {"w": (mean + rng.standard_normal((size, 6, 4))) * scales,
          "b": rng.standard_normal((size, 3)) * scales[:, :, 0]}


def test_clipping_residual_identity_and_bound():
  rng = np.random.default_rng(4)
  g = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), _per_example(rng))
  res = pm.clipping_residual(g, 2.0)
  assert 0 < np.mean(res.factors < 1) < 1  # some, not all, examples clipped
  for lhs, common, r in zip(*(jax.tree.leaves(t) for t in (res.clipped_mean, res.common,
                                                            res.residual))):
    np.testing.assert_allclose(lhs, common + r, rtol=1e-5, atol=1e-6 * np.abs(lhs).max())
  assert 0 < res.residual_norm <= res.bound
  assert res.normalized == pytest.approx(res.residual_norm / math.sqrt(
      sum(float(np.sum(x**2)) for x in jax.tree.leaves(res.common))))
  # Equal factors (nobody clipped): R = 0.
  small = jax.tree.map(lambda x: x * 1e-3, g)
  res0 = pm.clipping_residual(small, 2.0)
  np.testing.assert_array_equal(res0.factors, 1.0)
  assert res0.residual_norm == pytest.approx(0.0, abs=1e-12)


def test_polar_and_cosine_errors():
  rng = np.random.default_rng(5)
  u = np.linalg.qr(rng.standard_normal((8, 3)))[0]
  v = np.linalg.qr(rng.standard_normal((5, 3)))[0]
  a = (u * [3.0, 2.0, 1.0]) @ v.T
  b = (u * [1.0, 1.0, 5.0]) @ v.T  # same polar factor, different singular values
  assert np.linalg.norm(pm.polar(a)) == pytest.approx(math.sqrt(3))
  assert pm.polar_error(b, a) == pytest.approx(0.0, abs=1e-12)
  assert pm.cosine_error(b, a) > 0.3
  assert pm.cosine_error(2 * a, a) == pytest.approx(0.0, abs=1e-12)
  assert pm.cosine_error(-a, a) == pytest.approx(2.0)
  assert pm.polar_error(-a, a) == pytest.approx(2.0)


def test_history_weights_and_envelope():
  gamma = 0.9
  np.testing.assert_allclose(pm.history_weights(gamma, 3),
                             np.array([1, gamma, gamma**2]) / (1 + gamma + gamma**2))
  assert pm.envelope_factor(0.3, gamma, 0) == 1.0
  assert pm.variance_ratio([1, 1, 1, 1]) == pytest.approx(0.25)
  s_k = float(np.sum(pm.history_weights(gamma, 5) ** 2))
  assert pm.envelope_factor(0.4, gamma, 4) == pytest.approx(0.4 + 0.6 * s_k)
  assert pm.envelope_factor(1.0, gamma, 4) == 1.0


@pytest.mark.parametrize("rho", [0.0, 0.5])
def test_im_variance_ratio_matches_envelope_monte_carlo(rho):
  """ξ_{i,k} = √ρ a_i + √(1−ρ) e_{i,k}: the IM query's empirical variance over the
  current-only one is ρ + (1−ρ)S_K. Each empirical variance is σ²χ²((B−1)d)/((B−1)d)."""
  rng = np.random.default_rng(6 + int(10 * rho))
  size, dim, k, gamma = 400, 40, 4, 0.9
  mean = rng.standard_normal(dim)
  shared = rng.standard_normal((size, dim))
  states = [mean + math.sqrt(rho) * shared + math.sqrt(1 - rho) * rng.standard_normal((size, dim))
            for _ in range(k + 1)]
  im = pm.weighted_combination(gamma, k)(states)
  var = lambda x: np.sum((x - x.mean(0)) ** 2)
  ratio = var(im) / var(states[0])
  dof = (size - 1) * dim
  lo, hi = chi2_quantile(1e-6, dof) / dof, chi2_quantile(1 - 1e-6, dof) / dof
  expected = pm.envelope_factor(rho, gamma, k)
  assert expected * lo / hi <= ratio <= expected * hi / lo, (ratio, expected)
  assert expected < 1


def test_im_protocol_runner():
  params, batch = _problem(2)
  shift = lambda p, e: jax.tree.map(lambda x: x + e * jnp.ones_like(x), p)
  history = [shift(params, 0.05), shift(params, 0.1)]
  ckpts = [pm.ProtocolCheckpoint(params, history, seed=0, step=10),
           pm.ProtocolCheckpoint(shift(params, -0.02), history[:1], seed=1, step=10)]
  result = pm.nonprivate_im_protocol(_loss, ckpts, 0.5, gamma=0.9, num_history=2,
                                     probe_batch=batch)
  assert [(r.seed, r.path) for r in result.rows] == [
      (0, "dense/kernel"), (0, "out/kernel"), (1, "dense/kernel"), (1, "out/kernel")]
  assert result.polar_error.count == 4 and "polar_error" in result.table()
  # Row 0 by hand: IM = mean clip(Σ w_k ∇ℓ(θ_{t−k})), reference = raw mean current gradient.
  one = lambda p, x: jax.grad(_loss)(p, jax.tree.map(lambda a: a[None], x))
  w = pm.history_weights(0.9, 3)
  per = [jax.vmap(one, in_axes=(None, 0))(s, batch) for s in [params, *history]]
  flat = lambda t: np.concatenate([np.asarray(x, np.float64).reshape(BATCH, -1)
                                   for x in jax.tree.leaves(t)], 1)
  v = sum(wk * flat(p) for wk, p in zip(w, per))
  factors = np.minimum(1.0, 0.5 / np.linalg.norm(v, axis=1))
  im_dense = (np.asarray(sum(wk * np.asarray(p["dense"]["kernel"], np.float64)
                             for wk, p in zip(w, per))) * factors[:, None, None]).mean(0)
  ref_dense = np.asarray(per[0]["dense"]["kernel"], np.float64).mean(0)
  # float32 inputs, as the runner's: the rank cut-off of polar() uses the dtype's eps
  # (this dense kernel's gradient has rank 3 < 6).
  expected = pm.polar_error(im_dense.astype(np.float32), ref_dense.astype(np.float32))
  assert np.linalg.norm(pm.polar(ref_dense.astype(np.float32))) == pytest.approx(math.sqrt(3))
  assert result.rows[0].polar_error_im == pytest.approx(expected, rel=1e-3)
  # With no history (or a current-only combine) the two queries coincide: zero reduction.
  same = pm.nonprivate_im_protocol(_loss, [pm.ProtocolCheckpoint(params)], 0.5, probe_batch=batch)
  for r in same.rows:
    assert r.polar_error_im == r.polar_error_current and r.residual_im == r.residual_current
  assert same.clipping_residual.mean == 0.0
