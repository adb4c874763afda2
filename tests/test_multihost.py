"""Several JAX processes, one data-parallel mesh: 2 processes × 4 simulated CPU devices.

Every check launches real processes joined by ``jax.distributed`` (gloo CPU
collectives, a fresh coordinator port) and compares them with one process of
8 devices and with one device. The step check (``multihost_step.py``) runs a
few private releases of a small MLP and deliberately broken variants; the
trainer check runs ``dpmuon train`` in 2 processes, stops it, resumes it in 2
processes and compares with one uninterrupted device. All launches of a phase
run at once and share a compilation cache.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from process_group import DEVICES_PER_PROCESS, PROCESSES, Job, group, job_env, leaves, wait
from stats import std_interval

from dpmuon_jax.distributed import multihost

HERE = Path(__file__).resolve().parent
STEP_SCRIPT = HERE / "multihost_step.py"

# multihost_step.py's constants.
SIGMA, CLIP, DENOMINATOR, NOISE_DIM = 1.3, 1.0, 25.6, 16384
TOLERANCE = 1e-5


def _train_argv(data: Path, out: Path, *extra: str) -> list[str]:
  return [sys.executable, "-m", "dpmuon_jax.cli", "train", "--dataset", str(data),
          "--model", "mlp", "--optimizer", "dp_sgd", "--batch-size", "16", "--epochs", "1",
          "--epsilon", "50", "--noise-multiplier", "1.0", "--seed", "3", "--output-dir", str(out),
          "--no-progress", "--no-plot", *extra]


def _tiny_npz(path: Path) -> Path:
  rng = np.random.default_rng(0)
  x = rng.integers(0, 256, size=(80, 8, 8, 1), dtype=np.uint8)
  y = rng.integers(0, 3, size=(80,))
  np.savez(path, x_train=x[:64], y_train=y[:64], x_test=x[64:], y_test=y[64:])
  return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """Phase 1: the step check (2×4 and 1×8); phase 2: a 2-process run stopped after 2
  releases next to an uninterrupted one-device run of 3; phase 3: the resume to 3. At most
  three processes at a time: on the suite's two cores more would only add memory (each
  holds ~0.7-1 GB while the other xdist worker runs its own file)."""
  tmp = tmp_path_factory.mktemp("multihost")
  cache, logs = tmp / "jax_cache", tmp / "logs"
  logs.mkdir()
  data = _tiny_npz(tmp / "tiny.npz")
  group_dir, reference_dir = tmp / "group", tmp / "reference"
  started = time.monotonic()
  phase1 = group("step_group", lambda c, i: [
      sys.executable, str(STEP_SCRIPT), str(tmp / f"step_{i}.json"), c, str(PROCESSES), str(i)],
      cache, logs)
  phase1.append(Job("step_single", [sys.executable, str(STEP_SCRIPT), str(tmp / "single.json")],
                     job_env(PROCESSES * DEVICES_PER_PROCESS, cache), logs))
  distributed = lambda c, i: [  # noqa: E731
      "--coordinator-address", c, "--num-processes", str(PROCESSES), "--process-id", str(i),
      "--cpu-collectives", "gloo"]
  wait(phase1)
  phase2 = group("train_group", lambda c, i: _train_argv(
      data, group_dir, "--max-steps", "2", *distributed(c, i)), cache, logs)
  phase2.append(Job("train_reference", _train_argv(data, reference_dir, "--max-steps", "3"),
                     job_env(1, cache), logs))
  wait(phase2)
  phase3 = group("train_resume", lambda c, i: _train_argv(
      data, group_dir, "--max-steps", "3", "--resume", *distributed(c, i)), cache, logs)
  wait(phase3)
  print(f"multihost launches took {time.monotonic() - started:.1f} s")
  step = [json.loads((tmp / f"step_{i}.json").read_text()) for i in range(PROCESSES)]
  return {"step": step, "single": json.loads((tmp / "single.json").read_text()),
          "group_dir": group_dir, "reference_dir": reference_dir,
          "resume_logs": [job.text() for job in phase3]}


# ------------------------------------------------------------ the checks (each can fail)


def _params_problem(by_process: list[dict], reference: dict) -> str | None:
  """Why the processes' parameters are not one model equal to ``reference``, or None."""
  for p, params in enumerate(by_process):
    for name, value in params.items():
      gap = float(np.max(np.abs(np.asarray(value) - np.asarray(reference[name]))))
      if not gap <= TOLERANCE:
        return f"process {p}: {name} differs from the reference by {gap:.3g}"
  return None


def _rows_problem(fed: list[list[int]], sample: list[int]) -> str | None:
  """Why the processes' fed rows are not a partition of the sample, or None."""
  seen: dict[int, int] = {}
  for p, rows in enumerate(fed):
    for row in rows:
      if row in seen:
        return f"example {row} fed by processes {seen[row]} and {p}"
      seen[row] = p
  if sorted(seen) != sorted(sample):
    return f"fed {len(seen)} examples, the sample has {len(sample)} (different sets)"
  return None


def _noise_problem(rms: float) -> str | None:
  """Two-sided χ²(NOISE_DIM) test of the noise's RMS against σC/D (α = 1e-6)."""
  expected = SIGMA * CLIP / DENOMINATOR
  low, high = std_interval(NOISE_DIM, expected)
  if low <= rms <= high:
    return None
  return f"noise RMS {rms:.5f} outside [{low:.5f}, {high:.5f}] for std σC/D = {expected:.5f}"


def test_the_group_spans_all_devices(runs):
  for p, result in enumerate(runs["step"]):
    assert (result["process"], result["processes"], result["devices"]) == (p, PROCESSES, 8)
  assert runs["single"]["processes"] == 1 and runs["single"]["devices"] == 8


def test_releases_equal_one_process_and_one_device(runs):
  group = [r["correct"]["params"] for r in runs["step"]]
  single = runs["single"]
  assert _params_problem(group, single["correct"]["params"]) is None
  assert _params_problem(group, single["one_device"]["params"]) is None
  moved = max(float(np.max(np.abs(np.asarray(v) - np.asarray(single["one_device"]["params"][k]))))
              for k, v in runs["single"]["own_noise_key"]["params"].items())
  assert moved > 1e-2  # the reference is sensitive: another noise key gives another model


def test_no_example_is_fed_by_two_processes(runs):
  sample_lists = runs["single"]["correct"]["samples"]
  for t, sample in enumerate(sample_lists):
    for result in runs["step"]:
      assert result["correct"]["samples"][t] == sample  # every process drew the same sample
    fed = [result["correct"]["rows"][t] for result in runs["step"]]
    assert _rows_problem(fed, sample) is None


def test_noise_std_is_that_of_one_release(runs):
  noise = [r["noise"] for r in runs["step"]]
  assert noise[0]["head"] == noise[1]["head"]  # one draw, the same on every process
  assert _noise_problem(noise[0]["rms"]) is None
  assert _noise_problem(runs["single"]["noise"]["rms"]) is None
  np.testing.assert_allclose(noise[0]["head"], runs["single"]["noise"]["head"], rtol=1e-6)


def test_the_checks_catch_broken_variants(runs):
  """Noise added per process; each process sampling (or drawing its noise key) on its own."""
  group, single = runs["step"], runs["single"]
  per_process = group[0]["noise"]["per_process_rms"]
  assert _noise_problem(per_process) is not None  # √2 too much: P noises were summed
  assert _noise_problem(per_process / PROCESSES) is not None  # ... or averaged: √2 too little
  own_sample = [r["own_sample"] for r in group]
  assert _params_problem([s["params"] for s in own_sample], single["correct"]["params"])
  assert any(_rows_problem([s["rows"][t] for s in own_sample], single["correct"]["samples"][t])
             for t in range(len(own_sample[0]["rows"])))
  own_key = [r["own_noise_key"]["params"] for r in group]
  assert _params_problem(own_key, own_key[0]) is not None  # the processes' models diverged


def test_processes_share_the_root_and_refuse_to_differ(runs):
  guards = [r["guards"] for r in runs["step"]]
  assert guards[0]["own_root"] != guards[1]["own_root"]  # OS entropy differs per process...
  assert guards[0]["shared_root"] == guards[1]["shared_root"] == guards[0]["own_root"]
  assert not guards[0]["shared_seeded"]
  assert all(g["difference_caught"] for g in guards)  # raised on every process
  assert not runs["single"]["guards"]["difference_caught"]  # alone, nothing can differ


def test_files_are_written_once_and_resume_works_across_thegroup(runs):
  from dpmuon_jax.training.checkpoint import MANIFEST_NAME, latest_good_step
  from dpmuon_jax.training.export import load_exported
  from dpmuon_jax.training.journal import read_journal

  group, reference = runs["group_dir"], runs["reference_dir"]
  journal = read_journal(str(group / "release_journal.jsonl"))
  assert [(e.step, e.key_index) for e in journal] == [(0, 0), (1, 1), (2, 2)]  # once each
  assert len({e.fingerprint for e in journal}) == 1
  ckpt = group / "checkpoints"
  assert sorted(p.name for p in ckpt.iterdir()) == ["2", "3"]
  assert latest_good_step(str(ckpt)) == 3 and (ckpt / "3" / MANIFEST_NAME).is_file()
  assert not list(ckpt.rglob("ocdbt.process_1"))  # process 1 wrote no checkpoint data
  results = json.loads((group / "results.json").read_text())
  assert results["releases"] == 3 and results["stop_reason"] == "max_steps"
  for log in runs["resume_logs"]:  # both processes resumed from step 2 and agree on ε
    assert "after 3 releases" in log and f"ε = {results['epsilon_spent']:.3f}" in log
  resumed = load_exported(str(group / "export")).params
  alone = load_exported(str(reference / "export")).params
  flat = lambda tree: {k: v for k, v in leaves(tree)}  # noqa: E731
  assert flat(resumed).keys() == flat(alone).keys()
  assert _params_problem([flat(resumed)], flat(alone)) is None


# --------------------------------------------------------------- in-process, no group


def test_initialize_without_flags_does_nothing():
  assert multihost.initialize() is False
  assert multihost.is_primary()


def test_initialize_refuses_bad_arguments():
  with pytest.raises(ValueError, match="cpu_collectives"):
    multihost.initialize(cpu_collectives="nccl")
  with pytest.raises(ValueError, match="process_id"):
    multihost.initialize("127.0.0.1:1", 2, 2)
  with pytest.raises(ValueError, match="num_processes"):
    multihost.initialize("127.0.0.1:1", 0, 0)
