"""dpmuon tune and dpmuon compare on the embedded digits data, at the smallest scale."""

import json
import math
import os

import pytest

from dpmuon_jax.cli import _parser, main
from dpmuon_jax.training.export import load_exported

SMALL = ["--model", "mlp", "--epochs", "1", "--batch-size", "64", "--max-steps", "2"]


def test_tune_selects_a_learning_rate_within_the_total_budget(tmp_path, capsys):
  out = tmp_path / "tune"
  # E[K] = 1.2 (geometric): seed 0 draws a single run, which keeps the test short.
  code = main(["tune", *SMALL, "--expected-runs", "1.2", "--grid-size", "3", "--seed", "0",
               "--output-dir", str(out)])
  assert code == 0
  summary = json.loads((out / "tuning.json").read_text())
  assert 0 < summary["epsilon"] <= summary["target_epsilon"] == 4.0
  assert summary["training_epsilon_per_run"] < summary["epsilon"]
  assert summary["delta"] == 1e-5 and summary["seeded"]
  assert summary["learning_rate"] in summary["learning_rates"]
  rates = summary["learning_rates"]
  assert len(rates) == 3 and rates[1] / rates[0] == pytest.approx(3.0)
  assert math.isfinite(summary["score"]) and -0.5 < summary["score"] < 1.5
  assert "nonprivate_runs" not in summary  # K and the other runs stay hidden by default
  selected = out / "selected_run"
  assert (selected / "export" / "params.msgpack").exists()
  record = json.loads((selected / "results.json").read_text())
  assert record["export"] == "export"  # relative: still right after the run was moved
  assert record["config"]["output_dir"] == str(selected.resolve())
  assert summary["selected_run"]["releases"] == 2
  # The published model carries the ε of the whole search, not of its run alone.
  certificate = json.loads((selected / "export" / "privacy_certificate.json").read_text())
  assert certificate["epsilon"] == summary["epsilon"] > certificate["training_epsilon_per_run"]
  # the run's own releases (2 of the planned steps: --max-steps) spend no more than planned
  assert 0 < certificate["training_epsilon_per_run"] <= summary["training_epsilon_per_run"]
  assert certificate["guarantee"] == summary["guarantee"]
  assert certificate["tuning"]["learning_rate"] == summary["learning_rate"]
  assert load_exported(str(selected / "export")).certificate == certificate  # digest intact
  assert [p for p in os.listdir(out) if p.startswith(".")] == []  # temporary runs removed
  printed = capsys.readouterr().out
  assert "chosen learning rate" in printed and "whole tuning procedure" in printed
  assert "NON-private" not in printed


def test_compare_prints_a_table_of_both_optimizers_and_plots(tmp_path, capsys):
  out = tmp_path / "compare"
  assert main(["compare", *SMALL, "--output-dir", str(out)]) == 0
  summary = json.loads((out / "comparison.json").read_text())
  rows = {r["optimizer"]: r for r in summary["rows"]}
  assert list(rows) == ["dp_sgd", "dp_muon"]
  for r in rows.values():
    assert 0 < r["epsilon_spent"] <= 4.0 and r["releases"] == 2
    assert 0 <= r["final_test_accuracy"] <= 1 and len(r["test_accuracy"]) == len(r["epochs"]) >= 1
  assert rows["dp_sgd"]["noise_multiplier"] == rows["dp_muon"]["noise_multiplier"]
  spent = [r["epsilon_spent"] for r in rows.values()]
  assert max(spent) < summary["combined_epsilon"] <= sum(spent)
  assert (out / "accuracy.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  table = capsys.readouterr().out
  assert "dp_sgd" in table and "dp_muon" in table and "releases" in table


@pytest.mark.parametrize("args, message", [
    (["compare", "--optimizers", "dp_sgd,dp_lion"], "Unknown optimizer"),
    (["compare", "--optimizers", "dp_sgd,dp_sgd"], "once"),
    (["compare", "--learning-rates", "0.1"], "one learning rate per optimizer"),
    (["tune", "--learning-rates", "0.1,fast"], "comma-separated numbers"),
    (["tune", "--validation-size", "1500"], "validation size"),
    (["tune", "--epsilon", "0.01"], "out of reach"),
    (["tune", "--expected-runs", "1"], "--expected-runs must be"),
])
def test_bad_arguments_exit_nonzero_with_one_line(args, message, tmp_path, capsys):
  assert main([*args, "--output-dir", str(tmp_path / "x")]) == 2
  err = capsys.readouterr().err.strip()
  assert len(err.splitlines()) == 1 and message in err and "Traceback" not in err


def test_train_defaults_to_dp_muon():
  assert _parser().parse_args(["train"]).optimizer == "dp_muon"
