"""Ghost clipping vs per-example gradients: a private GPT-2 step's time and memory, CPU.

    python benchmarks/bench_ghost.py            # 256 wide, 4 layers, B = 64 (~3 min)
    python benchmarks/bench_ghost.py --quick    # 64 wide, 2 layers, B = 32 (~1 min)

Both on GPT-2's BPE cut to 4,096 tokens, T = 64 tokens per example.

Three steps on the same model (built with :func:`dpmuon_jax.models.taps.tapped`)
and the same padded batch, each in a fresh child process:

* non-private: ``grad`` of the mean loss and the SGD update;
* DP-SGD, ``vmap``: per-example gradients (``vmap(grad)``), clipped and summed;
* DP-SGD, ``ghost``: ghost norms and book-keeping
  (:func:`~dpmuon_jax.privacy.ghost.ghost_clipped_sum`), one forward and one
  backward, no per-example gradient of any tapped weight.

Per configuration: the fastest of ``--repeats`` steps, the peak resident set
size while the compiled step runs (Linux VmHWM, reset after compilation and
warm-up) and XLA's temporary buffer size. Ratios are against the non-private
step of the same run; the cores are shared, so compare ratios, not seconds.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import optax
from _peak_rss import peak_rss_gib, reset_peak_rss
from flax import nnx

from dpmuon_jax.models.taps import tapped
from dpmuon_jax.optimizers import dp_sgd
from dpmuon_jax.text.gpt2 import GPT2, GPT2Config, gpt2_model, lm_loss
from dpmuon_jax.training.step import make_private_step

METHODS = ("nonprivate", "vmap", "ghost")


def _sizes(quick: bool) -> dict:
  if quick:
    return {"config": GPT2Config(vocab_size=4096, max_positions=64, dim=64, num_layers=2,
                                 num_heads=2), "batch": 32, "length": 64}
  return {"config": GPT2Config(vocab_size=4096, max_positions=64, dim=256, num_layers=4,
                               num_heads=4), "batch": 64, "length": 64}


def _batch(config: GPT2Config, batch_size: int, length: int):
  k1, k2 = jax.random.split(jax.random.key(1))
  tokens = jax.random.randint(k1, (batch_size, length), 0, config.vocab_size)
  batch = {"tokens": tokens, "loss_mask": jnp.ones((batch_size, length), jnp.int32)}
  return batch, jax.random.bernoulli(k2, 0.875, (batch_size,))


def build(method: str, quick: bool):
  """A compiled step and its arguments."""
  sizes = _sizes(quick)
  apply, params = gpt2_model(tapped(GPT2(sizes["config"], rngs=nnx.Rngs(0))))
  loss_fn = lm_loss(apply)
  batch, mask = _batch(sizes["config"], sizes["batch"], sizes["length"])
  if method == "nonprivate":
    opt = optax.sgd(0.1)

    def step(params, state, batch, mask):
      del mask
      updates, state = opt.update(jax.grad(loss_fn)(params, batch), state, params)
      return optax.apply_updates(params, updates), state

    args = (params, opt.init(params), batch, mask)
    compiled = jax.jit(step).lower(*args).compile()
  else:
    opt = dp_sgd(0.1, 1.0, 1.0, denominator=0.875 * sizes["batch"], key=0)
    private = make_private_step(opt, loss_fn, clipped_sum_method=method)
    args = (params, opt.init(params), batch, mask, private.empty_overflow(params))
    compiled = private.step.lower(*args).compile()
  jax.block_until_ready(compiled(*args))  # warm-up
  return compiled, args






def child(method: str, quick: bool, repeats: int) -> None:
  """Times one configuration; prints its numbers as one JSON line."""
  compiled, args = build(method, quick)
  reset = reset_peak_rss()
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    times.append(time.perf_counter() - start)
  analysis = compiled.memory_analysis()
  print(json.dumps({
      "seconds": min(times),
      "step_peak_rss_gib": peak_rss_gib() if reset else None,
      "xla_temp_gib": analysis.temp_size_in_bytes / 2**30 if analysis else None,
  }))


def measure(method: str, quick: bool, repeats: int) -> dict:
  flags = ["--quick"] if quick else []
  out = subprocess.run(
      [sys.executable, __file__, "--child", method, "--repeats", str(repeats), *flags],
      capture_output=True, text=True, check=True)
  return json.loads(out.stdout.strip().splitlines()[-1])


def _fmt(x: float | None, unit: str) -> str:
  return "     n/a" if x is None else f"{x:8.3f} {unit}"


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--quick", action="store_true", help="small GPT-2, few repeats")
  parser.add_argument("--repeats", type=int, default=None)
  parser.add_argument("--child", choices=METHODS, help=argparse.SUPPRESS)
  args = parser.parse_args()
  repeats = args.repeats or (3 if args.quick else 5)
  if args.child:
    child(args.child, args.quick, repeats)
    return
  sizes = _sizes(args.quick)
  c = sizes["config"]
  print(f"jax {jax.__version__}, {jax.devices()[0].platform}; GPT-2 dim {c.dim}, "
        f"{c.num_layers} layers, vocab {c.vocab_size}, B = {sizes['batch']}, "
        f"T = {sizes['length']}, fastest of {repeats} steps, fresh process each")
  results = {m: measure(m, args.quick, repeats) for m in METHODS}
  base = results["nonprivate"]
  for m, r in results.items():
    ratios = f"{r['seconds'] / base['seconds']:5.2f}× time"
    if r["step_peak_rss_gib"] and base["step_peak_rss_gib"]:
      ratios += f", {r['step_peak_rss_gib'] / base['step_peak_rss_gib']:5.2f}× peak RSS"
    print(f"  {m:10s} {_fmt(r['seconds'], 's')}  peak RSS {_fmt(r['step_peak_rss_gib'], 'GiB')}"
          f"  XLA temp {_fmt(r['xla_temp_gib'], 'GiB')}  ({ratios} of non-private)")
  v, g = results["vmap"], results["ghost"]
  line = f"  ghost / vmap: {g['seconds'] / v['seconds']:.2f}× time"
  if v["xla_temp_gib"] and g["xla_temp_gib"]:
    line += f", {g['xla_temp_gib'] / v['xla_temp_gib']:.2f}× XLA temp"
  if v["step_peak_rss_gib"] and g["step_peak_rss_gib"]:
    line += f", {g['step_peak_rss_gib'] / v['step_peak_rss_gib']:.2f}× peak RSS"
  print(line)


if __name__ == "__main__":
  main()
