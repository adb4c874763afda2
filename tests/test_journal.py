"""The release journal: a noise key is never used on two different sums, no release is lost.

The crash is emulated by deleting the last checkpoint after a run: its releases
were made (and journaled) but the checkpoint that would record them is gone,
exactly as when a run is killed between a release and its checkpoint.
"""

import collections
import os
import shutil

import chex
import pytest

from dpmuon_jax.privacy.release import noise_counter
from dpmuon_jax.training.journal import (
    JournalEntry,
    ResumePlan,
    append_entry,
    plan_resume,
    read_journal,
)
from dpmuon_jax.training.trainer import JOURNAL_NAME, TrainConfig, TrainingError, train
from tests.test_trainer import _final


def test_plan_replays_only_an_identical_continuation():
  entries = [JournalEntry(s, s, "fp") for s in range(6)]
  # Checkpoint at step 4 (next key 4): releases 4 and 5 were lost.
  assert plan_resume(entries, 4, 4, "fp") == ResumePlan(4, 0, 6)
  assert plan_resume(entries, 4, 4, "other") == ResumePlan(6, 2, 6)
  assert plan_resume(entries, 4, 4, "fp", replayable=False) == ResumePlan(6, 2, 6)
  assert plan_resume(entries, 6, 6, "fp") == ResumePlan(6, 0, 6)
  # After a fresh-key resume (keys 6, 7 used from step 4), a second crash.
  entries += [JournalEntry(4, 6, "other"), JournalEntry(5, 7, "other")]
  assert plan_resume(entries, 4, 4, "other") == ResumePlan(8, 4, 8)


def test_journal_is_durable_owner_only_and_tolerates_a_torn_line(tmp_path):
  path = str(tmp_path / "journal.jsonl")
  append_entry(path, JournalEntry(0, 0, "a"))
  append_entry(path, JournalEntry(1, 1, "a"))
  assert os.stat(path).st_mode & 0o777 == 0o600
  with open(path, "a") as f:
    f.write('{"step": 2, "key_in')  # killed mid-write
  entries = read_journal(path)
  assert [e.key_index for e in entries] == [0, 1, 2]
  assert entries[-1].fingerprint == "torn"


def _config(tmp_path, name, **kw):
  base = dict(model="cnn", dataset="tiny", optimizer="dp_sgd", epsilon=3.0, delta=1e-3,
              batch_size=16, epochs=2, seed=3, output_dir=str(tmp_path / name),
              progress=False, plot=False, learning_rate=0.1, checkpoint_every=1)
  base.update(kw)
  return TrainConfig(**base)


def _crash_after(tmp_path, name, data, steps):
  """A run whose last checkpoint (made after release ``steps``) is lost."""
  config = _config(tmp_path, name, max_steps=steps)
  train(config, data)
  shutil.rmtree(os.path.join(config.output_dir, "checkpoints", str(steps)))
  return config


def _keys_meet_one_sum(output_dir):
  by_key = collections.defaultdict(set)
  for entry in read_journal(os.path.join(output_dir, JOURNAL_NAME)):
    by_key[entry.key_index].add(entry.fingerprint)
  return all(len(fingerprints) == 1 for fingerprints in by_key.values())


def test_resume_with_a_changed_setting_gets_fresh_keys_and_charges_the_lost_release(
    tmp_path, tiny_data, capsys
):
  config = _crash_after(tmp_path, "changed", tiny_data, 4)
  resumed = train(_config(tmp_path, "changed", resume=True, augment=True, max_steps=6),
                  tiny_data)
  assert "cannot be replayed" in capsys.readouterr().out
  # 3 checkpointed + 1 lost (charged) + 3 new (steps 3, 4, 5) releases.
  assert resumed["releases"] == 7
  assert _keys_meet_one_sum(config.output_dir)
  final = _final(config.output_dir, tiny_data, config)
  assert noise_counter(final.opt_state) == 7


def test_resume_with_identical_settings_replays_bit_for_bit_without_double_charging(
    tmp_path, tiny_data
):
  config = _crash_after(tmp_path, "same", tiny_data, 4)
  resumed = train(_config(tmp_path, "same", resume=True, max_steps=6), tiny_data)
  straight = train(_config(tmp_path, "straight", max_steps=6), tiny_data)
  assert resumed["releases"] == straight["releases"] == 6
  assert _keys_meet_one_sum(config.output_dir)
  a = _final(config.output_dir, tiny_data, config)
  b = _final(straight["config"]["output_dir"], tiny_data, config)
  chex.assert_trees_all_equal(a.params, b.params)


def test_lost_releases_not_redone_are_still_charged(tmp_path, tiny_data):
  config = _crash_after(tmp_path, "short", tiny_data, 4)
  # Resume from step 3 but stop at once: release 4 (lost) is not redone.
  resumed = train(_config(tmp_path, "short", resume=True, max_steps=3), tiny_data)
  assert resumed["releases"] == 4
  final = _final(config.output_dir, tiny_data, config)
  assert noise_counter(final.opt_state) == 4


def test_resume_refuses_another_seed(tmp_path, tiny_data):
  train(_config(tmp_path, "seed", max_steps=2), tiny_data)
  with pytest.raises(TrainingError, match="--seed 4 differs"):
    train(_config(tmp_path, "seed", resume=True, seed=4), tiny_data)
  # No seed on resume takes the run's own.
  assert train(_config(tmp_path, "seed", resume=True, seed=None, max_steps=3),
               tiny_data)["releases"] == 3


def test_resuming_a_finished_run_says_so(tmp_path, tiny_data, capsys):
  done = train(_config(tmp_path, "done", epochs=0.5), tiny_data)
  again = train(_config(tmp_path, "done", epochs=0.5, resume=True), tiny_data)
  assert "already finished (completed)" in capsys.readouterr().out
  assert again["releases"] == done["releases"]


def test_a_journal_without_checkpoint_is_not_overwritten(tmp_path, tiny_data):
  config = _config(tmp_path, "early")
  os.makedirs(config.output_dir)
  append_entry(os.path.join(config.output_dir, JOURNAL_NAME), JournalEntry(0, 0, "x"))
  with pytest.raises(TrainingError, match="already holds a run"):
    train(config, tiny_data)


_CHILD = """
import numpy as np, sys
from dpmuon_jax.data.images import ImageDataset
from dpmuon_jax.training.trainer import TrainConfig, train
rng = np.random.default_rng(0)
x = rng.integers(0, 256, size=(80, 8, 8, 1), dtype=np.uint8)
y = rng.integers(0, 3, size=(80,))
data = ImageDataset(x[:64], y[:64], x[64:], y[64:], num_classes=3, name="tiny")
train(TrainConfig(model="cnn", dataset="tiny", optimizer="dp_sgd", epsilon=50.0, delta=1e-3,
                  batch_size=16, epochs=200, seed=3, output_dir=sys.argv[1], progress=False,
                  plot=False, learning_rate=0.1, checkpoint_every=3), data)
"""


def test_a_killed_run_resumed_with_augmentation_never_reuses_a_key(tmp_path, tiny_data):
  import signal
  import subprocess
  import sys
  import time

  output_dir = str(tmp_path / "killed")
  journal = os.path.join(output_dir, JOURNAL_NAME)
  child = subprocess.Popen([sys.executable, "-c", _CHILD, output_dir],
                           env={**os.environ, "JAX_PLATFORMS": "cpu"})
  try:
    deadline = time.time() + 240
    while len(read_journal(journal)) < 8 and child.poll() is None and time.time() < deadline:
      time.sleep(0.05)
  finally:
    child.send_signal(signal.SIGKILL)
    child.wait()
  made = {e.key_index for e in read_journal(journal)}
  assert len(made) >= 8
  resumed = train(TrainConfig(model="cnn", dataset="tiny", optimizer="dp_sgd", epsilon=50.0,
                              delta=1e-3,
                              batch_size=16, epochs=200, seed=3, output_dir=output_dir,
                              progress=False, plot=False, learning_rate=0.1,
                              checkpoint_every=3, resume=True, augment=True,
                              max_steps=max(made) + 3), tiny_data)
  assert _keys_meet_one_sum(output_dir)
  used = {e.key_index for e in read_journal(journal)}
  # Every release ever journaled is in the ledger, and the noise counter is past all of them.
  assert resumed["releases"] == len(used) == max(used) + 1
  config = _config(tmp_path, "killed", epsilon=50.0, epochs=200)
  assert noise_counter(_final(output_dir, tiny_data, config).opt_state) == max(used) + 1
