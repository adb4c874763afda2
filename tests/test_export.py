"""Export: public parameters and a privacy certificate, and not one bit of key material."""

import os
import re
import stat

import chex
import jax
import numpy as np
import pytest

from dpmuon_jax.cli import main
from dpmuon_jax.models.registry import MODEL_NAMES, model_and_loss
from dpmuon_jax.privacy.accounting import PrivacyLedger
from dpmuon_jax.training import export
from dpmuon_jax.training.checkpoint import restore_untyped
from dpmuon_jax.training.export import (
    CERTIFICATE_FILE,
    PARAMS_FILE,
    export_model,
    export_run,
    load_exported,
)
from dpmuon_jax.training.trainer import TrainConfig, TrainingError, _initial_params, train

MODEL = "cnn"  # the smallest registered model


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  """One tiny run from OS entropy (a seed's root key [0, seed] would be trivially found)."""
  assert MODEL in MODEL_NAMES
  out = str(tmp_path_factory.mktemp("export") / "run")
  results = train(TrainConfig(dataset="digits", model=MODEL, max_steps=2, epochs=1,
                              batch_size=64, seed=None, plot=False, progress=False,
                              output_dir=out))
  exported = export_run(out)
  secret = restore_untyped(os.path.join(out, "checkpoints"), opt_state=True)
  return out, exported, results, secret


def _key_words(secret):
  root = [int(w) for w in secret.metadata["root_key"]]
  noise = [int(w) for leaf in jax.tree.leaves(secret.opt_state)
           if np.asarray(leaf).dtype == np.uint32 for w in np.asarray(leaf).ravel()]
  return root, noise


def test_export_holds_no_key_material(run):
  _, exported, _, secret = run
  root, noise = _key_words(secret)
  assert len(root) == 2 and len(noise) >= 2
  assert sorted(os.listdir(exported)) == sorted([CERTIFICATE_FILE, PARAMS_FILE])
  for name in os.listdir(exported):
    path = os.path.join(exported, name)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o644  # public by design
    with open(path, "rb") as f:
      data = f.read()
    for word in root + noise:
      assert not re.search(rb"(?<!\d)%d(?!\d)" % word, data), (name, word)
      assert np.uint32(word).tobytes() not in data, (name, word)
    for words in (root, noise[:2]):
      assert np.asarray(words, "<u4").tobytes() not in data


def test_certificate_matches_the_ledger(run):
  _, exported, results, secret = run
  certificate = load_exported(exported).certificate
  ledger = PrivacyLedger.from_json(secret.metadata["ledger"])
  assert certificate["epsilon"] == ledger.epsilon() == results["epsilon_spent"]
  assert certificate["delta"] == results["delta"]
  assert certificate["noise_multiplier"] == results["noise_multiplier"]
  assert certificate["sampling_rate"] == results["sampling_rate"]
  assert certificate["releases"] == 2 and certificate["denominator"] == 64
  assert certificate["accountant"] == "rdp" and certificate["adjacency"] == "add_remove"
  assert certificate["clipping"] == {"rule": "flat_clip", "l2_clip_norm": 1.0}
  assert certificate["seeded"] is False and certificate["secure_noise"] is False
  assert certificate["model"]["architecture"] == MODEL
  assert certificate["model"]["pretrained_initialisation"] is False
  assert "hyperparameter search across runs is not covered" in certificate["guarantee"]
  assert certificate["library"]["name"] == "dpmuon-jax"


def test_a_checkpoint_without_a_recorded_model_is_described_from_its_settings(
    run, monkeypatch, tmp_path):
  """Checkpoints written before runs recorded their model still export a description."""
  out, _, _, _ = run

  def older_checkpoint(*args, **kwargs):
    checkpoint = restore_untyped(*args, **kwargs)
    del checkpoint.metadata["model"]
    return checkpoint

  monkeypatch.setattr(export, "restore_untyped", older_checkpoint)
  model = load_exported(export_run(out, str(tmp_path / "old"))).certificate["model"]
  assert model["architecture"] == MODEL and model["pretrained_initialisation"] is False
  assert model["overrides"] == {}


def test_exported_params_equal_the_checkpoint_and_load_as_init_weights(run):
  _, exported, _, secret = run
  chex.assert_trees_all_equal(load_exported(exported).params, secret.params)
  model, _ = model_and_loss(MODEL, 10, (8, 8, 1), seed=0)
  typed = load_exported(exported, like=model.params).params
  chex.assert_trees_all_equal(jax.tree.leaves(typed), jax.tree.leaves(secret.params))
  initial = _initial_params(model.params, os.path.join(exported, PARAMS_FILE))
  chex.assert_trees_all_equal(initial, typed)
  with pytest.raises(TrainingError, match="does not match"):
    _initial_params({"other": model.params}, os.path.join(exported, PARAMS_FILE))


def test_cli_export_and_one_line_errors(run, tmp_path, capsys):
  out_dir, _, _, _ = run
  target = tmp_path / "public"
  assert main(["export", out_dir, "--out", str(target)]) == 0
  assert "ε =" in capsys.readouterr().out
  assert sorted(os.listdir(target)) == sorted([CERTIFICATE_FILE, PARAMS_FILE])

  assert main(["export", str(tmp_path / "no_such_run")]) == 1
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and "no_such_run" in err[0] and err[0].startswith("dpmuon export: error")
  assert main(["export", str(tmp_path)]) == 1  # a directory without checkpoints
  assert len(capsys.readouterr().err.strip().splitlines()) == 1
  with pytest.raises(SystemExit) as info:
    main(["export"])
  assert info.value.code == 2


def test_load_exported_errors(tmp_path):
  with pytest.raises(FileNotFoundError, match="No exported model"):
    load_exported(str(tmp_path / "missing"))
  export_model(str(tmp_path / "m"), {"w": np.ones(2, np.float32)}, {"epsilon": 1.0})
  os.remove(tmp_path / "m" / CERTIFICATE_FILE)
  with pytest.raises(FileNotFoundError, match="privacy_certificate.json is missing"):
    load_exported(str(tmp_path / "m"))


@pytest.mark.parametrize(
    "certificate",
    [
        {"epsilon": 1.0, "root_key": [1, 2]},
        {"epsilon": 1.0, "model": {"rng_state": 3}},
        {"epsilon": 1.0, "config": {"seed": 3}},
        {"epsilon": 1.0, "extra": [np.array([1, 2], np.uint32)]},
        {"epsilon": 1.0, "extra": jax.random.key(0)},
    ],
)
def test_export_model_refuses_key_material(tmp_path, certificate):
  with pytest.raises(ValueError, match="Refusing to export"):
    export_model(str(tmp_path / "m"), {"w": np.ones(2, np.float32)}, certificate)
  assert not os.path.exists(tmp_path / "m")


def test_export_model_refuses_key_leaves_but_allows_named_flags(tmp_path):
  with pytest.raises(ValueError, match="Refusing to export"):
    export_model(str(tmp_path / "m"), {"w": np.ones(2, np.uint32)}, {"epsilon": 1.0})
  # "seeded" is a flag, and a model's attention "key" projection is a parameter.
  params = {"attn": {"key": {"kernel": np.ones((2, 2), np.float32)}}}
  export_model(str(tmp_path / "ok"), params, {"epsilon": 1.0, "seeded": True})
  assert load_exported(str(tmp_path / "ok")).certificate["seeded"] is True


def test_an_export_into_the_runs_folder_or_above_it_is_refused(run):
  out, _, _, _ = run
  for folder in (out, os.path.dirname(out), os.path.join(out, ".")):
    with pytest.raises(ValueError, match="checkpoints and release journal are secret"):
      export_run(out, folder)
  assert not os.path.exists(os.path.join(out, PARAMS_FILE))
  assert main(["export", out, "--out", out]) == 1
