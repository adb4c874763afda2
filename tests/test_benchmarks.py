"""Every benchmark still runs: a smoke run of each script at its smallest size.

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

SMOKE_RUNS = {
    "bench_release.py": ["--quick"],
    "bench_filters.py": ["--quick"],
    "bench_ghost.py": ["--quick"],
    "bench_inner_momentum.py": ["--quick"],
    "bench_secure_noise.py": ["--dims", "1000", "--repeats", "1", "--step-batch", "16"],
    "bench_spectral.py": ["--repeats", "1", "--batch-size", "64", "--microbatch", "32",
                          "--step-repeats", "1"],
    "bench_sharded.py": ["--batch", "64", "--steps", "2", "--no-audit"],
    "gpu_check.py": ["--quick"],
}


def test_every_benchmark_has_a_smoke_run():
  scripts = [p.name for p in BENCHMARKS.glob("*.py") if not p.name.startswith("_")]
  assert sorted(SMOKE_RUNS) == sorted(scripts)  # _modules are shared helpers, not benchmarks


@pytest.mark.parametrize("script", sorted(SMOKE_RUNS))
def test_benchmark_runs(script):
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  done = subprocess.run([sys.executable, str(BENCHMARKS / script), *SMOKE_RUNS[script]],
                        capture_output=True, text=True, env=env, timeout=900)
  assert done.returncode == 0, done.stderr[-2000:]
  assert len(done.stdout.strip().splitlines()) >= 2, done.stdout
