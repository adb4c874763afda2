"""Cost of exact discrete Gaussian noise against float32 Gaussian noise, CPU.

    python benchmarks/bench_secure_noise.py                      # d = 1e4, 1e5, 1e6
    python benchmarks/bench_secure_noise.py --dims 1000000 --repeats 9
    python benchmarks/bench_secure_noise.py --quick              # d = 1e3, B = 4, one round

Prints, for each number of coordinates d, the seconds to draw d noise
coordinates, measured side by side in one run:

* float: ``jax.random.normal(key, (d,), float32)``, jitted, ``block_until_ready``;
* secure: :func:`~dpmuon_jax.privacy.discrete_gaussian.sample_discrete_gaussian`
  from ``os.urandom`` (exact, CKS 2020 Algorithms 1–3), with the integer noise
  scale the secure release would use for noise multiplier σ = 1,
  σ_int = ⌈σ·(2¹⁶ + √d/2)⌉, i.e. variance σ_int²;

and the ratio secure / float. Then one whole DP-SGD step of the benchmark CNN
(:func:`~dpmuon_jax.models.cnn.small_cnn`, CIFAR-shaped, microbatches of 64),
float release vs secure release (grid rounding, exact integer sum, host-side
discrete Gaussian), as the ratio secure / float and the noise standard
deviation ratio Δ/2ᵏ the secure mode costs in utility. The candidates are
timed in interleaved rounds (after one warm-up call each) and the median is
kept; the cores are shared, so compare the ratios, not the absolute seconds.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import jax
import jax.numpy as jnp

from dpmuon_jax.privacy.discrete_gaussian import sample_discrete_gaussian

SIGMA = 1.0
GRID = 2**16


def integer_sigma(sigma: float, dim: int) -> int:
  """σ_int = ⌈σ·(2¹⁶ + √d/2)⌉: the release's integer noise scale for noise multiplier σ."""
  return math.ceil(sigma * (GRID + math.sqrt(dim) / 2))


def interleaved_medians(candidates: dict, repeats: int) -> dict[str, float]:
  """Median seconds per call of each zero-argument callable, after one warm-up call each."""
  for fn in candidates.values():
    jax.block_until_ready(fn())
  times = {name: [] for name in candidates}
  for _ in range(repeats):
    for name, fn in candidates.items():
      start = time.perf_counter()
      jax.block_until_ready(fn())
      times[name].append(time.perf_counter() - start)
  return {name: statistics.median(ts) for name, ts in times.items()}


def bench(dim: int, repeats: int) -> dict[str, float]:
  normal = jax.jit(lambda key: jax.random.normal(key, (dim,), jnp.float32))
  key = jax.random.key(0)
  sigma_squared = integer_sigma(SIGMA, dim) ** 2
  return interleaved_medians({
      "float": lambda: normal(key),
      "secure": lambda: sample_discrete_gaussian(dim, sigma_squared),
  }, repeats)


def bench_step(batch_size: int, repeats: int) -> tuple[dict[str, float], int]:
  """Seconds per private DP-SGD step of the small CNN, float vs secure release."""
  from dpmuon_jax.models.cnn import small_cnn
  from dpmuon_jax.models.common import classification_loss
  from dpmuon_jax.optimizers import dp_sgd
  from dpmuon_jax.privacy.clipping import Clipping
  from dpmuon_jax.training.step import make_private_step

  model = small_cnn(10, 3, key=jax.random.key(0))
  loss_fn = classification_loss(model.apply)
  k1, k2 = jax.random.split(jax.random.key(1))
  batch = {"image": jax.random.normal(k1, (batch_size, 32, 32, 3)),
           "label": jax.random.randint(k2, (batch_size,), 0, 10)}
  chunks = [(batch, jnp.ones(batch_size, bool))]
  candidates = {}
  for name, grid_bits in (("float", None), ("secure", 16)):
    opt = dp_sgd(0.1, 1.0, SIGMA, float(batch_size), key=0,
                 clipping=Clipping(1.0, grid_bits=grid_bits))
    step = make_private_step(opt, loss_fn, microbatch_size=64)
    state = opt.init(model.params)
    candidates[name] = lambda step=step, state=state: step(model.params, state, chunks).params
  dim = sum(x.size for x in jax.tree.leaves(model.params))
  return interleaved_medians(candidates, repeats), dim


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--quick", action="store_true",
                      help="smoke run, its numbers mean nothing: d = 1e3, one round, B = 4")
  parser.add_argument("--dims", type=int, nargs="+", default=None,
                      help="numbers of noise coordinates d (default: 1e4 1e5 1e6)")
  parser.add_argument("--repeats", type=int, default=None,
                      help="timed rounds per d, median kept (default: 5)")
  parser.add_argument("--step-batch", type=int, default=None,
                      help="batch size of the whole-step comparison, 0 skips it (default: 256)")
  args = parser.parse_args()
  args.dims = args.dims or ([10**3] if args.quick else [10**4, 10**5, 10**6])
  args.repeats = args.repeats or (1 if args.quick else 5)
  if args.step_batch is None:
    args.step_batch = 4 if args.quick else 256
  print(f"== noise draw, {jax.devices()[0].platform}, σ = {SIGMA} "
        f"(median of {args.repeats} interleaved rounds)")
  print(f"{'d':>9} {'σ_int':>7} {'float s':>10} {'secure s':>10} {'secure/float':>12} "
        f"{'secure samples/s':>16}")
  for dim in args.dims:
    t = bench(dim, args.repeats)
    print(f"{dim:>9} {integer_sigma(SIGMA, dim):>7} {t['float']:10.5f} {t['secure']:10.4f} "
          f"{t['secure'] / t['float']:12.1f} {dim / t['secure']:16.3g}")
  if args.step_batch:
    t, dim = bench_step(args.step_batch, args.repeats)
    print(f"== DP-SGD step, small CNN ({dim} parameters), B = {args.step_batch}")
    print(f"float {t['float']:.3f} s, secure {t['secure']:.3f} s, "
          f"secure/float {t['secure'] / t['float']:.2f}; noise std ratio "
          f"{(GRID + math.sqrt(dim) / 2) / GRID:.4f}")


if __name__ == "__main__":
  main()
