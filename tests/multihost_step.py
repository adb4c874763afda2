"""One process of tests/test_multihost.py's step check (run as a script, never collected).

    python multihost_step.py OUT_JSON [COORDINATOR NUM_PROCESSES PROCESS_ID]

With a coordinator it joins a process group (gloo CPU collectives); alone it
is the one-process reference and also runs the one-device step. It writes
what it saw as JSON: parameters after a few private releases, the rows its
devices were fed, the noise of a zero-gradient release, and the same for
deliberately broken variants (each process sampling on its own, a noise key
per process, noise added per process).
"""

import json
import sys
import warnings

from dpmuon_jax.distributed import multihost

if len(sys.argv) > 2:  # before any other JAX use
  multihost.initialize(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), cpu_collectives="gloo")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import PartitionSpec  # noqa: E402

from dpmuon_jax.distributed.mesh import DATA_AXIS, data_mesh, shard_batch, sharded_capacity  # noqa: E402
from dpmuon_jax.optimizers import dp_sgd  # noqa: E402
from dpmuon_jax.privacy.keys import root_key  # noqa: E402
from dpmuon_jax.privacy.sampling import PoissonSampler, gather  # noqa: E402
from dpmuon_jax.training.step import make_private_step  # noqa: E402

SEED, N, RATE, CLIP, SIGMA, LR, RELEASES, NOISE_DIM = 7, 256, 0.1, 1.0, 1.3, 0.5, 3, 16384
DENOMINATOR = RATE * N
PID = jax.process_index()

rng = np.random.default_rng(0)
DATA = {"x": rng.normal(size=(N, 12)).astype(np.float32),
        "y": rng.integers(0, 3, size=N).astype(np.int32)}
PARAMS = {"w1": rng.normal(size=(12, 16)).astype(np.float32) / 4,
          "b1": np.zeros(16, np.float32),
          "w2": rng.normal(size=(16, 3)).astype(np.float32) / 4,
          "b2": np.zeros(3, np.float32)}


def loss_fn(p, batch):
  hidden = jnp.tanh(batch["x"] @ p["w1"] + p["b1"])
  logits = hidden @ p["w2"] + p["b2"]
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def zero_gradient_loss(p, batch):
  return 0.0 * (jnp.sum(p["v"]) + jnp.sum(batch["x"]))


def place(mesh, chunk):
  batch = gather(DATA, chunk)
  if mesh is None:
    return batch, jnp.asarray(chunk.mask)
  return shard_batch(mesh, batch, chunk.mask)


def fed_rows(mesh, chunk):
  """The example indices this process's devices were fed (real rows only)."""
  indices, mask = shard_batch(mesh, chunk.indices, chunk.mask)
  pieces = [np.asarray(i.data)[np.asarray(m.data)]
            for i, m in zip(indices.addressable_shards, mask.addressable_shards)]
  return sorted(int(i) for i in np.concatenate(pieces))


def releases(mesh, sampler_root, noise_root):
  """RELEASES private steps of the MLP; its parameters (this process's copy) and fed rows."""
  capacity = sharded_capacity(N, RATE, 8)
  sampler = PoissonSampler(N, RATE, capacity=capacity, key=sampler_root)
  # The raw key names the root's own noise stream: every variant adds the noise the correct
  # run adds (a RootKey object would hand each optimizer built from it a stream of its own).
  opt = dp_sgd(LR, CLIP, SIGMA, DENOMINATOR, key=noise_root.key)
  step = make_private_step(opt, loss_fn, mesh=mesh)
  params, state, rows, samples = PARAMS, opt.init(PARAMS), [], []
  for t in range(RELEASES):
    chunks = sampler.sample(t)
    out = step(params, state, [place(mesh, c) for c in chunks])
    params, state = out.params, out.opt_state
    samples.append(sampler.sample_indices(t).tolist())
    if mesh is not None:
      rows.append(sorted(r for c in chunks for r in fed_rows(mesh, c)))
  return {"params": {k: np.asarray(v).tolist() for k, v in params.items()},
          "rows": rows, "samples": samples}


def library_noise(mesh, root):
  """The update of one release of a zero gradient: −lr·z/D, z the release's noise."""
  big = {"v": np.zeros(NOISE_DIM, np.float32)}
  opt = dp_sgd(LR, CLIP, SIGMA, DENOMINATOR, key=root.key)
  step = make_private_step(opt, zero_gradient_loss, mesh=mesh)
  sampler = PoissonSampler(N, RATE, capacity=sharded_capacity(N, RATE, 8), key=root)
  out = step(big, opt.init(big), [place(mesh, c) for c in sampler.sample(0)])
  return np.asarray(out.params["v"]) / (-LR)


def noise_per_process(mesh, root):
  """BROKEN on purpose: each process adds its own N(0, σ²C²) to its part, then the psum."""
  local = jax.local_device_count()
  key = jax.random.fold_in(root.key, 99)

  def body(part):
    device = jax.lax.axis_index(DATA_AXIS)
    noise = SIGMA * CLIP * jax.random.normal(jax.random.fold_in(key, device // local), part.shape)
    return jax.lax.psum(part + jnp.where(device % local == 0, noise, 0.0), DATA_AXIS)

  summed = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=PartitionSpec(DATA_AXIS),
                                 out_specs=PartitionSpec(), check_vma=False))
  zeros = np.zeros((mesh.size, NOISE_DIM), np.float32)
  return np.asarray(summed(shard_batch(mesh, zeros, np.ones(mesh.size, bool))[0]))[0] / DENOMINATOR


def guards():
  """agree_on_root on OS-entropy roots, and check_same_everywhere on agreeing / differing text."""
  own = root_key(None)
  shared = multihost.agree_on_root(own)
  multihost.check_same_everywhere("a constant", "same on every process")
  try:
    multihost.check_same_everywhere("the process id", f"process {PID}")
    caught = False
  except ValueError:
    caught = True
  return {"own_root": np.asarray(own.key).tolist(), "shared_root": np.asarray(shared.key).tolist(),
          "shared_seeded": shared.seeded, "difference_caught": caught}


def main(path):
  mesh = data_mesh()
  root = multihost.agree_on_root(root_key(SEED))
  mine = root_key(SEED + 1 + PID)  # what a process drawing its own root would have
  result = {"process": PID, "processes": jax.process_count(), "devices": jax.device_count(),
            "correct": releases(mesh, root, root),
            "own_sample": releases(mesh, mine, root),
            "own_noise_key": releases(mesh, root, mine),
            "guards": guards()}
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    noise = library_noise(mesh, root)
    broken = noise_per_process(mesh, root)
  result["noise"] = {"rms": float(np.sqrt(np.mean(noise**2))), "head": noise[:8].tolist(),
                     "per_process_rms": float(np.sqrt(np.mean(broken**2)))}
  if jax.process_count() == 1:
    result["one_device"] = releases(None, root, root)
  with open(path, "w") as f:
    json.dump(result, f)
  print(f"wrote {path}", flush=True)


if __name__ == "__main__":
  main(sys.argv[1])
