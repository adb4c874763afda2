"""The private step on 8 simulated CPU devices: data-parallel throughput, sharded GPT-2 state.

    python benchmarks/bench_sharded.py [--batch 256] [--steps 20] [--no-audit]
    python benchmarks/bench_sharded.py --quick     # smoke run: B = 16, 1 step, tiny GPT-2, no audit

1. Throughput of the data-parallel step on 1, 2, 4, 8 devices.
2. A GPT-2 (4 layers, width 256, 8,192 tokens) with DP-Muon-IM (K = 4: six
   parameter-sized buffers) on the meshes (8/model) × model, model = 1, 2, 4,
   8: per-device bytes of parameters + optimizer state against total / model,
   the compiled step's per-device memory, the step time, and Newton–Schulz on
   one 256 × 1024 matrix split over 'model' (partitioned by XLA vs gathered).

Each device count runs in its own subprocess (the count must be fixed before
JAX starts). Simulated CPU devices share the machine's cores, so times
measure the overhead of sharding (collectives, layout), not a speed-up.
Also times one white-box one-run audit (10⁴ canaries, digits MLP).

``--quick`` only checks that every path runs (its numbers mean nothing): section 1
on the mesh of all 8 devices, section 2 at model = 8.
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

_WORKER = """
import json, time, warnings
import jax, jax.numpy as jnp, numpy as np, optax
from dpmuon_jax.distributed.mesh import data_mesh, shard_batch
from dpmuon_jax.training.step import make_private_step
from dpmuon_jax.optimizers import dp_sgd
B, STEPS, COUNTS = {batch}, {steps}, {counts}
rng = np.random.default_rng(0)
params = {{"w1": jnp.asarray(rng.normal(size=(784, 256)) / 28, jnp.float32),
           "b1": jnp.zeros(256), "w2": jnp.asarray(rng.normal(size=(256, 10)) / 16, jnp.float32),
           "b2": jnp.zeros(10)}}
def loss(p, b):
  h = jax.nn.relu(b["x"] @ p["w1"] + p["b1"])
  return optax.softmax_cross_entropy_with_integer_labels(h @ p["w2"] + p["b2"], b["y"]).mean()
batch = {{"x": rng.normal(size=(B, 784)).astype(np.float32), "y": rng.integers(0, 10, B)}}
mask = np.arange(B) < int(0.9 * B)
for n in COUNTS:
  mesh = data_mesh(n)
  opt = dp_sgd(0.1, 1.0, 1.0, float(B), key=0)
  step = make_private_step(opt, loss, mesh=mesh)
  b, m = shard_batch(mesh, batch, mask)
  state = opt.init(params)
  out = step(params, state, [(b, m)]); jax.block_until_ready(out.params)
  t = time.perf_counter()
  p, s = params, state
  for _ in range(STEPS):
    out = step(p, s, [(b, m)]); p, s = out.params, out.opt_state
  jax.block_until_ready(p)
  print("RESULT" + json.dumps({{"devices": n,
                               "examples_per_s": STEPS * B / (time.perf_counter() - t)}}))
"""


def _host_devices_env(devices: int) -> dict:
  """This environment with ``devices`` forced CPU devices; the caller's own XLA_FLAGS kept."""
  flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}"
  return dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=flags.strip())


def _run(counts: tuple[int, ...], batch: int, steps: int) -> list[dict]:
  """Section 1 on a mesh of each of ``counts`` devices, in one subprocess of max(counts)."""
  env = _host_devices_env(max(counts))
  code = _WORKER.format(batch=batch, steps=steps, counts=counts)
  proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                        check=True)
  return [json.loads(ln[len("RESULT"):]) for ln in proc.stdout.splitlines()
          if ln.startswith("RESULT")]


STATE_BUDGET_MIB = 64.0
"""The per-device budget of section 2: the full state (about 125 MiB) does not fit it."""


def _run_sharded(model: int, quick: bool) -> dict:
  env = _host_devices_env(8)
  worker = Path(__file__).resolve().parent / "_sharded_worker.py"
  proc = subprocess.run([sys.executable, str(worker), str(model), "1" if quick else "0"],
                        env=env, capture_output=True, text=True, check=True)
  line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")][-1]
  return json.loads(line[len("RESULT"):])


def sharded_table(quick: bool) -> None:
  """Section 2's table; at model = 8 the state must be within 1.15× of total / 8."""
  rows = [_run_sharded(m, quick) for m in ((8,) if quick else (1, 2, 4, 8))]
  total = rows[0]["state_bytes_total"] / 2**20
  print(f"\nGPT-2 + DP-Muon-IM (K = {4}) state: {total:.1f} MiB in all; budget "
        f"{STATE_BUDGET_MIB:.0f} MiB per device")
  print(f"{'mesh':>6} {'state MiB/dev':>14} {'/ (total/model)':>16} {'step MiB/dev':>13} "
        f"{'step s':>7} {'NS XLA s':>9} {'NS gather s':>12}")
  for r in rows:
    per = r["state_bytes_per_device"] / 2**20
    print(f"{8 // r['model']}x{r['model']:<4} {per:>14.1f} {per / (total / r['model']):>16.3f} "
          f"{r['step_bytes_per_device'] / 2**20:>13.1f} {r['step_s']:>7.3f} "
          f"{r['ns_partitioned_s']:>9.4f} {r['ns_gathered_s']:>12.4f}")
  last = rows[-1]
  ratio = last["state_bytes_per_device"] / (last["state_bytes_total"] / last["model"])
  if ratio > 1.15:
    raise SystemExit(f"per-device state at model = {last['model']} is {ratio:.3f}x total/model")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true",
                      help="smoke run (numbers mean nothing): B = 16, 1 step, no audit")
  parser.add_argument("--batch", type=int, default=None, help="default: 256")
  parser.add_argument("--steps", type=int, default=None, help="timed steps (default: 20)")
  parser.add_argument("--no-audit", dest="audit", action="store_false",
                      help="skip timing the one-run audit")
  args = parser.parse_args()
  args.batch = args.batch or (16 if args.quick else 256)
  args.steps = args.steps or (1 if args.quick else 20)
  args.audit = args.audit and not args.quick
  groups = [(8,)] if args.quick else [(1,), (2,), (4,), (8,)]
  rows = [r for counts in groups for r in _run(counts, args.batch, args.steps)]
  base = rows[0]["examples_per_s"]
  print(f"{'devices':>8} {'examples/s':>12} {'ratio to 1':>11}")
  for r in rows:
    print(f"{r['devices']:>8} {r['examples_per_s']:>12.0f} {r['examples_per_s'] / base:>11.2f}")
  sharded_table(args.quick)
  if args.audit:
    from dpmuon_jax.audit.run_audit import AuditConfig, audit

    started = time.perf_counter()
    result = audit(AuditConfig(steps=1, seed=1, audit_seed=2))
    print(f"one-run audit (white-box, m = 10⁴, 1 step): {time.perf_counter() - started:.1f} s, "
          f"ε̂ = {result['epsilon_hat']:.3f} vs ε = {result['epsilon_accountant']:.3f}")


if __name__ == "__main__":
  main()
