"""Candidate decision thresholds of a score-based membership attack.

The attacker calls a canary "in" when its score is ≥ τ. Choosing τ after seeing
the scores costs a multiple-testing correction, so only thresholds that can
matter are candidates: the vertices of the upper hull of the ROC curve (in
(FN, TN) counts), as in jax_privacy's ``auditing._get_tn_fn_counts``.
"""

from __future__ import annotations

import numpy as np


def _upper_hull(points: np.ndarray) -> np.ndarray:
  """Indices of the points (sorted by x) not weakly below a chord of their neighbours."""
  keep = np.arange(len(points))
  while len(keep) > 2:
    d = np.diff(points[keep], axis=0)
    dominated = d[:-1, 1] * d[1:, 0] - d[1:, 1] * d[:-1, 0] <= 0
    if not dominated.any():
      break
    keep = keep[np.r_[True, ~dominated, True]]
  return keep


def roc_thresholds(
    in_scores: np.ndarray, out_scores: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Candidate thresholds τ ("in" iff score ≥ τ) and the TP and FP counts at each.

  Only the vertices of the ROC curve's upper hull are kept: a threshold between
  two of them is never better for any of the bounds here.
  """
  in_scores, out_scores = np.sort(np.asarray(in_scores)), np.sort(np.asarray(out_scores))
  if in_scores.size == 0 or out_scores.size == 0:
    raise ValueError("Need at least one included and one excluded canary.")
  thresholds = np.concatenate([np.union1d(in_scores, out_scores), [np.inf]])
  false_neg = np.searchsorted(in_scores, thresholds, side="left")
  true_neg = np.searchsorted(out_scores, thresholds, side="left")
  keep = _upper_hull(np.stack([false_neg, true_neg], axis=1))
  return thresholds[keep], in_scores.size - false_neg[keep], out_scores.size - true_neg[keep]
