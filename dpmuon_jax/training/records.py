"""Run records on disk: rows of dicts as CSV (histories, sweep tables)."""

from __future__ import annotations

import csv
import os
from collections.abc import Sequence


def write_csv(path: str, rows: Sequence[dict], fields: Sequence[str] | None = None) -> None:
  """Writes ``rows`` with a header; ``fields`` default to every key, in first-seen order."""
  fields = list(fields or dict.fromkeys(k for row in rows for k in row))
  with open(path, "w", newline="") as f:
    writer = csv.DictWriter(f, fieldnames=fields)
    writer.writeheader()
    writer.writerows(rows)


def append_csv_row(path: str, row: dict, fields: Sequence[str]) -> None:
  """Appends one row (the header first if the file is new), flushed and fsynced at once,
  so a restartable sweep never loses a finished run to a crash."""
  new = not os.path.exists(path)
  with open(path, "a", newline="") as f:
    writer = csv.DictWriter(f, fieldnames=list(fields))
    if new:
      writer.writeheader()
    writer.writerow(row)
    f.flush()
    os.fsync(f.fileno())
