"""Run tracking: a run's metrics as TensorBoard event files, beside its CSV.

A writer has two methods, ``scalars(step, {tag: value})`` and ``close()``.
The TensorBoard one writes with ``tensorboardX`` (no TensorFlow needed;
install the ``tensorboard`` extra) and is viewed with
``tensorboard --logdir LOG_DIR``.

Tags say what they measure: ``test/…`` and ``valid/…`` are held-out
metrics, ``privacy/epsilon_spent`` is the ledger's ε, ``train/…`` public
settings, and ``nonprivate/…`` training-set statistics (clip fraction,
gradient norms) that are NOT covered by the privacy guarantee: they are
computed from the sampled examples before noise and are only logged.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Protocol

from dpmuon_jax.extras import requires

EXTRA = "tensorboard"
NONPRIVATE_PREFIX = "nonprivate/"
NONPRIVATE_DESCRIPTION = (
    "NON-PRIVATE: computed from the sampled training examples before noise; "
    "not covered by the privacy guarantee."
)


class ScalarWriter(Protocol):
  """Where a run's scalars go."""

  def scalars(self, step: int, values: Mapping[str, float]) -> None:
    """Writes ``values`` (tag -> number) at ``step``; non-finite values are skipped."""
    ...

  def close(self) -> None:
    ...


def history_tags(record: Mapping[str, float], names: Mapping[str, str]) -> dict[str, float]:
  """The scalars of one history row under their tags.

  Keys in ``names`` are renamed; every key starting with ``nonprivate_`` is
  written as ``nonprivate/<rest>`` so a non-private statistic can never appear
  under another tag. Other keys are left out.
  """
  tags = {}
  for key, value in record.items():
    if key.startswith("nonprivate_"):
      tags[NONPRIVATE_PREFIX + key[len("nonprivate_"):]] = value
    elif key in names:
      tags[names[key]] = value
  return tags


class TensorBoardWriter:
  """Scalars as TensorBoard event files under ``log_dir`` (tensorboardX).

  ``purge_step``: on resumption, TensorBoard drops the events at and after
  this step that an earlier, interrupted run of the same directory wrote
  (``None``: a new run, nothing to drop).
  """

  def __init__(self, log_dir: str, purge_step: int | None = None):
    with requires(EXTRA, "--log-dir (TensorBoard logs)"):
      from tensorboardX import SummaryWriter
    self._writer = SummaryWriter(log_dir, purge_step=purge_step)
    self.last_step: int | None = None

  def scalars(self, step: int, values: Mapping[str, float]) -> None:
    for tag, value in values.items():
      value = float(value)
      if not math.isfinite(value):
        continue
      description = NONPRIVATE_DESCRIPTION if tag.startswith(NONPRIVATE_PREFIX) else ""
      self._writer.add_scalar(tag, value, step, summary_description=description)
    self._writer.flush()  # a crashed run keeps what it logged
    self.last_step = step

  def close(self) -> None:
    self._writer.close()


def tensorboard_writer(log_dir: str | None, purge_step: int | None = None
                       ) -> TensorBoardWriter | None:
  """A :class:`TensorBoardWriter`, or ``None`` without ``log_dir`` (no tracking)."""
  if log_dir is None:
    return None
  return TensorBoardWriter(log_dir, purge_step=purge_step)
