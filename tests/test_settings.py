"""One name, one parser and one check per setting, on every command (parse-only, no training)."""

import argparse
import dataclasses
import math
import re

import pytest

from dpmuon_jax.cli import main
from dpmuon_jax.help_format import shown_default
from dpmuon_jax.text.train import LMTrainConfig
from dpmuon_jax.training.settings import PrivacySettings, RunControl, flag_of
from dpmuon_jax.training.trainer import TrainConfig

COMMANDS = ("train", "train-lm", "tune", "compare", "account", "audit")

# A concept -> its one flag, on every command that has it.
CONCEPTS = {
    "epsilon": "--epsilon", "delta": "--delta", "clip": "--clip", "seed": "--seed",
    "accountant": "--accountant", "noise_multiplier": "--noise-multiplier",
    "learning_rate": "--learning-rate", "fallback_learning_rate": "--fallback-learning-rate",
    "sampling_rate": "--sampling-rate", "steps": "--steps", "epochs": "--epochs",
    "batch_size": "--batch-size", "dataset": "--dataset", "data_dir": "--data-dir",
    "model": "--model", "optimizer": "--optimizer", "output_dir": "--output-dir",
    "max_steps": "--max-steps", "microbatch_size": "--microbatch-size",
    "clipped_sum_method": "--clipped-sum-method", "model_seed": "--model-seed",
    "resume": "--resume", "devices": "--devices", "mesh": "--mesh", "log_dir": "--log-dir",
    "privacy_unit": "--privacy-unit", "max_examples_per_user": "--max-examples-per-user",
    "noise": "--noise", "bands": "--bands", "buffers": "--buffers",
}
_SAME_CONCEPT = {"data": "dataset"}  # the audit's field for its --dataset


def _parsers() -> dict[str, argparse.ArgumentParser]:
  from dpmuon_jax.audit.run_audit import _parser as audit_parser
  from dpmuon_jax.cli import _parser

  top = _parser()
  (sub,) = [a for a in top._actions if isinstance(a, argparse._SubParsersAction)]
  return {**{c: sub.choices[c] for c in COMMANDS if c != "audit"},
          "audit": audit_parser("dpmuon audit")}


PARSERS = _parsers()


@pytest.mark.parametrize("command", COMMANDS)
def test_each_shared_concept_has_one_flag_name_on_every_command(command):
  for action in PARSERS[command]._actions:
    concept = _SAME_CONCEPT.get(action.dest, action.dest)
    if concept in CONCEPTS and action.option_strings:
      assert action.option_strings[0] == CONCEPTS[concept], (command, action.option_strings)


def test_the_training_commands_share_their_flags():
  def flags(command):
    return {CONCEPTS[a.dest] for a in PARSERS[command]._actions if a.dest in CONCEPTS}

  assert {"--epsilon", "--delta", "--clip", "--seed", "--max-steps"} <= flags("tune")
  assert flags("tune") <= flags("train") and flags("compare") <= flags("train")
  shared = {flag_of(f) for f in dataclasses.fields(PrivacySettings)}
  shared |= {flag_of(f) for f in dataclasses.fields(RunControl)}
  assert shared <= flags("train") | {"--log-clip-stats", "--eval-every", "--checkpoint-every",
                                     "--progress", "--plot"}


@pytest.mark.parametrize("command", COMMANDS)
def test_help_prints_defaults_as_typed_never_a_python_repr(command):
  text = PARSERS[command].format_help()
  assert not re.search(r"\d\.\d{7,}", text), command  # 1/41 is 0.02439
  for repr_only in ("default: None", "default: (", "default: [", "default: True",
                    "default: False"):
    assert repr_only not in text, (command, repr_only)


def test_defaults_are_shown_as_a_user_types_them():
  assert shown_default(1 / 41) == "0.02439" and shown_default(1e-5) == "1e-05"
  assert shown_default(("valid", "test")) == "valid,test" and shown_default(()) == "''"
  assert shown_default(None) == "none" and shown_default({}) == "{}"
  assert shown_default(0.002) == "0.002"


# (command, old spelling, value, field): each still parses to the same field.
OLD_FLAGS = [
    ("train", "--lr", "0.1", "learning_rate"),
    ("train", "--fallback-lr", "0.2", "fallback_learning_rate"),
    ("train", "--sigma", "1.5", "noise_multiplier"),
    ("train-lm", "--lr", "0.1", "learning_rate"),
    ("train-lm", "--fallback-lr", "0.2", "fallback_learning_rate"),
    ("account", "--sigma", "1.5", "noise_multiplier"),
    ("audit", "--lr", "0.1", "learning_rate"),
    ("audit", "--data", "x.npz", "data"),
]


@pytest.mark.parametrize("command, old, value, field", OLD_FLAGS)
def test_an_old_flag_name_parses_to_the_same_field_as_the_new_one(command, old, value, field):
  new = next(a for a in PARSERS[command]._actions if a.dest == field).option_strings[0]
  assert new != old
  parse = PARSERS[command].parse_args
  assert getattr(parse([old, value]), field) == getattr(parse([new, value]), field)


# Every flag each command had before its flags were made from the settings.
_OLD_TRAIN = (
    "--model --dataset --data-dir --optimizer --epsilon --delta --batch-size --epochs --lr "
    "--fallback-lr --clip --clipping --microbatch-size --clipped-sum-method --augment "
    "--noise-multiplier --seed --output-dir --resume --max-steps --log-clip-stats --log-dir "
    "--accountant --init-weights --devices --mesh --secure-noise --no-progress --no-plot "
    "--coordinator-address --num-processes --process-id --distributed --cpu-collectives")
_OLD_RUN = ("--model --dataset --data-dir --epsilon --delta --batch-size --epochs --clip "
            "--microbatch-size --clipped-sum-method --max-steps --output-dir --seed")
OLD_SPELLINGS = {
    "train": _OLD_TRAIN,
    "tune": _OLD_RUN + " --optimizer --lr-center --grid-size --learning-rates --expected-runs "
                       "--eta --poisson --validation-size --score-std --show-all-runs",
    "compare": _OLD_RUN + " --optimizers --learning-rates",
    "account": "--epsilon --sigma --delta --sampling-rate --steps --dataset-size --epochs "
               "--batch-sizes --accountant",
    "audit": "--scoring --canaries --epsilon --delta --sampling-rate --steps --clip --lr "
             "--hidden --noise-scale --significance --data --seed --audit-seed",
}


@pytest.mark.parametrize("command", sorted(OLD_SPELLINGS))
def test_every_old_flag_is_still_accepted(command):
  known = {s for a in PARSERS[command]._actions for s in a.option_strings}
  assert set(OLD_SPELLINGS[command].split()) <= known


def test_every_lm_field_keeps_its_flag_and_bools_both_spellings():
  known = {s for a in PARSERS["train-lm"]._actions for s in a.option_strings}
  for field in dataclasses.fields(LMTrainConfig):
    flag = "--" + field.name.replace("_", "-")
    assert flag in known
    if field.type == "bool":
      assert "--no-" + flag[2:] in known


# (field, a bad value, its text on the command line): each refused by the field's one check.
BAD = [
    ("epsilon", -1.0, "-1"), ("epsilon", math.nan, "nan"), ("epsilon", math.inf, "inf"),
    ("delta", 1.0, "1"), ("delta", 0.0, "0"), ("clip", -1.0, "-1"), ("clip", 0.0, "0"),
    ("max_steps", 0, "0"), ("microbatch_size", 0, "0"), ("accountant", "bogus", "bogus"),
    ("learning_rate", -1.0, "-1"), ("eval_every", 0, "0"), ("checkpoint_every", -2, "-2"),
    ("devices", 0, "0"), ("clipped_sum_method", "fast", "fast"),
]


@pytest.mark.parametrize("config", [TrainConfig, LMTrainConfig])
@pytest.mark.parametrize("field, value, text", BAD)
def test_both_configs_refuse_a_bad_value_in_one_line_naming_the_flag(config, field, value, text):
  required = {"data_dir": "unused"} if config is LMTrainConfig else {}
  with pytest.raises(ValueError) as info:
    config(**required, **{field: value})
  flag = _flag(field)
  assert str(info.value).startswith(f"{flag} must be") and "\n" not in str(info.value)


def _exit_code(argv) -> int:
  try:
    return main(argv)
  except SystemExit as done:  # argparse's own refusal (a choice): exit status 2 too
    return int(done.code or 0)


_REQUIRED = {"train-lm": ["--data-dir", "unused"], "account": ["--sampling-rate", "0.01",
                                                               "--steps", "10"]}


def _flag(field: str) -> str:
  return CONCEPTS.get(field, "--" + field.replace("_", "-"))


_APPLICABLE = [(command, field, text) for command in COMMANDS for field, _, text in BAD
               if _flag(field) in {s for a in PARSERS[command]._actions for s in a.option_strings}]


@pytest.mark.parametrize("command, field, text", _APPLICABLE)
def test_each_command_refuses_a_bad_value_in_one_line_naming_the_flag(command, field, text,
                                                                      tmp_path, capsys):
  flag = _flag(field)
  out = ["--output-dir", str(tmp_path / "run")] if command not in ("account", "audit") else []
  argv = [command, *_REQUIRED.get(command, []), *out, f"{flag}={text}"]
  if command == "account" and field != "epsilon":
    argv += ["--epsilon", "2"]
  assert _exit_code(argv) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and flag in err and "Traceback" not in err, err
  assert not (tmp_path / "run").exists()
