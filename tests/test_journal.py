"""The release journal: a noise key is never used on two different sums, no release is lost.

The crash is emulated by deleting the last checkpoint after a run: its releases
were made (and journaled) but the checkpoint that would record them is gone,
exactly as when a run is killed between a release and its checkpoint.
"""

import collections
import dataclasses
import json
import os
import shutil
import stat

import chex
import jax
import jax.numpy as jnp
import pytest

from dpmuon_jax.models.registry import model_and_loss
from dpmuon_jax.privacy.release import noise_counter
from dpmuon_jax.training import trainer
from dpmuon_jax.training.export import load_exported
from dpmuon_jax.training.journal import (
    SEALS_NAME,
    JournalEntry,
    ResumePlan,
    append_entry,
    plan_resume,
    read_high_water,
    read_journal,
    read_seals,
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
  base = dict(model="mlp", dataset="tiny", optimizer="dp_sgd", epsilon=3.0, delta=1e-3,
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


def test_a_replay_whose_clipped_sum_differs_is_discarded_and_the_lost_release_charged(
    tmp_path, tiny_data, capsys, monkeypatch):
  """The code changed between the crash and the resume (here the loss; the fingerprint
  cannot see code): the recomputed lost release's clipped sum is not the one released
  with its key, so that key is never applied to it; the lost release is charged and the
  step redone with a fresh key."""
  config = _crash_after(tmp_path, "other_sum", tiny_data, 4)
  journal = os.path.join(config.output_dir, JOURNAL_NAME)
  assert sorted(read_seals(journal)) == [0, 1, 2, 3]  # one per release, key 3 lost
  seals_file = os.path.join(config.output_dir, SEALS_NAME)
  assert stat.S_IMODE(os.stat(seals_file).st_mode) == 0o600  # digests of private sums

  def edited_model_and_loss(*args, **kwargs):
    model, loss_fn = model_and_loss(*args, **kwargs)
    drift = lambda params: 0.1 * sum(jnp.sum(jnp.sin(p)) for p in jax.tree.leaves(params))
    return model, lambda params, *rest: loss_fn(params, *rest) + drift(params)

  monkeypatch.setattr(trainer, "model_and_loss", edited_model_and_loss)
  resumed = train(_config(tmp_path, "other_sum", resume=True, max_steps=6), tiny_data)
  assert "differs from the one made before it" in capsys.readouterr().out
  # 3 checkpointed + 1 lost (charged) + 3 new (steps 3, 4, 5, keys 4, 5, 6) releases.
  assert resumed["releases"] == 7
  assert noise_counter(_final(config.output_dir, tiny_data, config).opt_state) == 7
  assert sorted(read_seals(journal)) == list(range(7))  # key 3's seal: the original's only


def test_lost_releases_without_their_seals_are_charged_not_replayed(tmp_path, tiny_data, capsys):
  """Only the last lost release (in flight at the crash, never seen) may lack a seal."""
  config = _crash_after(tmp_path, "unsealed", tiny_data, 4)
  shutil.rmtree(os.path.join(config.output_dir, "checkpoints", "3"))  # lost: keys 2 and 3
  os.remove(os.path.join(config.output_dir, SEALS_NAME))
  resumed = train(_config(tmp_path, "unsealed", resume=True, max_steps=6), tiny_data)
  assert "cannot be replayed" in capsys.readouterr().out
  assert resumed["releases"] == 2 + 2 + 4  # checkpointed, lost (charged), steps 2..5
  assert plan_resume([JournalEntry(2, 2, "f"), JournalEntry(3, 3, "f")], 2, 2, "f",
                     sealed={2}) == ResumePlan(2, 0, 4)  # the last may lack its seal


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
train(TrainConfig(model="mlp", dataset="tiny", optimizer="dp_sgd", epsilon=50.0, delta=1e-3,
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
  resumed = train(TrainConfig(model="mlp", dataset="tiny", optimizer="dp_sgd", epsilon=50.0,
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


# ---- Lost or truncated journals, changed settings, unfinished outputs ---------------------

_KILLABLE = """
import json, sys
import numpy as np
from dpmuon_jax.data.images import ImageDataset
from dpmuon_jax.training.trainer import TrainConfig, train
rng = np.random.default_rng(0)
x = rng.integers(0, 256, size=(80, 8, 8, 1), dtype=np.uint8)
y = rng.integers(0, 3, size=(80,))
data = ImageDataset(x[:64], y[:64], x[64:], y[64:], num_classes=3, name="tiny")
train(TrainConfig(**json.loads(sys.argv[1])), data)
"""


def _long_run(output_dir, **kw):
  base = dict(model="mlp", dataset="tiny", optimizer="dp_sgd", epsilon=50.0, delta=1e-3,
              batch_size=16, epochs=200, seed=3, output_dir=output_dir, progress=False,
              plot=False, learning_rate=0.1, checkpoint_every=3)
  base.update(kw)
  return base


def _kill_after(settings: dict, releases: int) -> set[int]:
  """Runs ``settings`` in a child process, SIGKILLs it after ``releases`` journal entries."""
  import json
  import signal
  import subprocess
  import sys
  import time

  journal = os.path.join(settings["output_dir"], JOURNAL_NAME)
  child = subprocess.Popen([sys.executable, "-c", _KILLABLE, json.dumps(settings)],
                           env={**os.environ, "JAX_PLATFORMS": "cpu"})
  try:
    deadline = time.time() + 240
    while (len(read_journal(journal)) < releases and child.poll() is None
           and time.time() < deadline):
      time.sleep(0.05)
  finally:
    child.send_signal(signal.SIGKILL)
    child.wait()
  made = {e.key_index for e in read_journal(journal)}
  assert len(made) >= releases
  return made


@pytest.mark.parametrize("clean_up", ["truncate", "delete"])
def test_a_truncated_journal_is_caught_by_the_high_water_mark_and_the_export_counts_it(
    tmp_path, tiny_data, capsys, clean_up
):
  from dpmuon_jax.privacy.accounting import compute_epsilon
  from dpmuon_jax.training.checkpoint import latest_good_step, restore_metadata
  from dpmuon_jax.training.export import export_run

  output_dir = str(tmp_path / "truncated")
  made = _kill_after(_long_run(output_dir), 8)
  ckpt = os.path.join(output_dir, "checkpoints")
  checkpointed = restore_metadata(ckpt, latest_good_step(ckpt))["key_index"]
  assert checkpointed <= max(made)
  # The export of the crashed run certifies every release made, not only the checkpoint's.
  certificate = json.loads(open(os.path.join(export_run(output_dir, str(tmp_path / "x")),
                                             "privacy_certificate.json")).read())
  assert certificate["releases"] == len(made) and certificate["releases_in_checkpoint"] == (
      checkpointed)
  # Its ε is that of all of them (at the σ the journal says they were made under, q = 16/64).
  journal = os.path.join(output_dir, JOURNAL_NAME)
  sigma = read_journal(journal)[0].privacy["noise_multiplier"]
  epsilon = lambda releases: compute_epsilon(sigma, 16 / 64, releases, 1e-3)
  assert certificate["epsilon"] == pytest.approx(epsilon(len(made)), rel=1e-9)
  assert certificate["epsilon"] > epsilon(checkpointed)
  # The mark is moved after the journal line and before the release, so a kill between the
  # two leaves it one behind: that last key was journaled but never used on a sum.
  last_used = read_high_water(journal).key_index
  assert max(made) - 1 <= last_used <= max(made)
  # Truncate the journal back to the checkpoint (or delete it), as a careless clean-up would.
  kept = [e for e in read_journal(journal) if e.key_index < checkpointed]
  if clean_up == "delete":
    os.remove(journal)
  else:
    with open(journal, "w") as f:
      f.write("".join(json.dumps(e._asdict()) + "\n" for e in kept))
  capsys.readouterr()
  resumed = train(TrainConfig(**_long_run(output_dir, resume=True, augment=True,
                                          max_steps=max(made) + 3)), tiny_data)
  # The releases after the checkpoint, gone from the journal, are charged and said to be.
  lost, out = last_used + 1 - checkpointed, capsys.readouterr().out
  if lost:
    assert (f"{lost} release(s) made after the last checkpoint cannot be replayed exactly: "
            f"charged to the ledger (ε = {epsilon(last_used + 1):.4f})") in out
  else:  # killed between the journal line and the mark of the release after the checkpoint
    assert "cannot be replayed" not in out
  new_keys = [e.key_index for e in read_journal(journal) if e.key_index >= checkpointed]
  assert new_keys and min(new_keys) > last_used  # no key of the lost releases used again
  # Every release made is charged: the checkpoint's, the lost ones, and the new ones.
  assert resumed["releases"] == last_used + 1 + len(new_keys)


def test_a_deleted_journal_is_caught_by_the_high_water_mark(tmp_path, tiny_data):
  config = _crash_after(tmp_path, "deleted", tiny_data, 4)
  os.remove(os.path.join(config.output_dir, JOURNAL_NAME))
  resumed = train(_config(tmp_path, "deleted", resume=True, augment=True, max_steps=6),
                  tiny_data)
  # 3 checkpointed + 1 lost (charged though its journal line is gone) + 3 new.
  assert resumed["releases"] == 7
  final = _final(config.output_dir, tiny_data, config)
  assert noise_counter(final.opt_state) == 7


def test_records_add_what_the_high_water_mark_proves_missing(tmp_path):
  from dpmuon_jax.training.journal import read_records, releases_after

  path = str(tmp_path / JOURNAL_NAME)
  settings = {"noise_multiplier": 1.0}
  for k in range(5):
    append_entry(path, JournalEntry(k, k, "fp", settings))
  assert [e.key_index for e in read_records(path)] == list(range(5))
  with open(path, "w") as f:  # truncated to two entries
    f.write("".join(json.dumps(JournalEntry(k, k, "fp", settings)._asdict()) + "\n"
                    for k in range(2)))
  records = read_records(path)
  assert [e.key_index for e in records] == list(range(5))
  assert [e.fingerprint for e in records[2:]] == ["missing"] * 3
  assert all(e.privacy == settings for e in records)
  assert releases_after(records, 3) == 2
  os.remove(path)
  assert [e.key_index for e in read_records(path)] == list(range(5))


def test_killed_before_its_first_checkpoint_resumes_only_under_the_journaled_settings(
    tmp_path, tiny_data
):
  from dpmuon_jax.privacy.accounting import compute_epsilon

  output_dir = str(tmp_path / "early")
  settings = _long_run(output_dir, noise_multiplier=0.5, epsilon=200.0, checkpoint_every=10**6)
  made = _kill_after(settings, 3)
  assert not os.path.exists(os.path.join(output_dir, "checkpoints"))
  assert all(e.seeded for e in read_journal(os.path.join(output_dir, JOURNAL_NAME)))
  # Resumed WITHOUT its seed (a fresh root from OS entropy): the lost releases came from
  # seed 3, so they are charged and the run stays seeded, caveat included, in results.json
  # and in the exported certificate.
  unseeded = str(tmp_path / "early_unseeded")
  shutil.copytree(output_dir, unseeded)
  fresh = train(TrainConfig(**{**settings, "output_dir": unseeded, "seed": None,
                               "resume": True, "max_steps": 1}), tiny_data)
  assert fresh["releases"] == len(made) + 1
  assert fresh["seeded"] and "seed" in fresh["guarantee"]
  certificate = load_exported(os.path.join(unseeded, "export")).certificate
  assert certificate["seeded"] and "seed" in certificate["guarantee"]
  # Another σ (calibrated to ε = 2) or another q (batch size) would charge the lost releases
  # at settings they were not made under: refused.
  for changed in (dict(noise_multiplier=None, epsilon=2.0), dict(batch_size=32)):
    with pytest.raises(TrainingError, match="other privacy settings"):
      train(TrainConfig(**{**settings, **changed, "resume": True, "max_steps": 1}), tiny_data)
  # Under the journaled settings (seeded: the lost releases replay bit for bit from the
  # start), every release is charged once, at σ = 0.5.
  resumed = train(TrainConfig(**{**settings, "resume": True, "max_steps": max(made) + 3}),
                  tiny_data)
  assert resumed["releases"] == max(made) + 3 == len(made) + 2
  expected = compute_epsilon(0.5, 16 / 64, max(made) + 3, 1e-3)
  assert resumed["epsilon_spent"] == pytest.approx(expected, rel=1e-9)


def test_every_journaled_release_records_the_settings_it_was_made_under(tmp_path, tiny_data):
  # Settings away from the defaults, so a journal that wrote a default would be caught.
  config = _config(tmp_path, "settings", max_steps=3, clip=0.5, noise_multiplier=1.3,
                   accountant="pld")
  results = train(config, tiny_data)
  journal = os.path.join(config.output_dir, JOURNAL_NAME)
  entries = read_journal(journal)
  assert results["releases"] == 3
  assert [e.key_index for e in entries] == [0, 1, 2]
  expected = {"sampling_rate": 16 / 64, "noise_multiplier": 1.3, "l2_clip_norm": 0.5,
              "denominator": 16.0, "neighbouring": "add_remove", "accountant": "pld",
              "dataset_size": 64, "target_delta": 1e-3, "target_epsilon": 3.0}
  for entry in [*entries, read_high_water(journal)]:
    assert entry.privacy is not None
    assert {k: entry.privacy.get(k) for k in expected} == expected


def _refused_resume(config, data, journaled_now, **changed):
  """Asserts that resuming ``config`` with ``changed`` settings is refused for ``journaled_now``."""
  with pytest.raises(TrainingError, match="other privacy settings") as refused:
    train(dataclasses.replace(config, resume=True, **changed), data)
  if isinstance(journaled_now, str):  # a field name: the changed settings include it
    assert f"'{journaled_now}':" in str(refused.value)
  else:  # the exact {field: (journaled, now)} of the settings that changed
    assert f"(journaled, now): {journaled_now!r}" in str(refused.value)


def test_deleted_checkpoints_do_not_let_a_resume_change_sigma_c_d_or_the_accountant(
    tmp_path, tiny_data, monkeypatch
):
  import dpmuon_jax.training.trainer as trainer_module

  config = _config(tmp_path, "nockpt", max_steps=3)
  train(config, tiny_data)
  shutil.rmtree(os.path.join(config.output_dir, "checkpoints"))
  sigma = read_journal(os.path.join(config.output_dir, JOURNAL_NAME))[0].privacy[
      "noise_multiplier"]
  _refused_resume(config, tiny_data, "noise_multiplier", epsilon=1.0)  # σ calibrated anew
  # One setting changed at a time, σ kept: C, the accountant, D with q (the batch size).
  _refused_resume(config, tiny_data, {"l2_clip_norm": (1.0, 0.5)}, clip=0.5)
  _refused_resume(config, tiny_data, {"accountant": ("rdp", "pld")}, noise_multiplier=sigma,
                  accountant="pld")
  _refused_resume(config, tiny_data, "denominator", batch_size=32)
  # D alone (no flag sets it apart from the batch size: a program that passes another D).
  make_private = trainer_module.make_private
  with monkeypatch.context() as patch:
    patch.setattr(trainer_module, "make_private",
                  lambda **kwargs: make_private(**kwargs, denominator=32.0))
    _refused_resume(config, tiny_data, {"denominator": (16.0, 32.0)})
  # The same settings (seeded) replay the 3 journaled releases from the start, then continue.
  resumed = train(_config(tmp_path, "nockpt", resume=True, max_steps=5), tiny_data)
  assert resumed["releases"] == 5


def test_a_torn_last_line_without_checkpoint_is_charged_at_the_journaled_settings(
    tmp_path, tiny_data
):
  """Killed while appending a journal line, before any checkpoint: the run still resumes."""
  config = _config(tmp_path, "torn", max_steps=2)
  train(config, tiny_data)
  shutil.rmtree(os.path.join(config.output_dir, "checkpoints"))
  with open(os.path.join(config.output_dir, JOURNAL_NAME), "a") as f:
    f.write('{"step": 2, "key_in')
  assert read_journal(os.path.join(config.output_dir, JOURNAL_NAME))[-1].privacy is not None
  resumed = train(_config(tmp_path, "torn", resume=True, max_steps=4), tiny_data)
  # The torn line cannot be replayed: 2 journaled + 1 torn releases charged, then 4 new ones.
  assert resumed["releases"] == 7
  entries = read_journal(os.path.join(config.output_dir, JOURNAL_NAME))
  assert [e.key_index for e in entries] == list(range(7))  # readable: the torn line mended
  assert entries[2].fingerprint == "torn" and entries[2].privacy == entries[0].privacy
  assert _keys_meet_one_sum(config.output_dir)


def test_lost_releases_redone_from_another_noise_stream_are_charged_not_replayed(
    tmp_path, tiny_data, monkeypatch
):
  """Same settings and data, but a program that claims its noise streams in another order
  (an edited script or library): redoing the journaled releases would release each of
  those sums a second time with other noise, so they are charged and fresh keys used."""
  import dpmuon_jax.training.trainer as trainer_module
  from dpmuon_jax.privacy.keys import claim_noise_stream

  config = _config(tmp_path, "stream", max_steps=3)
  train(config, tiny_data)
  shutil.rmtree(os.path.join(config.output_dir, "checkpoints"))
  make_private = trainer_module.make_private

  def one_claim_more(**kwargs):
    setup = make_private(**kwargs)
    claim_noise_stream(setup.release_kwargs["key"])
    return setup

  monkeypatch.setattr(trainer_module, "make_private", one_claim_more)
  resumed = train(_config(tmp_path, "stream", resume=True, max_steps=5), tiny_data)
  assert resumed["releases"] == 3 + 5


def test_a_run_stopped_after_its_final_checkpoint_finishes_its_outputs(tmp_path, tiny_data):
  config = _config(tmp_path, "outputs", epochs=0.5)
  done = train(config, tiny_data)
  # Killed after the final checkpoint, before results.json and export/ were written.
  os.remove(os.path.join(config.output_dir, "results.json"))
  shutil.rmtree(os.path.join(config.output_dir, "export"))
  again = train(_config(tmp_path, "outputs", epochs=0.5, resume=True), tiny_data)
  assert again["final_test_accuracy"] == done["final_test_accuracy"]
  assert again["releases"] == done["releases"]
  assert os.path.exists(os.path.join(config.output_dir, "results.json"))
  assert os.path.exists(os.path.join(config.output_dir, "export", "privacy_certificate.json"))


_KILLED_BEFORE_OUTPUTS = """
import os, signal, sys
import dpmuon_jax.training.driver as driver
from dpmuon_jax.cli import main


def killed(*args, **kwargs):  # after the final checkpoint, before export/ and results.json
  os.kill(os.getpid(), signal.SIGKILL)


driver.export_run = killed
main(sys.argv[1:])
"""


def test_a_run_killed_after_its_final_checkpoint_finishes_its_outputs_on_resume(
    tmp_path, tiny_data, capsys
):
  import signal
  import subprocess
  import sys

  import numpy as np

  from dpmuon_jax.cli import main

  data = str(tmp_path / "tiny.npz")
  np.savez(data, x_train=tiny_data.x_train, y_train=tiny_data.y_train,
           x_test=tiny_data.x_test, y_test=tiny_data.y_test)
  out = tmp_path / "run"
  command = ["train", "--dataset", data, "--optimizer", "dp_sgd", "--epsilon", "3",
             "--delta", "1e-3", "--batch-size", "16", "--epochs", "0.5", "--seed", "3",
             "--output-dir", str(out), "--no-progress", "--no-plot"]
  child = subprocess.run([sys.executable, "-c", _KILLED_BEFORE_OUTPUTS, *command],
                         env={**os.environ, "JAX_PLATFORMS": "cpu"}, timeout=300)
  assert child.returncode == -signal.SIGKILL
  assert (out / "checkpoints").is_dir()
  assert not (out / "results.json").exists() and not (out / "export").exists()
  capsys.readouterr()
  assert main(["train", "--resume", "--output-dir", str(out), "--no-progress", "--no-plot"]) == 0
  results = json.loads((out / "results.json").read_text())
  certificate = json.loads((out / "export" / "privacy_certificate.json").read_text())
  assert results["stop_reason"] == "completed"
  assert results["releases"] == certificate["releases"] == results["planned_steps"] == 2
  assert "test accuracy" in capsys.readouterr().out
