"""Peak resident memory of THIS process, for the benchmarks' child processes (Linux).

A benchmark measures a step in a child process: :func:`reset_peak_rss` after
compiling, then :func:`peak_rss_gib` after the step, so the figure is the
step's own high-water mark, not the parent's or the compiler's: the reset first
hands the heap the compiler freed back to the system (glibc's ``malloc_trim``),
which would otherwise stay resident and count as the step's (about 0.25 GiB for
a private GPT-2 step here, 0.07 GiB for a non-private one).
"""

from __future__ import annotations

from dpmuon_jax.text.train import reset_peak_rss

__all__ = ["peak_rss_gib", "reset_peak_rss"]  # the library's reset: trim the heap, then VmHWM


def peak_rss_gib() -> float:
  """VmHWM of this process in GiB."""
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith("VmHWM:"):
        return int(line.split()[1]) / 2**20
  raise RuntimeError("VmHWM not found")
