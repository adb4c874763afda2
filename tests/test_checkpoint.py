"""Checkpoints: owner-only on disk, and a damaged step falls back to the last intact one."""

import os
import stat

import chex
import jax.numpy as jnp
import numpy as np
import pytest

from dpmuon_jax.training import checkpoint as ckpt_lib
from dpmuon_jax.training.checkpoint import (
    MANIFEST_NAME,
    DamagedCheckpointError,
    TrainingCheckpoint,
    latest_good_step,
    latest_step,
    restore_checkpoint,
    restore_metadata,
    restore_untyped,
    save_checkpoint,
)
from dpmuon_jax.training.secret_files import (
    private_open,
    private_umask,
    restrict_tree,
    write_private_file,
)

PARAMS = {"dense": {"kernel": jnp.arange(6.0).reshape(2, 3), "bias": jnp.ones(3)},
          "blocks": {0: {"scale": jnp.full((4,), 2.0)}}}
NOISE_KEY = jnp.array([123456789, 987654321], jnp.uint32)


def _checkpoint(step):
  opt_state = ({"count": jnp.asarray(step, jnp.int32), "noise_key": NOISE_KEY},
               {"mu": jnp.zeros(3)})
  metadata = {"root_key": [2718281828, 3141592653], "seeded": False, "history": [step]}
  params = {**PARAMS, "dense": {**PARAMS["dense"], "bias": jnp.full(3, float(step))}}
  return TrainingCheckpoint(params, opt_state, step, metadata)


@pytest.fixture
def permissive_umask():
  previous = os.umask(0o022)
  yield
  os.umask(previous)


@pytest.fixture
def two_steps(tmp_path, permissive_umask):
  directory = str(tmp_path / "checkpoints")
  for step in (11, 12):
    save_checkpoint(directory, _checkpoint(step))
  return directory


def _files(directory):
  return sorted(os.path.join(root, name) for root, _, files in os.walk(directory)
                for name in files)


def _modes(directory):
  out = {directory: stat.S_IMODE(os.stat(directory).st_mode)}
  for root, dirs, files in os.walk(directory):
    for name in dirs + files:
      path = os.path.join(root, name)
      out[path] = stat.S_IMODE(os.lstat(path).st_mode)
  return out


def test_every_directory_and_file_is_owner_only(two_steps):
  modes = _modes(two_steps)
  assert modes[two_steps] == 0o700
  assert len(modes) > 20
  wrong = {p: oct(m) for p, m in modes.items()
           if m != (0o700 if os.path.isdir(p) else 0o600)}
  assert not wrong
  assert os.umask(0o022) == 0o022  # the save restored the caller's umask


def test_manifest_does_not_confuse_orbax_and_restores_round_trip(two_steps):
  assert os.path.isfile(os.path.join(two_steps, "12", MANIFEST_NAME))
  assert latest_step(two_steps) == latest_good_step(two_steps) == 12
  want = _checkpoint(12)
  got = restore_checkpoint(two_steps, _checkpoint(0))
  assert got.step == 12 and got.metadata == want.metadata
  chex.assert_trees_all_equal(got.params, want.params)
  chex.assert_trees_all_equal(got.opt_state, want.opt_state)
  assert restore_metadata(two_steps, 11)["history"] == [11]
  untyped = restore_untyped(two_steps)
  assert untyped.opt_state is None and untyped.step == 12
  np.testing.assert_array_equal(untyped.params["blocks"]["0"]["scale"], np.full(4, 2.0))
  secret = restore_untyped(two_steps, opt_state=True).opt_state
  np.testing.assert_array_equal(secret[0]["noise_key"], np.asarray(NOISE_KEY))


def test_zero_size_state_leaves_round_trip(tmp_path):
  """An inner-momentum group that keeps no history has (0, ...)-shaped states: orbax saves no
  array of size 0, so they are left out and restored from the template, shape and dtype kept."""
  params = {"w": jnp.arange(4.0).reshape(2, 2)}
  opt_state = {"states": {"w": jnp.zeros((0, 2, 2), jnp.bfloat16)}, "mu": jnp.ones((2, 2))}
  directory = str(tmp_path / "checkpoints")
  save_checkpoint(directory, TrainingCheckpoint(params, opt_state, 3, {}))
  like = TrainingCheckpoint(params, {"states": {"w": jnp.zeros((0, 2, 2), jnp.bfloat16)},
                                     "mu": jnp.zeros((2, 2))}, 0, {})
  got = restore_checkpoint(directory, like)
  chex.assert_trees_all_equal_shapes_and_dtypes(got.opt_state, opt_state)
  chex.assert_trees_all_equal(got.opt_state, opt_state)
  chex.assert_trees_all_equal(got.params, params)


def _largest_file(directory, step):
  files = [f for f in _files(os.path.join(directory, str(step)))
           if not f.endswith(MANIFEST_NAME)]
  return max(files, key=os.path.getsize)


@pytest.mark.parametrize("damage", ["truncate", "overwrite", "delete"])
def test_damaged_latest_step_falls_back_with_one_line(two_steps, capsys, damage):
  bad = _largest_file(two_steps, 12)
  if damage == "truncate":
    with open(bad, "r+b") as f:
      f.truncate(os.path.getsize(bad) // 2)
  elif damage == "overwrite":
    with open(bad, "r+b") as f:
      f.write(b"\xff" * 8)
  else:
    os.remove(bad)
  assert latest_good_step(two_steps) == 11
  err = capsys.readouterr().err.strip()
  kind = "missing" if damage == "delete" else "corrupt"
  assert err == f"checkpoint step 12 is damaged ({kind}: {bad}); falling back to step 11"

  restored = restore_checkpoint(two_steps, _checkpoint(0))
  assert restored.step == 11 and restored.metadata["history"] == [11]
  assert restore_metadata(two_steps)["history"] == [11]
  assert len(capsys.readouterr().err.strip().splitlines()) == 2  # one line per call
  with pytest.raises(DamagedCheckpointError, match=f"step 12 is damaged \\({kind}: "):
    restore_checkpoint(two_steps, _checkpoint(0), step=12)

  # A resumed run that reaches step 12 again replaces the damaged step.
  save_checkpoint(two_steps, _checkpoint(12))
  assert latest_good_step(two_steps) == 12
  assert capsys.readouterr().err == ""


def test_unreadable_step_with_a_valid_manifest_falls_back(two_steps, capsys):
  bad = _largest_file(two_steps, 12)
  with open(bad, "r+b") as f:
    f.truncate(3)
  ckpt_lib._write_manifest(os.path.join(two_steps, "12"), 12)  # digests agree with the damage
  restored = restore_checkpoint(two_steps, _checkpoint(0))
  assert restored.step == 11
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and "step 12 is damaged (unreadable: " in err[0]


def test_no_intact_step_left_is_one_clear_error(two_steps):
  os.remove(_largest_file(two_steps, 12))
  os.remove(os.path.join(two_steps, "11", MANIFEST_NAME))
  for call in (lambda: latest_good_step(two_steps),
               lambda: restore_checkpoint(two_steps, _checkpoint(0))):
    with pytest.raises(DamagedCheckpointError) as info:
      call()
    message = str(info.value)
    assert message.startswith(f"No intact checkpoint in {two_steps}: step 12 is damaged")
    assert f"step 11 is damaged (missing: {two_steps}/11/{MANIFEST_NAME})" in message
    assert "\n" not in message


def test_keeps_three_steps_and_no_checkpoint_is_none(tmp_path):
  directory = str(tmp_path / "c")
  assert latest_good_step(directory) is None
  for step in range(1, 5):
    save_checkpoint(directory, _checkpoint(step))
  assert sorted(os.listdir(directory)) == ["2", "3", "4"]
  assert all(ckpt_lib._damage(directory, s) is None for s in (2, 3, 4))  # old steps unchanged
  with pytest.raises(FileNotFoundError, match="No checkpoint"):
    restore_metadata(str(tmp_path / "empty"))


def test_private_file_helpers(tmp_path, permissive_umask):
  path = tmp_path / "journal.jsonl"
  write_private_file(path, "first\n")
  assert path.read_text() == "first\n"
  with private_open(path, "a") as f:
    f.write("second\n")
  assert path.read_text() == "first\nsecond\n"
  assert stat.S_IMODE(os.stat(path).st_mode) == 0o600

  loose = tmp_path / "loose.bin"
  loose.write_bytes(b"x")
  os.chmod(loose, 0o644)
  with private_open(loose, "wb") as f:
    f.write(b"secret")
  assert stat.S_IMODE(os.stat(loose).st_mode) == 0o600

  with private_umask():
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "f").write_text("x")
  assert stat.S_IMODE(os.stat(tmp_path / "d").st_mode) == 0o700
  assert stat.S_IMODE(os.stat(tmp_path / "d" / "f").st_mode) == 0o600
  os.chmod(tmp_path / "d" / "f", 0o644)
  restrict_tree(tmp_path / "d")
  assert stat.S_IMODE(os.stat(tmp_path / "d" / "f").st_mode) == 0o600
  assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []
