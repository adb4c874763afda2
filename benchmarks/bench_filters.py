"""Cost of DiSK-Muon and DOPPLER-Muon relative to DP-Muon on the small CNN, CPU.

    python benchmarks/bench_filters.py            # B = 1024, microbatch 128
    python benchmarks/bench_filters.py --quick    # B = 8, microbatch 4, one round, each code
                                                  # path once (smoke run)

One full private step each (:func:`dpmuon_jax.make_private_step`: chunked
clipped sum of the optimizer's own query, release, post-processing, update),
jitted, on :class:`dpmuon_jax.models.cnn.SmallCNN` (CIFAR-shaped inputs):

* DP-Muon (paper 1 preset);
* DiSK-Muon, κ = 0.7, γ = 0.5: two gradients per example (c = 0.857);
* DiSK-Muon, κ = 0.5, γ = 1: c = 1, one gradient per example;
* DOPPLER-Muon, EMA(0.9), ``composition="replace"``.

Prints the step time (minimum over interleaved rounds; the cores are shared,
so compare the ratios) and, in a fresh child process per optimizer, the peak
resident set size while the compiled step runs (Linux VmHWM, reset after
compilation) and XLA's temporary buffer size, each relative to DP-Muon.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
from _peak_memory import peak_rss_gib, reset_peak_rss

from dpmuon_jax.models.cnn import small_cnn
from dpmuon_jax.models.common import classification_loss
from dpmuon_jax.optimizers.filters import dp_disk_muon, dp_doppler_muon
from dpmuon_jax.optimizers.muon import dp_muon
from dpmuon_jax.training.step import make_private_step

CLIP, SIGMA, LR = 1.0, 1.0, 0.02
OPTIMIZERS = {
    "DP-Muon": lambda d: dp_muon(LR, CLIP, SIGMA, d, key=0),
    "DiSK-Muon (2 grads)": lambda d: dp_disk_muon(LR, CLIP, SIGMA, d, key=0, kappa=0.7, gamma=0.5),
    "DiSK-Muon (c = 1)": lambda d: dp_disk_muon(LR, CLIP, SIGMA, d, key=0, kappa=0.5, gamma=1.0),
    "DOPPLER-Muon": lambda d: dp_doppler_muon(LR, CLIP, SIGMA, d, key=0),
}
QUICK_OPTIMIZERS = ("DP-Muon", "DiSK-Muon (2 grads)", "DOPPLER-Muon")  # --quick: each path once


def build(name: str, batch_size: int, microbatch: int):
  """The compiled step of optimizer ``name`` and its arguments (after one warm-up step)."""
  model = small_cnn(10, 3, key=jax.random.key(0))
  keys = jax.random.split(jax.random.key(1), 3)
  batch = {
      "image": jax.random.normal(keys[0], (batch_size, 32, 32, 3)),
      "label": jax.random.randint(keys[1], (batch_size,), 0, 10),
  }
  mask = jax.random.bernoulli(keys[2], 0.875, (batch_size,))
  opt = OPTIMIZERS[name](0.875 * batch_size)
  step = make_private_step(opt, classification_loss(model.apply), microbatch_size=microbatch)
  params = model.params
  state = opt.init(params)
  overflow = step.empty_overflow(params)
  # One step first, so DiSK's recorded update d_1 is non-zero (as in training).
  params, state, _ = step.step(params, state, batch, mask, overflow)
  args = (params, state, batch, mask, overflow)
  compiled = step.sealed_step.lower(*args).compile()  # -> (StepOutput, the sum's seal)
  jax.block_until_ready(compiled(*args))
  return compiled, args


def time_steps(names: tuple[str, ...], batch_size: int, microbatch: int,
               rounds: int) -> dict[str, float]:
  built = {name: build(name, batch_size, microbatch) for name in names}
  times = {name: [] for name in names}
  for _ in range(rounds):
    for name, (compiled, args) in built.items():
      start = time.perf_counter()
      jax.block_until_ready(compiled(*args))
      times[name].append(time.perf_counter() - start)
  return {name: min(ts) for name, ts in times.items()}


def memory_child(name: str, batch_size: int, microbatch: int) -> None:
  compiled, args = build(name, batch_size, microbatch)
  peak = None
  if reset_peak_rss():
    jax.block_until_ready(compiled(*args))
    peak = peak_rss_gib()
  analysis = compiled.memory_analysis()
  state_bytes = sum(x.nbytes for x in jax.tree.leaves(args[1]) if isinstance(x, jnp.ndarray))
  print(json.dumps({
      "step_peak_rss_gb": peak,
      "xla_temp_gb": analysis.temp_size_in_bytes / 2**30,
      "opt_state_mb": state_bytes / 2**20,
  }))


def measure_memory(name: str, batch_size: int, microbatch: int) -> dict:
  out = subprocess.run(
      [sys.executable, __file__, "--memory-child", name, str(batch_size), str(microbatch)],
      capture_output=True, text=True, check=True,
  )
  return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--quick", action="store_true",
                      help="smoke run, its numbers mean nothing: B = 8, microbatch 4, "
                      "1 round, DiSK-Muon (c = 1) left out (DiSK's code path again), "
                      "DP-Muon's memory only")
  parser.add_argument("--batch-size", type=int, default=None)
  parser.add_argument("--microbatch", type=int, default=None)
  parser.add_argument("--rounds", type=int, default=None)
  parser.add_argument("--memory-child", nargs=3, help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.memory_child:
    name, b, mb = args.memory_child
    memory_child(name, int(b), int(mb))
    return

  b = args.batch_size or (8 if args.quick else 1024)
  mb = args.microbatch or (4 if args.quick else 128)
  rounds = args.rounds or (1 if args.quick else 3)
  print(f"jax {jax.__version__}, {jax.devices()[0].platform}, SmallCNN, B = {b}, "
        f"microbatch {mb}, {rounds} rounds")
  names = QUICK_OPTIMIZERS if args.quick else tuple(OPTIMIZERS)
  times = time_steps(names, b, mb, rounds)
  # --quick measures one child (the code path), not every optimizer's memory.
  measured = list(OPTIMIZERS)[:1] if args.quick else list(OPTIMIZERS)
  memory = {name: measure_memory(name, b, mb) for name in measured}
  base_t, base_m = times["DP-Muon"], memory["DP-Muon"]
  print(f"  {'optimizer':22s} {'step s':>8s} {'× time':>7s} {'peak RSS GiB':>13s} {'× RSS':>6s} "
        f"{'XLA temp GiB':>13s} {'× temp':>7s} {'state MiB':>10s}")
  for name in names:
    if name not in memory:
      print(f"  {name:22s} {times[name]:8.3f} {times[name] / base_t:7.2f}   (memory: not measured)")
      continue
    m = memory[name]
    rss = m["step_peak_rss_gb"] or float("nan")
    base_rss = base_m["step_peak_rss_gb"] or float("nan")
    print(f"  {name:22s} {times[name]:8.3f} {times[name] / base_t:7.2f} {rss:13.3f} "
          f"{rss / base_rss:6.2f} {m['xla_temp_gb']:13.3f} "
          f"{m['xla_temp_gb'] / base_m['xla_temp_gb']:7.2f} {m['opt_state_mb']:10.2f}")


if __name__ == "__main__":
  main()
