"""Peak resident memory of THIS process, for the benchmarks' child processes (Linux).

A benchmark measures a step in a child process: :func:`reset_peak_rss` after
compiling, then :func:`peak_rss_gib` after the step, so the figure is the
step's own high-water mark, not the parent's or the compiler's.
"""

from __future__ import annotations


def reset_peak_rss() -> bool:
  """Resets the kernel's high-water mark VmHWM of this process (Linux ≥ 4.0)."""
  try:
    with open("/proc/self/clear_refs", "w") as f:
      f.write("5")
    return True
  except OSError:
    return False


def peak_rss_gib() -> float:
  """VmHWM of this process in GiB."""
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith("VmHWM:"):
        return int(line.split()[1]) / 2**20
  raise RuntimeError("VmHWM not found")
