"""A careless ``dpmuon train-lm`` gets one line and exit status 2, never a traceback.

Each bad setting is refused while the run is validated or its weights load,
before any release (so before any step is compiled): the line names the
offending setting, key or file.
"""

import json
import os

import numpy as np
import pytest

from dpmuon_jax.cli import main
from dpmuon_jax.training.driver import TrainingError
from dpmuon_jax.training.trainer import TrainConfig, train
from experiments.text_sweep import TINY_MODEL
from tests.test_text_train import TEXT_DIR, needs_text_data

# A gpt2_tiny shape (TINY_MODEL) of the config.json the Hugging Face layout has.
TINY_HF_CONFIG = {"vocab_size": 512, "n_positions": 160, "n_embd": 16, "n_layer": 1,
                  "n_head": 2}


def _train_lm(tmp_path, capsys, *args: str) -> str:
  """Runs a one-release tiny ``dpmuon train-lm`` that must be refused: its one stderr line."""
  out = tmp_path / "run"
  code = main(["train-lm", "--data-dir", TEXT_DIR, "--output-dir", str(out),
               "--model", "gpt2_tiny", "--model-overrides", json.dumps(TINY_MODEL),
               "--vocab-size", "512", "--train-split", "train", "--train-subset", "64",
               "--eval-pairs", "16", "--generate-splits", "", "--sampling-rate", "0.125",
               "--steps", "1", "--microbatch-size", "8", "--seed", "1", *args])
  err = capsys.readouterr().err
  assert code == 2, err
  assert err.startswith("dpmuon train-lm: error: ") and err.count("\n") == 1, err
  assert "Traceback" not in err
  assert not (out / "release_journal.jsonl").exists()  # refused before a release
  return err


def _checkpoint(directory, config: object = None, weights: bytes | None = None,
                tensors: dict | None = None) -> str:
  """A Hugging Face folder with this config.json text (or JSON) and these weights."""
  os.makedirs(directory, exist_ok=True)
  config = TINY_HF_CONFIG if config is None else config
  with open(os.path.join(directory, "config.json"), "w") as f:
    f.write(config if isinstance(config, str) else json.dumps(config))
  path = os.path.join(directory, "model.safetensors")
  if weights is not None:
    with open(path, "wb") as f:
      f.write(weights)
  else:
    from safetensors.numpy import save_file

    save_file(tensors or {"foo.weight": np.zeros((2, 2), np.float32)}, path)
  return str(directory)


@needs_text_data
@pytest.mark.parametrize("key, why", [("key", "privacy setting"),
                                      ("noise_multiplier", "privacy setting"),
                                      ("learning_rate", "learning rate")])
def test_a_setting_of_the_run_in_optimizer_kwargs_is_refused_in_one_line(key, why, tmp_path,
                                                                         capsys):
  err = _train_lm(tmp_path, capsys, "--optimizer-kwargs", json.dumps({key: 0.01}))
  assert "optimizer_kwargs" in err and repr(key) in err and why in err, err


@needs_text_data
def test_an_unknown_optimizer_kwarg_is_refused_with_the_ones_the_optimizer_takes(tmp_path,
                                                                                 capsys):
  err = _train_lm(tmp_path, capsys, "--optimizer", "dp_muon_im",
                  "--optimizer-kwargs", '{"bogus": 1}')
  assert "optimizer_kwargs" in err and "'bogus'" in err and "dp_muon_im" in err, err
  for name in ("history", "decay", "beta", "weight_decay", "fallback"):
    assert name in err, err


@pytest.mark.parametrize("options, message", [
    ({"noise_multiplier": 0.0}, "optimizer_options: 'noise_multiplier' is a privacy setting"),
    ({"bogus": 1}, "optimizer_options: dp_sgd takes no option 'bogus'.*momentum, nesterov"),
])
def test_the_image_trainer_refuses_the_same_optimizer_options(options, message, tiny_data,
                                                              tmp_path):
  """``dpmuon train`` has no --optimizer-kwargs; its TrainConfig.optimizer_options share
  the check (and the one line) before anything is built."""
  config = TrainConfig(model="mlp", dataset="tiny", optimizer="dp_sgd", optimizer_options=options,
                       batch_size=16, epochs=1, seed=0, output_dir=str(tmp_path), progress=False,
                       plot=False, max_steps=1)
  with pytest.raises(TrainingError, match=message):
    train(config, tiny_data)
  assert not os.path.exists(tmp_path / "release_journal.jsonl")


@needs_text_data
@pytest.mark.parametrize("overrides, names", [
    ({"dim": -4}, ("model_overrides['dim']", "int >= 1", "-4")),
    ({"num_heads": 0}, ("model_overrides['num_heads']", "int >= 1", "0")),
    ({"dim": 20, "num_heads": 3}, ("model_overrides", "dim 20", "num_heads 3")),
    ({"layers": 2}, ("model_overrides", "'layers'", "num_layers", "dim")),
])
def test_bad_model_overrides_are_refused_before_the_model_is_built(overrides, names, tmp_path,
                                                                   capsys):
  err = _train_lm(tmp_path, capsys, "--model-overrides", json.dumps({**TINY_MODEL, **overrides}))
  for name in names:
    assert name in err, err


@needs_text_data
def test_init_weights_that_are_not_safetensors_are_refused_in_one_line(tmp_path, capsys):
  folder = _checkpoint(tmp_path / "gpt2", weights=os.urandom(256))
  err = _train_lm(tmp_path, capsys, "--init-weights", folder)
  assert os.path.join(folder, "model.safetensors") in err and "safetensors" in err, err


@needs_text_data
def test_a_config_json_that_is_not_json_is_named(tmp_path, capsys):
  folder = _checkpoint(tmp_path / "gpt2", config="not json {")
  err = _train_lm(tmp_path, capsys, "--init-weights", folder)
  assert os.path.join(folder, "config.json") in err and "not valid JSON" in err, err


@needs_text_data
def test_a_config_json_without_gpt2_fields_is_named(tmp_path, capsys):
  folder = _checkpoint(tmp_path / "gpt2", config={"model_type": "bert", "hidden_size": 16})
  err = _train_lm(tmp_path, capsys, "--init-weights", folder)
  assert os.path.join(folder, "config.json") in err and "'n_embd'" in err, err


@needs_text_data
def test_a_checkpoint_without_gpt2_tensors_is_named(tmp_path, capsys):
  folder = _checkpoint(tmp_path / "gpt2")
  err = _train_lm(tmp_path, capsys, "--init-weights", folder)
  assert os.path.join(folder, "model.safetensors") in err, err
  assert "lacks GPT-2 tensor 'wte.weight'" in err, err
  assert "Hugging Face" in err, err  # the layout it expected


@needs_text_data
def test_a_checkpoint_whose_tensors_do_not_fit_its_config_is_named(tmp_path, capsys):
  tensors = {"wte.weight": np.zeros((512, 8), np.float32)}  # config.json: n_embd 16
  folder = _checkpoint(tmp_path / "gpt2", tensors=tensors)
  err = _train_lm(tmp_path, capsys, "--init-weights", folder)
  assert os.path.join(folder, "model.safetensors") in err, err
  assert "'wte.weight'" in err and "(512, 8)" in err and "(512, 16)" in err, err
