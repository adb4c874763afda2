"""Every benchmark still runs: a smoke run of each script at its smallest size, ``--quick``
(one loop runs them all the same way: ``for b in benchmarks/[a-z]*.py; do python $b --quick;
done``).

The benchmarks print ratios measured side by side; nothing here checks their
values (timings are noisy on shared machines), only that each script runs to
the end and prints its table, so a benchmark cannot rot unnoticed.
"""

import os
import pathlib
import subprocess
import sys

import pytest

BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"

SCRIPTS = sorted(p.name for p in BENCHMARKS.glob("*.py") if not p.name.startswith("_"))


def test_the_benchmarks_are_found():
  assert len(SCRIPTS) >= 8 and "bench_secure_noise.py" in SCRIPTS, SCRIPTS


@pytest.mark.parametrize("script", SCRIPTS)
def test_benchmark_runs(script):
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  done = subprocess.run([sys.executable, str(BENCHMARKS / script), "--quick"],
                        capture_output=True, text=True, env=env, timeout=900)
  assert done.returncode == 0, done.stderr[-2000:]
  assert len(done.stdout.strip().splitlines()) >= 2, done.stdout
