"""Multi-run audit with Clopper–Pearson intervals (Jagielski, Ullman & Oprea 2020).

Train n_in models with the canary and n_out without it, score each model, and
call "in" when the score is ≥ a threshold τ. With FN of the "in" runs below τ
and FP of the "out" runs at or above it, at confidence 1 − α::

    FPR_ub = BetaInv(1 − α/2; FP + 1, n_out − FP)      (1 if FP = n_out)
    FNR_ub = BetaInv(1 − α/2; FN + 1, n_in − FN),   TPR_lb = 1 − FNR_ub
    ε̂ = max(0, ln((TPR_lb − δ) / FPR_ub))
    two-sided: also ln((TNR_lb − δ) / FNR_ub), the larger of the two.

τ is chosen after seeing the scores, so α is divided by the number of
candidate thresholds (Bonferroni), as in jax_privacy's
``CanaryScoreAuditor.epsilon_clopper_pearson``.
"""

from __future__ import annotations

import numpy as np
import scipy.stats

from dpmuon_jax.audit.thresholds import roc_thresholds


def clopper_pearson_upper(k, n, significance: float) -> np.ndarray:
  """One-sided upper bound p with P[Binomial(n, p) ≤ k] = significance (1 when k = n)."""
  k, n = np.asarray(k), np.asarray(n)
  with np.errstate(invalid="ignore", divide="ignore"):
    return np.where(k < n, scipy.stats.beta.ppf(1 - significance, k + 1, n - k), 1.0)


def _best_ratio(pos_lb_complement: np.ndarray, neg_ub: np.ndarray, delta: float) -> float:
  """max over thresholds of ln((1 − pos_ub − δ) / neg_ub), or 0."""
  pos_lb = 1.0 - pos_lb_complement
  valid = pos_lb > delta
  if not valid.any():
    return 0.0
  return max(0.0, float(np.max(np.log(pos_lb[valid] - delta) - np.log(neg_ub[valid]))))


def epsilon_clopper_pearson(
    in_scores: np.ndarray,
    out_scores: np.ndarray,
    significance: float = 0.05,
    delta: float = 0.0,
    one_sided: bool = True,
) -> float:
  """ε̂ from the scores of runs with (``in_scores``) and without (``out_scores``) the canary.

  Bonferroni over the thresholds of
  :func:`~dpmuon_jax.audit.thresholds.roc_thresholds`.
  """
  if not 0 < significance < 0.5:
    raise ValueError(f"significance must be in (0, 0.5), got {significance}.")
  if not 0 <= delta <= 1:
    raise ValueError(f"delta must be in [0, 1], got {delta}.")
  _, true_pos, false_pos = roc_thresholds(in_scores, out_scores)
  n_in, n_out = len(in_scores), len(out_scores)
  level = significance / len(true_pos) / 2
  fnr_ub = clopper_pearson_upper(n_in - true_pos, n_in, level)
  fpr_ub = clopper_pearson_upper(false_pos, n_out, level)
  eps = _best_ratio(fnr_ub, fpr_ub, delta)
  if not one_sided:
    eps = max(eps, _best_ratio(fpr_ub, fnr_ub, delta))
  return eps
