"""One (data, model) mesh of bench_sharded.py's sharded GPT-2 section (run as a script).

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python _sharded_worker.py MODEL QUICK

Prints one ``RESULT{json}`` line: per-device bytes of parameters + DP-Muon-IM
state (K = 4) against the total, the compiled step's per-device memory
(arguments + outputs + temporaries, from XLA's memory analysis), the step
time, and Newton–Schulz on one sharded matrix: partitioned by XLA vs gathered
first.
"""

import json
import sys
import time
import warnings

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from dpmuon_jax.distributed.mesh import shard_batch
from dpmuon_jax.distributed.sharding import (
  leaf_spec,
  model_mesh,
  per_device_bytes,
  shard_train_state,
)
from dpmuon_jax.linalg.newton_schulz import newton_schulz
from dpmuon_jax.optimizers import dp_muon_im
from dpmuon_jax.text.gpt2 import GPT2, GPT2Config, gpt2_model, lm_loss
from dpmuon_jax.training.step import make_private_step

FULL = GPT2Config(vocab_size=8192, max_positions=64, dim=256, num_layers=4, num_heads=4)
QUICK = GPT2Config(vocab_size=512, max_positions=16, dim=64, num_layers=1, num_heads=2)
HISTORY, SEQ = 4, 16


def _timed(fn, *args, repeats: int) -> float:
  jax.block_until_ready(fn(*args))
  started = time.perf_counter()
  for _ in range(repeats):
    out = fn(*args)
  jax.block_until_ready(out)
  return (time.perf_counter() - started) / repeats


def newton_schulz_times(mesh, shape, repeats: int) -> dict:
  """NS_5 of one (m, n) matrix split over 'model': XLA-partitioned vs gathered, then re-split."""
  sharding = NamedSharding(mesh, leaf_spec(shape, dict(mesh.shape)["model"]))
  whole = NamedSharding(mesh, PartitionSpec())
  x = jax.device_put(jax.random.normal(jax.random.key(0), shape), sharding)
  partitioned = jax.jit(newton_schulz, out_shardings=sharding)
  gathered = jax.jit(lambda m: newton_schulz(jax.lax.with_sharding_constraint(m, whole)),
                     out_shardings=sharding)
  return {"ns_partitioned_s": _timed(partitioned, x, repeats=repeats),
          "ns_gathered_s": _timed(gathered, x, repeats=repeats)}


def main(model: int, quick: bool) -> None:
  config, batch_rows = (QUICK, 8) if quick else (FULL, 16)
  mesh = model_mesh(8 // model, model)
  apply, params = gpt2_model(GPT2(config, rngs=nnx.Rngs(0)))
  opt = dp_muon_im(0.02, 1.0, 1.0, float(batch_rows), key=0, history=HISTORY)
  params, state = shard_train_state(mesh, params, opt.init(params))
  rng = np.random.default_rng(0)
  batch = {"tokens": rng.integers(0, config.vocab_size, (batch_rows, SEQ)).astype(np.int32),
           "loss_mask": np.ones((batch_rows, SEQ), np.int32)}
  batch, mask = shard_batch(mesh, batch, np.arange(batch_rows) < batch_rows - 1)
  step = make_private_step(opt, lm_loss(apply), mesh=mesh)
  overflow = step.empty_overflow(params)
  memory = step.sealed_step.lower(params, state, batch, mask,
                                 overflow).compile().memory_analysis()
  step_s = _timed(lambda p, s: step(p, s, [(batch, mask)]).params, params, state,
                  repeats=1 if quick else 3)
  result = {"model": model, "state_bytes_per_device": per_device_bytes((params, state)),
            "state_bytes_total": sum(x.nbytes for x in jax.tree.leaves((params, state))),
            "step_bytes_per_device": int(memory.argument_size_in_bytes
                                         + memory.output_size_in_bytes
                                         + memory.temp_size_in_bytes
                                         - memory.alias_size_in_bytes),
            "step_s": step_s}
  result.update(newton_schulz_times(mesh, (config.dim, 4 * config.dim), 1 if quick else 10))
  print("RESULT" + json.dumps(result))


if __name__ == "__main__":
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    main(int(sys.argv[1]), sys.argv[2] == "1")
