"""The report of a :class:`experiments.study.Study`: summary, gaps, plot, threshold report.

Writes into the study's folder:

* ``summary.csv``: per arm, the grid (learning rate → final validation
  accuracy), the chosen rate, whether it is still on the grid's edge, the 1-D
  group's rate, DiSK's κ with its white-noise variance gain κ/(2−κ) and
  whether the arm won its selection group, and the test accuracy over the
  reported seeds (mean ± std) with the largest ε any run spent;
* ``gaps.csv`` (the earlier protocol only, without a selection seed): per
  batch size and training length, each optimizer's test accuracy minus
  DP-SGD's, with the unpaired standard error sqrt(s₁²/n₁ + s₂²/n₂);
* ``paired_gaps.csv``: the same differences paired by seed: each seed's
  d_s, their mean and the paired standard error sd(d)/√n;
* ``filter_gaps.csv``: paper 1's temporal-filter question, paired the same
  way: each DiSK or DOPPLER arm minus the optimizer it filters (the
  registry's ``Entry.filters``; DiSK-Muon − DP-Muon, not − DP-SGD);
* ``decision.csv``: the pre-registered rule on DP-Muon − DP-SGD at a fixed
  number of epochs (:func:`decision`), once every batch size has every
  reported seed;
* ``gap_change.csv`` (a study with a ``gap_change_rule``): how that gap moves
  between two batch sizes, seed by seed, and where the B's between them sit
  against a reference study (:func:`gap_change_rows`);
* ``correlated_gaps.csv`` and ``correlated_decision.csv`` (a study with correlated-noise
  arms): the correlated-noise rule's paired quantities h, e, i per B and its two verdicts
  (:func:`correlated_noise_rows`);
* ``predictor.csv``: per B and training length, the recovery-threshold
  prediction next to the observed paired gap (:func:`predictor_rows`), and
  ``predictor_count.csv``, its hits and misses once every point has every
  reported seed (:func:`predictor_count`), and ``predictor_vs_cutoff.csv``,
  the same points scored by the plain batch-size cutoffs "helps iff B ≥ b*"
  for each b* among the study's batch sizes (:func:`predictor_vs_cutoff`);
* ``gap_steps.csv``: how the fixed-epoch DP-Muon − DP-SGD gap moves from each
  batch size to the next, seed by seed (:func:`gap_step_rows`, descriptive:
  the strict-rise clause of :func:`decision` read step by step), and
  ``paper1_gaps.csv``, the same clause read on paper 1's own means
  (:func:`paper1_gap_rows`);
* ``ablation.csv``: paper 1's ablation table laid out as the paper's, this
  study's test accuracy beside paper 1's (:data:`PAPER1_TABLE`), and
  ``ablation.md``, the same as a Markdown table for the READMEs, and
  ``filter_gaps.md``, ``filter_gaps.csv``'s fixed-epoch rows as one;
* ``accuracy_vs_batch.png``: test accuracy against B per optimizer, error
  bars = std over seeds (solid: fixed epochs; dashed: fixed releases);
* ``threshold_report.csv``: NON-PRIVATE analysis of paper 1's recovery
  threshold on the mean CLIPPED gradient (the signal the release averages)
  per layer, at initialisation and at the end of the DP-SGD and DP-Muon runs
  (selection seed, chosen rate) of every batch size and training length.
  The end rows need that run's folder (``runs/`` is not committed); where it
  is gone, the rows the last report recorded from it are kept.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable

import numpy as np

from dpmuon_jax.extras import pyplot
from dpmuon_jax.optimizers import registry
from dpmuon_jax.training.export import load_exported
from dpmuon_jax.training.records import write_csv
from experiments.study import (
    Arm,
    PrivatelyTunedArm,
    Study,
    grid_state,
    initial_model,
    mean_std,
    read_rows,
    reported_seeds,
    resolved,
    run_dir,
    selected_variant,
    selection_seed,
    split_data,
)

PROBE_SIZE = 1024
PRIVATE_LABEL = "private_tuning"

# Paper 1 ("Spectral Gradient Orthogonalization Improves Differentially Private Training at
# Scale"): CIFAR-10, WRN-16-4, ε = 4, test accuracy (%) mean ± std over 3 seeds; the ablation
# table (B = 256 / 1024 / 4096) and, for DP-Muon-S and B = 2048, the main table.
PAPER1_TABLE: dict[tuple[str, int], tuple[float, float]] = {
    ("dp_sgd", 256): (39.4, 1.2), ("dp_sgd", 1024): (39.7, 2.6), ("dp_sgd", 2048): (37.0, 2.6),
    ("dp_sgd", 4096): (39.3, 0.3),
    ("dp_disk_sgd", 256): (49.0, 2.8), ("dp_disk_sgd", 1024): (46.7, 1.3),
    ("dp_disk_sgd", 4096): (39.9, 0.6),
    ("dp_doppler_sgd", 256): (37.7, 2.0), ("dp_doppler_sgd", 1024): (39.3, 2.0),
    ("dp_doppler_sgd", 4096): (32.3, 1.1),
    ("dp_muon", 256): (39.0, 0.5), ("dp_muon", 1024): (43.3, 1.6), ("dp_muon", 2048): (47.3, 1.8),
    ("dp_muon", 4096): (48.7, 0.6),
    ("dp_disk_muon", 256): (41.7, 2.7), ("dp_disk_muon", 1024): (48.8, 1.0),
    ("dp_disk_muon", 4096): (45.8, 1.2),
    ("dp_doppler_muon", 256): (40.1, 1.6), ("dp_doppler_muon", 1024): (44.9, 2.0),
    ("dp_doppler_muon", 4096): (50.3, 1.0),
    ("dp_muon_s", 256): (38.7, 1.0), ("dp_muon_s", 1024): (44.5, 2.9),
    ("dp_muon_s", 2048): (47.8, 1.7), ("dp_muon_s", 4096): (46.3, 0.8),
}
PAPER1_ROWS = ("dp_sgd", "dp_disk_sgd", "dp_doppler_sgd", "dp_muon", "dp_disk_muon",
               "dp_doppler_muon", "dp_muon_s")


def _arm_rows(arm: Arm, rows: list[dict]) -> list[dict]:
  return [r for r in rows if r["arm"] == arm.name]


def noise_variance_gain(kappa: float) -> float:
  """κ/(2−κ): the stationary variance of DiSK's g_t = (1−κ)g_{t−1} + κw_t per unit of white w_t.

  Σ_k κ²(1−κ)^{2k} = κ²/(1 − (1−κ)²) = κ/(2−κ), for κ in (0, 2).
  """
  return kappa / (2.0 - kappa)


def reported_rows(study: Study, arm: Arm, rows: list[dict]) -> list[dict]:
  """The arm's runs at its chosen rate on the reported seeds (none if it lost its group)."""
  mine = _arm_rows(arm, rows)
  if isinstance(arm, PrivatelyTunedArm):  # one private selection per seed, rates may differ
    return mine
  _, chosen = grid_state(study, arm, rows)
  if chosen is None or selected_variant(study, arm, rows) != arm:
    return []
  return [r for r in mine if float(r["learning_rate"]) == chosen
          and int(r["seed"]) in reported_seeds(study, arm)]


def arm_summary(study: Study, arm: Arm, rows: list[dict]) -> dict:
  """One arm's grid, chosen rate and test accuracy over the chosen rate's reported seeds."""
  mine = _arm_rows(arm, rows)
  if isinstance(arm, PrivatelyTunedArm):
    grid, chosen = [], None
  else:
    grid = sorted((float(r["learning_rate"]), float(r["final_val_accuracy"])) for r in mine
                  if int(r["seed"]) == selection_seed(study))
    _, chosen = grid_state(study, arm, rows)
  seeds = reported_rows(study, arm, rows)
  tests = [float(r["test_accuracy"]) for r in seeds]
  mean, std = mean_std(tests) if tests else (math.nan, math.nan)
  on_edge = bool(grid) and chosen in (grid[0][0], grid[-1][0])
  kappa = dict(arm.options).get("kappa")
  ready = resolved(study, arm, rows)
  return {
      "arm": arm.name, "optimizer": arm.optimizer, "batch_size": arm.batch_size,
      "label": arm.label, "clipping": arm.clipping,
      "releases": mine[0]["releases"] if mine else "",
      "noise_multiplier": mine[0]["noise_multiplier"] if mine else "",
      "grid": " ".join(f"{lr:g}:{acc:.4f}" for lr, acc in grid),
      "chosen_learning_rate": " ".join(r["learning_rate"] for r in seeds) if chosen is None
      else chosen, "chosen_on_edge": on_edge,
      "fallback_learning_rate": "" if ready is None or ready.fallback_learning_rate is None
      else ready.fallback_learning_rate,
      "kappa": "" if kappa is None else kappa,
      "noise_variance_gain": "" if kappa is None else noise_variance_gain(float(kappa)),
      "selected": chosen is not None and selected_variant(study, arm, rows) == arm,
      "seeds": len(tests), "test_accuracy_mean": mean, "test_accuracy_std": std,
      "max_epsilon_spent": max((float(r["epsilon_spent"]) for r in mine), default=math.nan),
  }


def gap_rows(summary: list[dict], baseline: str = "dp_sgd") -> list[dict]:
  """Each optimizer minus ``baseline`` at the same B, label and clipping.

  A privately tuned arm is compared with its own optimizer's validation-tuned
  arm instead: the accuracy its tuning's privacy costs.
  """
  base = {(s["batch_size"], s["label"]): s for s in summary
          if s["optimizer"] == baseline and s["clipping"] == "flat"}
  same = {(s["optimizer"], s["batch_size"]): s for s in summary
          if s["label"] == "main" and s["clipping"] == "flat"}
  out = []
  for s in summary:
    b = base.get((s["batch_size"], s["label"]))
    if s["label"] == PRIVATE_LABEL:
      b = same.get((s["optimizer"], s["batch_size"]))
    if b is None or b is s or min(s["seeds"], b["seeds"]) < 2:  # no spread from one seed
      continue
    se = math.sqrt(_var(s) / s["seeds"] + _var(b) / b["seeds"])
    out.append({"batch_size": s["batch_size"], "label": s["label"], "arm": s["arm"],
                "baseline": b["arm"],
                "gap": s["test_accuracy_mean"] - b["test_accuracy_mean"], "standard_error": se,
                "seeds": min(s["seeds"], b["seeds"])})
  return out


def paired_gap_rows(study: Study, rows: list[dict], baseline: str = "dp_sgd") -> list[dict]:
  """Each reported arm minus ``baseline`` at the same B, label and clipping, paired by seed.

  d_s = test accuracy of the arm's seed s − the baseline's seed s, over the seeds both
  have; ``gap`` = mean d_s, ``paired_standard_error`` = sd(d_s)/√n.
  """
  return _paired_gaps(study, rows, lambda optimizer: baseline)


def filter_gap_rows(study: Study, rows: list[dict]) -> list[dict]:
  """Each temporal-filter arm minus the optimizer it filters (the registry's ``filters``),
  paired by seed as in :func:`paired_gap_rows`: what the filter alone adds at that B."""
  return _paired_gaps(study, rows, lambda optimizer: registry.OPTIMIZERS[optimizer].filters)


def _paired_gaps(study: Study, rows: list[dict],
                 baseline_of: Callable[[str], str]) -> list[dict]:
  bases = {(a.optimizer, a.batch_size, a.label, a.clipping): a for a in study.arms
           if not a.variant}
  out = []
  for arm in study.arms:
    b = bases.get((baseline_of(arm.optimizer), arm.batch_size, arm.label, arm.clipping))
    if b is None or b is arm:
      continue
    diffs = _paired(study, arm, b, rows)
    if len(diffs) < 2:
      continue
    gap, sd = mean_std(list(diffs.values()))
    out.append({"batch_size": arm.batch_size, "label": arm.label, "arm": arm.name,
                "baseline": b.name, "gap": gap, "paired_standard_error": sd / math.sqrt(len(diffs)),
                "seeds": len(diffs),
                "per_seed": " ".join(f"{s}:{d:+.4f}" for s, d in sorted(diffs.items()))})
  return out


def _paired(study: Study, arm: Arm, base: Arm, rows: list[dict]) -> dict[int, float]:
  mine = {int(r["seed"]): float(r["test_accuracy"]) for r in reported_rows(study, arm, rows)}
  theirs = {int(r["seed"]): float(r["test_accuracy"]) for r in reported_rows(study, base, rows)}
  return {s: mine[s] - theirs[s] for s in sorted(set(mine) & set(theirs))}


def decision(study: Study, rows: list[dict], label: str = "main") -> dict | None:
  """The pre-registered rule on d_s(B) = DP-Muon − DP-SGD at seed s, arms labelled ``label``.

  Holds if gap(B) = mean_s d_s(B) rises strictly over the B's in increasing order, the
  d_s at the largest B all have one sign, and gap(B_max) − gap(B_min) > 3 SE with
  SE = sd_s(d_s(B_max) − d_s(B_min))/√n. ``None`` until every B has every reported seed
  of both arms (a verdict is never read from part of the seeds).
  """
  pairs = muon_gaps(study, rows, label)
  if len(pairs) < 2 or not _complete(study, rows, label):
    return None
  sizes = sorted(pairs)
  gaps = [float(np.mean(list(pairs[b].values()))) for b in sizes]
  low, high = pairs[sizes[0]], pairs[sizes[-1]]
  common = sorted(set(low) & set(high))
  change = [high[s] - low[s] for s in common]
  se = float(np.std(change, ddof=1)) / math.sqrt(len(change)) if len(change) > 1 else math.nan
  rises = all(a < b for a, b in zip(gaps, gaps[1:]))
  signs = {np.sign(d) for d in high.values()}
  one_sign = len(signs) == 1 and 0 not in signs
  beyond = gaps[-1] - gaps[0] > 3 * se
  return {"label": label, "batch_sizes": " ".join(map(str, sizes)),
          "gaps": " ".join(f"{g:+.4f}" for g in gaps), "rises": rises,
          "seeds_at_largest_b": " ".join(f"{s}:{d:+.4f}" for s, d in sorted(high.items())),
          "one_sign_at_largest_b": one_sign, "change": gaps[-1] - gaps[0],
          "paired_standard_error_of_change": se, "change_exceeds_3_se": beyond,
          "holds": rises and one_sign and beyond}


def _muon_arms(study: Study, label: str) -> dict[int, tuple[Arm, Arm]]:
  """{B: (DP-Muon, DP-SGD)} of the flat-clipping arms labelled ``label``."""
  pairs = {}
  for arm in study.arms:
    if arm.optimizer == "dp_muon" and arm.label == label and arm.clipping == "flat":
      base = next((a for a in study.arms if a.optimizer == "dp_sgd" and a.label == label
                   and a.batch_size == arm.batch_size and a.clipping == "flat"), None)
      if base is not None:
        pairs[arm.batch_size] = (arm, base)
  return pairs


def muon_gaps(study: Study, rows: list[dict], label: str = "main") -> dict[int, dict[int, float]]:
  """{B: {seed: d_s}}: DP-Muon − DP-SGD test accuracy per reported seed, arms labelled
  ``label``."""
  return {b: _paired(study, muon, sgd, rows)
          for b, (muon, sgd) in _muon_arms(study, label).items()}


def _complete(study: Study, rows: list[dict], label: str, sizes: tuple[int, ...] = ()) -> bool:
  """Whether every DP-Muon / DP-SGD pair labelled ``label`` (at ``sizes``, default all) has
  all its reported seeds, paired."""
  arms = _muon_arms(study, label)
  return all(b in arms for b in sizes) and all(
      set(_paired(study, muon, sgd, rows)) == set(reported_seeds(study, muon))
      == set(reported_seeds(study, sgd))
      for b, (muon, sgd) in arms.items() if not sizes or b in sizes)


def gap_change(low: dict[int, float], high: dict[int, float]) -> dict:
  """How a paired gap moves from one batch size to another, seed by seed.

  c_s = ``high[s]`` − ``low[s]`` over the seeds both have; SE = sd(c)/√n. ``direction``:
  "falls" if every c_s < 0 and mean < −2 SE, "rises" if every c_s > 0 and mean > +2 SE,
  else "undecided".
  """
  seeds = sorted(set(low) & set(high))
  change = [high[s] - low[s] for s in seeds]
  mean, sd = mean_std(change)
  se = sd / math.sqrt(len(change))
  falls = all(c < 0 for c in change) and mean < -2 * se
  rises = all(c > 0 for c in change) and mean > 2 * se
  return {"seeds": " ".join(map(str, seeds)),
          "gap_low": float(np.mean([low[s] for s in seeds])),
          "gap_high": float(np.mean([high[s] for s in seeds])),
          "change_per_seed": " ".join(f"{s}:{c:+.4f}" for s, c in zip(seeds, change)),
          "change": mean, "paired_standard_error": se,
          "all_negative": all(c < 0 for c in change), "all_positive": all(c > 0 for c in change),
          "beyond_2_se": abs(mean) > 2 * se,
          "direction": "falls" if falls else "rises" if rises else "undecided"}


GAP_CHANGE_VERDICTS = {"falls": "dip replicates", "rises": "reversed", "undecided": "undecided"}


def gap_change_rows(study: Study, rows: list[dict], reference: Study | None = None,
                    reference_rows: list[dict] = ()) -> list[dict]:
  """``study.gap_change_rule`` = (label, B_low, B_high) applied (:func:`gap_change` on
  d_s(B_high) vs d_s(B_low), the arms labelled ``label``; ``verdict``: dip replicates,
  reversed or undecided), then, descriptive, each "main" B of ``study`` strictly between
  B_low and B_high placed against ``reference``'s "main" gaps there on the same seeds
  (B_low → B and B → B_high). A row appears only once every arm it reads has all its
  reported seeds: a direction is never read from part of the seeds."""
  if study.gap_change_rule is None:
    return []
  label, low, high = study.gap_change_rule
  out = []
  if _complete(study, rows, label, (low, high)):
    gaps = muon_gaps(study, rows, label)
    row = gap_change(gaps[low], gaps[high])
    out.append({"comparison": "rule", "label": label, "b_low": low, "b_high": high, **row,
                "verdict": GAP_CHANGE_VERDICTS[row["direction"]]})
  if reference is None:
    return out
  ref = muon_gaps(reference, list(reference_rows))
  ref_complete = _complete(reference, list(reference_rows), "main", (low, high))
  mine = muon_gaps(study, rows)
  for b in sorted(mine):
    if not (low < b < high) or not ref_complete or not _complete(study, rows, "main", (b,)):
      continue
    for a, c, first, second in ((low, b, ref[low], mine[b]), (b, high, mine[b], ref[high])):
      out.append({"comparison": f"position of B = {b} (reference: {reference.name})",
                  "label": "main", "b_low": a, "b_high": c, **gap_change(first, second),
                  "verdict": ""})
  return out


def _sign_class(values: list[float]) -> str:
  """"positive" if every value > 0 and the mean > +2 paired SE, "negative" if every value < 0
  and the mean < −2 paired SE, else "undecided" (the correlated-noise rule's classes)."""
  mean, sd = mean_std(values)
  se = sd / math.sqrt(len(values))
  if all(v > 0 for v in values) and mean > 2 * se:
    return "positive"
  if all(v < 0 for v in values) and mean < -2 * se:
    return "negative"
  return "undecided"


def _noise_arm(study: Study, optimizer: str, batch_size: int, label: str,
               rows: list[dict]) -> Arm | None:
  """The arm of (optimizer, B, label) that reports: its selected variant, if it has some."""
  for arm in study.arms:
    if (arm.optimizer, arm.batch_size, arm.label) == (optimizer, batch_size, label):
      return selected_variant(study, arm, rows)
  return None


def _accuracies(study: Study, arm: Arm | None, rows: list[dict]) -> dict[int, float]:
  if arm is None:
    return {}
  return {int(r["seed"]): float(r["test_accuracy"]) for r in reported_rows(study, arm, rows)}


def correlated_noise_rows(study: Study, rows: list[dict], noise_label: str = "bandmf",
                          iid_label: str = "iid") -> tuple[list[dict], list[dict]]:
  """The correlated-noise rule applied (experiments/results/README.md): (quantities, verdicts).

  Per B, on the reported seeds s (test accuracy, paired by seed):
  h_s(o) = acc(o + noise) − acc(o, iid) for o ∈ {DP-SGD, DP-Muon};
  e_s = acc(DP-Muon + noise) − acc(DP-SGD, iid); i_s = h_s(DP-Muon) − h_s(DP-SGD); each
  classed by :func:`_sign_class`. Verdicts, once every quantity has every reported seed:
  Q1 "closes the gap" if e is positive, "narrows it" if h(DP-Muon) is positive and e is
  not, "does not help DP-Muon" if h(DP-Muon) is negative, else "undecided"; Q2 "more" if i
  is positive, "less" if negative, else "no detectable difference".
  """
  quantities, verdicts = [], []
  sizes = sorted({a.batch_size for a in study.arms if a.label == noise_label})
  for b in sizes:
    acc = {(o, label): _accuracies(study, _noise_arm(study, o, b, label, rows), rows)
           for o in ("dp_sgd", "dp_muon") for label in (iid_label, noise_label)}
    seeds = sorted(set.intersection(*(set(v) for v in acc.values())))
    if not seeds:
      continue
    per_seed = {
        "h_dp_sgd": [acc["dp_sgd", noise_label][s] - acc["dp_sgd", iid_label][s] for s in seeds],
        "h_dp_muon": [acc["dp_muon", noise_label][s] - acc["dp_muon", iid_label][s]
                      for s in seeds],
        "e": [acc["dp_muon", noise_label][s] - acc["dp_sgd", iid_label][s] for s in seeds],
    }
    per_seed["i"] = [m - g for m, g in zip(per_seed["h_dp_muon"], per_seed["h_dp_sgd"])]
    complete = len(seeds) == len(reported_seeds(study))
    classes = {}
    for name, values in per_seed.items():
      mean, sd = mean_std(values)
      classes[name] = _sign_class(values) if complete else ""
      quantities.append({
          "batch_size": b, "quantity": name, "seeds": " ".join(map(str, seeds)),
          "per_seed": " ".join(f"{s}:{v:+.4f}" for s, v in zip(seeds, values)),
          "mean": mean, "paired_standard_error": sd / math.sqrt(len(values)),
          "class": classes[name]})
    if not complete:
      continue
    if classes["e"] == "positive":
      q1 = "closes DP-Muon's gap"
    elif classes["h_dp_muon"] == "positive":
      q1 = "narrows DP-Muon's gap"
    elif classes["h_dp_muon"] == "negative":
      q1 = "does not help DP-Muon"
    else:
      q1 = "undecided"
    q2 = {"positive": "helps DP-Muon more", "negative": "helps DP-Muon less"}.get(
        classes["i"], "no detectable difference")
    chosen = {o: _noise_arm(study, o, b, noise_label, rows) for o in ("dp_sgd", "dp_muon")}
    verdicts.append({"batch_size": b, "q1_gap": q1, "q2_as_much_as_dp_sgd": q2,
                     "dp_sgd_variant": chosen["dp_sgd"].variant if chosen["dp_sgd"] else "",
                     "dp_muon_variant": chosen["dp_muon"].variant if chosen["dp_muon"] else ""})
  return quantities, verdicts


def predictor_rows(study: Study, rows: list[dict], report: list[dict]) -> list[dict]:
  """Per B and length: the recovery-threshold prediction beside the observed paired gap.

  Predicted to help (gap > 0) when more than half of the routed layers are above the
  threshold at initialisation (``threshold_report``, with that arm's σ); a hit when the
  observed mean paired DP-Muon − DP-SGD gap has the predicted sign (> 0 vs ≤ 0).
  """
  gaps = {(g["batch_size"], g["label"]): g for g in paired_gap_rows(study, rows)
          if g["arm"].startswith("dp_muon_B")}
  out = []
  for (b, label), g in sorted(gaps.items()):
    init = [r for r in report if r["batch_size"] == b and r["label"] == label
            and r["params"] == "init"]
    end = [r for r in report if r["batch_size"] == b and r["label"] == label
           and r["params"] == "end" and r["params_from"].startswith("dp_muon")]
    if not init:
      continue
    above = sum(bool(r["above_threshold"]) for r in init)
    helps = 2 * above > len(init)
    at_end = sum(bool(r["above_threshold"]) for r in end) if end else ""  # no folder, no row
    out.append({"batch_size": b, "label": label, "layers": len(init),
                "above_at_init": above, "above_at_end": at_end,
                "predicted": "helps" if helps else "does not help",
                "gap": g["gap"], "paired_standard_error": g["paired_standard_error"],
                "seeds": g["seeds"], "hit": helps == (g["gap"] > 0)})
  return out


def predictor_count(study: Study, table: list[dict]) -> list[dict]:
  """Hits and misses of :func:`predictor_rows` over its points, counted (``hits``,
  ``misses``) only when every DP-Muon arm is a point with every reported seed."""
  lengths = ("main", f"T{_fixed_releases(study)}")  # the labels the threshold report covers
  points = sum(a.name.startswith("dp_muon_B") and a.label in lengths for a in study.arms)
  complete = len(table) == points and all(
      p["seeds"] == len(reported_seeds(study)) for p in table)
  hits = sum(bool(p["hit"]) for p in table)
  return [{"points": points, "scored": len(table), "complete": complete,
           "hits": hits if complete else "", "misses": len(table) - hits if complete else ""}]


def predictor_vs_cutoff(study: Study, table: list[dict]) -> list[dict]:
  """The predictor's hits and misses beside those of the plain batch-size cutoff
  "helps iff B ≥ b*", for each b* among the study's batch sizes, on the same scored
  points of :func:`predictor_rows` (a hit: the rule's sign is the observed gap's,
  > 0 vs ≤ 0). Counted, like :func:`predictor_count`, only once the count is complete."""
  (count,) = predictor_count(study, table)
  if not count["complete"]:
    return []
  out = [{"rule": "recovery-threshold predictor", "b_star": "", "hits": count["hits"],
          "misses": count["misses"]}]
  for b_star in sorted({a.batch_size for a in study.arms}):
    hits = sum((p["batch_size"] >= b_star) == (p["gap"] > 0) for p in table)
    out.append({"rule": f"helps iff B >= {b_star}", "b_star": b_star, "hits": hits,
                "misses": len(table) - hits})
  return out


def gap_step_rows(study: Study, rows: list[dict], label: str = "main") -> list[dict]:
  """:func:`gap_change` of the DP-Muon − DP-SGD gap (arms labelled ``label``) from each
  batch size to the next, once every batch size has every reported seed."""
  if not _complete(study, rows, label):
    return []
  gaps = muon_gaps(study, rows, label)
  sizes = sorted(gaps)
  return [{"label": label, "b_low": low, "b_high": high, **gap_change(gaps[low], gaps[high])}
          for low, high in zip(sizes, sizes[1:])]


def paper1_gap_rows(sizes: tuple[int, ...]) -> list[dict]:
  """Paper 1's DP-Muon − DP-SGD gap from its table's means (:data:`PAPER1_TABLE`, in
  points) at each of ``sizes`` it reports, with the step from the previous such B and
  whether the gap rises strictly over them all: :func:`decision`'s strict-rise clause
  applied to paper 1's own numbers."""
  muon, sgd = "dp_muon", "dp_sgd"
  sizes = [b for b in sorted(sizes) if (muon, b) in PAPER1_TABLE and (sgd, b) in PAPER1_TABLE]
  gaps = [round(PAPER1_TABLE[muon, b][0] - PAPER1_TABLE[sgd, b][0], 1) for b in sizes]
  rises = all(a < b for a, b in zip(gaps, gaps[1:]))
  return [{"batch_size": b, "muon_accuracy": PAPER1_TABLE[muon, b][0],
           "sgd_accuracy": PAPER1_TABLE[sgd, b][0], "gap_points": g,
           "step_from_previous_b": "" if i == 0 else round(g - gaps[i - 1], 1),
           "rises_throughout": rises} for i, (b, g) in enumerate(zip(sizes, gaps))]


def complete_arms(study: Study, summary: list[dict]) -> list[dict]:
  """The arms of ``summary`` with every reported seed: the only ones the table and plot
  show, so that a partial mean is never read as the arm's result."""
  return [s for s in summary if _has_every_seed(study, s)]


def _has_every_seed(study: Study, row: dict) -> bool:
  """Whether a summary or gap row covers all of the study's reported seeds."""
  return row["seeds"] >= len(reported_seeds(study))


def ablation_rows(summary: list[dict]) -> list[dict]:
  """Paper 1's ablation table (and DP-Muon-S, B = 2048): this study beside paper 1, in %.

  Pass :func:`complete_arms`: every fixed-epoch, flat-clipping arm given fills its cell.
  """
  mine = {(s["optimizer"], s["batch_size"]): s for s in summary
          if s["label"] == "main" and s["clipping"] == "flat"}
  sizes = sorted({b for _, b in PAPER1_TABLE} | {b for _, b in mine})
  out = []
  for optimizer in PAPER1_ROWS:
    row = {"optimizer": optimizer}
    for b in sizes:
      s, paper = mine.get((optimizer, b)), PAPER1_TABLE.get((optimizer, b))
      row[f"B{b}"] = "" if s is None else _percent(s["test_accuracy_mean"],
                                                    s["test_accuracy_std"])
      row[f"B{b}_paper1"] = "" if paper is None else f"{paper[0]:.1f} ± {paper[1]:.1f}"
    out.append(row)
  return out


def ablation_markdown(table: list[dict]) -> str:
  """:func:`ablation_rows` as the Markdown table the READMEs show: each cell is this
  study's test accuracy (%, mean ± std over the reported seeds), paper 1's in brackets,
  "—" where either has no run, and alone where neither has."""
  sizes = [k[1:] for k in table[0] if k.startswith("B") and not k.endswith("_paper1")]
  lines = ["| | " + " | ".join(f"B = {b}" for b in sizes) + " |",
           "|---" * (len(sizes) + 1) + "|"]
  for row in table:
    cells = [f"{row[f'B{b}'] or '—'} ({row[f'B{b}_paper1'] or '—'})"
             if row[f"B{b}"] or row[f"B{b}_paper1"] else "—" for b in sizes]
    lines.append(f"| {registry.OPTIMIZERS[row['optimizer']].title} | " + " | ".join(cells) + " |")
  return "\n".join(lines) + "\n"


def filter_gaps_markdown(study: Study, table: list[dict]) -> str:
  """:func:`filter_gap_rows`' fixed-epoch rows as the Markdown table the READMEs show:
  a column per filter ("DiSK-Muon − DP-Muon"), a row per B, each cell the paired gap
  in points, mean ± paired SE, then each reported seed's; "—" until both arms have
  every reported seed."""
  arms = {a.name: a for a in study.arms}
  # A DiSK arm's row is its selected κ variant's: the others run no reported seed.
  main = {(arms[r["arm"]].optimizer, r["batch_size"]): r for r in table
          if r["label"] == "main" and _has_every_seed(study, r)}
  filters = {a.optimizer for a in study.arms if registry.OPTIMIZERS[a.optimizer].filters}
  columns = [name for name in registry.OPTIMIZERS if name in filters]  # registry order
  sizes = sorted({a.batch_size for a in study.arms if a.optimizer in filters
                  and a.label == "main"})
  titles = [f"{registry.OPTIMIZERS[o].title} − "
            f"{registry.OPTIMIZERS[registry.OPTIMIZERS[o].filters].title}" for o in columns]
  lines = ["| B | " + " | ".join(titles) + " |", "|---" * (len(columns) + 1) + "|"]
  for b in sizes:
    lines.append(f"| {b} | " + " | ".join(_gap_cell(main.get((o, b))) for o in columns) + " |")
  return "\n".join(lines) + "\n"


def _gap_cell(row: dict | None) -> str:
  if row is None:
    return "—"
  per_seed = " / ".join(_points(float(d.split(":")[1])) for d in row["per_seed"].split())
  return (f"{_points(row['gap'])} ± {100 * row['paired_standard_error']:.2f} "
          f"({per_seed})")


def _points(gap: float) -> str:
  """A gap in percentage points, signed, with the typographic minus the READMEs use."""
  return f"{100 * gap:+.2f}".replace("-", "−")


def _percent(mean: float, std: float) -> str:
  return f"{100 * mean:.1f} ± {100 * np.nan_to_num(std):.1f}"


def _var(s: dict) -> float:
  std = s["test_accuracy_std"]
  return 0.0 if math.isnan(std) else std ** 2


def write_report(study: Study, rows: list[dict], out: str, data_dir: str | None) -> None:
  summary = [arm_summary(study, arm, rows) for arm in study.arms]
  write_csv(os.path.join(out, "summary.csv"), summary, tuple(summary[0]))
  if study.selection_seed is None:  # the earlier protocol; paired gaps replace it since
    _write(out, "gaps.csv", gap_rows(summary))
  _write(out, "paired_gaps.csv", paired_gap_rows(study, rows))
  filter_gaps = filter_gap_rows(study, rows)
  _write(out, "filter_gaps.csv", filter_gaps)
  verdict = decision(study, rows)  # the rule reads the fixed-epoch ("main") arms only
  _write(out, "decision.csv", [] if verdict is None else [verdict])
  steps = gap_step_rows(study, rows)
  _write(out, "gap_steps.csv", steps)
  if steps:
    _write(out, "paper1_gaps.csv", paper1_gap_rows(tuple(sorted(muon_gaps(study, rows)))))
  if study.gap_change_rule is not None:
    reference, reference_rows = None, []
    if study.reference is not None:
      from experiments.study_configs import STUDIES

      reference = STUDIES[study.reference]
      reference_rows = read_rows(os.path.join(os.path.dirname(os.path.abspath(out)),
                                              reference.name, "runs.csv"))
    _write(out, "gap_change.csv", gap_change_rows(study, rows, reference, reference_rows))
  if any(arm.noise != "iid" for arm in study.arms):
    quantities, verdicts = correlated_noise_rows(study, rows)
    _write(out, "correlated_gaps.csv", quantities)
    _write(out, "correlated_decision.csv", verdicts)
  complete = complete_arms(study, summary)
  ablation = ablation_rows(complete)
  _write(out, "ablation.csv", ablation)
  with open(os.path.join(out, "ablation.md"), "w") as f:
    f.write(ablation_markdown(ablation))
  if filter_gaps:
    with open(os.path.join(out, "filter_gaps.md"), "w") as f:
      f.write(filter_gaps_markdown(study, filter_gaps))
  plot(study, complete, os.path.join(out, "accuracy_vs_batch.png"))
  report = threshold_report(study, rows, out, data_dir)
  if report:
    write_csv(os.path.join(out, "threshold_report.csv"), report, tuple(report[0]))
  predictions = predictor_rows(study, rows, report)
  _write(out, "predictor.csv", predictions)
  if predictions:
    _write(out, "predictor_count.csv", predictor_count(study, predictions))
    _write(out, "predictor_vs_cutoff.csv", predictor_vs_cutoff(study, predictions))


def _write(out: str, name: str, table: list[dict]) -> None:
  if table:
    write_csv(os.path.join(out, name), table, tuple(table[0]))


def plot(study: Study, summary: list[dict], path: str) -> None:
  """Test accuracy against B per optimizer; pass :func:`complete_arms`."""
  plt = pyplot("accuracy_vs_batch.png")
  fixed = _fixed_releases(study)
  fig, ax = plt.subplots(figsize=(6, 4))
  for i, optimizer in enumerate(sorted({s["optimizer"] for s in summary})):
    for label, style in (("main", "-"), (f"T{fixed}", "--")):
      # A fixed-release line also takes the main arm whose epochs give that many releases.
      pts = sorted((s["batch_size"], s) for s in summary if s["optimizer"] == optimizer
                   and (s["label"] == label or (label != "main" and s["label"] == "main"
                                                and str(s["releases"]) == str(fixed)))
                   and s["clipping"] == "flat")
      if not any(s["label"] == label for _, s in pts):
        continue
      ax.errorbar([b for b, _ in pts], [100 * s["test_accuracy_mean"] for _, s in pts],
                  yerr=[100 * np.nan_to_num(s["test_accuracy_std"]) for _, s in pts],
                  color=f"C{i}", linestyle=style, marker="o", capsize=3,
                  label=optimizer + ("" if label == "main" else f" ({label} releases)"))
  ax.set_xscale("log", base=2)
  ax.set_xlabel("expected batch size B")
  ax.set_ylabel("test accuracy (%)")
  ax.set_title(f"{study.name}: ε = {study.epsilon:g}, mean ± std over seeds", fontsize=9)
  if ax.get_legend_handles_labels()[0]:  # no line before any arm has its seeds
    ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def _fixed_releases(study: Study) -> int | None:
  return next((a.releases for a in study.arms if a.releases is not None), None)


def threshold_report(study: Study, rows: list[dict], out: str, data_dir: str | None) -> list[dict]:
  """Per layer: σ₁−σ₂ of the mean clipped gradient against ‖N‖₂ = σC(√m+√n)/B."""
  from dpmuon_jax.analysis.diagnostics import nonprivate_layer_report

  with_val, _ = split_data(study, data_dir)
  report, recorded = [], recorded_end_rows(out)
  lengths = ("main", f"T{_fixed_releases(study)}")
  for arm in study.arms:
    if arm.label not in lengths or arm.optimizer not in ("dp_sgd", "dp_muon"):
      continue
    _, chosen = grid_state(study, arm, rows)
    if chosen is None:
      continue
    model, loss_fn = initial_model(study, with_val)
    sigma = float(_arm_rows(arm, rows)[0]["noise_multiplier"])
    points = [] if arm.optimizer == "dp_sgd" else [("init", model.params)]
    # The selection run's parameters, where its folder is still here (runs/ is not committed);
    # where it is gone, the "end" rows the last report recorded from it stay.
    export = os.path.join(run_dir(out, arm, chosen, selection_seed(study)), "export")
    has_folder = os.path.isdir(export)
    if has_folder:
      points.append(("end", load_exported(export, like=model.params).params))
    for when, params in points:
      for r in nonprivate_layer_report(loss_fn, params, _probe(with_val), study.clip, sigma,
                                       float(arm.batch_size), microbatch_size=256):
        report.append({
            "batch_size": arm.batch_size, "label": arm.label, "sigma": sigma, "params": when,
            "params_from": "initialisation" if when == "init" else arm.name,
            "layer": r.path, "shape": "x".join(map(str, r.shape)), "gap": r.spectrum.gap,
            "noise_norm": r.noise_norm, "snr": r.snr, "above_threshold": r.above_threshold,
            "threshold_batch_size": r.threshold_batch_size,
        })
    report += [] if has_folder else [r for r in recorded if r["params_from"] == arm.name]
  return report


def recorded_end_rows(out: str) -> list[dict]:
  """The "end" rows of ``out/threshold_report.csv`` as :func:`threshold_report` makes them
  (``batch_size`` an int, ``above_threshold`` a bool; the rest as written)."""
  return [{**r, "batch_size": int(r["batch_size"]),
           "above_threshold": r["above_threshold"] == "True"}
          for r in read_rows(os.path.join(out, "threshold_report.csv")) if r["params"] == "end"]


def _probe(data) -> dict:
  import jax.numpy as jnp

  from dpmuon_jax.data.images import normalize

  info = data.info
  return {"image": normalize(jnp.asarray(data.x_train[:PROBE_SIZE]), info.mean, info.std),
          "label": jnp.asarray(data.y_train[:PROBE_SIZE])}
