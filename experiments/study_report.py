"""The report of a :class:`experiments.study.Study`: summary, gaps, plot, threshold report.

Writes into the study's folder:

* ``summary.csv``: per arm, the grid (learning rate → final validation
  accuracy), the chosen rate, whether it is still on the grid's edge, and the
  test accuracy over seeds (mean ± std) with the largest ε any run spent;
* ``gaps.csv``: per batch size and training length, each optimizer's test
  accuracy minus DP-SGD's, with the standard error sqrt(s₁²/n₁ + s₂²/n₂);
* ``accuracy_vs_batch.png``: test accuracy against B per optimizer, error
  bars = std over seeds (solid: fixed epochs; dashed: fixed releases);
* ``threshold_report.csv``: NON-PRIVATE analysis of paper 1's recovery
  threshold on the mean CLIPPED gradient (the signal the release averages)
  per layer, at initialisation and at the end of the DP-SGD and DP-Muon runs
  (seed ``seeds[0]``, chosen rate) of every batch size.
"""

from __future__ import annotations

import math
import os

import numpy as np

from dpmuon_jax.training.records import write_csv
from experiments.study import (
    Arm,
    PrivatelyTunedArm,
    Study,
    final_params,
    grid_state,
    mean_std,
    run_dir,
    split_data,
)

PROBE_SIZE = 1024
PRIVATE_LABEL = "private_tuning"


def _arm_rows(arm: Arm, rows: list[dict]) -> list[dict]:
  return [r for r in rows if r["arm"] == arm.name]


def arm_summary(study: Study, arm: Arm, rows: list[dict]) -> dict:
  """One arm's grid, chosen rate and test accuracy over the chosen rate's seeds."""
  mine = _arm_rows(arm, rows)
  if isinstance(arm, PrivatelyTunedArm):  # one private selection per seed, rates may differ
    grid, chosen, seeds = [], None, mine
  else:
    grid = sorted((float(r["learning_rate"]), float(r["final_val_accuracy"])) for r in mine
                  if int(r["seed"]) == study.seeds[0])
    _, chosen = grid_state(study, arm, rows)
    seeds = [r for r in mine if chosen is not None and float(r["learning_rate"]) == chosen]
  tests = [float(r["test_accuracy"]) for r in seeds]
  mean, std = mean_std(tests) if tests else (math.nan, math.nan)
  on_edge = bool(grid) and chosen in (grid[0][0], grid[-1][0])
  return {
      "arm": arm.name, "optimizer": arm.optimizer, "batch_size": arm.batch_size,
      "label": arm.label, "clipping": arm.clipping,
      "releases": mine[0]["releases"] if mine else "",
      "noise_multiplier": mine[0]["noise_multiplier"] if mine else "",
      "grid": " ".join(f"{lr:g}:{acc:.4f}" for lr, acc in grid),
      "chosen_learning_rate": " ".join(r["learning_rate"] for r in seeds) if chosen is None
      else chosen, "chosen_on_edge": on_edge,
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


def _var(s: dict) -> float:
  std = s["test_accuracy_std"]
  return 0.0 if math.isnan(std) else std ** 2


def write_report(study: Study, rows: list[dict], out: str, data_dir: str | None) -> None:
  summary = [arm_summary(study, arm, rows) for arm in study.arms]
  write_csv(os.path.join(out, "summary.csv"), summary, tuple(summary[0]))
  gaps = gap_rows(summary)
  if gaps:
    write_csv(os.path.join(out, "gaps.csv"), gaps, tuple(gaps[0]))
  plot(study, summary, os.path.join(out, "accuracy_vs_batch.png"))
  report = threshold_report(study, rows, out, data_dir)
  if report:
    write_csv(os.path.join(out, "threshold_report.csv"), report, tuple(report[0]))


def plot(study: Study, summary: list[dict], path: str) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fixed = _fixed_releases(study)
  fig, ax = plt.subplots(figsize=(6, 4))
  for i, optimizer in enumerate(sorted({s["optimizer"] for s in summary})):
    for label, style in (("main", "-"), (f"T{fixed}", "--")):
      # A fixed-release line also takes the main arm whose epochs give that many releases.
      pts = sorted((s["batch_size"], s) for s in summary if s["optimizer"] == optimizer
                   and (s["label"] == label or (label != "main" and s["label"] == "main"
                                                and str(s["releases"]) == str(fixed)))
                   and s["clipping"] == "flat" and s["seeds"])
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
  report = []
  for arm in study.arms:
    if arm.label != "main" or arm.optimizer not in ("dp_sgd", "dp_muon"):
      continue
    _, chosen = grid_state(study, arm, rows)
    directory = None if chosen is None else run_dir(out, arm, chosen, study.seeds[0])
    if directory is None or not os.path.isdir(os.path.join(directory, "export")):
      continue
    model, loss_fn, end = final_params(study, os.path.join(directory, "export"), with_val)
    sigma = float(_arm_rows(arm, rows)[0]["noise_multiplier"])
    points = [("end", end)] if arm.optimizer == "dp_sgd" else [("init", model.params), ("end", end)]
    for when, params in points:
      for r in nonprivate_layer_report(loss_fn, params, _probe(with_val), study.clip, sigma,
                                       float(arm.batch_size), microbatch_size=256):
        report.append({
            "batch_size": arm.batch_size, "sigma": sigma, "params": when,
            "params_from": "initialisation" if when == "init" else arm.name,
            "layer": r.path, "shape": "x".join(map(str, r.shape)), "gap": r.spectrum.gap,
            "noise_norm": r.noise_norm, "snr": r.snr, "above_threshold": r.above_threshold,
            "threshold_batch_size": r.threshold_batch_size,
        })
  return report


def _probe(data) -> dict:
  import jax.numpy as jnp

  from dpmuon_jax.data.images import normalize

  info = data.info
  return {"image": normalize(jnp.asarray(data.x_train[:PROBE_SIZE]), info.mean, info.std),
          "label": jnp.asarray(data.y_train[:PROBE_SIZE])}
