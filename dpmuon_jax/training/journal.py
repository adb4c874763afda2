"""A write-ahead journal of releases: no noise key meets two sums, no release escapes the ledger.

Every release uses the key index k of one counter that only grows: the
release's noise key is ``fold_in(noise_stream, k)``, and the Poisson sample and
the augmentation of that release are drawn with the same index. Before release
k the training loop appends one line ``{"step", "key_index", "fingerprint"}``
to the journal and syncs it to disk, so a release can be made only after its
record exists. A checkpoint stores the next key index K.

Resuming from a checkpoint, the journal's entries with key index ≥ K are the
releases made after that checkpoint and lost with the crash. They may have
been observed (logs, a model copied mid-run), so they count:

* **Replay.** When they were made from this checkpoint's step, with key
  indices K, K+1, … and the same fingerprint as the resumed run (a digest of
  every setting that determines the clipped sums and the trajectory, the data
  included), the resumed run recomputes exactly the same releases with the
  same keys: nothing new is revealed, and each is charged once, as it is
  redone. Any that the resumed run does not redo are charged when it stops.
* **Fresh keys.** Otherwise (a setting such as augmentation changed, the data
  changed, or the noise is not replayable) the lost releases are charged to
  the ledger at once, and the key index jumps past the largest one used, so no
  key is ever used on a different clipped sum.

A torn last line (a crash while appending) is treated as a release that
happened: its record was being written, so the release may have followed.
It was written by the process that wrote the line before it, under that
line's privacy settings, so it is charged at those.

Every entry also records the privacy settings the release was made under (q,
σ, C, D, N, the neighbouring relation, δ and the accountant: the ledger's
configuration), so lost releases are charged exactly as they were made, and a
resume under other settings is refused even when no checkpoint is left. It
records whether the release was seeded too: lost releases of a seeded run,
charged to a run resumed without its seed, keep the seeded caveat.

A replay is checked, not assumed: right after each release, before anything
of it can be seen (a history row, a checkpoint, a printed line), the trainer
appends the **seal** of the clipped sum it released (a 64-bit digest of the
sum's bits) to :data:`SEALS_NAME`. A resumed run recomputes each lost release
and adds its noise only when the sum's seal equals the recorded one; on a
mismatch (code, weights or the machine's rounding changed, or a
non-deterministic kernel) the recomputed release is discarded unseen, and it
and the lost releases after it are charged with their keys skipped. The last
lost release may have no seal (the crash came during it): nothing of it was
seen, so it is redone with its key; an earlier lost release without a seal
(the seals file lost) is never replayed.

A **high-water mark** is kept apart from the journal (:data:`HIGH_WATER_NAME`,
rewritten atomically before every release, after its journal line): the last
key index used and its settings. A journal that was truncated or deleted
after a crash is recognised by it, and the releases missing from the journal
are charged as lost, with their key indices skipped.
"""

from __future__ import annotations

import json
import os
from collections.abc import Collection, Sequence
from typing import Any, NamedTuple

from dpmuon_jax.privacy.accounting import LedgerConfig
from dpmuon_jax.training.secret_files import private_open, write_private_file

JOURNAL_NAME = "release_journal.jsonl"
HIGH_WATER_NAME = "release_high_water.json"
SEALS_NAME = "release_seals.jsonl"  # SECRET: digests of the private clipped sums


class JournalEntry(NamedTuple):
  """The record written before one release."""

  step: int  # position in the training schedule the release was made at
  key_index: int  # index of the noise / sampling / augmentation keys it used
  fingerprint: str  # digest of everything that determined the release
  privacy: dict[str, Any] | None = None  # the ledger's configuration (q, σ, C, D, ...)
  seeded: bool | None = None  # whether its noise and sample came from a user seed (None: not
  #                             recorded, an older journal; counted as seeded when charged)


class ResumePlan(NamedTuple):
  """How a run continues from a checkpoint, given the journal.

  Attributes:
    key_index: the first key index the resumed run uses.
    charge_now: lost releases to add to the ledger before continuing.
    replay_until: key indices below this are replays of lost releases; when the
      run stops before reaching it, the rest are charged then.
  """

  key_index: int
  charge_now: int
  replay_until: int


def append_entry(path: str, entry: JournalEntry) -> None:
  """Appends ``entry`` as one JSON line, syncs it, then moves the high-water mark.

  The mark (:data:`HIGH_WATER_NAME` beside ``path``) is the entry again, in a
  file of its own, written atomically.
  """
  line = json.dumps(entry._asdict(), sort_keys=True)
  _append_synced(path, line)
  write_private_file(_high_water_path(path), line)


def _append_synced(path: str, line: str) -> None:
  """Appends ``line`` to the owner-only file ``path`` and syncs it to disk."""
  with private_open(path, "a") as f:
    f.write(line + "\n")
    f.flush()
    os.fsync(f.fileno())


def _high_water_path(journal_path: str) -> str:
  return os.path.join(os.path.dirname(os.path.abspath(journal_path)), HIGH_WATER_NAME)


def read_high_water(journal_path: str) -> JournalEntry | None:
  """The entry of the last release begun, from the high-water mark (``None`` if absent)."""
  path = _high_water_path(journal_path)
  if not os.path.exists(path):
    return None
  with open(path, encoding="utf-8") as f:
    try:
      return JournalEntry(**json.loads(f.read()))
    except (ValueError, TypeError):
      raise ValueError(f"{path} is damaged: cannot tell how many releases were made.") from None


def read_records(journal_path: str) -> list[JournalEntry]:
  """The journal's entries plus those the high-water mark proves are missing from it.

  When the mark's key index is above every index in the journal, the journal
  lost its tail (truncated or deleted): each missing index becomes an entry
  of fingerprint ``"missing"`` with the mark's settings, so it is charged,
  never replayed.
  """
  entries = read_journal(journal_path)
  mark = read_high_water(journal_path)
  if mark is None:
    return entries
  last = max((e.key_index for e in entries), default=-1)
  missing = [JournalEntry(-1, k, "missing", mark.privacy, mark.seeded)
             for k in range(last + 1, mark.key_index + 1)]
  return entries + missing


def _seals_path(journal_path: str) -> str:
  return os.path.join(os.path.dirname(os.path.abspath(journal_path)), SEALS_NAME)


def append_seal(journal_path: str, key_index: int, seal: Sequence[int]) -> None:
  """Records (synced, owner-only) the seal of the clipped sum released with ``key_index``."""
  _append_synced(_seals_path(journal_path),
                 json.dumps({"key_index": int(key_index), "seal": [int(w) for w in seal]}))


def read_seals(journal_path: str) -> dict[int, tuple[int, ...]]:
  """The recorded seal of each key index (the latest where a replay recorded it again);
  a torn last line is ignored (its release had not been seen)."""
  path = _seals_path(journal_path)
  if not os.path.exists(path):
    return {}
  seals = {}
  with open(path, encoding="utf-8") as f:
    for line in f:
      try:
        record = json.loads(line)
        seals[int(record["key_index"])] = tuple(int(w) for w in record["seal"])
      except (ValueError, KeyError, TypeError):
        continue  # torn while being written
  return seals


def releases_after(entries: list[JournalEntry], key_index: int) -> int:
  """How many releases the records show at key indices ``key_index`` and above."""
  return len({e.key_index for e in entries if e.key_index >= key_index})


def any_seeded(entries: list[JournalEntry]) -> bool:
  """Whether a user seed may have made any of these releases (unrecorded counts as seeded).

  A run resumed without its seed (a fresh root) still has the releases its
  seeded start made: when they are charged, the run's guarantee keeps the
  caveat that it holds only while that seed stays secret.
  """
  return any(e.seeded is not False for e in entries)


def _as_json(value: Any) -> Any:
  """``value`` as the journal reads it back (a tuple is a JSON list)."""
  return json.loads(json.dumps(value))


def check_settings(entries: list[JournalEntry], privacy: dict[str, Any]) -> None:
  """Raises ValueError unless every recorded release was made under ``privacy``.

  Entries written before settings were journaled (``privacy`` is ``None``)
  cannot be checked and are refused too.
  """
  for entry in entries:
    if entry.privacy is None:
      raise ValueError(
          f"the journal's release at key index {entry.key_index} does not record its privacy "
          "settings, so they cannot be compared with this run's"
      )
    # A setting journaled before it existed had its default (LedgerConfig's).
    recorded = {**LedgerConfig._field_defaults, **entry.privacy}
    changed = {k: (recorded.get(k), v) for k, v in privacy.items()
               if _as_json(recorded.get(k)) != _as_json(v)}
    if changed:
      raise ValueError(
          f"the release at key index {entry.key_index} was made under other privacy settings "
          f"(journaled, now): {changed}"
      )


def read_journal(path: str) -> list[JournalEntry]:
  """The journal's entries; a torn last line becomes an entry of unknown fingerprint.

  The torn entry carries the privacy settings of the entry before it (one
  process writes a run's lines, under one configuration); ``None`` when it
  is the only line.
  """
  if not os.path.exists(path):
    return []
  with open(path, encoding="utf-8") as f:
    lines = f.read().split("\n")
  entries = []
  for number, line in enumerate(lines, 1):
    if not line.strip():
      continue
    try:
      entries.append(JournalEntry(**json.loads(line)))
    except (ValueError, TypeError):
      if number < len(lines) - 1:
        raise ValueError(f"{path}: line {number} is not a journal entry.") from None
      # Torn while being written: count a release after the last good one.
      last = max((e.key_index for e in entries), default=-1)
      before = entries[-1] if entries else JournalEntry(-1, -1, "torn")
      entries.append(JournalEntry(-1, last + 1, "torn", before.privacy, before.seeded))
  return entries


def mend_torn_line(path: str) -> None:
  """Rewrites a journal whose last line is torn with that line as a whole ``"torn"`` entry.

  Run before a resumed run appends to the journal: its next line would
  otherwise continue the torn one, and the journal could no longer be read.
  The rewrite is atomic; the torn release stays in the journal (charged).
  """
  entries = read_journal(path)
  if entries and entries[-1].fingerprint == "torn":
    write_private_file(path, "".join(json.dumps(e._asdict(), sort_keys=True) + "\n"
                                     for e in entries))


def plan_resume(
    entries: list[JournalEntry],
    checkpoint_step: int,
    checkpoint_key_index: int,
    fingerprint: str,
    replayable: bool = True,
    sealed: Collection[int] | None = None,
) -> ResumePlan:
  """Decides whether the releases lost after a checkpoint are replayed or charged.

  Args:
    entries: the journal (:func:`read_journal`).
    checkpoint_step: the schedule step of the checkpoint resumed from.
    checkpoint_key_index: the next key index stored in that checkpoint.
    fingerprint: the resumed run's fingerprint.
    replayable: False when releases cannot be recomputed bit for bit (noise
      from OS entropy at every release): lost releases are then always charged.
    sealed: the key indices with a recorded seal (:func:`read_seals`); every lost
      release but the last needs one to be replayed. ``None``: not required.
  """
  start = checkpoint_key_index
  lost = {e.key_index: e for e in entries if e.key_index >= start}
  if not lost:
    return ResumePlan(start, 0, start)
  indices = sorted(lost)
  same = replayable and indices == list(range(start, start + len(indices))) and all(
      lost[k].fingerprint == fingerprint and lost[k].step == checkpoint_step + (k - start)
      for k in indices
  ) and (sealed is None or all(k in sealed for k in indices[:-1]))
  if same:
    return ResumePlan(start, 0, start + len(indices))
  return ResumePlan(indices[-1] + 1, len(indices), indices[-1] + 1)
