"""Cost of the private release on the small CNN, CPU.

    python benchmarks/bench_release.py            # full run (~10 min on 2 cores)
    python benchmarks/bench_release.py --quick    # smoke run (~1 min)

Prints, from one run:

* DP-SGD step / non-private step at B = 256 and 1024 (targets ≤ 1.3×, ≤ 1.15×).
  A DP-SGD step is the per-example clipped sum (``vmap(grad)``, flat clipping),
  the Gaussian release and the SGD update, jitted. The non-private step is
  ``grad`` of the mean loss and the same SGD update. Both are timed for the
  model with :func:`~dpmuon_jax.models.cnn.patch_conv` (the library's default)
  and the non-private step also with ``lax.conv_general_dilated``; ratios are
  taken against the FASTER non-private step, so the patch formulation cannot
  flatter them.
* Chunked (rolled ``lax.scan`` over microbatches) vs unchunked clipped sum,
  and, at B = 256, the chunked step of the ``lax`` conv model (the slow case).
* Peak memory of the chunked DP-SGD step at B = 256 vs 4096 (target ≤ 1.3×):
  in a fresh child process per configuration, the peak resident set size
  while the compiled step runs (Linux VmHWM, reset after compilation), the
  process-wide peak including compilation, and XLA's buffer sizes.

The two cores are shared, so every step is timed in interleaved rounds and the
minimum is kept; compare the ratios, not the absolute seconds.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import jax
import optax
from _peak_memory import peak_rss_gib, reset_peak_rss

from dpmuon_jax.models.cnn import small_cnn
from dpmuon_jax.models.common import classification_loss
from dpmuon_jax.privacy.query import clipped_sum, gradient_query

CLIP = 1.0
SIGMA = 1.0
LEARNING_RATE = 0.1


def _dp_sgd(denominator: float) -> optax.GradientTransformationExtraArgs:
  try:
    from dpmuon_jax.optimizers import dp_sgd
  except ImportError:
    from dpmuon_jax.privacy.release import dp_release

    return optax.chain(dp_release(CLIP, SIGMA, denominator, key=0), optax.sgd(LEARNING_RATE))
  return dp_sgd(LEARNING_RATE, CLIP, SIGMA, denominator, key=0)


def _batch(batch_size: int):
  """Random CIFAR-shaped batch; about 1 row in 8 is padding (mask False)."""
  k1, k2, k3 = jax.random.split(jax.random.key(1), 3)
  batch = {
      "image": jax.random.normal(k1, (batch_size, 32, 32, 3)),
      "label": jax.random.randint(k2, (batch_size,), 0, 10),
  }
  return batch, jax.random.bernoulli(k3, 0.875, (batch_size,))


def build(kind: str, batch_size: int, conv_impl: str, microbatch: int | None):
  """A compiled step and its arguments. ``kind``: ``"dp"`` or ``"nonprivate"``."""
  model = small_cnn(10, 3, key=jax.random.key(0), conv_impl=conv_impl)
  loss_fn = classification_loss(model.apply)
  batch, mask = _batch(batch_size)
  if kind == "nonprivate":
    opt = optax.sgd(LEARNING_RATE)

    def step(params, state, batch, mask):
      del mask
      updates, state = opt.update(jax.grad(loss_fn)(params, batch), state, params)
      return optax.apply_updates(params, updates), state

  else:
    opt = _dp_sgd(denominator=0.875 * batch_size)
    query = gradient_query(loss_fn)

    def step(params, state, batch, mask):
      total = clipped_sum(query, params, batch, mask, CLIP, microbatch_size=microbatch)
      updates, state = opt.update(total, state, params)
      return optax.apply_updates(params, updates), state

  args = (model.params, opt.init(model.params), batch, mask)
  compiled = jax.jit(step).lower(*args).compile()
  jax.block_until_ready(compiled(*args))  # warm-up
  return compiled, args


def time_steps(configs: dict, rounds: int) -> dict:
  built = {name: build(*cfg) for name, cfg in configs.items()}
  times = {name: [] for name in configs}
  for _ in range(rounds):
    for name, (compiled, args) in built.items():
      start = time.perf_counter()
      jax.block_until_ready(compiled(*args))
      times[name].append(time.perf_counter() - start)
  return {name: min(ts) for name, ts in times.items()}


def memory_child(batch_size: int, microbatch: int) -> None:
  """Runs one chunked DP-SGD step; prints peak RSS and XLA sizes as JSON.

  Compilation needs more memory than a step, so the process-wide peak
  (``ru_maxrss``) hides the step; the peak of the step alone is read after
  resetting the kernel's high-water mark once the step is compiled and warm.
  """
  compiled, args = build("dp", batch_size, "patches", microbatch or None)
  # VmHWM, not ru_maxrss: Linux keeps ru_maxrss across fork + exec, so a child's
  # ru_maxrss is at least its parent's peak; VmHWM belongs to the child's own memory map.
  overall = peak_rss_gib()
  step_peak = None
  if reset_peak_rss():
    jax.block_until_ready(compiled(*args))
    step_peak = peak_rss_gib()
  analysis = compiled.memory_analysis()
  print(json.dumps({
      "step_peak_rss_gb": step_peak,
      "process_peak_rss_gb": overall,
      "xla_temp_gb": analysis.temp_size_in_bytes / 2**30,
      "xla_args_gb": analysis.argument_size_in_bytes / 2**30,
  }))


def measure_memory(batch_size: int, microbatch: int) -> dict:
  out = subprocess.run(
      [sys.executable, __file__, "--memory-child", str(batch_size), str(microbatch)],
      capture_output=True, text=True, check=True,
  )
  return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--quick", action="store_true",
                      help="smoke run, its numbers mean nothing: B = 8 (one memory child, read as "
                      "both sizes), microbatch 4, 1 round, no unchunked memory contrast")
  parser.add_argument("--microbatch", type=int, default=None, help="chunk size (default 128)")
  parser.add_argument("--rounds", type=int, default=None)
  parser.add_argument("--memory-child", nargs=2, type=int, help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.memory_child:
    memory_child(*args.memory_child)
    return

  # --quick: one timed batch size, one memory child (its reading serves both rows) and no
  # unchunked memory contrast (a smoke run).
  sizes, mem_sizes = ((8,), (8, 8)) if args.quick else ((256, 1024), (256, 4096))
  mb = args.microbatch or (4 if args.quick else 128)
  rounds = args.rounds or (1 if args.quick else 3)
  targets = dict(zip(sizes, (1.3, 1.15), strict=False))
  print(f"jax {jax.__version__}, {jax.devices()[0].platform}, microbatch {mb}, {rounds} rounds")

  for b in sizes:
    configs = {
        "nonprivate (patch conv)": ("nonprivate", b, "patches", None),
        "nonprivate (lax conv)": ("nonprivate", b, "lax", None),
        f"DP-SGD chunked {mb} (patch conv)": ("dp", b, "patches", mb),
        "DP-SGD unchunked (patch conv)": ("dp", b, "patches", None),
    }
    if b == sizes[0]:
      configs[f"DP-SGD chunked {mb} (lax conv)"] = ("dp", b, "lax", mb)
    times = time_steps(configs, rounds)
    base = min(times["nonprivate (patch conv)"], times["nonprivate (lax conv)"])
    print(f"\n== B = {b}")
    for name, t in times.items():
      print(f"  {name:34s} {t:7.3f} s   {t / base:5.2f}× fastest non-private")
    dp = times[f"DP-SGD chunked {mb} (patch conv)"]
    print(f"  DP-SGD (chunked) / non-private: {dp / base:.2f}× (target ≤ {targets[b]}×)"
          f"{'  MISSED' if dp / base > targets[b] else ''}")
    print(f"  chunked / unchunked: {dp / times['DP-SGD unchunked (patch conv)']:.2f}×")

  small = measure_memory(mem_sizes[0], mb)
  large = small if args.quick else measure_memory(mem_sizes[1], mb)
  print(f"\n== Peak memory, DP-SGD step (microbatch {mb}), fresh process each")
  rows = ((f"B = {mem_sizes[0]:5d}", small), (f"B = {mem_sizes[1]:5d}", large))
  if not args.quick:
    rows += ((f"B = {sizes[1]:5d} unchunked", measure_memory(sizes[1], 0)),)
  for b, m in rows:
    print(f"  {b}: step peak RSS {m['step_peak_rss_gb'] or float('nan'):.3f} GiB, "
          f"process peak RSS (incl. compilation) {m['process_peak_rss_gb']:.3f} GiB, "
          f"XLA temp {m['xla_temp_gb']:.3f} GiB, arguments {m['xla_args_gb']:.3f} GiB")
  key = "step_peak_rss_gb" if small["step_peak_rss_gb"] else "process_peak_rss_gb"
  ratio = large[key] / small[key]
  print(f"  {key} B={mem_sizes[1]} / B={mem_sizes[0]}: {ratio:.2f}× (target ≤ 1.3×)"
        f"{'  MISSED' if ratio > 1.3 else ''}")


if __name__ == "__main__":
  main()
