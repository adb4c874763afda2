"""Real process groups for the multi-process tests: P processes joined by ``jax.distributed``
(gloo CPU collectives, a fresh coordinator port), each with simulated CPU devices, their
output in log files, all launches of a phase sharing one compilation cache."""

from __future__ import annotations

import signal
import socket
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
from devices import host_devices_env

HERE = Path(__file__).resolve().parent
PROCESSES, DEVICES_PER_PROCESS = 2, 4
TIMEOUT_S = 420
# jax.distributed's coordinator (process 0) can abort in gRPC's server destructor at interpreter
# exit, after its run finished and wrote everything: an upstream teardown race, seen once in CI
# in ~20 runs. Such a job counts as finished only if it aborted there AND printed its last line.
TEARDOWN_ABORT = "grpc_core::Server::~Server"
FINISHED_LINE = {"train": "results in ", "step": "wrote "}


def _free_port() -> int:
  """A port nothing listens on now, for a group's coordinator."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def job_env(devices: int, cache: Path) -> dict:
  """The environment of a process with ``devices`` simulated CPU devices and a shared cache."""
  return host_devices_env(
      devices, TF_CPP_MIN_LOG_LEVEL="3",
      JAX_COMPILATION_CACHE_DIR=str(cache), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
      JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
  )


class Job:
  """One started process, its output in a log file."""

  def __init__(self, name: str, argv: list[str], env: dict, logs: Path):
    self.name, self.log = name, logs / f"{name}.log"
    with open(self.log, "w") as out:
      self.proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT,
                                   cwd=HERE.parent)

  def text(self) -> str:
    return self.log.read_text(errors="replace")

  def succeeded(self) -> bool:
    """Exit 0, or the upstream teardown abort after the job's finishing line."""
    if self.proc.returncode == 0:
      return True
    finished = FINISHED_LINE["train" if self.name.startswith("train") else "step"]
    text = self.text()
    return (self.proc.returncode == -signal.SIGABRT and TEARDOWN_ABORT in text
            and finished in text.split(TEARDOWN_ABORT)[0])


def wait(jobs: list[Job], timeout: float = TIMEOUT_S) -> None:
  """Waits for all; if one fails or time runs out, ends the others and reports."""
  deadline = time.monotonic() + timeout
  while any(job.proc.poll() is None for job in jobs):
    failed = [job for job in jobs if job.proc.poll() is not None and not job.succeeded()]
    if failed or time.monotonic() > deadline:
      for job in jobs:
        if job.proc.poll() is None:
          job.proc.kill()
          job.proc.wait()
      culprit = failed[0] if failed else jobs[0]
      why = "failed" if failed else f"timed out after {timeout:.0f} s"
      pytest.fail(f"{culprit.name} {why}:\n{culprit.text()[-3000:]}")
    time.sleep(0.2)
  for job in jobs:
    assert job.succeeded(), f"{job.name}:\n{job.text()[-3000:]}"


def group(name: str, argv_of, cache: Path, logs: Path) -> list[Job]:
  """PROCESSES processes of one group; ``argv_of(coordinator, process_id)``."""
  coordinator = f"127.0.0.1:{_free_port()}"
  environment = job_env(DEVICES_PER_PROCESS, cache)
  return [Job(f"{name}{i}", argv_of(coordinator, i), environment, logs) for i in range(PROCESSES)]


def leaves(tree, prefix=""):
  """``(path, array)`` of every leaf of a nested dict of arrays."""
  if isinstance(tree, dict):
    for key, value in tree.items():
      yield from leaves(value, f"{prefix}/{key}")
  else:
    yield prefix, np.asarray(tree)
