"""One-run and Clopper–Pearson audits: formulas, jax_privacy's numbers, and real runs."""

import numpy as np
import pytest
import scipy.special
import scipy.stats

from dpmuon_jax.audit.canaries import canary_coordinates, canary_membership
from dpmuon_jax.audit.clopper_pearson import clopper_pearson_upper, epsilon_clopper_pearson
from dpmuon_jax.audit.one_run import epsilon_one_run, epsilon_one_run_counts, one_run_p_value
from dpmuon_jax.audit.run_audit import AuditConfig, audit
from dpmuon_jax.audit.thresholds import roc_thresholds
from dpmuon_jax.privacy.accounting import calibrate_noise_multiplier


def _deterministic_normal(mu, n):
  """n evenly spaced quantiles of N(mu, 1) (jax_privacy's auditing_test helper)."""
  return scipy.stats.norm.ppf(np.linspace(0, 1, n, endpoint=False) + 1 / (2 * n)) + mu


def _naive_p_value(m, r, v, eps, delta):
  """The one-run p-value (Steinke, Nasr & Jagielski 2023, Theorem 3.3), term by term."""
  q = np.exp(eps) / (1 + np.exp(eps))
  beta = sum(scipy.stats.binom.pmf(j, r, q) for j in range(v, r + 1))
  alpha = max(
      (sum(scipy.stats.binom.pmf(j, r, q) for j in range(v - i, v)) / i for i in range(1, v + 1)),
      default=0.0,
  )
  return min(1.0, beta + alpha * delta * 2 * m)


@pytest.mark.parametrize("m,r,v", [(100, 10, 10), (100, 40, 31), (1000, 100, 60), (50, 5, 0)])
@pytest.mark.parametrize("eps", [0.0, 0.7, 2.0])
@pytest.mark.parametrize("delta", [0.0, 1e-5, 1e-2])
def test_p_value_matches_the_formula(m, r, v, eps, delta):
  np.testing.assert_allclose(one_run_p_value(m, r, v, eps, delta),
                             _naive_p_value(m, r, v, eps, delta), rtol=1e-9, atol=1e-12)


def test_epsilon_counts_is_where_p_value_crosses_significance():
  m, r, v, alpha, delta = 1000, 200, 170, 0.05, 1e-5
  eps = epsilon_one_run_counts(m, r, v, alpha, delta)
  assert eps > 1.0
  assert one_run_p_value(m, r, v, eps - 1e-3, delta) < alpha < one_run_p_value(
      m, r, v, eps + 1e-3, delta)
  # Chance-level guessing rejects nothing.
  assert epsilon_one_run_counts(m, 200, 100, alpha, delta) == 0.0


@pytest.mark.parametrize("shift,expected", [(1, 1.13346), (2, 2.311945), (4, 4.395568)])
def test_epsilon_one_run_reproduces_jax_privacy(shift, expected):
  """jax_privacy auditing_test.test_epsilon_one_run_close."""
  n = 10_000
  eps = epsilon_one_run(_deterministic_normal(shift, n), _deterministic_normal(0, n), 0.05, 1e-6)
  np.testing.assert_allclose(eps, expected, rtol=1e-5)


def test_clopper_pearson_upper_has_its_coverage():
  n, k, alpha = 200, 30, 0.05
  p = clopper_pearson_upper(k, n, alpha)
  np.testing.assert_allclose(scipy.stats.binom.cdf(k, n, p), alpha, rtol=1e-6)
  assert clopper_pearson_upper(n, n, alpha) == 1.0


def test_epsilon_clopper_pearson_matches_the_formula_at_a_perfect_split():
  # One threshold separates 100 "in" runs from 100 "out" runs: FN = FP = 0.
  n, alpha = 100, 0.05
  eps = epsilon_clopper_pearson(np.arange(n) + 1000.0, np.arange(n) * 1.0, alpha, 0.0)
  thresholds = len(roc_thresholds(np.arange(n) + 1000.0, np.arange(n) * 1.0)[0])
  level = alpha / thresholds / 2
  expected = np.log((1 - clopper_pearson_upper(0, n, level)) / clopper_pearson_upper(0, n, level))
  np.testing.assert_allclose(eps, expected, rtol=1e-9)
  assert epsilon_clopper_pearson(np.zeros(n), np.zeros(n), alpha) == 0.0


def test_epsilon_clopper_pearson_is_below_the_true_gdp_epsilon():
  import dp_accounting

  n, mu, delta = 20_000, 1.0, 0.1
  eps = epsilon_clopper_pearson(_deterministic_normal(mu, n), _deterministic_normal(0, n), 0.1,
                                delta)
  if not hasattr(dp_accounting, "get_epsilon_gaussian"):
    pytest.skip("dp-accounting < 0.6 has no get_epsilon_gaussian (the exact GDP ε)")
  true_eps = dp_accounting.get_epsilon_gaussian(1 / mu, delta)
  assert 0.6 * true_eps < eps < true_eps


def test_against_jax_privacy_when_installed():
  auditing = pytest.importorskip("jax_privacy.auditing")
  rng = np.random.default_rng(3)
  for mu in (0.3, 1.5, 3.0):
    ins, outs = rng.normal(mu, 1, 300), rng.normal(0, 1, 250)
    ref = auditing.CanaryScoreAuditor(ins, outs)
    np.testing.assert_allclose(epsilon_one_run(ins, outs, 0.05, 1e-5),
                               ref.epsilon_one_run(0.05, 1e-5), rtol=1e-6)
    for one_sided in (True, False):
      np.testing.assert_allclose(epsilon_clopper_pearson(ins, outs, 0.1, 1e-3, one_sided),
                                 ref.epsilon_clopper_pearson(0.1, 1e-3, one_sided), rtol=1e-9)


def test_canary_draws_come_from_the_audit_key():
  a, b = canary_membership(7, 10_000), canary_membership(7, 10_000)
  np.testing.assert_array_equal(a, b)
  assert not np.array_equal(a, canary_membership(8, 10_000))
  assert abs(a.mean() - 0.5) < 4.5 * 0.5 / np.sqrt(10_000)
  coords = canary_coordinates(7, 500, 600)
  assert len(set(coords.tolist())) == 500 and coords.max() < 600
  with pytest.raises(ValueError, match="parameters"):
    canary_coordinates(7, 601, 600)


@pytest.fixture(scope="module")
def audited():
  """One honest DP-SGD run at ε = 2 with 10⁴ white-box canaries, and two broken ones."""
  def run(noise_scale):
    config = AuditConfig(num_canaries=10_000, epsilon=2.0, steps=1, seed=1, audit_seed=2,
                         noise_scale=noise_scale)
    return audit(config)

  return {scale: run(scale) for scale in (1.0, 0.5, 0.0)}


def test_honest_run_passes_the_audit(audited):
  honest = audited[1.0]
  assert honest["num_params"] >= honest["config"]["num_canaries"] == 10_000
  assert honest["epsilon_hat"] <= honest["epsilon_accountant"]
  np.testing.assert_allclose(honest["epsilon_accountant"], 2.0, rtol=2e-3)


def test_noise_off_fails_the_audit(audited):
  broken = audited[0.0]
  assert broken["epsilon_hat"] > broken["epsilon_accountant"]


def test_halved_noise_raises_epsilon_hat(audited):
  assert audited[0.5]["epsilon_hat"] > audited[1.0]["epsilon_hat"]
  assert audited[0.5]["noise_multiplier_released"] == pytest.approx(
      audited[1.0]["noise_multiplier_released"] / 2)


@pytest.fixture(scope="module")
def audited_bandmf():
  """DP-SGD with the BandMF release (b = 2, T = 4, each example in 2 of the 4 releases) at
  ε = 2 with 10⁴ white-box canaries, honest and with its noise off."""
  def run(noise_scale):
    config = AuditConfig(num_canaries=10_000, epsilon=2.0, steps=4, seed=1, audit_seed=2,
                         noise_scale=noise_scale, noise="bandmf", bands=2)
    return audit(config)

  return {scale: run(scale) for scale in (1.0, 0.0)}


def test_an_honest_bandmf_run_passes_the_audit(audited_bandmf):
  honest = audited_bandmf[1.0]
  assert honest["epsilon_hat"] <= honest["epsilon_accountant"]
  np.testing.assert_allclose(honest["epsilon_accountant"], 2.0, rtol=2e-3)
  # σ is calibrated for ⌈4/2⌉ = 2 participations, not 4: less noise than iid would need.
  iid = calibrate_noise_multiplier(2.0, 1e-5, 1.0, 4)
  assert honest["noise_multiplier_accounted"] < iid


def test_a_bandmf_run_without_noise_fails_the_audit(audited_bandmf):
  broken = audited_bandmf[0.0]
  assert broken["epsilon_hat"] > broken["epsilon_accountant"]


@pytest.mark.parametrize("noise, bands", [("bandmf", None), ("iid", 2), ("tree", None)])
def test_the_audit_refuses_a_noise_without_its_bands(noise, bands):
  with pytest.raises(ValueError, match="--bands|--noise"):
    audit(AuditConfig(noise=noise, bands=bands))


def test_p_value_of_logistic_is_expit():
  # p_ε = e^ε/(1+e^ε): with r = v = 1 and δ = 0 the p-value is exactly p_ε.
  np.testing.assert_allclose(one_run_p_value(10, 1, 1, 1.3, 0.0), scipy.special.expit(1.3))
