"""Checkpoints that keep the privacy ledger, with orbax: owner-only and verified.

One checkpoint holds the parameters, the optimizer state (which contains the
release's noise key), the step, the run's root key and the privacy ledger.
Orbax writes each checkpoint to a temporary directory and renames it when
complete, so a crash mid-write leaves the last good checkpoint in place.

SECURITY: a checkpoint holds RNG state. Whoever reads it can reconstruct the
noise and the sampled batches and so undo the privacy of every release made
with it. Keep checkpoints as secret as the training data; publish only the
final parameters (:mod:`dpmuon_jax.training.export`). Every directory and file
of a checkpoint is therefore created owner-only (directories 0700, files
0600), the checkpoint directory itself included.

INTEGRITY: after a save, a manifest of the SHA-256 digest of every file of the
step (:data:`MANIFEST_NAME`, inside the step folder) is written.
:func:`latest_good_step` and the restore functions check it: a step with a
missing or altered file (or without a manifest, e.g. a crash right after the
save) is skipped for the previous intact one, and ONE line on stderr names
the damaged file. The last :data:`MAX_TO_KEEP` steps are kept.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar

import jax
import numpy as np
import orbax.checkpoint as ocp

from dpmuon_jax.training.secret_files import (
    PRIVATE_DIR_MODE,
    make_private_dir,
    private_umask,
    restrict_tree,
    write_private_file,
)

PyTree = Any
T = TypeVar("T")

MAX_TO_KEEP = 3
"""Steps kept on disk: the latest and two to fall back to if it is damaged."""

MANIFEST_NAME = "sha256_manifest.json"
"""The per-step file of SHA-256 digests (ignored by orbax)."""

_MANIFEST_FORMAT = 1
_STEP_DIR = re.compile(r"^\d+$")


class TrainingCheckpoint(NamedTuple):
  params: PyTree
  opt_state: PyTree  # SECRET: holds the release's noise key
  step: int
  metadata: dict  # JSON: ledger, privacy configuration, root key (SECRET), history


class DamagedCheckpointError(OSError):
  """No intact checkpoint is left (or a requested step is damaged); one line."""


def _this_process_only() -> dict:
  """With several JAX processes, orbax options for a manager of this process alone.

  Process 0 writes the checkpoints (of host copies of the replicated state)
  and every process reads them on its own, so no manager waits for the others.
  """
  if jax.process_count() == 1:
    return {}
  me = jax.process_index()
  return {"multiprocessing_options": ocp.options.MultiprocessingOptions(
      primary_host=me, active_processes={me})}


def _manager(directory: str, max_to_keep: int = MAX_TO_KEEP) -> ocp.CheckpointManager:
  options = ocp.CheckpointManagerOptions(
      max_to_keep=max_to_keep,
      create=jax.process_count() == 1,  # several processes: save_checkpoint makes it
      file_options=ocp.options.FileOptions(path_permission_mode=PRIVATE_DIR_MODE),
      **_this_process_only(),
  )
  return ocp.CheckpointManager(os.path.abspath(directory), options=options)


def _untyped_reader(directory: str) -> ocp.CheckpointManager:
  """Reads items without a target structure (parameters as nested dicts of numpy)."""
  return ocp.CheckpointManager(
      os.path.abspath(directory),
      options=ocp.CheckpointManagerOptions(create=False, **_this_process_only()),
      item_handlers={
          "state": ocp.PyTreeCheckpointHandler(),
          "metadata": ocp.JsonCheckpointHandler(),
      },
  )


def _step_dir(directory: str, step: int) -> str:
  return os.path.join(os.path.abspath(directory), str(step))


def _sha256(path: str) -> str:
  with open(path, "rb") as f:
    return hashlib.file_digest(f, "sha256").hexdigest()


def _step_files(step_dir: str) -> list[str]:
  """Paths (relative, '/'-separated) of the step's regular files, manifest excluded."""
  found = []
  for root, _, files in os.walk(step_dir):
    for name in files:
      path = os.path.join(root, name)
      rel = os.path.relpath(path, step_dir).replace(os.sep, "/")
      if rel != MANIFEST_NAME and os.path.isfile(path) and not os.path.islink(path):
        found.append(rel)
  return sorted(found)


def _write_manifest(step_dir: str, step: int) -> None:
  files = {rel: _sha256(os.path.join(step_dir, rel)) for rel in _step_files(step_dir)}
  manifest = {"format": _MANIFEST_FORMAT, "step": int(step), "sha256": files}
  write_private_file(os.path.join(step_dir, MANIFEST_NAME), json.dumps(manifest, indent=1))


def _damage(directory: str, step: int) -> str | None:
  """What is wrong with ``step`` ("missing: PATH" or "corrupt: PATH"), or None if intact."""
  step_dir = _step_dir(directory, step)
  manifest_path = os.path.join(step_dir, MANIFEST_NAME)
  try:
    with open(manifest_path, encoding="utf-8") as f:
      manifest = json.load(f)
    files = manifest["sha256"]
    if manifest.get("step") != step or not isinstance(files, dict) or not files:
      raise ValueError
  except FileNotFoundError:
    return f"missing: {manifest_path}"
  except (OSError, ValueError, KeyError, TypeError):
    return f"corrupt: {manifest_path}"
  for rel, expected in sorted(files.items()):
    path = os.path.join(step_dir, *rel.split("/"))
    if not os.path.isfile(path):
      return f"missing: {path}"
    try:
      if _sha256(path) != expected:
        return f"corrupt: {path}"
    except OSError:
      return f"corrupt: {path}"
  return None


def _steps(directory: str) -> list[int]:
  """Steps present on disk (committed or not), newest first."""
  if not os.path.isdir(directory):
    return []
  names = [n for n in os.listdir(directory) if _STEP_DIR.match(n)]
  return sorted((int(n) for n in names if os.path.isdir(os.path.join(directory, n))),
                reverse=True)


def _first_line(error: BaseException) -> str:
  text = str(error).strip()
  return text.splitlines()[0] if text else type(error).__name__


def _skipped_line(skipped: list[tuple[int, str]], used: int) -> str:
  parts = [f"checkpoint step {step} is damaged ({why})" for step, why in skipped]
  return "; ".join(parts) + f"; falling back to step {used}"


def _none_left(directory: str, skipped: list[tuple[int, str]]) -> DamagedCheckpointError:
  parts = "; ".join(f"step {step} is damaged ({why})" for step, why in skipped)
  return DamagedCheckpointError(f"No intact checkpoint in {os.path.abspath(directory)}: {parts}.")


def _report(skipped: list[tuple[int, str]], used: int) -> None:
  if skipped:
    print(_skipped_line(skipped, used), file=sys.stderr)


def _without_empty(tree: PyTree) -> PyTree:
  """Zero-size leaves as ``None``: orbax saves no array of size 0, and they hold nothing
  (e.g. the states of an inner-momentum group that keeps no history)."""
  return jax.tree.map(lambda x: None if np.size(x) == 0 else x, tree)


def _with_empty(like: PyTree, restored: PyTree) -> PyTree:
  """``restored`` (from :func:`_without_empty`) with ``like``'s zero-size leaves put back."""
  leaves, treedef = jax.tree.flatten(like)
  got = treedef.flatten_up_to(restored)  # checks the structure; a None stands for its leaf
  return jax.tree.unflatten(treedef, [want if np.size(want) == 0 else have
                                      for want, have in zip(leaves, got)])


def save_checkpoint(directory: str, ckpt: TrainingCheckpoint) -> None:
  """Writes ``ckpt`` atomically and owner-only as step ``ckpt.step`` under ``directory``.

  An existing step of the same number (e.g. a damaged one that a resumed run
  reaches again) is replaced. The step's SHA-256 manifest is written last.
  With several JAX processes, call it on one of them (process 0): the state
  must be replicated, and is saved from this process's host copy.
  """
  directory = make_private_dir(directory)
  state = _without_empty({"params": ckpt.params, "opt_state": ckpt.opt_state})
  if jax.process_count() > 1:
    state = jax.tree.map(np.asarray, state)
  with private_umask():
    with _manager(directory) as manager:
      if ckpt.step in manager.all_steps():
        manager.delete(ckpt.step)
      manager.save(
          ckpt.step,
          args=ocp.args.Composite(
              state=ocp.args.StandardSave(state), metadata=ocp.args.JsonSave(ckpt.metadata)
          ),
          force=True,
      )
      manager.wait_until_finished()
  restrict_tree(directory)
  _write_manifest(_step_dir(directory, ckpt.step), ckpt.step)


def latest_step(directory: str) -> int | None:
  """The newest committed step under ``directory`` (intact or not), or None."""
  if not os.path.isdir(directory):
    return None
  with _manager(directory) as manager:
    return manager.latest_step()


def _good_steps(directory: str) -> tuple[list[int], list[tuple[int, str]]]:
  """Steps whose manifest verifies (newest first) and the damaged ones before the first."""
  skipped: list[tuple[int, str]] = []
  steps = _steps(directory)
  for i, step in enumerate(steps):
    why = _damage(directory, step)
    if why is None:
      return steps[i:], skipped
    skipped.append((step, why))
  return [], skipped


def latest_good_step(directory: str) -> int | None:
  """The newest step whose files all match its manifest; None if there is no step.

  Damaged newer steps are named in one line on stderr.

  Raises:
    DamagedCheckpointError: if steps exist but none is intact.
  """
  steps, skipped = _good_steps(directory)
  if not steps:
    if skipped:
      raise _none_left(directory, skipped)
    return None
  _report(skipped, steps[0])
  return steps[0]


def _restore(directory: str, step: int | None, read: Callable[[int], T]) -> tuple[int, T]:
  """``read(step)`` of the given step, or of the newest intact, readable one."""
  if step is not None:
    why = _damage(directory, step)
    if why is not None:
      raise DamagedCheckpointError(f"checkpoint step {step} is damaged ({why}).")
    return step, read(step)
  if not _steps(directory):
    raise FileNotFoundError(f"No checkpoint found in {directory}.")
  steps, skipped = _good_steps(directory)
  for i, candidate in enumerate(steps):
    why = None if i == 0 else _damage(directory, candidate)  # steps[0] is verified
    if why is None:
      try:
        value = read(candidate)
      except Exception as error:  # orbax cannot read the step: try the previous one
        why = f"unreadable: {_first_line(error)}"
      else:
        _report(skipped, candidate)
        return candidate, value
    skipped.append((candidate, why))
  raise _none_left(directory, skipped)


def restore_checkpoint(
    directory: str, like: TrainingCheckpoint, step: int | None = None
) -> TrainingCheckpoint:
  """Restores the given or newest intact checkpoint with the structure of ``like``.

  Raises:
    FileNotFoundError: if ``directory`` holds no checkpoint.
    DamagedCheckpointError: if the given step, or every step, is damaged.
  """
  template = {"params": like.params, "opt_state": like.opt_state}
  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, _without_empty(template))

  def read(s: int) -> dict:
    with _manager(directory) as manager:
      return manager.restore(
          s,
          args=ocp.args.Composite(
              state=ocp.args.StandardRestore(abstract), metadata=ocp.args.JsonRestore()
          ),
      )

  step, restored = _restore(directory, step, read)
  state = _with_empty(template, restored["state"])
  return TrainingCheckpoint(state["params"], state["opt_state"], int(step), restored["metadata"])


def restore_metadata(directory: str, step: int | None = None) -> dict:
  """Only the JSON metadata of the given or newest intact checkpoint."""

  def read(s: int) -> dict:
    with _manager(directory) as manager:
      return manager.restore(s, args=ocp.args.Composite(metadata=ocp.args.JsonRestore()))

  return _restore(directory, step, read)[1]["metadata"]


def restore_untyped(
    directory: str, step: int | None = None, *, opt_state: bool = False
) -> TrainingCheckpoint:
  """The given or newest intact checkpoint, read without knowing the model.

  Parameters come back as nested dicts of numpy arrays (list indices and
  integer keys as strings). The SECRET optimizer state is not read unless
  ``opt_state=True`` (then untyped too: named tuples become lists); otherwise
  ``opt_state`` is None. The metadata still holds the root key.
  """
  wanted = ("params", "opt_state") if opt_state else ("params",)

  def read(s: int) -> dict:
    with _untyped_reader(directory) as reader:
      tree = reader.item_metadata(s)["state"].tree
      item = {name: tree[name] for name in wanted}
      restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), item)
      return reader.restore(
          s,
          args=ocp.args.Composite(
              state=ocp.args.PyTreeRestore(
                  item=item, restore_args=restore_args, partial_restore=not opt_state
              ),
              metadata=ocp.args.JsonRestore(),
          ),
      )

  step, restored = _restore(directory, step, read)
  state = restored["state"]
  return TrainingCheckpoint(
      state["params"], state.get("opt_state"), int(step), restored["metadata"]
  )
