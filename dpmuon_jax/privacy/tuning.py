"""Private hyperparameter selection: the best of a random number of private runs.

Papernot & Steinke, "Hyperparameter Tuning with Renyi Differential Privacy"
(ICLR 2022; arXiv:2110.03620v2). The base mechanism Q draws a candidate
uniformly at random from a fixed, public grid, makes one private training run
with it and releases the run's output together with a score. The tuning
procedure A runs Q independently K times, K drawn from a fixed distribution
that does not look at the data, and outputs ONLY the run with the best score.
If Q is (λ, ε(λ))-RDP at every order λ, A is (λ, ε'(λ))-RDP with

* K ~ the truncated negative binomial D_{η,γ} (the paper's main result for it,
  Theorem 2 of arXiv v2, the number dp-accounting's implementation also cites)::

      ε'(λ) = ε(λ) + (1+η)·min_{λ̂≥1} [(1 − 1/λ̂)·ε(λ̂) + log(1/γ)/λ̂] + log E[K]/(λ − 1),

  for η ∈ (−1, ∞), γ ∈ (0, 1); η = 0 is the logarithmic distribution, η = 1
  the geometric one;
* K ~ Poisson(μ) (its result for the Poisson distribution, Theorem 6 of arXiv v2)::

      ε'(λ) = ε(λ) + μ·δ̂(λ) + log μ/(λ − 1),

  where Q is (ε̂, δ̂)-DP at ε̂ = log(1 + 1/(λ − 1)); δ̂ is read off ε(·) by the
  RDP→DP conversion. K = 0 has positive probability: A then outputs nothing.

A Rényi divergence never decreases with its order, so ε'(λ) is also lowered to
min_{λ'≥λ} ε'(λ'). (ε, δ) follows from dp-accounting's RDP→DP conversion.

The base curve ε(λ) is dp-accounting's RDP of one run: T releases of
PoissonSampled(q, Gaussian(σ)), add/remove-one adjacency, composed with the
release of the score. A score computed on a validation split of the PRIVATE
data is released with Gaussian noise N(0, (σ_s·Δ)²), Δ its add/remove
sensitivity (1/n for an accuracy over n examples), which costs λ/(2σ_s²) more
at order λ. A score computed only on genuinely public data needs no noise and
costs nothing; that is an explicit choice (:func:`public_score`), never a default.

What must stay secret for the guarantee to hold: K, the candidates that were
tried, every run but the best one (its output and its score), and anything
that reveals them, such as the total running time, which grows with K. With a
user seed, K and the score noise are reproducible, and the guarantee holds
only while the seed stays secret (the result is then marked ``seeded``).
"""

from __future__ import annotations

import functools
import math
import secrets
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np
from dp_accounting.rdp import rdp_privacy_accountant
from numpy.typing import ArrayLike

from dpmuon_jax import checks
from dpmuon_jax.privacy.accounting import (
  CALIBRATION_RTOL,
  RDP_ORDERS,
  epsilon_from_rdp,
  log_gap,
  quiet_dp_accounting,
  refine_bracket,
  release_rdp,
)


class TruncatedNegativeBinomial(NamedTuple):
  """K ~ D_{η,γ} on {1, 2, ...} (the paper's Definition 1).

  ::

      P[K = k] = (1−γ)^k / (γ^{−η} − 1) · ∏_{l=0}^{k−1} (l + η)/(l + 1)   (η ≠ 0),
      P[K = k] = (1−γ)^k / (k·log(1/γ))                               (η = 0),

  with η ∈ (−1, ∞) and γ ∈ (0, 1): η = 0 is the logarithmic distribution,
  η = 1 the geometric one, P[K = k] = γ(1−γ)^{k−1}.
  """

  eta: float
  gamma: float


class Poisson(NamedTuple):
  """K ~ Poisson(μ) on {0, 1, ...}; with K = 0 nothing is output."""

  mu: float


RunCount = TruncatedNegativeBinomial | Poisson


def _check_run_count(distribution: RunCount) -> None:
  if isinstance(distribution, TruncatedNegativeBinomial):
    checks.check_in_range("eta", distribution.eta, -1.0, math.inf, low_inclusive=False)
    checks.check_in_range("gamma", distribution.gamma, 0.0, 1.0, False, False)
  elif isinstance(distribution, Poisson):
    checks.check_positive("mu", distribution.mu)
  else:
    raise TypeError(
        "distribution must be a TruncatedNegativeBinomial or a Poisson, got "
        f"{type(distribution).__name__}."
    )


def _log_eta_over_expm1(eta: float, log_inv_gamma: float) -> float:
  """log(η/(γ^{−η} − 1)) = log(η/expm1(η·log(1/γ))), and its limit −log log(1/γ) at η = 0."""
  x = eta * log_inv_gamma
  if x == 0.0:
    return -math.log(log_inv_gamma)
  log_abs_expm1 = x + math.log1p(-math.exp(-x)) if x > 30.0 else math.log(abs(math.expm1(x)))
  return math.log(abs(eta)) - log_abs_expm1


def expected_runs(distribution: RunCount) -> float:
  """E[K]: μ, or η(1−γ)/(γ(1−γ^η)) for D_{η,γ} ((1/γ − 1)/log(1/γ) at η = 0)."""
  _check_run_count(distribution)
  if isinstance(distribution, Poisson):
    return float(distribution.mu)
  eta, gamma = distribution
  return (1.0 / gamma - 1.0) * math.exp(_log_ratio_mean(eta, gamma))


def _log_ratio_mean(eta: float, gamma: float) -> float:
  """log(η/(1 − γ^η)), the limit −log log(1/γ) at η = 0."""
  x = -eta * math.log(gamma)  # γ^η = exp(−x), 1 − γ^η = −expm1(−x)
  if x == 0.0:
    return -math.log(-math.log(gamma))
  return math.log(eta / -math.expm1(-x))


def truncated_negative_binomial(mean: float, eta: float = 0.0) -> TruncatedNegativeBinomial:
  """The D_{η,γ} with E[K] = ``mean`` (> 1); γ by bisection, E[K] decreasing in γ."""
  checks.check_in_range("mean", mean, 1.0, math.inf, low_inclusive=False)
  checks.check_in_range("eta", eta, -1.0, math.inf, low_inclusive=False)
  if eta == 1.0:
    return TruncatedNegativeBinomial(1.0, 1.0 / mean)
  mean_at = lambda log_gamma: expected_runs(TruncatedNegativeBinomial(eta, math.exp(log_gamma)))
  low, high = -1.0, 0.0  # in log γ; E[K] → 1 as γ → 1 and → ∞ as γ → 0
  while mean_at(low) < mean:
    low, high = 2.0 * low, low
  while high - low > 1e-12:
    middle = (low + high) / 2
    if mean_at(middle) < mean:
      high = middle
    else:
      low = middle
  return TruncatedNegativeBinomial(float(eta), math.exp((low + high) / 2))


def sample_run_count(distribution: RunCount, rng: np.random.Generator) -> int:
  """Draws K with ``rng``: numpy's Poisson sampler, or the inverse CDF of D_{η,γ}."""
  _check_run_count(distribution)
  if isinstance(distribution, Poisson):
    return int(rng.poisson(distribution.mu))
  return _tnb_inverse_cdf(distribution, float(rng.random()))


def _tnb_inverse_cdf(distribution: TruncatedNegativeBinomial, u: float) -> int:
  """The least k with P[K ≤ k] > u, summing the pmf by its ratio (1−γ)(k+η)/(k+1)."""
  eta, gamma = distribution
  log_decay = math.log1p(-gamma)
  log_p = log_decay + _log_eta_over_expm1(eta, -math.log(gamma))  # log P[K = 1]
  k, cumulative = 1, math.exp(log_p)
  while cumulative <= u:
    ratio = (1.0 - gamma) * (k + eta) / (k + 1)
    log_p += log_decay + math.log((k + eta) / (k + 1))
    k += 1
    p = math.exp(log_p)
    if p == 0.0 and ratio < 1.0:
      break  # u lies beyond the rounding error of the total mass 1
    cumulative += p
  return k


class ScoreRelease(NamedTuple):
  """How each run's score is released before the best run is chosen.

  Attributes:
    sensitivity: Δ, the most the raw score can change when one example is
      added or removed (1/n for an accuracy over n private examples).
    noise_multiplier: σ_s; the score is released with N(0, (σ_s·Δ)²) noise,
      an RDP cost of λ/(2σ_s²) at order λ. ``None`` for a public score.
    public: the score reads only data outside the protected dataset: it is
      released as it is and costs nothing.
  """

  sensitivity: float | None
  noise_multiplier: float | None
  public: bool = False

  @property
  def noise_std(self) -> float:
    """The standard deviation σ_s·Δ of the noise on the score (0 if public)."""
    if self.public:
      return 0.0
    if self.noise_multiplier is None or self.sensitivity is None:
      raise ValueError("A private score needs its sensitivity and noise_multiplier.")
    return float(self.noise_multiplier) * float(self.sensitivity)


def noisy_score(sensitivity: float, noise_multiplier: float) -> ScoreRelease:
  """A score on private data, released with Gaussian noise of std noise_multiplier·sensitivity."""
  checks.check_positive("score sensitivity", sensitivity)
  checks.check_positive("score noise_multiplier", noise_multiplier)
  return ScoreRelease(float(sensitivity), float(noise_multiplier), False)


def public_score() -> ScoreRelease:
  """A score computed only on public data (not the training or validation data): no noise."""
  return ScoreRelease(None, None, True)


def _check_score(score: ScoreRelease) -> None:
  if not isinstance(score, ScoreRelease):
    raise TypeError(
        f"score must be a ScoreRelease (noisy_score or public_score), got {type(score).__name__}."
    )
  if not score.public:
    checks.check_positive("score sensitivity", score.sensitivity)
    checks.check_positive("score noise_multiplier", score.noise_multiplier)


class RunPrivacy(NamedTuple):
  """What every run releases: ``steps`` releases of PoissonSampled(q, Gaussian(σ)).

  σ is the noise multiplier as the accountant sees it (add/remove-one adjacency).
  """

  noise_multiplier: float
  sampling_rate: float
  steps: int


def _check_run(run: RunPrivacy) -> None:
  if not isinstance(run, RunPrivacy):
    raise TypeError(f"run must be a RunPrivacy, got {type(run).__name__}.")
  checks.check_positive("noise_multiplier", run.noise_multiplier)
  checks.check_in_range("sampling_rate", run.sampling_rate, 0.0, 1.0, low_inclusive=False)
  checks.check_positive_int("steps", run.steps)


@functools.lru_cache(maxsize=512)
def _base_rdp(sigma: float, q: float, steps: int, score_sigma: float | None) -> tuple[float, ...]:
  rdp = release_rdp(sigma, q, steps)
  if score_sigma is not None:  # the score's Gaussian: a release of every example (q = 1)
    rdp = rdp + release_rdp(score_sigma, 1.0)
  return tuple(float(r) for r in rdp)


def base_rdp(run: RunPrivacy, score: ScoreRelease) -> np.ndarray:
  """ε(λ) of one run Q at the orders :data:`RDP_ORDERS`: its training releases and its score."""
  _check_run(run)
  _check_score(score)
  score_sigma = None if score.noise_multiplier is None or score.public else float(
      score.noise_multiplier)
  return np.asarray(_base_rdp(float(run.noise_multiplier), float(run.sampling_rate),
                              int(run.steps), score_sigma))


def _tnb_rdp(orders: np.ndarray, rdp: np.ndarray, d: TruncatedNegativeBinomial) -> np.ndarray:
  """ε(λ) + (1+η)·min_λ̂ [(1 − 1/λ̂)ε(λ̂) + log(1/γ)/λ̂] + log E[K]/(λ − 1), λ̂ over ``orders``."""
  with np.errstate(invalid="ignore"):
    hat = (1.0 - 1.0 / orders) * rdp - math.log(d.gamma) / orders
  hat = np.where(np.isnan(hat), np.inf, hat)  # 0·inf at λ̂ = 1
  constant = (1.0 + d.eta) * float(np.min(hat))
  out = np.full(orders.shape, np.inf)
  above = orders > 1.0
  out[above] = rdp[above] + constant + math.log(expected_runs(d)) / (orders[above] - 1.0)
  return out


def _poisson_rdp(orders: np.ndarray, rdp: np.ndarray, d: Poisson) -> np.ndarray:
  """ε(λ) + μ·δ̂ + log μ/(λ − 1), δ̂ the δ of Q at ε̂ = log(1 + 1/(λ−1))."""
  out = np.full(orders.shape, np.inf)
  order_list, rdp_list = orders.tolist(), rdp.tolist()
  with quiet_dp_accounting():
    for i, order in enumerate(order_list):
      if order <= 1.0 or not math.isfinite(rdp_list[i]):
        continue
      delta_hat, _ = rdp_privacy_accountant.compute_delta(
          order_list, rdp_list, math.log1p(1 / (order - 1)))
      out[i] = rdp[i] + d.mu * delta_hat + math.log(d.mu) / (order - 1.0)
  return out


def tuned_rdp(orders: ArrayLike, rdp: ArrayLike, distribution: RunCount) -> np.ndarray:
  """The RDP curve of the best of K runs, from one run's curve ``rdp`` at ``orders``.

  Args:
    orders: increasing RDP orders, all ≥ 1.
    rdp: ε(λ) of one run at each order (``inf`` where unknown).
    distribution: the law of K.

  Returns:
    ε'(λ) at each order (``inf`` at λ = 1), lowered to min_{λ'≥λ} ε'(λ').
  """
  _check_run_count(distribution)
  at, eps = np.asarray(orders, np.float64), np.asarray(rdp, np.float64)
  if at.ndim != 1 or at.shape != eps.shape or at.size == 0:
    raise ValueError(f"orders and rdp must be 1-D of one length, got {at.shape}, {eps.shape}.")
  if np.any(at < 1.0) or np.any(np.diff(at) <= 0):
    raise ValueError("orders must be increasing and all >= 1.")
  if np.any(np.isnan(eps)) or np.any(eps < 0):
    raise ValueError("rdp must be non-negative (inf allowed), without NaN.")
  if isinstance(distribution, Poisson):
    out = _poisson_rdp(at, eps, distribution)
  else:
    out = _tnb_rdp(at, eps, distribution)
  return np.minimum.accumulate(out[::-1])[::-1]


def run_epsilon(run: RunPrivacy, score: ScoreRelease, target_delta: float) -> float:
  """ε at δ of ONE run and its score (what a single run, untuned, would spend)."""
  checks.check_in_range("target_delta", target_delta, 0.0, 1.0, False, False)
  return epsilon_from_rdp(base_rdp(run, score), target_delta)


def tuned_epsilon(
    run: RunPrivacy, distribution: RunCount, score: ScoreRelease, target_delta: float
) -> float:
  """ε at δ = ``target_delta`` of the whole tuning procedure (all K runs, best one output).

  Args:
    run: σ, q and T of every training run.
    distribution: the law of K (:class:`TruncatedNegativeBinomial` or :class:`Poisson`).
    score: how each run's score is released (:func:`noisy_score` or :func:`public_score`).
    target_delta: δ in (0, 1).
  """
  checks.check_in_range("target_delta", target_delta, 0.0, 1.0, False, False)
  return epsilon_from_rdp(tuned_rdp(RDP_ORDERS, base_rdp(run, score), distribution),
                           target_delta)


MAX_NOISE_MULTIPLIER = 1e4
"""The largest σ :func:`calibrate_tuned_noise_multiplier` tries."""


def calibrate_tuned_noise_multiplier(
    target_epsilon: float,
    target_delta: float,
    sampling_rate: float,
    steps: int,
    distribution: RunCount,
    score: ScoreRelease,
) -> float:
  """The σ of every run for which the WHOLE tuning procedure spends at most ``target_epsilon``.

  ε'(σ) decreases in σ. It is bracketed by factors of 2 from σ = 1, then
  secant steps in (log σ, log ε') safeguarded by bisection shrink the bracket
  (as for one run, :func:`~dpmuon_jax.privacy.accounting.calibrate_noise_multiplier`)
  until ε'(σ) is within a relative :data:`~dpmuon_jax.privacy.accounting.CALIBRATION_RTOL`
  below the target; that σ is returned.

  Raises:
    ValueError: if even σ = :data:`MAX_NOISE_MULTIPLIER` spends more than
      the target: the score's release and the random number of runs alone
      cost that much.
  """
  checks.check_positive("target_epsilon", target_epsilon)
  epsilon = lambda sigma: tuned_epsilon(
      RunPrivacy(sigma, sampling_rate, steps), distribution, score, target_delta)
  floor = epsilon(MAX_NOISE_MULTIPLIER)
  if floor > target_epsilon:
    raise ValueError(
        f"A tuned ε of {target_epsilon:g} is out of reach: with σ = {MAX_NOISE_MULTIPLIER:g} the "
        f"score releases and the random number of runs (E[K] = {expected_runs(distribution):g}) "
        f"already spend ε = {floor:.3f}; add score noise, expect fewer runs or raise ε."
    )
  fits, fails = 1.0, 0.5
  while epsilon(fits) > target_epsilon:
    fits, fails = min(2.0 * fits, MAX_NOISE_MULTIPLIER), fits
  while epsilon(fails) <= target_epsilon:
    fits, fails = fails, fails / 2.0
  close_enough = lambda fits, fails, gap_fits: (
      gap_fits >= math.log1p(-CALIBRATION_RTOL) or fits - fails <= 1e-9 * fits)
  return refine_bracket(lambda sigma: log_gap(epsilon(sigma), target_epsilon), fits, fails,
                 integer=False, close_enough=close_enough)


class RunRecord(NamedTuple):
  """One run of a tuning procedure: its candidate and its released (noisy) score."""

  candidate: Any
  score: float


class TuningResult(NamedTuple):
  """What :func:`private_tune` returns.

  Attributes:
    candidate: the best run's candidate (``None`` if K = 0, Poisson only).
    result: the best run's result, as ``train_fn`` returned it (``None`` if K = 0).
    score: the best run's released score (``None`` if K = 0).
    epsilon: ε of the whole procedure at ``delta``.
    delta: δ.
    seeded: K, the candidates and the score noise came from a user seed.
    nonprivate_runs: every run's candidate and released score, in order. NOT
      covered by (ε, δ): it reveals K and the other runs. For debugging only;
      never publish it.
  """

  candidate: Any
  result: Any
  score: float | None
  epsilon: float
  delta: float
  seeded: bool
  nonprivate_runs: tuple[RunRecord, ...]


def _tuning_rng(seed: int | None) -> tuple[np.random.Generator, bool]:
  """A generator from 128 bits of OS entropy, or from a user seed (then ``seeded``)."""
  if seed is None:
    return np.random.default_rng(secrets.randbits(128)), False
  return np.random.default_rng(checks.check_nonnegative_int("seed", seed)), True


def _released_score(raw: Any, score: ScoreRelease, rng: np.random.Generator) -> float:
  """The raw score plus N(0, (σ_s·Δ)²) (nothing for a public score)."""
  if isinstance(raw, (bool, np.bool_)) or not isinstance(raw, (int, float, np.number)):
    raise TypeError(f"train_fn must return (score, result) with a numeric score, got {raw!r}.")
  if not math.isfinite(float(raw)):
    raise ValueError(f"train_fn returned a score that is not a finite number: {raw!r}.")
  noise = 0.0 if score.public else float(rng.normal(0.0, score.noise_std))
  return float(raw) + noise


def _check_tune_arguments(train_fn, candidates, target_delta) -> None:
  if not callable(train_fn):
    raise TypeError(f"train_fn must be callable, got {type(train_fn).__name__}.")
  if isinstance(candidates, (str, bytes)) or not isinstance(candidates, Sequence):
    raise TypeError(f"candidates must be a sequence, got {type(candidates).__name__}.")
  if len(candidates) == 0:
    raise ValueError("candidates must not be empty.")
  checks.check_in_range("target_delta", target_delta, 0.0, 1.0, False, False)


def private_tune(
    train_fn: Callable[[Any, int | None], tuple[float, Any]],
    candidates: Sequence[Any],
    *,
    run: RunPrivacy,
    distribution: RunCount,
    score: ScoreRelease,
    target_delta: float,
    seed: int | None = None,
    discard: Callable[[Any], None] | None = None,
) -> TuningResult:
  """Runs ``train_fn`` K times on random candidates and returns only the best run.

  K is drawn from ``distribution`` before any run, from OS entropy unless
  ``seed`` is given. Each run draws its candidate uniformly from
  ``candidates``, calls ``train_fn(candidate, run_seed)`` (``run_seed`` is
  ``None`` unless seeded: the run then draws its own OS entropy), and
  releases ``score_k = raw_k + N(0, (σ_s·Δ)²)``. The best run maximises
  (score_k, u_k), u_k an independent uniform tie-break.

  Args:
    train_fn: one private run. It must release no more than ``run`` allows
      (at most T releases of PoissonSampled(q, Gaussian(σ))) and return
      ``(raw_score, result)`` with ``raw_score`` a finite number whose
      add/remove sensitivity is at most ``score.sensitivity``.
    candidates: the public grid of hyperparameters.
    run: σ, q and T of every run.
    distribution: the law of K.
    score: how scores are released.
    target_delta: δ of the returned guarantee.
    seed: reproducible K, candidates and score noise (marks the result seeded).
    discard: called once on the result of every run that is not (or no
      longer) the best, e.g. to delete its files.

  Returns:
    A :class:`TuningResult`; for K = 0 (Poisson only) without a best run.
  """
  _check_tune_arguments(train_fn, candidates, target_delta)
  epsilon = tuned_epsilon(run, distribution, score, target_delta)  # refuses bad settings first
  rng, seeded = _tuning_rng(seed)
  count = sample_run_count(distribution, rng)
  best, records = None, []
  for _ in range(count):
    candidate = candidates[int(rng.integers(len(candidates)))]
    run_seed = int(rng.integers(2**31 - 1)) if seeded else None
    out = train_fn(candidate, run_seed)
    if not isinstance(out, tuple) or len(out) != 2:
      raise TypeError(f"train_fn must return a (score, result) pair, got {type(out).__name__}.")
    released = _released_score(out[0], score, rng)
    entry = (released, float(rng.random()), candidate, out[1])
    records.append(RunRecord(candidate, released))
    loser = None
    if best is None or entry[:2] > best[:2]:
      best, loser = entry, best
    else:
      loser = entry
    if loser is not None and discard is not None:
      discard(loser[3])
  if best is None:
    return TuningResult(None, None, None, epsilon, float(target_delta), seeded, tuple(records))
  return TuningResult(best[2], best[3], best[0], epsilon, float(target_delta), seeded,
                      tuple(records))
