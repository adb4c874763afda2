"""The one-run audit ε̂ of Steinke, Nasr & Jagielski (arXiv 2305.08846, NeurIPS 2023).

m canaries are each included with probability 1/2 (S_i = ±1); after ONE
training run an attacker guesses "in" for the r highest-scoring canaries, v of
them correctly. Under the null "the algorithm is (ε, δ)-DP" (the paper's
Theorem 3.3)::

    p_ε   = e^ε / (1 + e^ε)
    β     = P[Binomial(r, p_ε) ≥ v]
    α     = max_{i=1..v} P[v > Binomial(r, p_ε) ≥ v − i] / i
    p(ε, δ) = min(1, β + α·δ·2m)                           (δ = 0: p = β)

ε̂ is the largest ε with p(ε, δ) ≤ significance (p decreases in ε). The
threshold (r) is chosen after seeing the scores, so the significance is split
over all candidate thresholds (Bonferroni), as jax_privacy's
``CanaryScoreAuditor.epsilon_one_run`` does by default; the candidates are the
vertices of the ROC curve's upper hull (other thresholds are dominated).
"""

from __future__ import annotations

from typing import cast

import numpy as np
import scipy.optimize
import scipy.special
import scipy.stats

from dpmuon_jax.audit.clopper_pearson import clopper_pearson_upper
from dpmuon_jax.audit.thresholds import roc_thresholds

_binom = scipy.stats.binom


def one_run_p_value(
    num_canaries: int, num_guesses: int, num_correct: int, epsilon: float, delta: float
) -> float:
  """p(ε, δ) = min(1, β + α·δ·2m) of the one-run audit (module docstring)."""
  q = scipy.special.expit(epsilon)
  beta = float(_binom.sf(num_correct - 1, num_guesses, q))
  if delta == 0:
    return beta
  i = np.arange(1, num_correct + 1)
  alpha = np.max((_binom.sf(num_correct - i - 1, num_guesses, q) - beta) / i, initial=0.0)
  return min(beta + float(alpha) * delta * 2 * num_canaries, 1.0)


def epsilon_one_run_counts(
    num_canaries: int,
    num_guesses: int,
    num_correct: int,
    significance: float,
    delta: float,
    epsilon_floor: float = 0.0,
) -> float:
  """The largest ε ≥ ``epsilon_floor`` with p(ε, δ) ≤ significance (else the floor)."""
  if num_guesses == 0 or (
      one_run_p_value(num_canaries, num_guesses, num_correct, epsilon_floor, 0.0) > significance
  ):
    return epsilon_floor  # not rejected even with δ = 0

  def gap(eps: float) -> float:  # > 0 while (ε, δ)-DP is rejected
    return significance - one_run_p_value(num_canaries, num_guesses, num_correct, eps, delta)

  if gap(epsilon_floor) <= 0:
    return epsilon_floor
  lo, hi = epsilon_floor, max(1.0, 2 * epsilon_floor)
  while gap(hi) > 0:
    lo, hi = hi, 2 * hi
  return float(cast(float, scipy.optimize.brentq(gap, lo, hi, xtol=1e-6)))


def epsilon_one_run(
    in_scores: np.ndarray, out_scores: np.ndarray, significance: float = 0.05, delta: float = 1e-6
) -> float:
  """ε̂: the one-run lower bound, Bonferroni-corrected over the thresholds.

  Args:
    in_scores: scores of the included canaries (S_i = +1); higher means "in".
    out_scores: scores of the excluded canaries (S_i = −1).
    significance: 1 − confidence (0.05: ε̂ is a 95% lower bound).
    delta: the δ of the (ε, δ) claim under test, in (0, 1].
  """
  if not 0 < significance < 1:
    raise ValueError(f"significance must be in (0, 1), got {significance}.")
  if not 0 < delta <= 1:
    raise ValueError(f"delta must be in (0, 1], got {delta}.")
  _, true_pos, false_pos = roc_thresholds(in_scores, out_scores)
  m = len(in_scores) + len(out_scores)
  level = significance / len(true_pos)
  guesses = true_pos + false_pos
  # Visit thresholds by decreasing precision lower bound; a threshold whose raw
  # precision is at most p_ε̂ cannot reject a larger ε.
  precision_lb = 1.0 - clopper_pearson_upper(false_pos, guesses, level)
  best, best_q = 0.0, 0.5
  for k in np.argsort(-precision_lb):
    r, v = int(guesses[k]), int(true_pos[k])
    if r == 0 or v / r <= best_q:
      continue
    eps = epsilon_one_run_counts(m, r, v, level, delta, best)
    if eps > best:
      best, best_q = eps, float(scipy.special.expit(eps))
  return best



