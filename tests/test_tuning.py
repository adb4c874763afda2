"""Private hyperparameter selection (Papernot & Steinke, ICLR 2022): bounds, sampler, driver.

The bounds are checked against formulas written out here from the paper, for
a Gaussian base mechanism whose RDP curve is known in closed form
(ε(λ) = λ/(2σ²)), and against dp-accounting's own implementation of the
paper (``RepeatAndSelectDpEvent``), which is independent code.
"""

import math

import dp_accounting
import numpy as np
import pytest
from scipy import special, stats

from dpmuon_jax.privacy import tuning
from dpmuon_jax.privacy.accounting import RDP_ORDERS, compute_epsilon
from dpmuon_jax.privacy.tuning import (
    Poisson,
    RunPrivacy,
    TruncatedNegativeBinomial,
    expected_runs,
    noisy_score,
    private_tune,
    public_score,
    sample_run_count,
    truncated_negative_binomial,
    tuned_epsilon,
    tuned_rdp,
)

ORDERS = np.asarray(RDP_ORDERS)
SIGMA = 2.0
DELTA = 1e-5


def gaussian(sigma: float = SIGMA) -> RunPrivacy:
  """One Gaussian release of sensitivity 1: q = 1, T = 1."""
  return RunPrivacy(sigma, 1.0, 1)


def envelope(values: np.ndarray) -> np.ndarray:
  """min over orders ≥ λ (a Rényi divergence is nondecreasing in its order)."""
  return np.minimum.accumulate(values[::-1])[::-1]


def paper_geometric(orders, sigma, gamma):
  """The truncated negative binomial bound at η = 1 for ε(λ) = λ/(2σ²), written from the paper.

  ε'(λ) = ε(λ) + (1+η)·min_λ̂ [(1 − 1/λ̂)ε(λ̂) + log(1/γ)/λ̂] + log(E[K])/(λ − 1), E[K] = 1/γ.
  """
  eps = orders / (2 * sigma**2)
  inner = min((1 - 1 / lh) * (lh / (2 * sigma**2)) + math.log(1 / gamma) / lh for lh in orders)
  out = [e + 2 * inner + math.log(1 / gamma) / (lam - 1) if lam > 1 else math.inf
         for lam, e in zip(orders, eps)]
  return envelope(np.asarray(out))


def rdp_to_dp(orders, rdp, delta):
  """ε = min_λ ε(λ) + log(1 − 1/λ) − (log δ + log λ)/(λ − 1) (Balle et al. 2020, Prop. 12)."""
  return min(r + math.log1p(-1 / a) - (math.log(delta) + math.log(a)) / (a - 1)
             for a, r in zip(orders, rdp) if a > 1.01)


def test_the_base_curve_of_a_gaussian_is_lambda_over_two_sigma_squared():
  np.testing.assert_allclose(tuning.base_rdp(gaussian(), public_score()),
                             ORDERS / (2 * SIGMA**2), rtol=1e-12)
  with_score = tuning.base_rdp(gaussian(), noisy_score(0.01, 3.0))
  np.testing.assert_allclose(with_score, ORDERS / (2 * SIGMA**2) + ORDERS / (2 * 3.0**2),
                             rtol=1e-12)


@pytest.mark.parametrize("gamma", [0.5, 0.1, 0.01])
def test_geometric_bound_matches_the_paper_formula(gamma):
  distribution = TruncatedNegativeBinomial(1.0, gamma)
  ours = tuned_rdp(ORDERS, ORDERS / (2 * SIGMA**2), distribution)
  np.testing.assert_allclose(ours, paper_geometric(ORDERS, SIGMA, gamma), rtol=1e-12)
  epsilon = tuned_epsilon(gaussian(), distribution, public_score(), DELTA)
  assert epsilon == pytest.approx(rdp_to_dp(ORDERS, paper_geometric(ORDERS, SIGMA, gamma), DELTA),
                                  rel=1e-9)


def test_geometric_bound_matches_its_closed_form_optimum_over_lambda_hat():
  """min_λ̂ [(λ̂ − 1)/σ² + 2L/λ̂] = 2√(2L)/σ − 1/σ² at λ̂ = σ√(2L), L = log(1/γ)."""
  gamma = 0.05
  L = math.log(1 / gamma)
  closed = ORDERS / (2 * SIGMA**2) + 2 * math.sqrt(2 * L) / SIGMA - 1 / SIGMA**2 + L / (ORDERS - 1)
  ours = tuned_rdp(ORDERS, ORDERS / (2 * SIGMA**2), TruncatedNegativeBinomial(1.0, gamma))
  rising = ORDERS >= ORDERS[np.argmin(closed)]  # where the envelope leaves the formula alone
  assert np.all(ours[rising] >= closed[rising] - 1e-12)  # a grid minimum is never lower
  np.testing.assert_allclose(ours[rising], closed[rising], rtol=1e-3)


@pytest.mark.parametrize("shape", [0.0, 1.0, 2.5, math.inf])
def test_agrees_with_dp_accountings_repeat_and_select(shape):
  mean = 8.0
  if math.isinf(shape):
    distribution = Poisson(mean)
  else:
    distribution = truncated_negative_binomial(mean, shape)
  accountant = dp_accounting.rdp.RdpAccountant(list(RDP_ORDERS))
  accountant.compose(dp_accounting.dp_event.RepeatAndSelectDpEvent(
      dp_accounting.GaussianDpEvent(SIGMA), mean, shape))
  ours = tuned_rdp(ORDERS, ORDERS / (2 * SIGMA**2), distribution)
  # dp-accounting lowers ε'(λ) to min_{λ'≥λ} ε'(λ') for D_{η,γ} only; we do it for Poisson too.
  np.testing.assert_allclose(ours, envelope(accountant.rdp), rtol=1e-6)
  assert np.all(ours <= accountant.rdp * (1 + 1e-6))


def test_poisson_bound_is_no_lower_than_with_the_exact_gaussian_delta():
  """ε(λ) + μ·δ̂ + log μ/(λ−1); δ̂ from the RDP conversion bounds the exact δ(ε̂) of a Gaussian."""
  mu = 5.0

  def exact_delta(eps):  # Balle & Wang 2018, the analytic Gaussian mechanism
    return (stats.norm.cdf(1 / (2 * SIGMA) - eps * SIGMA)
            - math.exp(eps) * stats.norm.cdf(-1 / (2 * SIGMA) - eps * SIGMA))

  lower = envelope(np.asarray([
      lam / (2 * SIGMA**2) + mu * exact_delta(math.log1p(1 / (lam - 1))) + math.log(mu) / (lam - 1)
      if lam > 1 else math.inf for lam in ORDERS]))
  ours = tuned_rdp(ORDERS, ORDERS / (2 * SIGMA**2), Poisson(mu))
  assert np.all(ours >= lower - 1e-12)
  assert ours[np.argmin(lower)] <= 1.5 * lower.min()  # and not far above it


def test_tuning_costs_more_than_one_run_and_grows_only_logarithmically():
  run, score = RunPrivacy(1.0, 0.01, 1000), noisy_score(1 / 1000, 20.0)
  one_run = tuning.run_epsilon(run, score, DELTA)
  tuned = {m: tuned_epsilon(run, TruncatedNegativeBinomial(1.0, 1 / m), score, DELTA)
           for m in (10, 100, 1000)}
  assert one_run < tuned[10] < tuned[100] < tuned[1000]
  # Each ×10 in E[K] adds no more than the last did: concave in log E[K].
  assert tuned[1000] - tuned[100] <= tuned[100] - tuned[10] + 1e-9
  assert tuned[1000] < 2 * tuned[10]  # far from linear growth in E[K]
  ten_runs = compute_epsilon(1.0, 0.01, 10 * 1000, DELTA)  # ten runs composed, scores left out
  assert tuned[10] < ten_runs


def test_expected_runs_matches_the_mean_of_the_paper_pmf():
  """P[K=k] = (1−γ)^k/(γ^{−η} − 1)·Γ(k+η)/(Γ(η)·k!), and (1−γ)^k/(k·log(1/γ)) at η = 0."""
  k = np.arange(1, 20001)
  for eta, gamma in [(-0.5, 0.05), (0.0, 0.1), (0.5, 0.2), (1.0, 0.25), (3.0, 0.4)]:
    if eta == 0.0:
      pmf = (1 - gamma) ** k / (k * math.log(1 / gamma))
    else:
      log_pmf = (k * math.log1p(-gamma) + special.gammaln(k + eta) - special.gammaln(eta)
                 - special.gammaln(k + 1) - math.log(abs(gamma**-eta - 1)))
      pmf = np.exp(log_pmf)
    assert pmf.sum() == pytest.approx(1.0, abs=1e-9)
    assert expected_runs(TruncatedNegativeBinomial(eta, gamma)) == pytest.approx(
        float(np.sum(k * pmf)), rel=1e-9)


def _variance(distribution) -> float:
  """Var K from the textbook forms of each law."""
  if isinstance(distribution, Poisson):
    return distribution.mu
  eta, gamma = distribution
  if eta == 0.0:  # logarithmic, p = 1 − γ
    p, log = 1 - gamma, math.log(gamma)
    return -p * (p + log) / (gamma**2 * log**2)
  m, v, p0 = eta * (1 - gamma) / gamma, eta * (1 - gamma) / gamma**2, gamma**eta
  mean = m / (1 - p0)  # negative binomial conditioned on K ≥ 1
  return (v + m * m) / (1 - p0) - mean**2


@pytest.mark.parametrize("distribution", [
    TruncatedNegativeBinomial(1.0, 0.2),
    TruncatedNegativeBinomial(0.0, 0.1),
    TruncatedNegativeBinomial(2.0, 0.3),
    Poisson(4.0),
])
def test_the_sampler_has_the_right_mean(distribution):
  n = 20000
  rng = np.random.default_rng(7)
  draws = np.array([sample_run_count(distribution, rng) for _ in range(n)])
  bound = 5 * math.sqrt(_variance(distribution) / n)  # 5 standard errors
  assert abs(draws.mean() - expected_runs(distribution)) < bound
  if isinstance(distribution, TruncatedNegativeBinomial):
    assert draws.min() >= 1


def test_a_negative_eta_samples_from_the_right_law():
  distribution = TruncatedNegativeBinomial(-0.5, 0.05)
  rng = np.random.default_rng(3)
  draws = np.array([sample_run_count(distribution, rng) for _ in range(20000)])
  p1 = 0.95 * -0.5 / (0.05**0.5 - 1)  # P[K = 1] = (1−γ)·η/(γ^{−η} − 1)
  assert abs(np.mean(draws == 1) - p1) < 5 * math.sqrt(p1 * (1 - p1) / 20000)


def test_mean_to_gamma_round_trips():
  for eta in (-0.5, 0.0, 1.0, 4.0):
    assert expected_runs(truncated_negative_binomial(6.0, eta)) == pytest.approx(6.0, rel=1e-9)
  assert truncated_negative_binomial(4.0, 1.0).gamma == 0.25


def test_calibration_meets_the_target_tightly():
  score, distribution = noisy_score(1 / 500, 10.0), truncated_negative_binomial(5.0, 0.0)
  sigma = tuning.calibrate_tuned_noise_multiplier(3.0, DELTA, 1.0, 1, distribution, score)
  assert 3.0 * (1 - 1e-3) <= tuned_epsilon(gaussian(sigma), distribution, score, DELTA) <= 3.0
  run = RunPrivacy(1.0, 0.02, 300)
  sigma = tuning.calibrate_tuned_noise_multiplier(3.0, DELTA, 0.02, 300, distribution, score)
  assert 3.0 * (1 - 1e-3) <= tuned_epsilon(run._replace(noise_multiplier=sigma), distribution,
                                           score, DELTA) <= 3.0


def test_calibration_refuses_an_unreachable_target():
  with pytest.raises(ValueError, match="out of reach"):
    tuning.calibrate_tuned_noise_multiplier(
        1.0, DELTA, 1.0, 1, truncated_negative_binomial(5.0), noisy_score(0.01, 0.5))


# ------------------------------------------------------------------------------ the driver

RUN = RunPrivacy(2.0, 1.0, 1)


def _fixed_scores(table):
  calls = []

  def train_fn(candidate, seed):
    calls.append((candidate, seed))
    return table[candidate], {"candidate": candidate, "call": len(calls)}

  return train_fn, calls


def test_the_driver_returns_the_argmax_of_the_noisy_scores():
  train_fn, calls = _fixed_scores({0.01: 0.2, 0.03: 0.5, 0.1: 0.4})
  discarded = []
  out = private_tune(train_fn, [0.01, 0.03, 0.1], run=RUN,
                     distribution=truncated_negative_binomial(12.0, 1.0),
                     score=noisy_score(1 / 100, 5.0), target_delta=DELTA, seed=11,
                     discard=discarded.append)
  runs = out.nonprivate_runs
  assert len(runs) == len(calls) >= 2
  best = max(range(len(runs)), key=lambda i: runs[i].score)
  assert out.score == runs[best].score and out.candidate == runs[best].candidate
  assert out.result == {"candidate": out.candidate, "call": best + 1}
  assert sorted(r["call"] for r in discarded) == [i + 1 for i in range(len(runs)) if i != best]
  assert all(seed is not None for _, seed in calls) and out.seeded
  assert out.epsilon == tuned_epsilon(RUN, truncated_negative_binomial(12.0, 1.0),
                                      noisy_score(1 / 100, 5.0), DELTA)
  again = private_tune(_fixed_scores({0.01: 0.2, 0.03: 0.5, 0.1: 0.4})[0], [0.01, 0.03, 0.1],
                       run=RUN, distribution=truncated_negative_binomial(12.0, 1.0),
                       score=noisy_score(1 / 100, 5.0), target_delta=DELTA, seed=11)
  assert again.nonprivate_runs == runs


def test_the_driver_adds_score_noise_of_the_stated_scale_and_draws_candidates_uniformly():
  train_fn, calls = _fixed_scores({"a": 0.5, "b": 0.5, "c": 0.5})
  out = private_tune(train_fn, ["a", "b", "c"], run=RUN,
                     distribution=TruncatedNegativeBinomial(1.0, 1 / 600),
                     score=noisy_score(1 / 200, 4.0), target_delta=DELTA, seed=5)
  noise = np.array([r.score - 0.5 for r in out.nonprivate_runs])
  n = len(noise)
  assert n >= 300
  # n·s²/σ² ~ χ²(n): between its 0.1% and 99.9% quantiles.
  ratio = np.sum(noise**2) / 0.02**2
  assert stats.chi2.ppf(0.001, n) < ratio < stats.chi2.ppf(0.999, n)
  counts = np.array([sum(c == x for c, _ in calls) for x in "abc"])
  assert stats.chisquare(counts).pvalue > 0.001


def test_public_scores_are_released_as_they_are_and_unseeded_runs_get_no_seed():
  train_fn, calls = _fixed_scores({1: 0.1, 2: 0.9})
  out = private_tune(train_fn, [1, 2], run=RUN, distribution=truncated_negative_binomial(30.0),
                     score=public_score(), target_delta=DELTA)
  assert {r.score for r in out.nonprivate_runs} <= {0.1, 0.9}
  assert not out.seeded and all(seed is None for _, seed in calls)
  if any(c == 2 for c, _ in calls):
    assert out.candidate == 2 and out.score == 0.9


def test_poisson_with_no_run_outputs_nothing():
  rng_seed = next(s for s in range(100)
                  if sample_run_count(Poisson(0.05), np.random.default_rng(s)) == 0)
  train_fn, calls = _fixed_scores({1: 0.5})
  out = private_tune(train_fn, [1], run=RUN, distribution=Poisson(0.05),
                     score=public_score(), target_delta=DELTA, seed=rng_seed)
  assert out.candidate is None and out.result is None and out.score is None
  assert calls == [] and out.nonprivate_runs == () and math.isfinite(out.epsilon)


@pytest.mark.parametrize("kwargs, error, match", [
    ({"train_fn": "not callable"}, TypeError, "train_fn must be callable"),
    ({"candidates": []}, ValueError, "candidates must not be empty"),
    ({"candidates": "abc"}, TypeError, "candidates must be a sequence"),
    ({"distribution": TruncatedNegativeBinomial(1.0, 1.0)}, ValueError, "gamma"),
    ({"distribution": TruncatedNegativeBinomial(-1.0, 0.5)}, ValueError, "eta"),
    ({"distribution": Poisson(0.0)}, ValueError, "mu"),
    ({"distribution": 5}, TypeError, "distribution must be"),
    ({"score": 0.1}, TypeError, "score must be a ScoreRelease"),
    ({"target_delta": 0.0}, ValueError, "target_delta"),
    ({"run": RunPrivacy(0.0, 0.1, 10)}, ValueError, "noise_multiplier"),
    ({"run": RunPrivacy(1.0, 0.1, 0)}, ValueError, "steps"),
    ({"seed": -1}, ValueError, "seed"),
    ({"train_fn": lambda c, s: (math.nan, None)}, ValueError, "not a finite number"),
    ({"train_fn": lambda c, s: 0.5}, TypeError, r"\(score, result\) pair"),
    ({"train_fn": lambda c, s: ("high", None)}, TypeError, "numeric score"),
])
def test_the_driver_refuses_bad_arguments(kwargs, error, match):
  arguments = {"train_fn": lambda c, s: (0.5, None), "candidates": [1, 2], "run": RUN,
               "distribution": truncated_negative_binomial(3.0), "score": public_score(),
               "target_delta": DELTA, "seed": 0, **kwargs}
  with pytest.raises(error, match=match):
    private_tune(arguments.pop("train_fn"), arguments.pop("candidates"), **arguments)


def test_bad_score_and_curve_arguments_are_refused():
  with pytest.raises(ValueError, match="sensitivity"):
    noisy_score(0.0, 1.0)
  with pytest.raises(ValueError, match="noise_multiplier"):
    noisy_score(0.1, -1.0)
  with pytest.raises(ValueError, match="increasing"):
    tuned_rdp([2.0, 1.5], [1.0, 1.0], Poisson(2.0))
  with pytest.raises(ValueError, match="one length"):
    tuned_rdp([2.0, 3.0], [1.0], Poisson(2.0))
  with pytest.raises(ValueError, match="mean"):
    truncated_negative_binomial(1.0)
