"""Cost of correlated noise: BandMF (b = 4, 16) and BLT (k = 4) releases against the iid one.

    python benchmarks/bench_correlated.py                    # small CNN, B = 256, microbatch 64
    python benchmarks/bench_correlated.py --workload gpt2    # the e2e_cpu_im GPT-2, B = 64
    python benchmarks/bench_correlated.py --quick            # smoke run (numbers mean nothing)

For each release, the whole jitted private step of DP-Muon
(:func:`dpmuon_jax.make_private_step`: query, clipped sum, release, momentum and
Newton–Schulz), with ``noise`` the release's (:mod:`dpmuon_jax.privacy.correlated`):

* step time: minimum over interleaved rounds (the cores are shared), and its ratio to the
  iid step (target ≤ 1.1×);
* the release's state: its noise buffers counted exactly, in copies of the parameters
  (target: ≤ b for BandMF, ≤ k for BLT), and the whole optimizer state in MiB;
* XLA's temporary buffers of the compiled step.

The strategies are built for T = 1,000 releases (BLT for participations 16 apart); their
construction (jax_privacy's optimisation, once per run) is not timed.
"""

from __future__ import annotations

import argparse
import time

import jax
from bench_inner_momentum import WORKLOADS

from dpmuon_jax.optimizers.muon import dp_muon
from dpmuon_jax.privacy.correlated import bandmf_strategy, blt_strategy
from dpmuon_jax.privacy.release import BandMFReleaseState
from dpmuon_jax.training.step import make_private_step

STEPS = 1000
BLT_SEPARATION = 16
STRATEGIES = {
    "iid": lambda steps: "iid",
    "BandMF b=4": lambda steps: bandmf_strategy(steps, 4),
    "BandMF b=16": lambda steps: bandmf_strategy(steps, 16),
    "BLT k=4": lambda steps: blt_strategy(steps, 4, BLT_SEPARATION),
}


def _nbytes(tree) -> int:
  return sum(x.nbytes for x in jax.tree.leaves(tree) if hasattr(x, "nbytes"))


def _noise_buffers(state) -> int:
  found = [s for s in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, BandMFReleaseState))
           if isinstance(s, BandMFReleaseState)]
  return sum(_nbytes(s.buffers) for s in found)


def build(noise, batch_size: int, microbatch: int, workload: str):
  params, loss_fn, batch, routing = WORKLOADS[workload](batch_size)
  mask = jax.random.bernoulli(jax.random.key(2), 0.875, (batch_size,))
  opt = dp_muon(0.02, 1.0, 1.0, 0.875 * batch_size, key=0, noise=noise, **routing)
  step = make_private_step(opt, loss_fn, microbatch_size=microbatch)
  args = (params, opt.init(params), batch, mask, step.empty_overflow(params))
  compiled = step.sealed_step.lower(*args).compile()
  out, _ = compiled(*args)  # warm-up; then the state after one release
  args = (out.params, out.opt_state, batch, mask, args[-1])
  jax.block_until_ready(compiled(*args))
  return compiled, args, _nbytes(params)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--quick", action="store_true",
                      help="smoke run (numbers mean nothing): B = 8, microbatch 4, 1 round, "
                      "iid and BLT k=2 for T = 16 releases (the script's one code path)")
  parser.add_argument("--workload", choices=sorted(WORKLOADS), default="cnn")
  args = parser.parse_args()
  if args.quick:
    batch_size, microbatch, rounds, steps = 8, 4, 1, 16
    strategies = {"iid": STRATEGIES["iid"], "BLT k=2": lambda steps: blt_strategy(steps, 2, 4)}
  elif args.workload == "gpt2":
    batch_size, microbatch, rounds, steps, strategies = 64, 32, 5, STEPS, STRATEGIES
  else:
    batch_size, microbatch, rounds, steps, strategies = 256, 64, 5, STEPS, STRATEGIES
  print(f"jax {jax.__version__}, {jax.devices()[0].platform}, {args.workload}, DP-Muon, "
        f"B = {batch_size}, microbatch {microbatch}, {rounds} rounds, T = {steps}")
  built = {name: build(make(steps), batch_size, microbatch, args.workload)
           for name, make in strategies.items()}
  times = {name: [] for name in built}
  for _ in range(rounds):
    for name, (compiled, step_args, _) in built.items():
      start = time.perf_counter()
      jax.block_until_ready(compiled(*step_args))
      times[name].append(time.perf_counter() - start)
  base = min(times["iid"])
  for name, (compiled, step_args, param_bytes) in built.items():
    t = min(times[name])
    copies = _noise_buffers(step_args[1]) / param_bytes
    temp = compiled.memory_analysis().temp_size_in_bytes / 2**30
    print(f"  {name:12s} step {t:7.3f} s ({t / base:4.2f}× iid)   noise buffers "
          f"{copies:5.2f} parameter copies   opt state {_nbytes(step_args[1]) / 2**20:8.2f} MiB"
          f"   XLA temp {temp:.3f} GiB")


if __name__ == "__main__":
  main()
