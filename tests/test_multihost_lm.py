"""GPT-2 training on several processes: ``dpmuon train-lm`` in 2 processes × 4 CPU devices
gives the parameters of 1 process × 8 devices, for DP-Muon and DP-Muon-IM, and resumes across
the group.

The GPT-2 task runs in the one trainer, so what the image trainer's multi-process test pins
(one root key, one Poisson sample, one noise draw, files written by process 0) must hold here
too; these runs check it end to end on the tiny GPT-2: DP-Muon's 2-process run of 3 releases
(decoding 3 validation sources at the end), and DP-Muon-IM's (K = 4, the GPT-2 preset) with its
state split over both processes (``--mesh 1x8``), stopped after 2 releases and resumed to 3 in
2 processes from the run's recorded settings alone, each against an uninterrupted 1 × 8 run.
(The resume of an unsplit state across a group is pinned by ``test_multihost.py``'s image
run, in the same trainer.)
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import text_folder
from process_group import DEVICES_PER_PROCESS, PROCESSES, Job, group, job_env, leaves, wait

TEXT_DIR = Path(text_folder.TEXT_DIR)
TOLERANCE = 1e-6
TINY_MODEL = '{"dim": 16, "num_layers": 1, "num_heads": 2, "max_positions": 160}'

pytestmark = text_folder.needs_text_data


def _argv(out: Path, optimizer: str, *extra: str) -> list[str]:
  return [sys.executable, "-m", "dpmuon_jax.cli", "train-lm", "--data-dir", str(TEXT_DIR),
          "--output-dir", str(out), "--model", "gpt2_tiny", "--model-overrides", TINY_MODEL,
          "--vocab-size", "512", "--train-split", "train", "--train-subset", "64",
          "--sampling-rate", "0.25", "--steps", "3", "--denominator", "16", "--epsilon", "50",
          "--seed", "5", "--eval-pairs", "16", "--generate-splits", "", "--optimizer",
          optimizer, "--learning-rate", "0.02", "--fallback-learning-rate", "0.003", *extra]


def _distributed(coordinator: str, process_id: int) -> list[str]:
  return ["--coordinator-address", coordinator, "--num-processes", str(PROCESSES),
          "--process-id", str(process_id), "--cpu-collectives", "gloo"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """Phase 1: DP-Muon in 2 processes and on 1 × 8; phase 2: DP-Muon-IM in 2 processes with
  its state split over 'model' = all 8 devices of both (each holds half of every split
  leaf), stopped after 2 releases, and on 1 × 8 for 3; phase 3: the group resumes to 3. At
  most three processes at a time (the suite's two cores)."""
  tmp = tmp_path_factory.mktemp("multihost_lm")
  cache, logs = tmp / "jax_cache", tmp / "logs"
  logs.mkdir()
  single = job_env(PROCESSES * DEVICES_PER_PROCESS, cache)
  started = time.monotonic()
  decode = ("--generate-splits", "valid", "--generate-groups", "3", "--max-new-tokens", "6")
  phase1 = group("train_muon", lambda c, i: _argv(tmp / "muon_group", "dp_muon", *decode,
                                                   *_distributed(c, i)), cache, logs)
  phase1.append(Job("train_muon_single", _argv(tmp / "muon_single", "dp_muon", *decode,
                                               "--devices", "8"), single, logs))
  wait(phase1)
  phase2 = group("train_im", lambda c, i: _argv(tmp / "im_group", "dp_muon_im", "--mesh", "1x8",
                                                 "--max-steps", "2", *_distributed(c, i)),
                 cache, logs)
  phase2.append(Job("train_im_single", _argv(tmp / "im_single", "dp_muon_im", "--devices", "8"),
                    single, logs))
  wait(phase2)
  # Every setting but where the run is comes from its record (--data-dir included).
  phase3 = group("train_im_resume", lambda c, i: [
      sys.executable, "-m", "dpmuon_jax.cli", "train-lm", "--output-dir", str(tmp / "im_group"),
      "--resume", *_distributed(c, i)], cache, logs)
  wait(phase3)
  print(f"train-lm launches took {time.monotonic() - started:.1f} s")
  return {"dir": tmp, "resume_logs": [job.text() for job in phase3]}


def _params(run_dir: Path) -> dict[str, np.ndarray]:
  from dpmuon_jax.training.export import load_exported

  return dict(leaves(load_exported(str(run_dir / "export")).params))


def _largest_gap(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
  assert a.keys() == b.keys()
  return max(float(np.max(np.abs(a[k] - b[k]))) for k in a)


def _results(run_dir: Path) -> dict:
  return json.loads((run_dir / "results.json").read_text())


@pytest.mark.parametrize("name", ["muon", "im"])
def test_two_processes_give_the_parameters_of_one_process_of_eight_devices(runs, name):
  group_dir, single_dir = runs["dir"] / f"{name}_group", runs["dir"] / f"{name}_single"
  assert _largest_gap(_params(group_dir), _params(single_dir)) <= TOLERANCE
  grouped, alone = _results(group_dir), _results(single_dir)
  assert grouped["releases"] == alone["releases"] == 3
  assert grouped["epsilon_spent"] == pytest.approx(alone["epsilon_spent"], rel=1e-12)
  assert grouped["valid_nll"] == pytest.approx(alone["valid_nll"], rel=1e-5)
  assert len(_params(single_dir)) > 4  # a real GPT-2 tree, not an empty export


def test_the_group_decodes_what_one_process_decodes(runs):
  grouped = _results(runs["dir"] / "muon_group")["scores"]["valid"]
  assert grouped["groups"] == 3 and len(grouped["examples"]) == 3
  assert grouped == _results(runs["dir"] / "muon_single")["scores"]["valid"]


def test_state_split_over_both_processes_gives_the_same_run(runs):
  """--mesh 1x8 over 2 processes: each large matrix and its K = 4 states live in slices on the
  devices of both; the checkpoint gathers them, the resume splits them again."""
  sharded, alone = runs["dir"] / "im_group", runs["dir"] / "im_single"
  assert _results(sharded)["releases"] == 3 and _results(sharded)["config"]["mesh"] == "1x8"
  assert _largest_gap(_params(sharded), _params(alone)) <= TOLERANCE


def test_the_group_writes_its_files_once_and_resumes_together(runs):
  from dpmuon_jax.training.journal import read_journal

  group_dir = runs["dir"] / "im_group"
  journal = read_journal(str(group_dir / "release_journal.jsonl"))
  assert [(e.step, e.key_index) for e in journal] == [(0, 0), (1, 1), (2, 2)]  # once each
  ckpt = group_dir / "checkpoints"
  assert sorted(p.name for p in ckpt.iterdir()) == ["2", "3"]
  assert not list(ckpt.rglob("ocdbt.process_1"))  # process 1 wrote no checkpoint data
  results = _results(group_dir)
  assert results["stop_reason"] == "completed" and results["releases"] == 3
  for log in runs["resume_logs"]:  # both processes resumed from release 2 and agree on ε
    assert "after 3 releases" in log and f"ε = {results['epsilon_spent']:.3f}" in log
