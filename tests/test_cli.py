"""The dpmuon command: the main job runs; bad arguments get one line, no traceback."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from text_folder import TEXT_DIR, require_text_data

from dpmuon_jax.cli import main


def test_train_on_the_embedded_default_writes_results(tmp_path, capsys):
  out = tmp_path / "run"
  code = main(["train", "--max-steps", "3", "--seed", "1", "--batch-size", "64",
               "--output-dir", str(out), "--no-progress", "--no-plot"])
  assert code == 0
  results = json.loads((out / "results.json").read_text())
  assert results["releases"] == 3 and results["seeded"]
  assert 0 < results["epsilon_spent"] < results["target_epsilon"]
  printed = capsys.readouterr().out
  assert "test accuracy" in printed and "ε =" in printed
  final = printed.strip().splitlines()[-1]
  assert f"{out}/results.json" in final and f"{out}/export/" in final
  assert results["export"] == "export"  # relative to the run, so the folder can move
  assert (out / "export" / "privacy_certificate.json").exists()
  assert (out / "history.csv").exists()


def test_version(capsys):
  import dpmuon_jax

  with pytest.raises(SystemExit) as done:
    main(["--version"])
  assert done.value.code == 0
  assert capsys.readouterr().out.strip() == f"dpmuon {dpmuon_jax.__version__}"


def _subcommand_parsers():
  import argparse

  from dpmuon_jax.audit.run_audit import _parser as audit_parser
  from dpmuon_jax.cli import _parser

  top = _parser()
  (sub,) = [a for a in top._actions if isinstance(a, argparse._SubParsersAction)]
  return top, {**sub.choices, "audit": audit_parser("dpmuon audit")}


@pytest.mark.parametrize("command", [
    "train", "train-lm", "account", "audit", "tune", "compare"])
def test_every_option_has_help_and_its_default_is_shown_once(command):
  _, parsers = _subcommand_parsers()
  parser = parsers[command]
  assert parser.description, command
  for action in parser._actions:
    assert action.help, (command, action.option_strings)
  text = parser.format_help()
  assert f"usage: dpmuon {command} " in text
  for marker in ("``", ":mod:", ":func:", ":class:"):  # reST is for the docs, not --help
    assert marker not in text, (command, marker)
  # One option per entry: "  --flag ..." up to the next one; its default at most once.
  entries = [e for e in text.split("\n  -")[1:]]
  assert len(entries) >= 8
  for entry in entries:
    assert entry.lower().count("default") <= 1, entry
  if command in ("train", "tune", "compare"):  # one default batch size for every training
    assert parser.get_default("batch_size") == 256


def test_the_top_level_help_has_no_rest_markup():
  top, _ = _subcommand_parsers()
  text = top.format_help()
  assert "``" not in text and ":mod:" not in text and "--version" in text


def test_account_sigma_and_epsilon_round_trip(capsys):
  assert main(["account", "--epsilon", "2", "--delta", "1e-5", "--sampling-rate", "0.01",
               "--steps", "500"]) == 0
  sigma = json.loads(capsys.readouterr().out)["sigma"]
  assert main(["account", "--sigma", str(sigma), "--delta", "1e-5", "--sampling-rate", "0.01",
               "--steps", "500"]) == 0
  eps = json.loads(capsys.readouterr().out)["epsilon"]
  assert 0.98 * 2 <= eps <= 2


def test_account_table_across_batch_sizes(capsys):
  assert main(["account", "--epsilon", "4", "--dataset-size", "50000", "--epochs", "5",
               "--batch-sizes", "512,4096"]) == 0
  lines = capsys.readouterr().out.strip().splitlines()
  sigmas = [float(line.split()[-1]) for line in lines[1:]]
  assert len(sigmas) == 2 and sigmas[1] > sigmas[0]  # σ grows with B at fixed ε, epochs


@pytest.fixture
def bad_npz(tmp_path):
  path = tmp_path / "bad.npz"
  np.savez(path, images=np.zeros((2, 4, 4), np.uint8))
  return str(path)


@pytest.mark.parametrize(
    "args",
    [
        ["--epsilon", "0"],
        ["--epsilon", "-1"],
        ["--delta", "1"],
        ["--batch-size", "100000"],
        ["--dataset", "not_a_dataset"],
        ["--optimizer", "dp_lion"],
        ["--dataset", "cifar10", "--data-dir", "/nonexistent/tfds"],
        ["--dataset", "/nonexistent/file.npz"],
        ["--dataset", "BAD_NPZ"],
    ],
)
def test_bad_train_arguments_exit_nonzero_with_one_line(args, bad_npz, tmp_path, capsys):
  args = [bad_npz if a == "BAD_NPZ" else a for a in args]
  with pytest.raises(SystemExit) if "--optimizer" in args else _no_exit():
    code = main(["train", "--output-dir", str(tmp_path / "x"), "--no-progress", *args])
    assert code != 0
  err = capsys.readouterr().err.strip()
  assert err and "Traceback" not in err
  assert len([line for line in err.splitlines() if "error" in line]) == 1, err


@pytest.mark.parametrize(
    "args, message",
    [
        (["--sampling-rate", "0"], "--sampling-rate"),
        (["--optimizer", "dp_lion"], "dp_lion"),
        (["--model-overrides", "{not json"], "--model-overrides"),
        (["--mesh", "3x5"], "--mesh: The mesh 3x5 needs positive axis sizes"),
    ],
)
def test_bad_train_lm_arguments_exit_2_with_one_line(args, message, tmp_path, capsys):
  if "--mesh" in args:
    require_text_data()
  with pytest.raises(SystemExit) if "--model-overrides" in args else _no_exit():
    code = main(["train-lm", "--data-dir", TEXT_DIR, "--output-dir", str(tmp_path / "x"),
                 "--model", "gpt2_tiny", "--vocab-size", "512", "--train-split", "train",
                 "--train-subset", "64", *args])
    assert code == 2
  err = capsys.readouterr().err.strip()
  assert err.count("\n") == 0 and "Traceback" not in err and message in err, err
  assert not (tmp_path / "x" / "release_journal.jsonl").exists()  # refused before a release


class _no_exit:
  def __enter__(self):
    return self

  def __exit__(self, *exc):
    return False


def test_bad_arguments_in_a_real_process_print_no_traceback(tmp_path):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  proc = subprocess.run(
      [sys.executable, "-m", "dpmuon_jax.cli", "train", "--epsilon", "-3",
       "--output-dir", str(tmp_path / "y")],
      capture_output=True, text=True, env=env, timeout=300,
  )
  assert proc.returncode != 0
  assert "Traceback" not in proc.stderr
  assert "--epsilon must be a finite number > 0" in proc.stderr


def test_ghost_clipping_trains_the_same_model_as_per_example_gradients(tmp_path):
  """Same seed, same releases: --clipped-sum-method ghost (a tapped MLP, per-layer
  clipping) ends where vmap does, to float rounding; the noise is the same draw. (Ghost
  clipping of the CNN's convolutions is pinned in test_ghost.py.)"""
  import jax

  from dpmuon_jax.training.export import load_exported

  finals = {}
  for method in ("vmap", "ghost"):
    out = tmp_path / method
    assert main(["train", "--model", "mlp", "--max-steps", "3", "--seed", "1",
                 "--batch-size", "64", "--clipping", "per_layer", "--clipped-sum-method", method,
                 "--output-dir", str(out), "--no-progress", "--no-plot"]) == 0
    finals[method] = load_exported(str(out / "export")).params
  for a, b in zip(jax.tree.leaves(finals["vmap"]), jax.tree.leaves(finals["ghost"]),
                  strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_cli_choices_are_the_library_names():
  from dpmuon_jax.cli import _parser
  from dpmuon_jax.privacy.clipping import CLIPPING_STYLES
  from dpmuon_jax.privacy.ghost import CLIPPED_SUM_METHODS

  train = _parser()._subparsers._group_actions[0].choices["train"]
  choices = {a.dest: a.choices for a in train._actions}
  assert tuple(choices["clipping"]) == CLIPPING_STYLES
  assert tuple(choices["clipped_sum_method"]) == CLIPPED_SUM_METHODS


def test_secure_noise_with_ghost_clipping_is_refused_in_one_line(tmp_path, capsys):
  code = main(["train", "--secure-noise", "--clipped-sum-method", "ghost", "--max-steps", "1",
               "--output-dir", str(tmp_path / "s"), "--no-progress", "--no-plot"])
  assert code != 0
  err = capsys.readouterr().err
  assert "--clipped-sum-method vmap" in err and "Traceback" not in err


def test_fallback_lr_reaches_the_train_config():
  from dpmuon_jax.cli import _parser
  from dpmuon_jax.training.trainer import TrainConfig

  args = _parser().parse_args(["train", "--optimizer", "dp_muon", "--fallback-lr", "0.9"])
  fields = {k: v for k, v in vars(args).items() if k in TrainConfig.__dataclass_fields__}
  assert TrainConfig(**fields).fallback_learning_rate == 0.9
  assert _parser().parse_args(["train"]).fallback_learning_rate is None  # the preset's


def test_resume_reuses_the_runs_settings_unless_told_otherwise(tmp_path, capsys):
  out = str(tmp_path / "run")
  first = ["train", "--model", "mlp", "--max-steps", "2", "--seed", "1", "--batch-size", "64",
           "--epochs", "0.2", "--output-dir", out, "--no-progress", "--no-plot"]
  assert main(first) == 0
  # No --epochs, --batch-size or --seed: the run's own are reused; it runs to its end.
  assert main(["train", "--resume", "--output-dir", out, "--no-progress", "--no-plot"]) == 0
  with open(os.path.join(out, "results.json")) as f:
    results = json.load(f)
  assert results["config"]["epochs"] == 0.2 and results["config"]["batch_size"] == 64
  assert results["releases"] == results["planned_steps"] > 2
  assert results["stop_reason"] == "completed"
  # Stating another privacy setting anew is refused, in one line, without the old doubling.
  capsys.readouterr()
  assert main(["train", "--resume", "--epochs", "0.3", "--output-dir", out, "--no-progress",
               "--no-plot"]) == 2
  err = capsys.readouterr().err
  assert "Refusing to resume: changed privacy configuration" in err
  assert "Refusing to continue" not in err and len(err.strip().splitlines()) == 1
  # An image run is no GPT-2 run: train-lm refuses to resume it, in one line.
  assert main(["train-lm", "--resume", "--output-dir", out]) == 2
  err = capsys.readouterr().err.strip()
  assert err.startswith("dpmuon train-lm: error: --resume: ") and "another kind" in err
  assert len(err.splitlines()) == 1


_BAD_NUMBERS = [
    (["audit", "--epsilon", "-1"], "--epsilon"),
    (["train", "--fallback-lr", "-0.1"], "--fallback-learning-rate"),  # the old name parses
    (["train", "--fallback-learning-rate", "nan"], "--fallback-learning-rate"),
    (["audit", "--epsilon", "inf"], "--epsilon"),
    (["audit", "--delta", "1"], "--delta"),
    (["audit", "--sampling-rate", "2"], "--sampling-rate"),
    (["audit", "--sampling-rate", "nan"], "--sampling-rate"),
    (["audit", "--canaries", "0"], "--canaries"),
    (["audit", "--canaries", "1"], "--canaries"),  # needs one included and one excluded
    (["audit", "--steps", "0"], "--steps"),
    (["audit", "--clip", "inf"], "--clip"),
    (["audit", "--lr", "0"], "--learning-rate"),  # the white-box residual divides by it
    (["audit", "--hidden", "-1"], "--hidden"),
    (["audit", "--noise-scale", "nan"], "--noise-scale"),
    (["audit", "--significance", "1"], "--significance"),
    (["account", "--epsilon", "4", "--dataset-size", "50000", "--batch-sizes", "512",
      "--epochs", "inf"], "--epochs"),
    (["account", "--epsilon", "4", "--dataset-size", "50000", "--batch-sizes", "512",
      "--epochs", "nan"], "--epochs"),
    (["account", "--epsilon", "4", "--dataset-size", "50000", "--batch-sizes", "512",
      "--epochs", "0"], "--epochs"),
    (["account", "--epsilon", "4", "--dataset-size", "50000", "--batch-sizes", "512",
      "--epochs", "-5"], "--epochs"),
    (["account", "--epsilon", "4", "--dataset-size", "0", "--batch-sizes", "512",
      "--epochs", "2"], "--dataset-size"),
    (["account", "--sigma", "inf", "--sampling-rate", "0.01", "--steps", "100"],
     "--noise-multiplier"),
    (["account", "--sigma", "1", "--sampling-rate", "0.01", "--steps", "0"], "--steps"),
    (["account", "--epsilon", "inf", "--sampling-rate", "0.01", "--steps", "100"], "--epsilon"),
    (["account", "--epsilon", "2", "--delta", "1", "--sampling-rate", "0.01", "--steps", "100"],
     "--delta"),
    (["account", "--epsilon", "2", "--sampling-rate", "2", "--steps", "100"], "--sampling-rate"),
    (["tune", "--lr-center", "0"], "--lr-center"),  # 0 silently meant the preset
    (["tune", "--expected-runs", "1"], "--expected-runs"),
    (["tune", "--poisson", "--expected-runs", "0"], "--expected-runs"),
    (["tune", "--eta", "nan"], "--eta"),
    (["tune", "--score-std", "0"], "--score-std"),
    (["tune", "--epochs", "inf"], "--epochs"),
    (["tune", "--learning-rates", "0.1,inf"], "--learning-rates"),
    (["compare", "--epsilon", "inf"], "--epsilon"),
    (["compare", "--delta", "nan"], "--delta"),
    (["compare", "--clip", "0"], "--clip"),
    (["compare", "--learning-rates", "nan,0.1"], "--learning-rates"),
]


@pytest.mark.parametrize("args, flag", _BAD_NUMBERS)
def test_bad_numbers_exit_2_with_one_line_that_names_the_flag(args, flag, tmp_path, capsys):
  """Refused before any work: nothing on stdout, one line on stderr, no traceback."""
  if args[0] in ("tune", "compare"):
    args = [*args, "--output-dir", str(tmp_path / "run"), "--max-steps", "1"]
  assert main(args) == 2
  captured = capsys.readouterr()
  assert captured.out == ""
  assert captured.err.count("\n") == 1 and "Traceback" not in captured.err
  assert captured.err.startswith(f"dpmuon {args[0]}: error: {flag} must be"), captured.err
  assert not (tmp_path / "run").exists()


def test_a_bad_audit_number_exits_2_in_a_real_process():
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, "-m", "dpmuon_jax.cli", "audit", "--canaries", "0"],
                        capture_output=True, text=True, env=env, timeout=300)
  assert proc.returncode == 2
  assert proc.stderr == "dpmuon audit: error: --canaries must be an int >= 2, got 0.\n"
