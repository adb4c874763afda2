"""The trainer: resume bit-for-bit, refusal on a changed privacy setup, budget guard."""

import json
import os

import chex
import numpy as np
import pytest

from dpmuon_jax.optimizers import registry as optimizer_registry
from dpmuon_jax.privacy.accounting import compute_epsilon
from dpmuon_jax.training.checkpoint import TrainingCheckpoint, latest_step, restore_checkpoint
from dpmuon_jax.training.journal import JOURNAL_NAME
from dpmuon_jax.training.trainer import TrainConfig, TrainingError, train


def _config(tmp_path, name, **kw):
  base = dict(model="mlp", dataset="tiny", optimizer="dp_sgd", epsilon=3.0, delta=1e-3,
              batch_size=16, epochs=2, seed=3, output_dir=str(tmp_path / name),
              progress=False, plot=False, learning_rate=0.1)
  base.update(kw)
  return TrainConfig(**base)


def _final(directory, data, config):
  from dpmuon_jax.models.registry import model_and_loss
  from dpmuon_jax.privacy.setup import make_private

  model, _ = model_and_loss(config.model, data.num_classes, data.image_shape,
                            seed=config.model_seed)
  setup = make_private(target_epsilon=config.epsilon, target_delta=config.delta,
                       dataset_size=data.num_train, expected_batch_size=config.batch_size,
                       l2_clip_norm=config.clip, epochs=config.epochs, key=0)
  opt = optimizer_registry.build(config.optimizer, lambda t: 0.1, setup.release_kwargs)
  like = TrainingCheckpoint(model.params, opt.init(model.params), 0, {})
  return restore_checkpoint(os.path.join(directory, "checkpoints"), like)


def test_resume_continues_bit_for_bit_and_refuses_changed_privacy(tmp_path, tiny_data):
  full = _config(tmp_path, "full")
  results = train(full, tiny_data)
  assert results["releases"] == results["planned_steps"] == 8

  part = _config(tmp_path, "part", max_steps=3)
  assert train(part, tiny_data)["releases"] == 3
  resumed = train(_config(tmp_path, "part", resume=True), tiny_data)
  assert resumed["releases"] == 8

  a, b = _final(full.output_dir, tiny_data, full), _final(part.output_dir, tiny_data, full)
  assert a.step == b.step == 8
  chex.assert_trees_all_equal(a.params, b.params)
  chex.assert_trees_all_equal(a.opt_state, b.opt_state)
  assert json.loads(a.metadata["ledger"]) == json.loads(b.metadata["ledger"])

  with pytest.raises(TrainingError, match="Refusing to resume"):
    train(_config(tmp_path, "part", resume=True, batch_size=8), tiny_data)
  with pytest.raises(TrainingError, match="Refusing to resume"):
    train(_config(tmp_path, "part", resume=True, noise_multiplier=2.0), tiny_data)
  with pytest.raises(TrainingError, match="Refusing to resume.*clipping"):
    train(_config(tmp_path, "part", resume=True, clipping="per_layer"), tiny_data)
  with pytest.raises(TrainingError, match="already holds a run"):
    train(_config(tmp_path, "part"), tiny_data)
  # Other data of the same size and name: the ledger would be the same, the run would not.
  from dpmuon_jax.data.images import ImageDataset

  other = ImageDataset(255 - tiny_data.x_train, tiny_data.y_train, tiny_data.x_test,
                       tiny_data.y_test, num_classes=3, name="tiny")
  with pytest.raises(TrainingError, match="Refusing to resume: the training data differ"):
    train(_config(tmp_path, "part", resume=True), other)


def test_a_tuple_in_the_settings_resumes_although_the_checkpoint_stores_a_list(
    tmp_path, tiny_data):
  """The checkpoint's JSON holds (16, 8) as [16, 8]: the same settings still resume."""
  config = dict(model_overrides={"hidden": (16, 8)}, epochs=1)
  assert train(_config(tmp_path, "part", max_steps=1, **config), tiny_data)["releases"] == 1
  resumed = train(_config(tmp_path, "part", resume=True, **config), tiny_data)
  assert resumed["releases"] == resumed["planned_steps"] == 4
  with pytest.raises(TrainingError, match="Refusing to resume.*model_overrides"):
    train(_config(tmp_path, "part", resume=True, model_overrides={"hidden": (16, 4)}),
          tiny_data)


class _FakeTime:
  """The driver's clock: one second per reading, and whatever a patched step adds."""

  def __init__(self):
    self.now = 0.0

  def perf_counter(self):
    self.now += 1.0
    return self.now

  process_time = perf_counter


def test_training_time_leaves_out_checkpoint_writes_and_goes_on_across_a_resumption(
    tmp_path, tiny_data, monkeypatch):
  """Each checkpoint write costs 1000 s and each evaluation of the first segment 50 s:
  the run's time holds the evaluations of both segments and none of the writes."""
  from dpmuon_jax.training import driver

  fake = _FakeTime()
  monkeypatch.setattr(driver, "time", fake)
  save, record = driver.save_checkpoint, driver._record

  def slow_save(*args):
    fake.now += 1000.0
    return save(*args)

  def slow_record(*args):
    fake.now += 50.0
    return record(*args)

  monkeypatch.setattr(driver, "save_checkpoint", slow_save)
  monkeypatch.setattr(driver, "_record", slow_record)
  config = dict(checkpoint_every=1, eval_every=1)
  part = train(_config(tmp_path, "part", max_steps=3, **config), tiny_data)
  assert 150 <= part["train_seconds"] < 1000  # 3 evaluations, 2 writes left out
  monkeypatch.setattr(driver, "_record", record)
  resumed = train(_config(tmp_path, "part", resume=True, **config), tiny_data)
  assert resumed["releases"] == 8
  assert part["train_seconds"] < resumed["train_seconds"] < 1000  # 4 more writes left out
  assert resumed["train_cpu_seconds"] > part["train_cpu_seconds"]
  assert resumed["seconds_per_epoch"] == pytest.approx(resumed["train_seconds"] / 8 * 4)
  with open(os.path.join(tmp_path, "part", "history.csv")) as f:
    seconds = [float(row.split(",")[-2]) for row in f.read().splitlines()[1:]]
  assert seconds == sorted(seconds) and len(seconds) == 8


@pytest.mark.parametrize("optimizer, options, match", [
    ("dp_disk_sgd", {"kappa": 0.5, "gamma": 0.8, "reference_noise_rescaling": True},
     "other privacy settings"),
    # The relation is a privacy setting of the run: refused as an option, before the ledger.
    ("dp_sgd", {"neighbouring": "replace_one"}, "'neighbouring' is a privacy setting"),
])
def test_an_optimizer_releasing_otherwise_than_accounted_is_refused_before_any_release(
    tmp_path, tiny_data, optimizer, options, match):
  """σ (or the relation) the optimizer releases at must be the one the ledger charges:
  refused before the first journal entry, so no release is ever made."""
  config = _config(tmp_path, "refused", optimizer=optimizer, optimizer_options=options)
  with pytest.raises(TrainingError, match=match):
    train(config, tiny_data)
  assert not os.path.exists(os.path.join(config.output_dir, JOURNAL_NAME))


def test_results_state_the_certificates_guarantee_with_the_seed_caveat(tmp_path, tiny_data):
  results = train(_config(tmp_path, "scope", max_steps=1), tiny_data)
  assert results["guarantee"].startswith(f"({results['epsilon_spent']:.4g}, 0.001)-differential")
  assert "add/remove-one" in results["guarantee"]
  assert "holds only while that seed stays secret" in results["guarantee"]  # seed=3


def test_the_fingerprint_leaves_out_what_changes_no_release():
  """A GPT-2 run resumed with other evaluation settings still replays its lost releases."""
  import dataclasses

  from dpmuon_jax.text.train import LMTask, LMTrainConfig
  from dpmuon_jax.training.driver import data_digest, run_fingerprint

  config = LMTrainConfig(data_dir="d")
  arrays, stream = [np.arange(6, dtype=np.int32)], np.array([1, 2], np.uint32)
  data = data_digest(arrays)
  fingerprint = lambda c: run_fingerprint(c, data, stream, LMTask.evaluation_fields)  # noqa: E731
  assert LMTask.evaluation_fields
  for field in LMTask.evaluation_fields:
    value = getattr(config, field)
    changed = (*value, 7) if isinstance(value, tuple) else (value or 0) + 1
    assert fingerprint(dataclasses.replace(config, **{field: changed})) == fingerprint(config)
  for release_field, value in (("clip", 2.0), ("microbatch_size", 8), ("model_seed", 1)):
    assert fingerprint(dataclasses.replace(config, **{release_field: value})) != fingerprint(
        config), release_field
  other_data = data_digest([arrays[0] + 1])
  assert run_fingerprint(config, other_data, stream) != run_fingerprint(config, data, stream)


def test_budget_guard_stops_at_the_largest_affordable_step(tmp_path, tiny_data):
  sigma, q, delta, target = 1.0, 16 / 64, 1e-3, 2.0
  config = _config(tmp_path, "budget", noise_multiplier=sigma, epsilon=target, epochs=10,
                   delta=delta)
  results = train(config, tiny_data)
  expected = 0
  while compute_epsilon(sigma, q, expected + 1, delta) <= target:
    expected += 1
  assert 0 < expected < 40
  assert results["stop_reason"] == "budget"
  assert results["releases"] == expected
  assert results["epsilon_spent"] <= target
  # The ledger's count equals the number of noise draws the release made.
  ckpt = _final(config.output_dir, tiny_data, config)
  assert int(ckpt.opt_state[0].count) == expected
  assert latest_step(os.path.join(config.output_dir, "checkpoints")) == expected


def test_nonprivate_clip_logging_leaves_parameters_bit_identical(tmp_path, tiny_data):
  runs = {}
  for flag in (False, True):
    config = _config(tmp_path, f"log{flag}", log_clip_stats=flag, max_steps=2, eval_every=1)
    train(config, tiny_data)
    runs[flag] = _final(config.output_dir, tiny_data, config)
    logged = [k for k in _history(config.output_dir) if "nonprivate" in k]
    assert bool(logged) == flag
  chex.assert_trees_all_equal(runs[False].params, runs[True].params)


def _history(directory):
  with open(os.path.join(directory, "history.csv")) as f:
    return f.readline().strip().split(",")


# The default optimizer runs here in every CI run; the others are slow variants: each
# registered optimizer's private step (jit once, checkpoint restore, learning) is pinned
# fast by test_conformance, and building one by name for the trainer by test_registry.
@pytest.mark.parametrize("name", [
    name if name == TrainConfig.optimizer else pytest.param(name, marks=pytest.mark.slow)
    for name in optimizer_registry.OPTIMIZERS])
def test_every_registered_optimizer_trains(tmp_path, tiny_data, name):
  results = train(_config(tmp_path, name, optimizer=name, max_steps=2, learning_rate=None),
                  tiny_data)
  assert results["releases"] == 2
  assert np.isfinite(results["final_test_loss"])


def test_init_weights_of_another_shape_are_refused(tmp_path, tiny_data):
  from flax import serialization

  from dpmuon_jax.models.registry import model_and_loss

  other, _ = model_and_loss("mlp", 5, tiny_data.image_shape, seed=0)  # 5 classes, not 3
  path = tmp_path / "other.msgpack"
  path.write_bytes(serialization.to_bytes(other.params))
  with pytest.raises(TrainingError, match="has shape"):
    train(_config(tmp_path, "init", init_weights=str(path), max_steps=1), tiny_data)


def test_fallback_group_runs_its_own_rate_on_the_runs_schedule():
  from dpmuon_jax.training.trainer import _learning_rate_schedule, _optimizer_options

  steps = 100
  config = TrainConfig(optimizer="dp_muon", learning_rate=0.05)
  muon = _learning_rate_schedule(config, steps)
  preset = _optimizer_options(config, steps)["fallback"]  # DP-SGD's 0.3, momentum 0.9
  given = _optimizer_options(TrainConfig(optimizer="dp_muon", learning_rate=0.05,
                                         fallback_learning_rate=0.9), steps)["fallback"]
  assert preset.momentum == given.momentum == 0.9
  for t in (0, 3, 5, 50, 99):  # the same warm-up and cosine shape, other peaks
    np.testing.assert_allclose(preset.learning_rate(t), 0.3 / 0.05 * muon(t), rtol=1e-5)
    np.testing.assert_allclose(given.learning_rate(t), 0.9 / 0.05 * muon(t), rtol=1e-5)
  with pytest.raises(ValueError, match="no fallback group"):
    _optimizer_options(TrainConfig(optimizer="dp_sgd", fallback_learning_rate=0.9), steps)


def test_a_resumed_run_compiles_its_step_once(tmp_path, tiny_data, caplog):
  """The checkpoint restores committed arrays; the noise counter set for the resumption
  must be placed like them, or the first release retraces the step (twice the compile
  time and memory on every resumption)."""
  import jax

  train(_config(tmp_path, "part", max_steps=2, checkpoint_every=2), tiny_data)
  caplog.set_level("WARNING")
  with jax.log_compiles():
    resumed = train(_config(tmp_path, "part", resume=True, checkpoint_every=2), tiny_data)
  assert resumed["releases"] == 8
  compiles = [r.getMessage() for r in caplog.records if "Compiling jit(step)" in r.getMessage()]
  assert len(compiles) == 1, compiles
