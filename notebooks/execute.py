"""Re-executes the notebooks top to bottom and saves them with their outputs.

    python notebooks/execute.py                    # all, at their default (full) scale
    python notebooks/execute.py quickstart         # one notebook
    python notebooks/execute.py --scale tiny       # what CI runs (outputs then meaningless)

Each notebook runs in a fresh ``python3`` kernel started in ``notebooks/`` (the
``dev`` extra installs nbclient and ipykernel), with the environment of this
command minus ``DPMUON_NOTEBOOK_SCALE`` unless ``--scale`` is given: the
committed outputs are what a Colab user gets from the notebook's defaults.
Standard-error streams (library warnings and logs) are dropped from the saved
outputs and consecutive printed lines joined; a notebook over :data:`MAX_BYTES`
is reported as an error.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
MAX_BYTES = 300_000  # per notebook, outputs and inline PNGs included
CELL_TIMEOUT_S = 1200


def _tidy_outputs(nb) -> int:
  """Drops stderr streams and joins consecutive stdout ones; returns how many were dropped."""
  dropped = 0
  for cell in nb.cells:
    if cell.cell_type != "code":
      continue
    kept = []
    for output in cell.outputs:
      if output.output_type == "stream" and output.name == "stderr":
        dropped += 1
      elif output.output_type == "stream" and kept and kept[-1].output_type == "stream":
        kept[-1].text += output.text
      else:
        kept.append(output)
    cell.outputs = kept
  return dropped


def execute(path: pathlib.Path, scale: str | None, timeout: int = CELL_TIMEOUT_S) -> float:
  """Runs ``path`` in a fresh kernel, saves it with outputs; returns the seconds it took."""
  import nbclient
  import nbformat

  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL=os.environ.get("TF_CPP_MIN_LOG_LEVEL", "3"))
  env.pop("DPMUON_NOTEBOOK_SCALE", None)
  if scale is not None:
    env["DPMUON_NOTEBOOK_SCALE"] = scale
  nb = nbformat.read(path, as_version=4)
  client = nbclient.NotebookClient(
      nb, timeout=timeout, kernel_name="python3", record_timing=False,
      resources={"metadata": {"path": str(path.parent)}},
  )
  start = time.perf_counter()
  client.execute(env=env)  # the kernel's environment
  seconds = time.perf_counter() - start
  dropped = _tidy_outputs(nb)
  nbformat.write(nb, path)
  size = path.stat().st_size
  print(f"{path.name}: {seconds:.0f} s, {size / 1000:.0f} kB"
        + (f", {dropped} stderr outputs dropped" if dropped else ""))
  if size > MAX_BYTES:
    raise SystemExit(f"{path.name} is {size} bytes > {MAX_BYTES}: make its figures smaller.")
  return seconds


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("names", nargs="*", help="notebook names (default: all)")
  parser.add_argument("--scale", choices=("full", "tiny"), default=None,
                      help="DPMUON_NOTEBOOK_SCALE for the kernel (default: unset, i.e. full)")
  parser.add_argument("--timeout", type=int, default=CELL_TIMEOUT_S, help="seconds per cell")
  args = parser.parse_args(argv)
  paths = [HERE / f"{n}.ipynb" for n in args.names] or sorted(HERE.glob("*.ipynb"))
  for path in paths:
    if not path.is_file():
      parser.error(f"no notebook {path}")
    execute(path, args.scale, args.timeout)
  return 0


if __name__ == "__main__":
  sys.exit(main())
