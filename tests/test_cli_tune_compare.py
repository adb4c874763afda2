"""dpmuon tune and dpmuon compare on the embedded digits data, at the smallest scale."""

import contextlib
import csv
import dataclasses
import io
import json
import math
import os
import shutil

import pytest

from dpmuon_jax.cli import _parser, main
from dpmuon_jax.training.export import load_exported

SMALL = ["--model", "mlp", "--epochs", "1", "--batch-size", "64", "--max-steps", "2"]


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
  """One ``dpmuon tune`` for the module's tests: its folder and what it printed. Tests that
  write to the selected run work on a copy (:func:`_copy_of_selected_run`)."""
  out = tmp_path_factory.mktemp("tune") / "tune"
  printed = io.StringIO()
  with contextlib.redirect_stdout(printed):
    # E[K] = 1.2 (geometric): seed 0 draws a single run, which keeps the tests short.
    code = main(["tune", *SMALL, "--expected-runs", "1.2", "--grid-size", "3", "--seed", "0",
                 "--output-dir", str(out)])
  assert code == 0
  return out, printed.getvalue()


def _copy_of_selected_run(tuned, tmp_path):
  copy = tmp_path / "selected_run"
  shutil.copytree(tuned[0] / "selected_run", copy)
  return copy


def test_tune_selects_a_learning_rate_within_the_total_budget(tuned):
  out, printed = tuned
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
  assert "chosen learning rate" in printed and "whole tuning procedure" in printed
  assert "NON-private" not in printed


def _assert_tuned(statement, summary, epsilon_key="epsilon"):
  """A selected run's results or certificate: the search's ε and guarantee, the search named."""
  assert statement[epsilon_key] == summary["epsilon"]
  assert 0 < statement.get("training_epsilon_per_run", math.inf) < summary["epsilon"]
  assert statement["delta"] == summary["delta"]
  assert statement["target_epsilon"] == summary["target_epsilon"]
  assert statement["seeded"] and statement["guarantee"] == summary["guarantee"]
  assert "whole tuning procedure" in statement["guarantee"] and "seed" in statement["guarantee"]
  tuning = statement["tuning"]
  assert tuning["learning_rate"] == summary["learning_rate"]
  assert tuning["learning_rates"] == summary["learning_rates"]
  assert tuning["distribution"] == summary["distribution"]


def test_the_selected_runs_results_and_history_state_the_search(tuned):
  out, _ = tuned
  summary = json.loads((out / "tuning.json").read_text())
  _assert_tuned(json.loads((out / "selected_run" / "results.json").read_text()), summary,
                "epsilon_spent")
  with open(out / "selected_run" / "history.csv") as f:
    history = list(csv.DictReader(f))
  assert all(float(row["epsilon"]) == summary["epsilon"] for row in history)
  assert float(history[-1]["training_epsilon_per_run"]) < summary["epsilon"]


def test_dpmuon_export_of_the_selected_run_certifies_the_search(tuned, tmp_path, capsys):
  out, _ = tuned
  summary = json.loads((out / "tuning.json").read_text())
  assert main(["export", str(out / "selected_run"), "--out", str(tmp_path / "model")]) == 0
  _assert_tuned(load_exported(str(tmp_path / "model")).certificate, summary)
  assert f"ε = {summary['epsilon']:.3f}" in capsys.readouterr().out


def test_a_resumed_selected_run_keeps_the_search_in_its_results_and_export(tuned, tmp_path):
  from dpmuon_jax.data.loaders import load_dataset
  from dpmuon_jax.training.selection import holdout
  from dpmuon_jax.training.trainer import TrainConfig, train

  out, _ = tuned
  summary = json.loads((out / "tuning.json").read_text())
  run = _copy_of_selected_run(tuned, tmp_path)
  recorded = json.loads((run / "results.json").read_text())["config"]
  config = dataclasses.replace(TrainConfig(**recorded), output_dir=str(run), resume=True)
  train_part = holdout(load_dataset("digits"), summary["validation_size"])[0]
  shutil.rmtree(run / "export")  # the resume writes it anew
  results = train(config, train_part)  # --max-steps 2 again: no release, outputs rewritten
  assert results["releases"] == 2
  _assert_tuned(results, summary, "epsilon_spent")
  _assert_tuned(json.loads((run / "results.json").read_text()), summary, "epsilon_spent")
  _assert_tuned(load_exported(str(run / "export")).certificate, summary)


def test_a_selected_run_whose_search_record_is_gone_or_changed_is_not_exported_or_resumed(
    tuned, tmp_path, capsys):
  from dpmuon_jax.data.loaders import load_dataset
  from dpmuon_jax.training.export import SEARCH_FILE
  from dpmuon_jax.training.selection import holdout
  from dpmuon_jax.training.trainer import TrainConfig, TrainingError, train

  summary = json.loads((tuned[0] / "tuning.json").read_text())
  run = _copy_of_selected_run(tuned, tmp_path)
  os.remove(run / SEARCH_FILE)
  assert main(["export", str(run), "--out", str(tmp_path / "model")]) == 1
  err = capsys.readouterr().err.strip()
  assert len(err.splitlines()) == 1 and "tuning search" in err and SEARCH_FILE in err
  assert not (tmp_path / "model").exists()
  recorded = json.loads((run / "results.json").read_text())["config"]
  config = dataclasses.replace(TrainConfig(**recorded), output_dir=str(run), resume=True)
  with pytest.raises(TrainingError, match="tuning search"):
    train(config, holdout(load_dataset("digits"), summary["validation_size"])[0])
  record = json.loads((tuned[0] / "selected_run" / SEARCH_FILE).read_text())
  (run / SEARCH_FILE).write_text(json.dumps({**record, "epsilon": 1.0}))  # a smaller ε
  assert main(["export", str(run), "--out", str(tmp_path / "model")]) == 1
  assert "differs from the one its checkpoints hold" in capsys.readouterr().err


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
