"""Peak memory of THIS process (Linux: VmHWM), for the benchmarks and the text sweeps.

A benchmark measures a step in a child process: :func:`reset_peak_rss` after
compiling, then :func:`peak_rss_gib` after the step, so the figure is the
step's own high-water mark, not the parent's or the compiler's: the reset first
hands the heap the compiler freed back to the system (glibc's ``malloc_trim``),
which would otherwise stay resident and count as the step's (about 0.25 GiB for
a private GPT-2 step here, 0.07 GiB for a non-private one).

A training run is measured by :class:`ReleaseMemory`, a callback of
``train`` / ``train_lm``: the process's peak, and its steady state, the
high-water mark over releases 2..T and their evaluations, reset after the
first release so that it leaves out the first release's compilation (a resumed
run's: the releases after its resumption's first). Both are the PROCESS's
peaks: for a figure per run, run each run in a process of its own
(``experiments.text_sweep`` does).
"""

from __future__ import annotations

import ctypes
import resource
import sys

import jax

__all__ = ["ReleaseMemory", "peak_memory", "peak_rss_gib", "reset_peak_rss"]


def peak_rss_gib() -> float:
  """This process's peak resident set in GiB: Linux's VmHWM, which belongs to the process's
  own memory map, else ``ru_maxrss``, which Linux carries over from the parent through
  fork and exec (so a spawned child's would be at least its parent's peak)."""
  try:
    with open("/proc/self/status") as f:
      for line in f:
        if line.startswith("VmHWM:"):
          return int(line.split()[1]) / 2**20
  except OSError:
    pass
  unit = 2**30 if sys.platform == "darwin" else 2**20  # bytes on macOS, KiB elsewhere
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / unit


def reset_peak_rss() -> bool:
  """Resets this process's VmHWM to its current resident set (Linux ≥ 4.0), after handing
  the heap freed since (e.g. by the compiler) back to the system; False where unsupported."""
  try:
    ctypes.CDLL("libc.so.6").malloc_trim(0)
  except (OSError, AttributeError):
    pass
  try:
    with open("/proc/self/clear_refs", "w") as f:
      f.write("5")
    return True
  except OSError:
    return False


def peak_memory() -> dict[str, float]:
  """Peak resident set (GiB) and peak device allocation (GiB, where the backend reports
  it) of this process since it started."""
  out = {"peak_rss_gib": peak_rss_gib()}
  stats = jax.local_devices()[0].memory_stats() or {}
  if "peak_bytes_in_use" in stats:
    out["peak_device_gib"] = stats["peak_bytes_in_use"] / 2**30
  return out


class ReleaseMemory:
  """A training callback: ``callback(releases_made)`` after each release and its evaluation.

  After this process's first release, when more follow (``releases_made < steps``), it keeps
  the peak so far (compilation included) and resets the high-water mark; after each later
  one it reads the peak, so :meth:`summary` covers the releases and their evaluations and
  not what follows them (the final decoding, the outputs).
  """

  def __init__(self, steps: int):
    self.steps = steps
    self._first_peak: float | None = None
    self._reset = False
    self._latest: dict[str, float] = {}

  def __call__(self, releases_made: int) -> None:
    first = not self._latest
    if first and releases_made < self.steps:
      self._first_peak = peak_rss_gib()
      self._reset = reset_peak_rss()
    self._latest = peak_memory()

  def summary(self) -> dict[str, float]:
    """``peak_rss_gib`` (the run's whole peak), ``peak_device_gib`` where reported, and
    ``steady_peak_rss_gib`` (releases 2..T) where the reset worked."""
    memory = dict(self._latest) or peak_memory()
    if self._reset and self._first_peak is not None:
      memory["steady_peak_rss_gib"] = memory["peak_rss_gib"]
      memory["peak_rss_gib"] = max(memory["peak_rss_gib"], self._first_peak)
    return memory
