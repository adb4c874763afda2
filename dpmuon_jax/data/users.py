"""Training data grouped by user, for user-level DP (one clipped vector per user).

With the user as the privacy unit, the neighbouring datasets differ in ONE
USER's records, all of them. The sampler then draws users (Poisson, rate
q = expected users / U), and each sampled user contributes one vector: the
mean of the queries of at most ``max_records`` of their records, clipped to C
(:func:`~dpmuon_jax.privacy.query.per_user_query`). Adding or removing a user
moves the clipped sum by at most C, so σ, the accountant and the ledger are
those of example-level DP-SGD with N = U users.

Which records a user keeps is fixed before training and does not depend on
the model: their first ``max_records`` in the data's order. A user with more
records loses the rest (counted), never a sampled subset per step.

:func:`group_by_user` lays the records out as one row per user: every field
gets a second axis of ``max_records`` slots, and ``record_mask`` (the
:data:`~dpmuon_jax.privacy.query.RECORD_MASK` field) marks the filled ones.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import numpy as np

from dpmuon_jax import checks
from dpmuon_jax.privacy.query import RECORD_MASK


class UserGroups(NamedTuple):
  """Records laid out one row per user.

  Attributes:
    arrays: each field as ``(users, max_records, ...)`` and ``record_mask``
      ``(users, max_records)``; unfilled slots hold the field's first record and are masked.
    users: the user id of each row, in sorted order.
    records_kept: records placed in a slot.
    records_dropped: records past their user's ``max_records``.
  """

  arrays: dict[str, np.ndarray]
  users: np.ndarray
  records_kept: int
  records_dropped: int

  @property
  def num_users(self) -> int:
    return len(self.users)


def group_by_user(arrays: Mapping[str, np.ndarray], users: np.ndarray,
                  max_records: int) -> UserGroups:
  """One row per user: their first ``max_records`` records (data order) and a mask.

  Args:
    arrays: the training fields, each with one leading entry per record.
    users: one user id per record (any sortable dtype: ints or strings).
    max_records: m, the most records a user contributes (the rest are dropped, counted).

  Returns:
    :class:`UserGroups`. Raises ``ValueError`` for no records, a length mismatch or a
    missing user id (an empty string or NaN).
  """
  max_records = checks.check_positive_int("max_records", max_records)
  users = np.asarray(users)
  if users.ndim != 1 or len(users) == 0:
    raise ValueError(f"users must be one id per record, got shape {users.shape}.")
  for name, array in arrays.items():
    if len(array) != len(users):
      raise ValueError(f"{name} has {len(array)} records but users has {len(users)} ids.")
  _refuse_missing_ids(users)
  ids, row_of_record = np.unique(users, return_inverse=True)
  slot = _slot_in_user(row_of_record)
  kept = slot < max_records
  grouped = {}
  for name, array in arrays.items():
    array = np.asarray(array)
    out = np.broadcast_to(array[:1], (len(ids), max_records) + array.shape[1:]).copy()
    out[row_of_record[kept], slot[kept]] = array[kept]
    grouped[name] = out
  mask = np.zeros((len(ids), max_records), bool)
  mask[row_of_record[kept], slot[kept]] = True
  grouped[RECORD_MASK] = mask
  return UserGroups(grouped, ids, int(kept.sum()), int((~kept).sum()))


def _slot_in_user(row_of_record: np.ndarray) -> np.ndarray:
  """For each record, how many records of the same user come before it (data order)."""
  order = np.argsort(row_of_record, kind="stable")
  sorted_rows = row_of_record[order]
  starts = np.searchsorted(sorted_rows, sorted_rows, side="left")
  slot = np.empty_like(order)
  slot[order] = np.arange(len(order)) - starts
  return slot


def _refuse_missing_ids(users: np.ndarray) -> None:
  if users.dtype.kind in "US":
    missing = np.flatnonzero(np.char.strip(users.astype(str)) == "")
  elif users.dtype.kind == "f":
    missing = np.flatnonzero(~np.isfinite(users))
  elif users.dtype.kind == "O":
    missing = np.flatnonzero([u is None or str(u).strip() == "" for u in users])
  else:
    return
  if len(missing):
    raise ValueError(f"record {int(missing[0])} has no user id ({len(missing)} record(s) "
                     "without one); every record needs its user for user-level DP.")
