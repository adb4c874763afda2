"""Spectral benchmarks. Not a test: prints numbers measured side by side in one run.

1. Newton–Schulz time: ``dpmuon_jax.newton_schulz`` vs ``optax.contrib``'s
   ``orthogonalize_via_newton_schulz`` vs the exact polar factor U Vᵀ by SVD,
   on 256×256, 576×64, 1024×1024, 4096×1024 (float32). Target: ≤ 1.1× Optax.
2. Optimizer-state bytes of DP-SGD (momentum), DP-Adam, DP-Muon, DP-Muon-S on
   the small benchmark CNN (paper 1's first-order-memory claim).
3. DP-Muon step / DP-SGD step on the CNN at B = 1024 (full private step:
   per-example gradients, clipping, release, post-processing). Target ≤ 1.05×.
   Also the post-processing alone (update on a given clipped sum).

Timings interleave the candidates repeat by repeat and report medians, so a
machine whose load changes affects all of them alike.

    python benchmarks/bench_spectral.py                # everything
    python benchmarks/bench_spectral.py --skip-step    # parts 1 and 2 only
    python benchmarks/bench_spectral.py --quick        # one repeat, small shapes (smoke run)
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from optax.contrib._muon import orthogonalize_via_newton_schulz

from dpmuon_jax.linalg.newton_schulz import DEFAULT_NS_COEFFS, newton_schulz
from dpmuon_jax.optimizers import dp_adam, dp_sgd
from dpmuon_jax.optimizers.muon import dp_muon, dp_muon_s

NS_SHAPES = [(256, 256), (576, 64), (1024, 1024), (4096, 1024)]
C, SIGMA = 1.0, 1.0


def _block(tree):
  return jax.tree.map(lambda x: x.block_until_ready(), tree)


def interleaved_medians(candidates: dict, repeats: int) -> dict[str, float]:
  """Median seconds per call of each zero-argument callable, after one warm-up call each."""
  for fn in candidates.values():
    _block(fn())
  times = {name: [] for name in candidates}
  for _ in range(repeats):
    for name, fn in candidates.items():
      start = time.perf_counter()
      _block(fn())
      times[name].append(time.perf_counter() - start)
  return {name: statistics.median(ts) for name, ts in times.items()}


def bench_newton_schulz(repeats: int, shapes=tuple(NS_SHAPES)) -> None:
  print(f"\n== Newton–Schulz, 5 steps, float32, {jax.devices()[0].platform} "
        f"(median of {repeats}; large shapes {max(3, repeats // 5)}; SVD 3)")
  ours = jax.jit(lambda x: newton_schulz(x, eps=1e-8))
  coeffs = jnp.asarray(DEFAULT_NS_COEFFS)
  theirs = jax.jit(lambda x: orthogonalize_via_newton_schulz(x, coeffs, 5, eps=1e-8))

  @jax.jit
  def svd_polar(x):
    u, _, vt = jnp.linalg.svd(x, full_matrices=False)
    return u @ vt

  print(f"{'shape':>11} {'ours ms':>9} {'optax ms':>9} {'svd ms':>9} {'ours/optax':>10} "
        f"{'svd/ours':>9} {'max|diff|':>10}")
  for shape in shapes:
    x = jax.random.normal(jax.random.key(0), shape)
    diff = float(jnp.max(jnp.abs(ours(x) - theirs(x))))
    large = shape[0] * shape[1] >= 2**20
    t = interleaved_medians(
        {"ours": lambda x=x: ours(x), "optax": lambda x=x: theirs(x)},
        max(3, repeats // 5) if large else repeats,
    )
    t.update(interleaved_medians({"svd": lambda x=x: svd_polar(x)}, 3))
    print(f"{shape[0]:>5}×{shape[1]:<5} {1e3 * t['ours']:9.2f} {1e3 * t['optax']:9.2f} "
          f"{1e3 * t['svd']:9.2f} {t['ours'] / t['optax']:10.3f} {t['svd'] / t['ours']:9.2f} "
          f"{diff:10.2e}")


def _cnn():
  from dpmuon_jax.models.registry import model_and_loss

  return model_and_loss("cnn", 10, (32, 32, 3), seed=0)


def _optimizers(batch_size: float, key: int = 0) -> dict:
  return {
      "DP-SGD": dp_sgd(0.3, C, SIGMA, batch_size, key, momentum=0.9),
      "DP-Adam": dp_adam(1e-3, C, SIGMA, batch_size, key),
      "DP-Muon": dp_muon(0.02, C, SIGMA, batch_size, key),
      "DP-Muon-S": dp_muon_s(0.3, C, SIGMA, batch_size, key),
  }


def _nbytes(tree) -> int:
  return sum(int(np.prod(np.shape(x))) * jnp.dtype(jnp.result_type(x)).itemsize
             for x in jax.tree.leaves(tree))


def bench_state_bytes() -> None:
  model, _ = _cnn()
  params = model.params
  p_bytes = _nbytes(params)
  n_params = sum(int(np.prod(np.shape(x))) for x in jax.tree.leaves(params))
  print(f"\n== Optimizer state on the small CNN ({n_params} parameters, {p_bytes} bytes)")
  print(f"{'optimizer':>10} {'state bytes':>12} {'release':>8} {'post':>10} {'post/params':>11}")
  for name, opt in _optimizers(1024.0).items():
    state = opt.init(params)
    release, post = _nbytes(state[0]), _nbytes(state[1:])
    print(f"{name:>10} {release + post:12d} {release:8d} {post:10d} {post / p_bytes:11.3f}")


def bench_step(batch_size: int, microbatch: int, repeats: int) -> None:
  from dpmuon_jax.training.step import make_private_step

  model, loss_fn = _cnn()
  params = model.params
  rng = np.random.default_rng(0)
  batch = {
      "image": jnp.asarray(rng.standard_normal((batch_size, 32, 32, 3)), jnp.float32),
      "label": jnp.asarray(rng.integers(0, 10, batch_size), jnp.int32),
  }
  mask = jnp.ones(batch_size, bool)
  opts = {k: v for k, v in _optimizers(float(batch_size)).items() if k in ("DP-SGD", "DP-Muon")}
  steps, updates, states = {}, {}, {}
  for name, opt in opts.items():
    step = make_private_step(opt, loss_fn, microbatch_size=microbatch)
    states[name] = opt.init(params)
    overflow = step.empty_overflow(params)
    steps[name] = lambda s=step, n=name, o=overflow: s.step(params, states[n], batch, mask, o)
    if name == "DP-SGD":  # DP-Muon clips the same per-example gradients: one sum serves both
      total = step.clipped_sum(params, states[name], batch, mask)
    update = jax.jit(opt.update)
    updates[name] = lambda u=update, t=total, n=name: u(t, states[n], params)
  print(f"\n== Private step on the small CNN, B = {batch_size} (microbatch {microbatch}), "
        f"median of {repeats}")
  t = interleaved_medians(steps, repeats)
  print(f"full step    DP-SGD {1e3 * t['DP-SGD']:9.1f} ms   DP-Muon {1e3 * t['DP-Muon']:9.1f} ms"
        f"   ratio {t['DP-Muon'] / t['DP-SGD']:.3f}")
  t = interleaved_medians(updates, 5 * repeats)
  print(f"update only  DP-SGD {1e3 * t['DP-SGD']:9.2f} ms   DP-Muon {1e3 * t['DP-Muon']:9.2f} ms"
        f"   ratio {t['DP-Muon'] / t['DP-SGD']:.3f}   (release + post-processing on a clipped sum)")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true",
                      help="smoke run, its numbers mean nothing: one repeat; Newton–Schulz "
                      "on 576×64 only; step at B = 8, microbatch 4")
  parser.add_argument("--repeats", type=int, default=None,
                      help="Newton–Schulz timing repeats (default: 21)")
  parser.add_argument("--batch-size", type=int, default=None, help="step batch (default: 1024)")
  parser.add_argument("--microbatch", type=int, default=None, help="step chunk (default: 256)")
  parser.add_argument("--step-repeats", type=int, default=None, help="default: 3")
  parser.add_argument("--skip-step", action="store_true", help="parts 1 and 2 only")
  args = parser.parse_args()
  args.repeats = args.repeats or (1 if args.quick else 21)
  args.batch_size = args.batch_size or (8 if args.quick else 1024)
  args.microbatch = args.microbatch or (4 if args.quick else 256)
  args.step_repeats = args.step_repeats or (1 if args.quick else 3)
  print(f"jax {jax.__version__}, devices {jax.devices()}")
  bench_newton_schulz(args.repeats, NS_SHAPES[1:2] if args.quick else NS_SHAPES)
  bench_state_bytes()
  if not args.skip_step:
    bench_step(args.batch_size, args.microbatch, args.step_repeats)


if __name__ == "__main__":
  main()
