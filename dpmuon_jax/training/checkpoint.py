"""Checkpoints that keep the privacy ledger (DESIGN.md, invariant 6), with orbax.

One checkpoint holds the parameters, the optimizer state (which contains the
release's noise key), the step, the run's root key and the privacy ledger.
Orbax writes each checkpoint to a temporary directory and renames it when
complete, so a crash mid-write leaves the last good checkpoint in place.

SECURITY: a checkpoint holds RNG state. Whoever reads it can reconstruct the
noise and the sampled batches and so undo the privacy of every release made
with it. Keep checkpoints as secret as the training data; publish only the
final parameters.
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple

import jax
import orbax.checkpoint as ocp

PyTree = Any


class TrainingCheckpoint(NamedTuple):
  params: PyTree
  opt_state: PyTree  # SECRET: holds the release's noise key
  step: int
  metadata: dict  # JSON: ledger, privacy configuration, root key (SECRET), history


def _manager(directory: str, max_to_keep: int = 2) -> ocp.CheckpointManager:
  options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True)
  return ocp.CheckpointManager(os.path.abspath(directory), options=options)


def save_checkpoint(directory: str, ckpt: TrainingCheckpoint) -> None:
  """Writes ``ckpt`` atomically as step ``ckpt.step`` under ``directory``."""
  with _manager(directory) as manager:
    state = {"params": ckpt.params, "opt_state": ckpt.opt_state}
    manager.save(
        ckpt.step,
        args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), metadata=ocp.args.JsonSave(ckpt.metadata)
        ),
        force=True,
    )
    manager.wait_until_finished()


def latest_step(directory: str) -> int | None:
  if not os.path.isdir(directory):
    return None
  with _manager(directory) as manager:
    return manager.latest_step()


def restore_checkpoint(
    directory: str, like: TrainingCheckpoint, step: int | None = None
) -> TrainingCheckpoint:
  """Restores the latest (or given) checkpoint with the structure of ``like``."""
  with _manager(directory) as manager:
    step = manager.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f"No checkpoint found in {directory}.")
    abstract = jax.tree.map(
        ocp.utils.to_shape_dtype_struct,
        {"params": like.params, "opt_state": like.opt_state},
    )
    restored = manager.restore(
        step,
        args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract), metadata=ocp.args.JsonRestore()
        ),
    )
  state = restored["state"]
  return TrainingCheckpoint(state["params"], state["opt_state"], int(step), restored["metadata"])


def restore_metadata(directory: str, step: int | None = None) -> dict:
  """Only the JSON metadata of the latest (or given) checkpoint."""
  with _manager(directory) as manager:
    step = manager.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f"No checkpoint found in {directory}.")
    restored = manager.restore(step, args=ocp.args.Composite(metadata=ocp.args.JsonRestore()))
  return restored["metadata"]
