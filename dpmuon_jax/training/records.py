"""Run records on disk: rows of dicts as CSV (histories, sweep tables)."""

from __future__ import annotations

import csv
from collections.abc import Sequence


def write_csv(path: str, rows: Sequence[dict], fields: Sequence[str] | None = None) -> None:
  """Writes ``rows`` with a header; ``fields`` default to every key, in first-seen order."""
  fields = list(fields or dict.fromkeys(k for row in rows for k in row))
  with open(path, "w", newline="") as f:
    writer = csv.DictWriter(f, fieldnames=fields)
    writer.writeheader()
    writer.writerows(rows)
