"""The study driver: the learning-rate rule, restartability and the report."""

from __future__ import annotations

import csv
import dataclasses
import math
import os

import numpy as np
import pytest

from dpmuon_jax.training.records import write_csv
from experiments import study_report
from experiments.study import (
    Arm,
    PrivatelyTunedArm,
    Study,
    append_row,
    grid_state,
    ready_runs,
    restart_first,
    run_study,
    selection_seed,
)
from experiments.study_configs import STUDIES
from experiments.study_report import (
    ablation_markdown,
    ablation_rows,
    arm_summary,
    complete_arms,
    decision,
    filter_gap_rows,
    filter_gaps_markdown,
    noise_variance_gain,
    paired_gap_rows,
    predictor_count,
    predictor_rows,
    predictor_vs_cutoff,
    write_report,
)

ARM = Arm("dp_sgd", 32, 0.1, epochs=1.0)
STUDY = Study("t", "test", (ARM,), seeds=(1, 2), grid_points=3, max_extensions=2)


def _row(lr, acc, seed=1, arm=ARM):
  return {"arm": arm.name, "learning_rate": str(lr), "seed": str(seed),
          "final_val_accuracy": str(acc), "test_accuracy": str(acc), "epsilon_spent": "4",
          "releases": "1", "noise_multiplier": "1"}


def test_grid_starts_as_three_rates_spaced_by_three():
  pending, chosen = grid_state(STUDY, ARM, [])
  assert chosen is None
  np.testing.assert_allclose(sorted(pending), [0.1 / 3, 0.1, 0.3], rtol=1e-3)


def test_interior_best_is_chosen_then_remaining_seeds_run():
  rows = [_row(0.03333, 0.2), _row(0.1, 0.5), _row(0.3, 0.4)]
  assert grid_state(STUDY, ARM, rows) == ([], 0.1)
  assert list(ready_runs(STUDY, rows)) == [(ARM, 0.1, 2)]


def test_edge_best_extends_the_grid_one_step_on_that_side():
  rows = [_row(0.03333, 0.2), _row(0.1, 0.3), _row(0.3, 0.4)]
  pending, chosen = grid_state(STUDY, ARM, rows)
  assert chosen is None and pending == [0.9]
  rows.append(_row(0.9, 0.35))
  assert grid_state(STUDY, ARM, rows) == ([], 0.3)
  rows = [_row(0.03333, 0.6), _row(0.1, 0.3), _row(0.3, 0.4)]
  assert grid_state(STUDY, ARM, rows)[0] == [0.01111]


def test_extensions_stop_after_max_extensions():
  rows = [_row(lr, acc) for lr, acc in
          ((0.03333, 0.1), (0.1, 0.2), (0.3, 0.3), (0.9, 0.4), (2.7, 0.5))]
  assert grid_state(STUDY, ARM, rows) == ([], 2.7)


def test_fixed_releases_arm_sets_epochs_from_t():
  arm = Arm("dp_sgd", 4096, 0.3, releases=66)
  epochs = arm.training_epochs(45_000)
  assert round(epochs / (4096 / 45_000)) == 66
  with pytest.raises(ValueError, match="exactly one"):
    Arm("dp_sgd", 256, 0.3).training_epochs(100)


def test_private_selections_start_first_as_they_cannot_resume():
  tuned = PrivatelyTunedArm("dp_sgd", 32, 0.1, epochs=1.0)
  study = Study("t", "test", (ARM, tuned), seeds=(1, 2))
  ordered = restart_first(ready_runs(study, []))
  assert [arm.name for arm, _, _ in ordered[:2]] == [tuned.name] * 2
  assert ordered[2:] == [(ARM, lr, 1) for lr in grid_state(study, ARM, [])[0]]


# ------------------------------------------------------ selection seed, 1-D rates, variants

SGD = Arm("dp_sgd", 32, 0.1, epochs=1.0)
MUON = Arm("dp_muon", 32, 0.02, epochs=1.0, fallback_lr_from=SGD.name, priority=1)
APART = Study("t", "test", (SGD, MUON), seeds=(2, 3), selection_seed=1, grid_points=3)


def _grid(arm, best, scores=(0.2, 0.5, 0.4), seed=1):
  """A finished grid of ``arm`` whose middle rate (= ``best``) wins."""
  rates = [float(f"{best / 3:.4g}"), best, float(f"{best * 3:.4g}")]
  return [_row(lr, acc, seed, arm) for lr, acc in zip(rates, scores)]


def test_selection_seed_trains_the_grid_and_is_never_reported():
  assert selection_seed(APART) == 1 and selection_seed(STUDY) == 1  # earlier: seeds[0]
  runs = list(ready_runs(APART, []))
  assert {seed for _, _, seed in runs} == {1}
  runs = list(ready_runs(APART, _grid(SGD, 0.1)))
  assert [(a.name, lr, seed) for a, lr, seed in runs if a.name == SGD.name] == [
      (SGD.name, 0.1, 2), (SGD.name, 0.1, 3)]


def test_muon_arm_waits_for_dp_sgds_rate_then_runs_its_1d_group_at_it():
  assert all(arm.name == SGD.name for arm, _, _ in ready_runs(APART, []))
  rows = _grid(SGD, 0.1)
  muon = [arm for arm, _, _ in ready_runs(APART, rows) if arm.name == MUON.name]
  assert len(muon) == 3 and {arm.fallback_learning_rate for arm in muon} == {0.1}
  # within a priority the grid comes first; the lower priority after
  order = restart_first(ready_runs(APART, rows), selection_seed(APART))
  assert [(a.name, seed) for a, _, seed in order] == [(SGD.name, 2), (SGD.name, 3)] + [
      (MUON.name, 1)] * 3


def test_variants_compete_and_only_the_best_trains_the_reported_seeds():
  low = Arm("dp_disk_sgd", 32, 1.0, epochs=1.0, options=(("kappa", 0.5),), variant="k0.5")
  high = Arm("dp_disk_sgd", 32, 1.0, epochs=1.0, options=(("kappa", 0.7),), variant="k0.7")
  study = Study("t", "test", (low, high), seeds=(2, 3), selection_seed=1)
  assert low.name == "dp_disk_sgd_B32_k0.5" and low.group == high.group
  rows = _grid(low, 1.0, (0.2, 0.45, 0.4))
  assert {(a.name, seed) for a, _, seed in ready_runs(study, rows)} == {(high.name, 1)}
  rows += _grid(high, 1.0, (0.2, 0.5, 0.4))
  assert [(a.name, lr, seed) for a, lr, seed in ready_runs(study, rows)] == [
      (high.name, 1.0, 2), (high.name, 1.0, 3)]
  rows += [_row(1.0, 0.5, s, high) for s in (2, 3)]
  summaries = {a.name: arm_summary(study, a, rows) for a in (low, high)}
  assert summaries[low.name]["seeds"] == 0 and not summaries[low.name]["selected"]
  assert summaries[high.name]["seeds"] == 2 and summaries[high.name]["selected"]
  assert summaries[low.name]["noise_variance_gain"] == pytest.approx(1 / 3)


def test_noise_variance_gain_is_the_filters_white_noise_variance():
  rng = np.random.default_rng(0)
  for kappa in (0.5, 0.7, 1.0, 1.5):
    w = rng.standard_normal(200_000)
    g, out = 0.0, np.empty_like(w)
    for i, x in enumerate(w):
      g = (1 - kappa) * g + kappa * x
      out[i] = g
    # the variance estimate of 2·10⁵ correlated draws is within a few percent
    assert np.var(out[1000:]) == pytest.approx(noise_variance_gain(kappa), rel=0.05)


def _reported(arm, lr, accuracies, seeds=(2, 3, 4)):
  return [_row(lr, 0.5, s, arm) | {"test_accuracy": str(a)} for s, a in zip(seeds, accuracies)]


def _decision_study(sizes=(256, 1024, 4096)):
  arms = []
  for b in sizes:
    arms += [Arm("dp_sgd", b, 0.1, epochs=1.0),
             Arm("dp_muon", b, 0.1, epochs=1.0, fallback_lr_from=f"dp_sgd_B{b}")]
  return Study("t", "test", tuple(arms), seeds=(2, 3, 4), selection_seed=1)


def _decision_rows(study, gaps):
  rows = []
  for arm in study.arms:
    rows += _grid(arm, 0.1)
    base = [0.50, 0.52, 0.48]
    d = gaps[arm.batch_size] if arm.optimizer == "dp_muon" else (0, 0, 0)
    rows += _reported(arm, 0.1, [x + y for x, y in zip(base, d)])
  return rows


def test_decision_rule_holds_only_for_a_rising_one_signed_gap_beyond_3_se():
  study = _decision_study()
  rising = {256: (0.00, -0.01, 0.01), 1024: (0.02, 0.03, 0.02), 4096: (0.07, 0.08, 0.07)}
  result = decision(study, _decision_rows(study, rising))
  assert result["rises"] and result["one_sign_at_largest_b"] and result["holds"]
  assert result["change"] == pytest.approx(np.mean(rising[4096]) - np.mean(rising[256]))
  flat = {256: (0.00, -0.01, 0.01), 1024: (0.03, 0.03, 0.02), 4096: (0.02, 0.03, 0.02)}
  assert not decision(study, _decision_rows(study, flat))["holds"]  # does not rise
  mixed = {256: (0.00, -0.01, 0.01), 1024: (0.01, 0.01, 0.02), 4096: (0.09, -0.01, 0.06)}
  result = decision(study, _decision_rows(study, mixed))
  assert result["rises"] and not result["one_sign_at_largest_b"] and not result["holds"]
  noisy = {256: (0.00, -0.05, 0.05), 1024: (0.01, 0.01, 0.02), 4096: (0.09, 0.01, 0.02)}
  result = decision(study, _decision_rows(study, noisy))  # rises, one sign, within 3 SE
  assert result["rises"] and result["one_sign_at_largest_b"]
  assert not result["change_exceeds_3_se"] and not result["holds"]
  # Undecided until every B has every reported seed: two seeds that agree decide nothing.
  without_44 = [r for r in _decision_rows(study, rising) if not (
      r["arm"] == "dp_muon_B4096" and r["seed"] == "4")]
  assert decision(study, without_44) is None
  gaps = {g["batch_size"]: g for g in paired_gap_rows(study, _decision_rows(study, rising))}
  assert gaps[4096]["gap"] == pytest.approx(np.mean(rising[4096]))
  assert gaps[4096]["paired_standard_error"] == pytest.approx(
      np.std(rising[4096], ddof=1) / np.sqrt(3))


def test_a_filter_is_paired_with_the_optimizer_it_filters_not_with_dp_sgd():
  """DiSK-Muon − DP-Muon per seed (the ablation's question), not DiSK-Muon − DP-SGD; arms
  that filter nothing have no row."""
  study = _decision_study(sizes=(256,))
  disk = Arm("dp_disk_muon", 256, 0.1, epochs=1.0, fallback_lr_from="dp_sgd_B256",
             options=(("kappa", 0.7),), variant="k0.7")  # a chosen κ, as in the study
  study = dataclasses.replace(study, arms=study.arms + (disk,))
  d = (0.01, 0.04, 0.02)  # DP-Muon's lead over DP-SGD and DiSK-Muon (level with DP-SGD)
  (row,) = filter_gap_rows(study, _decision_rows(study, {256: d}))
  assert (row["arm"], row["baseline"]) == ("dp_disk_muon_B256_k0.7", "dp_muon_B256")
  assert row["gap"] == pytest.approx(-np.mean(d))
  assert row["paired_standard_error"] == pytest.approx(np.std(d, ddof=1) / np.sqrt(3))
  assert row["per_seed"] == "2:-0.0100 3:-0.0400 4:-0.0200"
  (header, _, line) = filter_gaps_markdown(study, [row]).splitlines()
  assert header == "| B | DiSK-Muon − DP-Muon |"
  assert line == "| 256 | −2.33 ± 0.88 (−1.00 / −4.00 / −2.00) |"
  assert filter_gaps_markdown(study, [dict(row, seeds=2)]).splitlines()[2] == "| 256 | — |"


def test_report_decides_on_the_fixed_epoch_arms_only_and_pairs_every_gap(tmp_path, monkeypatch):
  """decision.csv holds the pre-registered (fixed-epoch, "main") verdict alone; the
  66-release arms are reported as paired gaps; no unpaired gaps.csv."""
  main = _decision_study()
  t66 = (Arm("dp_sgd", 256, 0.1, releases=2, label="T66"),
         Arm("dp_muon", 256, 0.1, releases=2, label="T66", fallback_lr_from="dp_sgd_B256_T66"))
  study = dataclasses.replace(main, arms=main.arms + t66)
  rising = {256: (0.00, -0.01, 0.01), 1024: (0.02, 0.03, 0.02), 4096: (0.07, 0.08, 0.07)}
  rows = _decision_rows(study, rising)
  monkeypatch.setattr(study_report, "threshold_report", lambda *args: [])  # no data here
  write_report(study, rows, str(tmp_path), None)
  with open(tmp_path / "decision.csv") as f:
    (verdict,) = list(csv.DictReader(f))
  assert verdict["label"] == "main" and verdict["holds"] == "True"
  with open(tmp_path / "paired_gaps.csv") as f:
    labels = {(r["arm"], r["label"]) for r in csv.DictReader(f)}
  assert ("dp_muon_B256_T66", "T66") in labels
  assert not (tmp_path / "gaps.csv").exists()


def test_predictor_counts_layers_above_at_init_and_scores_the_sign():
  study = _decision_study()
  rows = _decision_rows(study, {256: (-0.01,) * 3, 1024: (0.01,) * 3, 4096: (0.05,) * 3})
  report = [{"batch_size": b, "label": "main", "params": "init", "params_from": "initialisation",
             "above_threshold": i < above} for b, above in ((256, 0), (1024, 2), (4096, 5))
            for i in range(5)]
  table = {r["batch_size"]: r for r in predictor_rows(study, rows, report)}
  assert [table[b]["predicted"] for b in (256, 1024, 4096)] == [
      "does not help", "does not help", "helps"]
  assert [table[b]["hit"] for b in (256, 1024, 4096)] == [True, False, True]
  (count,) = predictor_count(study, list(table.values()))
  assert (count["points"], count["complete"], count["hits"], count["misses"]) == (3, True, 2, 1)
  (partial,) = predictor_count(study, [table[256], table[4096]])  # a point still missing
  assert not partial["complete"] and partial["hits"] == partial["misses"] == ""


def test_the_predictor_is_scored_beside_every_batch_size_cutoff_on_the_same_points():
  """predictor_vs_cutoff.csv: a rule "helps iff B ≥ b*" per batch size of the study, scored
  on the predictor's own points; a predictor no better than some cutoff shows it."""
  study = _decision_study()
  rows = _decision_rows(study, {256: (-0.01,) * 3, 1024: (0.01,) * 3, 4096: (0.05,) * 3})
  report = [{"batch_size": b, "label": "main", "params": "init", "params_from": "initialisation",
             "above_threshold": i < above} for b, above in ((256, 0), (1024, 2), (4096, 5))
            for i in range(5)]
  table = predictor_rows(study, rows, report)
  scores = [(r["rule"], r["hits"], r["misses"]) for r in predictor_vs_cutoff(study, table)]
  # The predictor misses B = 1024 (it says "does not help"); the cutoff at 1024 misses nothing.
  assert scores == [("recovery-threshold predictor", 2, 1), ("helps iff B >= 256", 2, 1),
                    ("helps iff B >= 1024", 3, 0), ("helps iff B >= 4096", 2, 1)]
  assert predictor_vs_cutoff(study, table[:2]) == []  # not every point yet: no count


def test_gap_steps_read_the_strict_rise_seed_by_seed_and_paper1_fails_it_too():
  study = _decision_study()
  rows = _decision_rows(study, {256: (-0.01, -0.02, 0.0), 1024: (-0.02, -0.03, -0.02),
                                4096: (0.05, 0.06, 0.05)})
  dip, rise = study_report.gap_step_rows(study, rows)
  assert (dip["b_low"], dip["b_high"], rise["b_low"], rise["b_high"]) == (256, 1024, 1024, 4096)
  assert dip["change"] == pytest.approx(-0.04 / 3) and dip["all_negative"]
  assert rise["direction"] == "rises"
  assert study_report.gap_step_rows(study, rows[:-1]) == []  # a seed missing: no steps
  paper = study_report.paper1_gap_rows((256, 1024, 2048, 4096))
  assert [r["gap_points"] for r in paper] == [-0.4, 3.6, 10.3, 9.4]
  assert paper[-1]["step_from_previous_b"] == -0.9 and not paper[0]["rises_throughout"]
  assert all(r["rises_throughout"] for r in study_report.paper1_gap_rows((256, 1024, 2048)))


def test_the_threshold_report_needs_no_run_folder_for_the_initialisation(tmp_path):
  """The prediction reads the public initialisation with the arm's σ: a selection run whose
  folder is gone (runs/ is not committed) still has its prediction; "end" needs the folder."""
  study = dataclasses.replace(_decision_study(sizes=(256,)), dataset="digits", model="mlp",
                              validation_size=200)
  rows = _decision_rows(study, {256: (0.0, 0.0, 0.0)})
  report = study_report.threshold_report(study, rows, str(tmp_path), None)
  assert report and {(r["batch_size"], r["params"]) for r in report} == {(256, "init")}
  assert {r["sigma"] for r in report} == {1.0}  # the rows' σ
  (point,) = predictor_rows(study, rows, report)
  assert point["above_at_end"] == "" and point["predicted"] in ("helps", "does not help")


def test_the_threshold_report_keeps_the_end_rows_of_a_run_folder_now_gone(tmp_path):
  """A report rewritten where the selection run's folder is gone (a new checkout) keeps
  the "end" rows the last report recorded from it, and reads them back as written."""
  study = dataclasses.replace(_decision_study(sizes=(256,)), dataset="digits", model="mlp",
                              validation_size=200)
  rows = _decision_rows(study, {256: (0.0, 0.0, 0.0)})
  init = study_report.threshold_report(study, rows, str(tmp_path), None)
  muon = next(a.name for a in study.arms if a.optimizer == "dp_muon")
  ends = [{**r, "params": "end", "params_from": muon, "above_threshold": i < 1}
          for i, r in enumerate(init)]
  write_csv(str(tmp_path / "threshold_report.csv"), init + ends)
  report = study_report.threshold_report(study, rows, str(tmp_path), None)
  assert [r for r in report if r["params"] == "end"] == [
      {k: (v if k in ("batch_size", "above_threshold") else str(v)) for k, v in r.items()}
      for r in ends]
  (point,) = predictor_rows(study, rows, report)
  assert point["above_at_end"] == 1  # "False" read back as False, not as a true string


def test_paper1_ablation_study_is_designed_as_its_readme_says():
  study = STUDIES["paper1_ablation"]
  assert study.selection_seed == 41 and 41 not in study.seeds and len(study.seeds) == 3
  names = {a.name: a for a in study.arms}
  for optimizer in ("dp_sgd", "dp_disk_sgd", "dp_doppler_sgd", "dp_muon", "dp_disk_muon",
                    "dp_doppler_muon", "dp_muon_s"):
    for b in (256, 1024, 4096):
      assert any(a.optimizer == optimizer and a.batch_size == b and a.label == "main"
                 for a in study.arms), (optimizer, b)
  assert {"dp_sgd_B2048", "dp_muon_B2048"} <= set(names)
  for arm in study.arms:  # every Muon-family arm's 1-D group runs its SGD row's choice
    if "muon" in arm.optimizer:
      source = names[arm.fallback_lr_from]
      row = "dp_doppler_sgd" if arm.optimizer == "dp_doppler_muon" else "dp_sgd"
      assert (source.optimizer, source.batch_size, source.label) == (
          row, arm.batch_size, arm.label)
  kappas = {dict(a.options)["kappa"] for a in study.arms if a.optimizer == "dp_disk_sgd"
            and a.batch_size == 4096}
  assert kappas == {0.5, 0.7, 1.0}
  first = [a for a in study.arms if a.priority == 0]
  assert {(a.optimizer, a.batch_size) for a in first} == {
      (o, b) for o in ("dp_sgd", "dp_muon") for b in (256, 1024, 2048, 4096)}
  table = ablation_rows([])
  assert [r["optimizer"] for r in table][:6] == [
      "dp_sgd", "dp_disk_sgd", "dp_doppler_sgd", "dp_muon", "dp_disk_muon", "dp_doppler_muon"]
  assert table[5]["B4096_paper1"] == "50.3 ± 1.0"
  summary = [{"optimizer": "dp_muon", "batch_size": 4096, "label": "main", "clipping": "flat",
              "seeds": 3, "test_accuracy_mean": 0.539, "test_accuracy_std": 0.0022},
             {"optimizer": "dp_disk_sgd", "batch_size": 256, "label": "main", "clipping": "flat",
              "seeds": 1, "test_accuracy_mean": 0.544, "test_accuracy_std": math.nan}]
  markdown = ablation_markdown(ablation_rows(complete_arms(study, summary))).splitlines()
  assert markdown[0] == "| | B = 256 | B = 1024 | B = 2048 | B = 4096 |"
  assert markdown[2 + 3] == ("| DP-Muon | — (39.0 ± 0.5) | — (43.3 ± 1.6) | — (47.3 ± 1.8) "
                             "| 53.9 ± 0.2 (48.7 ± 0.6) |")
  assert len(markdown) == 2 + len(table)
  assert markdown[2 + 1].split(" | ")[3] == "—"  # DiSK-SGD at B = 2048: neither has a run
  assert markdown[2 + 1].split(" | ")[1] == "— (49.0 ± 2.8)"  # one seed of three: not shown


def test_a_fixed_rate_arm_trains_no_grid_and_runs_its_own_seeds_only():
  """paper1_dip's replication arms: a rate fixed in advance (no selection run), fresh
  seeds of their own; a Muon arm's 1-D group takes the fixed SGD arm's rate."""
  sgd = Arm("dp_sgd", 32, 0.3, epochs=1.0, learning_rate=0.3, seeds=(5, 6), label="rep")
  muon = Arm("dp_muon", 32, 0.02, epochs=1.0, learning_rate=0.02, seeds=(5, 6), label="rep",
             fallback_lr_from=sgd.name)
  study = Study("t", "test", (sgd, muon, SGD), seeds=(2, 3), selection_seed=1)
  runs = [(a.name, lr, seed, a.fallback_learning_rate) for a, lr, seed in ready_runs(study, [])]
  assert runs[:4] == [(sgd.name, 0.3, 5, None), (sgd.name, 0.3, 6, None),
                      (muon.name, 0.02, 5, 0.3), (muon.name, 0.02, 6, 0.3)]
  assert {seed for name, _, seed, _ in runs[4:]} == {1}  # the selected arm: its grid only
  # A recorded run at another seed or rate is not one of the arm's reported runs.
  rows = [_row(0.3, 0.5, s, sgd) for s in (2, 5, 6)] + [_row(0.9, 0.5, 5, sgd)]
  assert [r["seed"] for r in study_report.reported_rows(study, sgd, rows)] == ["5", "6"]
  assert [(a.name, seed) for a, _, seed in ready_runs(study, rows)][:2] == [
      (muon.name, 5), (muon.name, 6)]
  summary = arm_summary(study, sgd, rows)
  assert summary["seeds"] == 2 and summary["chosen_learning_rate"] == 0.3
  assert summary["grid"] == "" and not summary["chosen_on_edge"]


def _dip_study(label="rep", sizes=(256, 1024), seeds=(5, 6, 7)):
  arms = []
  for b in sizes:
    arms += [Arm("dp_sgd", b, 0.1, epochs=1.0, learning_rate=0.1, seeds=seeds, label=label),
             Arm("dp_muon", b, 0.1, epochs=1.0, learning_rate=0.1, seeds=seeds, label=label,
                 fallback_lr_from=f"dp_sgd_B{b}_{label}")]
  return Study("t", "test", tuple(arms), seeds=(2, 3, 4), selection_seed=1,
               gap_change_rule=(label, *sizes))


def _dip_rows(study, gaps, seeds=(5, 6, 7)):
  rows = []
  for arm in study.arms:
    d = gaps[arm.batch_size] if arm.optimizer == "dp_muon" else (0, 0, 0)
    rows += _reported(arm, 0.1, [0.5 + x for x in d], seeds)
  return rows


def test_gap_change_rule_needs_every_seed_one_sign_and_the_mean_beyond_2_paired_se():
  study = _dip_study()
  dip = {256: (-0.006, -0.004, -0.004), 1024: (-0.016, -0.008, -0.022)}
  (row,) = study_report.gap_change_rows(study, _dip_rows(study, dip))
  assert row["verdict"] == "dip replicates" and row["all_negative"] and row["beyond_2_se"]
  change = np.subtract(dip[1024], dip[256])
  assert row["change"] == pytest.approx(change.mean())
  assert row["paired_standard_error"] == pytest.approx(change.std(ddof=1) / np.sqrt(3))
  assert row["change_per_seed"] == "5:-0.0100 6:-0.0040 7:-0.0180"
  rise = {256: (-0.006, -0.004, -0.004), 1024: (0.01, 0.012, 0.011)}
  assert study_report.gap_change_rows(study, _dip_rows(study, rise))[0]["verdict"] == "reversed"
  one_up = {256: (-0.006, -0.004, -0.004), 1024: (-0.03, -0.03, -0.003)}  # seed 7: +0.001
  (row,) = study_report.gap_change_rows(study, _dip_rows(study, one_up))
  assert not row["all_negative"] and row["verdict"] == "undecided"
  spread = {256: (0.0, 0.0, 0.0), 1024: (-0.001, -0.04, -0.001)}  # one sign, within 2 SE
  (row,) = study_report.gap_change_rows(study, _dip_rows(study, spread))
  assert row["all_negative"] and not row["beyond_2_se"] and row["verdict"] == "undecided"
  # Nothing is decided from part of the seeds, nor from seeds the arms do not report.
  partial = [r for r in _dip_rows(study, dip) if not (
      r["arm"] == "dp_muon_B1024_rep" and r["seed"] == "7")]
  assert study_report.gap_change_rows(study, partial) == []
  assert study_report.gap_change_rows(study, _dip_rows(study, dip, seeds=(2, 3, 4))) == []


def test_a_middle_batch_size_is_placed_against_the_reference_on_the_same_seeds(tmp_path,
                                                                               monkeypatch):
  reference = _decision_study(sizes=(256, 1024))
  ref_rows = _decision_rows(reference, {256: (-0.01, -0.004, -0.004),
                                        1024: (-0.016, -0.008, -0.022)})
  rule = _dip_study()
  middle = _decision_study(sizes=(512,))
  study = dataclasses.replace(rule, arms=rule.arms + middle.arms, reference="reference")
  rows = _dip_rows(rule, {256: (0.0,) * 3, 1024: (0.0,) * 3})
  rows += _decision_rows(middle, {512: (-0.02, -0.012, -0.018)})
  low, high = study_report.gap_change_rows(study, rows, reference, ref_rows)[1:]
  assert (low["b_low"], low["b_high"], high["b_low"], high["b_high"]) == (256, 512, 512, 1024)
  assert low["seeds"] == high["seeds"] == "2 3 4"
  assert low["change_per_seed"] == "2:-0.0100 3:-0.0080 4:-0.0140"
  assert low["direction"] == "falls" and high["direction"] == "undecided"
  assert low["verdict"] == ""  # placed, not decided
  # The report reads the reference's runs.csv from the sibling folder.
  monkeypatch.setattr(study_report, "threshold_report", lambda *args: [])
  monkeypatch.setitem(STUDIES, "reference", dataclasses.replace(reference, name="reference"))
  (tmp_path / "reference").mkdir()
  (tmp_path / "dip").mkdir()
  for row in ref_rows:
    append_row(str(tmp_path / "reference" / "runs.csv"), row)
  write_report(study, rows, str(tmp_path / "dip"), None)
  with open(tmp_path / "dip" / "gap_change.csv") as f:
    written = list(csv.DictReader(f))
  assert [r["comparison"] for r in written] == ["rule"] + [
      "position of B = 512 (reference: reference)"] * 2
  assert written[0]["verdict"] == "undecided" and written[1]["direction"] == "falls"


def test_paper1_dip_study_reuses_paper1_ablations_choices_on_fresh_seeds():
  study, ablation = STUDIES["paper1_dip"], STUDIES["paper1_ablation"]
  path = os.path.join(os.path.dirname(__file__), "..", "experiments", "results",
                      "paper1_ablation", "runs.csv")
  with open(path) as f:
    recorded = list(csv.DictReader(f))
  used = {int(r["seed"]) for r in recorded}
  names = {a.name: a for a in ablation.arms}
  fixed = [a for a in study.arms if a.learning_rate is not None]
  assert {(a.optimizer, a.batch_size) for a in fixed} == {
      (o, b) for o in ("dp_sgd", "dp_muon") for b in (256, 1024)}
  for arm in fixed:
    source = names[f"{arm.optimizer}_B{arm.batch_size}"]
    assert grid_state(ablation, source, recorded) == ([], arm.learning_rate)  # not reselected
    assert arm.seeds == (45, 46, 47) and not set(arm.seeds) & used  # fresh seeds
    assert arm.epochs == source.epochs == 6 and arm.options == source.options
    assert arm.priority == 0  # what the rule reads trains first
  for arm, _, _ in ready_runs(study, []):
    if arm.optimizer == "dp_muon" and arm.learning_rate is not None:  # DP-SGD's at the same B
      sgd = names[f"dp_sgd_B{arm.batch_size}"]
      assert arm.fallback_learning_rate == grid_state(ablation, sgd, recorded)[1]
  middle = [a for a in study.arms if a.learning_rate is None]
  assert {(a.optimizer, a.batch_size, a.label) for a in middle} == {
      ("dp_sgd", 512, "main"), ("dp_muon", 512, "main")}
  assert all(a.lr_center == names[f"{a.optimizer}_B256"].lr_center and a.seeds is None
             for a in middle)  # the ablation's grid rule; seed 41 selects, 42-44 report
  assert (study.selection_seed, study.seeds) == (41, (42, 43, 44))
  assert (study.grid_points, study.grid_factor, study.max_extensions) == (
      ablation.grid_points, ablation.grid_factor, ablation.max_extensions)
  assert (study.epsilon, study.delta, study.model_overrides) == (
      ablation.epsilon, ablation.delta, ablation.model_overrides)
  assert study.gap_change_rule == ("replicate", 256, 1024)
  assert study.reference == "paper1_ablation"


def test_a_runs_file_keeps_its_header_when_a_column_is_added(tmp_path):
  path = str(tmp_path / "runs.csv")
  with open(path, "w") as f:
    f.write("arm,seed\n")
  append_row(path, {"arm": "a", "seed": 1, "fallback_learning_rate": 0.3})
  with open(path) as f:
    assert f.read().splitlines() == ["arm,seed", "a,1"]


@pytest.fixture
def tiny_npz(tmp_path):
  rng = np.random.default_rng(0)
  path = tmp_path / "tiny.npz"
  images = rng.integers(0, 256, (120, 8, 8, 3), dtype=np.uint8)
  labels = rng.integers(0, 3, 120)
  np.savez(path, x_train=images[:96], y_train=labels[:96], x_test=images[96:],
           y_test=labels[96:])
  return str(path)


def test_study_restarts_where_it_stopped_and_writes_its_report(tiny_npz, tmp_path):
  arm = Arm("dp_sgd", 16, 0.1, epochs=1.0)
  study = Study("tiny", "test", (arm,), dataset=tiny_npz, model="mlp", validation_size=32,
                seeds=(1, 2), max_extensions=0, microbatch_size=None)
  out = str(tmp_path / "out")
  rows = run_study(study, out, None, workers=1, max_steps=1, max_runs=2)
  assert len(rows) == 2
  rows = run_study(study, out, None, workers=1, max_steps=1)  # skips the two recorded runs
  with open(os.path.join(out, "runs.csv")) as f:
    recorded = list(csv.DictReader(f))
  keys = [(r["arm"], float(r["learning_rate"]), int(r["seed"])) for r in recorded]
  assert len(keys) == len(set(keys)) == 4  # 3 grid rates at seed 1, the chosen one at seed 2
  assert all(float(r["epsilon_spent"]) <= 4.0 for r in recorded)
  assert all(0.0 <= float(r["test_accuracy"]) <= 1.0 for r in recorded)
  write_report(study, rows, out, None)
  with open(os.path.join(out, "summary.csv")) as f:
    (summary,) = list(csv.DictReader(f))
  assert summary["seeds"] == "2" and summary["chosen_learning_rate"]
  assert os.path.exists(os.path.join(out, "accuracy_vs_batch.png"))


def test_privately_tuned_arm_runs_one_selection_per_seed(tiny_npz, tmp_path):
  arm = PrivatelyTunedArm("dp_sgd", 16, 0.1, epochs=1.0, mean_runs=1.5, score_std=0.5,
                          label="private_tuning")
  study = Study("tiny", "test", (arm,), dataset=tiny_npz, model="mlp", validation_size=32,
                seeds=(3,),
                microbatch_size=None)
  assert list(ready_runs(study, [])) and all(math.isnan(lr) for _, lr, _ in ready_runs(study, []))
  out = str(tmp_path / "out")
  (row,) = run_study(study, out, None, workers=1, max_steps=1)
  assert float(row["epsilon_spent"]) <= 4.0 + 1e-9  # the WHOLE selection's ε
  assert any(math.isclose(float(row["learning_rate"]), lr) for lr in (0.1 / 3, 0.1, 0.3))
  assert run_study(study, out, None, workers=1, max_steps=1) == [row]  # recorded: skipped


def test_report_only_writes_the_report_of_the_runs_so_far_and_trains_nothing(
    tiny_npz, tmp_path, monkeypatch):
  from experiments import sweep

  study = Study("tiny_report", "test", (ARM,), dataset=tiny_npz, model="mlp", validation_size=32,
                seeds=(2,), selection_seed=1)
  monkeypatch.setitem(sweep.STUDIES, study.name, study)
  out = tmp_path / "out"
  out.mkdir()
  for row in _grid(ARM, 0.1):
    append_row(str(out / "runs.csv"), row | {"optimizer": "dp_sgd", "batch_size": 32})
  assert sweep.main([study.name, "--out", str(out), "--report-only"]) == 0
  with open(out / "summary.csv") as f:
    (summary,) = list(csv.DictReader(f))
  assert summary["chosen_learning_rate"] == "0.1" and summary["seeds"] == "0"
  assert not (out / "runs").exists()  # nothing trained


def _noise_study():
  arms = tuple(Arm(o, 256, 0.1, epochs=1.0, learning_rate=0.1, label=label,
                   **({"noise": "bandmf", "bands": 4} if label == "bandmf" else {}))
               for label in ("iid", "bandmf") for o in ("dp_sgd", "dp_muon"))
  return Study("t", "test", arms, seeds=(1, 2, 3, 4), selection_seed=1)


def _noise_rows(study, accuracies):
  """``accuracies[(optimizer, label)]``: test accuracy on seeds 2, 3, 4."""
  return [r for arm in study.arms
          for r in _reported(arm, 0.1, accuracies[arm.optimizer, arm.label])]


@pytest.mark.parametrize("muon_bandmf, q1, q2", [
    # e = DP-Muon + BandMF − DP-SGD iid > 0 on every seed, beyond 2 SE: the gap closes
    ((0.52, 0.53, 0.51), "closes DP-Muon's gap", "helps DP-Muon more"),
    # h(DP-Muon) > 0 on every seed, e of both signs: narrowed only
    ((0.49, 0.50, 0.495), "narrows DP-Muon's gap", "helps DP-Muon more"),
    # h(DP-Muon) < 0 on every seed, but less so than h(DP-SGD): i > 0
    ((0.46, 0.47, 0.465), "does not help DP-Muon", "helps DP-Muon more"),
    # h(DP-Muon) < 0, and below h(DP-SGD) on every seed: i < 0
    ((0.44, 0.445, 0.43), "does not help DP-Muon", "helps DP-Muon less"),
    # h(DP-Muon) < 0, i of both signs
    ((0.44, 0.47, 0.455), "does not help DP-Muon", "no detectable difference"),
    # h(DP-Muon) of both signs
    ((0.47, 0.49, 0.48), "undecided", "helps DP-Muon more"),
])
def test_the_correlated_noise_rule_classes_h_e_and_i_seed_by_seed(muon_bandmf, q1, q2):
  """DP-SGD iid 0.50 on every seed, DP-SGD + BandMF 0.47 (h(DP-SGD) = −0.03), DP-Muon iid
  0.48 (1.5 points behind where e and h(DP-Muon) split apart, the seeds' spread)."""
  study = _noise_study()
  accuracies = {("dp_sgd", "iid"): (0.50, 0.50, 0.50), ("dp_sgd", "bandmf"): (0.47, 0.47, 0.47),
                ("dp_muon", "iid"): (0.48, 0.48, 0.48), ("dp_muon", "bandmf"): muon_bandmf}
  quantities, (verdict,) = study_report.correlated_noise_rows(study, _noise_rows(study,
                                                                              accuracies))
  by_name = {q["quantity"]: q for q in quantities}
  assert by_name["h_dp_sgd"]["class"] == "negative"
  assert by_name["e"]["mean"] == pytest.approx(np.mean(muon_bandmf) - 0.50)
  assert by_name["i"]["mean"] == pytest.approx(np.mean(muon_bandmf) - 0.48 + 0.03)
  assert (verdict["q1_gap"], verdict["q2_as_much_as_dp_sgd"]) == (q1, q2)


def test_the_correlated_noise_rule_reads_no_verdict_from_part_of_the_seeds():
  study = _noise_study()
  accuracies = {key: (0.5, 0.5, 0.5) for key in
                [(o, label) for o in ("dp_sgd", "dp_muon") for label in ("iid", "bandmf")]}
  rows = [r for r in _noise_rows(study, accuracies) if r["seed"] != "4"]
  quantities, verdicts = study_report.correlated_noise_rows(study, rows)
  assert verdicts == [] and {q["class"] for q in quantities} == {""}
  assert all(q["seeds"] == "2 3" for q in quantities)
