"""Peak resident memory of THIS process, for the benchmarks' child processes (Linux).

A benchmark measures a step in a child process: :func:`reset_peak_rss` after
compiling, then :func:`peak_rss_gib` after the step, so the figure is the
step's own high-water mark, not the parent's or the compiler's: the reset first
hands the heap the compiler freed back to the system (glibc's ``malloc_trim``),
which would otherwise stay resident and count as the step's (about 0.25 GiB for
a private GPT-2 step here, 0.07 GiB for a non-private one).
"""

from __future__ import annotations

import ctypes


def _trim_heap() -> None:
  """Returns freed heap pages to the system (glibc); a no-op elsewhere."""
  try:
    ctypes.CDLL("libc.so.6").malloc_trim(0)
  except (OSError, AttributeError):
    pass


def reset_peak_rss() -> bool:
  """Trims the freed heap, then resets the kernel's high-water mark VmHWM of this
  process (Linux ≥ 4.0)."""
  _trim_heap()
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
