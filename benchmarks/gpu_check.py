"""Prepared accelerator check for the spectral optimizers; ≤ 5 minutes on one GPU.

1. Newton–Schulz accuracy on the device, float32 (default and HIGHEST matmul
   precision; GPUs may use TF32 by default) and bfloat16, against the float64
   numpy reference U · p^{∘5}(Σ/‖M‖_F) · Vᵀ; plus the device time per call
   (``--quick``: 576×64 only).
2. DP-Muon / DP-SGD on a WRN-16-4 parameter tree (2.7M parameters):
   the optimizer update alone (release + post-processing on a clipped sum),
   and a full private step (per-example gradients, clipping, release, update).
   (``--quick``: the small CNN's tree, and its step at B = 8.)
3. GPT-2 small (124M, tapped for ghost clipping), B = 64 × T = 128 tokens:
   the non-private step, then DP-SGD and DP-Muon with ghost clipping, then
   DP-SGD with per-example gradients (microbatches of 16): tokens/s, the
   ratio to the non-private step, and the device's peak memory so far (the
   steps run in this order, so each increase belongs to the step that made it).
4. The same GPT-2 with DP-Muon-IM (K = 4, ghost clipping) on a (1, n) mesh of
   all n devices: parameters and optimizer state split over 'model'
   (per-device bytes against total / n) and the step time.

    python benchmarks/gpu_check.py            # accelerator sizes (B = 1024)
    python benchmarks/gpu_check.py --quick    # CPU-sized smoke run (its numbers mean nothing)

Prints results; exits non-zero if an accuracy check fails.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from dpmuon_jax.linalg.newton_schulz import newton_schulz, newton_schulz_polynomial
from dpmuon_jax.optimizers import dp_sgd
from dpmuon_jax.optimizers.muon import dp_muon
from dpmuon_jax.privacy.clipping import flat_norm
from dpmuon_jax.privacy.query import ClippedSum

# Relative Frobenius error bounds against the float64 reference.
# bfloat16 rounding (2⁻⁸) is amplified by the polynomial's slope at small singular values.
TOLERANCES = {"f32-highest": 1e-4, "f32-default": 5e-3, "bf16": 1e-1}


def _median_time(fn, repeats: int) -> float:
  jax.block_until_ready(fn())
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def check_newton_schulz(shapes, repeats: int) -> bool:
  print(f"\n== Newton–Schulz on {jax.devices()[0].device_kind} vs float64 numpy reference")
  print(f"{'shape':>11} {'variant':>12} {'rel.err':>9} {'max|err|':>9} {'ms':>8}  ok")
  variants = {
      "f32-highest": dict(precision=jax.lax.Precision.HIGHEST),
      "f32-default": dict(),
      "bf16": dict(dtype=jnp.bfloat16),
  }
  ok = True
  rng = np.random.default_rng(0)
  for shape in shapes:
    m = rng.standard_normal(shape)
    u, s, vt = np.linalg.svd(m, full_matrices=False)
    ref = (u * newton_schulz_polynomial(s / (np.linalg.norm(m) + 1e-7))) @ vt
    x = jnp.asarray(m, jnp.float32)
    for name, kwargs in variants.items():
      fn = jax.jit(lambda x, kw=kwargs: newton_schulz(x, **kw))
      out = np.asarray(fn(x), np.float64)
      rel = np.linalg.norm(out - ref) / np.linalg.norm(ref)
      seconds = _median_time(lambda fn=fn, x=x: fn(x), repeats)
      passed = rel < TOLERANCES[name]
      ok &= passed
      print(f"{shape[0]:>5}×{shape[1]:<5} {name:>12} {rel:9.2e} {np.max(np.abs(out - ref)):9.2e} "
            f"{1e3 * seconds:8.3f}  {'OK' if passed else 'FAIL'}")
  return ok


def _optimizers(batch_size: int) -> dict:
  return {
      "DP-SGD": dp_sgd(0.3, 1.0, 1.0, float(batch_size), momentum=0.9),
      "DP-Muon": dp_muon(0.02, 1.0, 1.0, float(batch_size)),
  }


def check_update_ratio(model_name: str, label: str, repeats: int) -> None:
  from dpmuon_jax.models.common import pure_model
  from dpmuon_jax.models.registry import create_model

  params = pure_model(create_model(model_name, 10, (32, 32, 3), seed=0)).params
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(1), len(leaves))
  noise = [jax.random.normal(k, x.shape) for k, x in zip(keys, leaves, strict=True)]
  total = treedef.unflatten(noise)
  # The fewest vectors of norm ≤ 1 whose sum can have this norm.
  count = int(np.ceil(float(flat_norm(total))))
  clipped = ClippedSum.assume_clipped(total, 1.0, num_examples=count)
  times = {}
  for name, opt in _optimizers(1024).items():
    update, state = jax.jit(opt.update), opt.init(params)
    times[name] = _median_time(lambda u=update, s=state: u(clipped, s, params), repeats)
  n = sum(x.size for x in leaves)
  print(f"\n== Optimizer update on a {label} tree ({n} parameters): release + post-processing")
  print(f"DP-SGD {1e3 * times['DP-SGD']:.3f} ms   DP-Muon {1e3 * times['DP-Muon']:.3f} ms   "
        f"ratio {times['DP-Muon'] / times['DP-SGD']:.3f}")


def check_step_ratio(model_name, batch_size: int, microbatch: int, repeats: int) -> None:
  from dpmuon_jax.models.registry import model_and_loss
  from dpmuon_jax.training.step import make_private_step

  model, loss_fn = model_and_loss(model_name, 10, (32, 32, 3), seed=0)
  rng = np.random.default_rng(0)
  batch = {
      "image": jnp.asarray(rng.standard_normal((batch_size, 32, 32, 3)), jnp.float32),
      "label": jnp.asarray(rng.integers(0, 10, batch_size), jnp.int32),
  }
  mask = jnp.ones(batch_size, bool)
  times = {}
  for name, opt in _optimizers(batch_size).items():
    step = make_private_step(opt, loss_fn, microbatch_size=microbatch)
    state, overflow = opt.init(model.params), step.empty_overflow(model.params)
    start = time.perf_counter()
    jax.block_until_ready(step.step(model.params, state, batch, mask, overflow))
    compile_s = time.perf_counter() - start
    times[name] = _median_time(
        lambda s=step, st=state, o=overflow: s.step(model.params, st, batch, mask, o), repeats
    )
    print(f"  {name}: first call (compile + run) {compile_s:.1f} s")
  print(f"== Full private step, {model_name}, B = {batch_size} (microbatch {microbatch})")
  print(f"DP-SGD {1e3 * times['DP-SGD']:.1f} ms   DP-Muon {1e3 * times['DP-Muon']:.1f} ms   "
        f"ratio {times['DP-Muon'] / times['DP-SGD']:.3f}")


def _peak_gib() -> float:
  stats = jax.devices()[0].memory_stats() or {}
  return stats.get("peak_bytes_in_use", float("nan")) / 2**30


def _gpt2_steps(loss_fn, params, batch_size: int) -> dict:
  import optax

  from dpmuon_jax.training.step import make_private_step

  sgd = optax.sgd(0.1)
  nonprivate = jax.jit(lambda p, s, b: optax.apply_updates(
      p, sgd.update(jax.grad(loss_fn)(p, b), s, p)[0]))
  steps = {"non-private": lambda p, b, m: nonprivate(p, sgd.init(p), b)}
  for name, opt in _optimizers(batch_size).items():
    for method, micro in (("ghost", None), ("vmap", 16)):
      if name == "DP-Muon" and method == "vmap":
        continue
      step = make_private_step(opt, loss_fn, clipped_sum_method=method, microbatch_size=micro)
      state, empty = opt.init(params), step.empty_overflow(params)
      steps[f"{name} {method}"] = (
          lambda p, b, m, s=step, st=state, e=empty: s.step(p, st, b, m, e))
  return steps


def check_gpt2_ghost(quick: bool, repeats: int) -> None:
  from flax import nnx

  from dpmuon_jax.models.taps import tapped
  from dpmuon_jax.text.gpt2 import GPT2, GPT2_SMALL, GPT2Config, gpt2_model, lm_loss

  config = (GPT2Config(vocab_size=512, max_positions=64, dim=32, num_layers=1, num_heads=2)
            if quick else GPT2_SMALL)
  batch_size, length = (8, 32) if quick else (64, 128)
  apply, params = gpt2_model(tapped(GPT2(config, rngs=nnx.Rngs(0))))
  tokens = jax.random.randint(jax.random.key(1), (batch_size, length), 0, config.vocab_size)
  batch = {"tokens": tokens, "loss_mask": jnp.ones((batch_size, length), jnp.int32)}
  mask = jnp.ones(batch_size, bool)
  n = sum(x.size for x in jax.tree.leaves(params))
  print(f"\n== GPT-2 ({n / 1e6:.1f}M parameters), B = {batch_size}, T = {length}")
  base = None
  for name, fn in _gpt2_steps(lm_loss(apply), params, batch_size).items():
    seconds = _median_time(lambda f=fn: f(params, batch, mask), repeats)
    base = base or seconds
    print(f"{name:>16}: {batch_size * length / seconds:12.0f} tokens/s  "
          f"{seconds / base:5.2f}× non-private  peak memory so far {_peak_gib():.2f} GiB")


def check_gpt2_sharded(quick: bool, repeats: int) -> None:
  from flax import nnx

  from dpmuon_jax.distributed.mesh import shard_batch
  from dpmuon_jax.distributed.sharding import model_mesh, per_device_bytes, shard_train_state
  from dpmuon_jax.models.taps import tapped
  from dpmuon_jax.optimizers import dp_muon_im
  from dpmuon_jax.text.gpt2 import GPT2, GPT2_SMALL, GPT2Config, gpt2_model, lm_loss
  from dpmuon_jax.training.step import make_private_step

  config = (GPT2Config(vocab_size=512, max_positions=64, dim=32, num_layers=1, num_heads=2)
            if quick else GPT2_SMALL)
  batch_size, length, n = (8, 32, jax.device_count()) if quick else (64, 128, jax.device_count())
  mesh = model_mesh(1, n)
  apply, params = gpt2_model(tapped(GPT2(config, rngs=nnx.Rngs(0))))
  opt = dp_muon_im(0.02, 1.0, 1.0, float(batch_size), key=0, history=4)
  params, state = shard_train_state(mesh, params, opt.init(params))
  tokens = np.asarray(jax.random.randint(jax.random.key(1), (batch_size, length), 0,
                                         config.vocab_size))
  batch, mask = shard_batch(mesh, {"tokens": tokens,
                                   "loss_mask": np.ones((batch_size, length), np.int32)},
                            np.ones(batch_size, bool))
  step = make_private_step(opt, lm_loss(apply), mesh=mesh, clipped_sum_method="ghost")
  empty = step.empty_overflow(params)
  seconds = _median_time(lambda: step.step(params, state, batch, mask, empty), repeats)
  per, total = per_device_bytes((params, state)), sum(x.nbytes for x in jax.tree.leaves(
      (params, state)))
  print(f"\n== GPT-2 DP-Muon-IM (K = 4, ghost) on a 1 x {n} mesh: state "
        f"{per / 2**20:.1f} MiB per device = {per / (total / n):.3f} x total / {n}; "
        f"{batch_size * length / seconds:.0f} tokens/s; peak memory so far {_peak_gib():.2f} GiB")


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true",
                      help="tiny sizes, one repeat: a CPU smoke run (numbers mean nothing)")
  parser.add_argument("--skip-step", action="store_true", help="skip the full private step")
  args = parser.parse_args()
  start = time.perf_counter()
  print(f"jax {jax.__version__}, backend {jax.default_backend()}, devices {jax.devices()}")
  if args.quick:
    shapes, repeats, gpt2_repeats = [(576, 64)], 1, 1
    tree, step_args = ("cnn", "small CNN"), ("cnn", 8, 4, 1)
  else:
    shapes, repeats = [(576, 64), (1024, 1024), (4096, 1024), (4096, 4096)], 20
    gpt2_repeats, tree, step_args = 5, ("wrn16_4", "WRN-16-4"), ("wrn16_4", 1024, 256, 5)
  ok = check_newton_schulz(shapes, repeats)
  check_update_ratio(*tree, repeats)
  if not args.skip_step:
    check_step_ratio(*step_args)
  check_gpt2_ghost(args.quick, gpt2_repeats)
  check_gpt2_sharded(args.quick, gpt2_repeats)
  print(f"\nwall time {time.perf_counter() - start:.1f} s; accuracy {'OK' if ok else 'FAILED'}")
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
