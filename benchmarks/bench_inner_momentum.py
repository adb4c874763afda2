"""Cost of inner momentum (DP-Muon-IM, K = 0, 1, 2, 4) and DP-Muon-BC.

    python benchmarks/bench_inner_momentum.py            # small CNN, B = 1024, microbatch 128
    python benchmarks/bench_inner_momentum.py --quick    # B = 8; DP-Muon, IM K=1, BC (smoke run)
    python benchmarks/bench_inner_momentum.py --workload gpt2   # the e2e_cpu_im GPT-2, B = 256

``--workload gpt2`` times ``GPT2_CPU``, the CPU-scale GPT-2 of
``experiments/text_configs.py`` (2 layers, width 64, vocabulary 4,096, 128
tokens per example), with the ``paper2`` routing and its AdamW group.

For each optimizer, the whole jitted private step of
:func:`dpmuon_jax.make_private_step` (query, clipped sum, release,
post-processing) on :func:`dpmuon_jax.models.cnn.small_cnn` (CIFAR-shaped):

* step time: minimum over interleaved rounds (the cores are shared), and its
  ratio to DP-Muon's; IM costs K + 1 gradient evaluations per example;
* memory, in a fresh child process per optimizer: the peak resident set size
  of one compiled step (``_peak_memory.reset_peak_rss`` after compilation, as in the
  other benchmarks: the compiler's freed heap is trimmed, then Linux's VmHWM is
  reset), XLA's temporary buffers, and the optimizer state (IM keeps K copies of
  the parameters).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import jax
from _peak_memory import peak_rss_gib, reset_peak_rss
from flax import nnx

from dpmuon_jax.models.cnn import small_cnn
from dpmuon_jax.models.common import classification_loss
from dpmuon_jax.optimizers.muon import dp_muon
from dpmuon_jax.optimizers.options import Fallback
from dpmuon_jax.optimizers.paper2 import dp_muon_bc, dp_muon_im
from dpmuon_jax.text.gpt2 import GPT2, GPT2_CPU, gpt2_model, lm_loss
from dpmuon_jax.training.step import make_private_step

CONFIGS = {
    "DP-Muon": lambda d, **kw: dp_muon(0.02, 1.0, 1.0, d, key=0, **kw),
    **{f"DP-Muon-IM K={k}": (
        lambda d, k=k, **kw: dp_muon_im(0.02, 1.0, 1.0, d, key=0, history=k, **kw))
       for k in (0, 1, 2, 4)},
    "DP-Muon-BC": lambda d, **kw: dp_muon_bc(0.02, 1.0, 1.0, d, key=0, **kw),
}
QUICK_CONFIGS = ("DP-Muon", "DP-Muon-IM K=1", "DP-Muon-BC")  # --quick: each code path once
GPT2_MAX_LENGTH = 128  # tokens per example, as e2e_cpu_im
GPT2_ROUTING = {"routing": "paper2", "fallback": Fallback(kind="adamw", learning_rate=3e-3)}


def cnn_workload(batch_size: int):
  model = small_cnn(10, 3, key=jax.random.key(0))
  k1, k2 = jax.random.split(jax.random.key(1))
  batch = {"image": jax.random.normal(k1, (batch_size, 32, 32, 3)),
           "label": jax.random.randint(k2, (batch_size,), 0, 10)}
  return model.params, classification_loss(model.apply), batch, {}


def gpt2_workload(batch_size: int):
  apply, params = gpt2_model(GPT2(GPT2_CPU, rngs=nnx.Rngs(0)))
  k1, k2 = jax.random.split(jax.random.key(1))
  tokens = jax.random.randint(k1, (batch_size, GPT2_MAX_LENGTH), 0, GPT2_CPU.vocab_size)
  lengths = jax.random.randint(k2, (batch_size, 1), 40, GPT2_MAX_LENGTH)
  positions = jax.numpy.arange(GPT2_MAX_LENGTH)
  loss_mask = ((positions >= 20) & (positions < lengths)).astype(jax.numpy.float32)
  return params, lm_loss(apply), {"tokens": tokens, "loss_mask": loss_mask}, GPT2_ROUTING


WORKLOADS = {"cnn": cnn_workload, "gpt2": gpt2_workload}


def build(name: str, batch_size: int, microbatch: int | None, workload: str = "cnn"):
  params, loss_fn, batch, routing = WORKLOADS[workload](batch_size)
  mask = jax.random.bernoulli(jax.random.key(2), 0.875, (batch_size,))
  opt = CONFIGS[name](0.875 * batch_size, **routing)
  step = make_private_step(opt, loss_fn, microbatch_size=microbatch)
  state = opt.init(params)
  args = (params, state, batch, mask, step.empty_overflow(params))
  compiled = step.sealed_step.lower(*args).compile()  # -> (StepOutput, the sum's seal)
  out, _ = compiled(*args)  # warm-up; then one step so the IM history is non-trivial
  args = (out.params, out.opt_state, batch, mask, args[-1])
  jax.block_until_ready(compiled(*args))
  return compiled, args


def memory_child(name: str, batch_size: int, microbatch: int, workload: str) -> None:
  compiled, args = build(name, batch_size, microbatch or None, workload)
  peak = None
  if reset_peak_rss():  # the step's own peak, not the compiler's
    jax.block_until_ready(compiled(*args))
    peak = peak_rss_gib()
  state_bytes = sum(x.nbytes for x in jax.tree.leaves(args[1]) if hasattr(x, "nbytes"))
  print(json.dumps({"step_peak_rss_gib": peak,
                    "xla_temp_gib": compiled.memory_analysis().temp_size_in_bytes / 2**30,
                    "opt_state_mib": state_bytes / 2**20}))


def _gib(value: float | None) -> str:
  return "n/a (no VmHWM reset)" if value is None else f"{value:.3f} GiB"


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--quick", action="store_true",
                      help="smoke run (numbers mean nothing): B = 8, microbatch 4, 1 round; "
                      "DP-Muon, IM K=1 and BC, DP-Muon's memory only")
  parser.add_argument("--workload", choices=sorted(WORKLOADS), default="cnn")
  parser.add_argument("--memory-child", nargs=4, help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.memory_child:
    name, b, mb, workload = args.memory_child
    memory_child(name, int(b), int(mb), workload)
    return
  if args.quick:
    batch_size, microbatch, rounds = 8, 4, 1
  elif args.workload == "gpt2":
    batch_size, microbatch, rounds = 256, 64, 3
  else:
    batch_size, microbatch, rounds = 1024, 128, 3
  print(f"jax {jax.__version__}, {jax.devices()[0].platform}, {args.workload}, "
        f"B = {batch_size}, microbatch {microbatch}, {rounds} rounds")
  names = QUICK_CONFIGS if args.quick else tuple(CONFIGS)
  built = {name: build(name, batch_size, microbatch, args.workload) for name in names}
  times = {name: [] for name in names}
  for _ in range(rounds):
    for name, (compiled, step_args) in built.items():
      start = time.perf_counter()
      jax.block_until_ready(compiled(*step_args))
      times[name].append(time.perf_counter() - start)
  base = min(times["DP-Muon"])
  for name in names:
    t = min(times[name])
    if args.quick and name != "DP-Muon":  # --quick measures one child (the code path)
      print(f"  {name:18s} step {t:7.3f} s ({t / base:4.2f}× DP-Muon)   (memory: not in --quick)")
      continue
    out = subprocess.run(
        [sys.executable, __file__, "--memory-child", name, str(batch_size), str(microbatch),
         args.workload],
        capture_output=True, text=True, check=True,
    )
    mem = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"  {name:18s} step {t:7.3f} s ({t / base:4.2f}× DP-Muon)   "
          f"peak RSS {_gib(mem['step_peak_rss_gib'])}   XLA temp {mem['xla_temp_gib']:.3f} GiB"
          f"   opt state {mem['opt_state_mib']:.2f} MiB")


if __name__ == "__main__":
  main()
