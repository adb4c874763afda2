"""The files of a training run's folder that are public by design (not its secrets)."""

import pathlib

from dpmuon_jax.training.journal import HIGH_WATER_NAME, JOURNAL_NAME, SEALS_NAME

SECRET = ("checkpoints", JOURNAL_NAME, HIGH_WATER_NAME, SEALS_NAME)  # keys, sums' digests


def public_files(run_dir) -> list[pathlib.Path]:
  """Every file under ``run_dir`` outside its secret checkpoints, journal and mark."""
  root = pathlib.Path(run_dir)
  return [p for p in root.rglob("*") if p.is_file()
          and p.relative_to(root).parts[0] not in SECRET]
