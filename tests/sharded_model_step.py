"""The script of tests/test_sharded_model.py (run in a subprocess, never collected).

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python sharded_model_step.py OUT_JSON

A tapped MLP (two matrices split over 'model', a LayerNorm and biases
replicated) trained for a few private releases on every (data, model)
mesh of 8 devices, for DP-SGD, DP-Muon (per-example gradients) and DP-Muon-IM
(ghost clipping); the layouts its parameters and optimizer state
took; the noise of one key drawn under each mesh's layouts; and the noise of
a zero-gradient release on a sharded mesh. Written as JSON for the test.
"""

import json
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dpmuon_jax.distributed.mesh import shard_batch, sharded_capacity
from dpmuon_jax.distributed.sharding import (
    model_mesh,
    param_specs,
    per_device_bytes,
    shard_train_state,
    shardings,
)
from dpmuon_jax.models.common import classification_loss
from dpmuon_jax.models.taps import tapped_model
from dpmuon_jax.optimizers import dp_muon, dp_muon_im, dp_sgd
from dpmuon_jax.privacy.release import gaussian_noise_like
from dpmuon_jax.privacy.sampling import PoissonSampler, gather
from dpmuon_jax.training.step import make_private_step

MESHES = ((1, 8), (2, 4), (4, 2), (8, 1))
N, RATE, CLIP, SIGMA, RELEASES, NOISE_SHAPE = 128, 0.125, 1.0, 1.3, 2, (128, 128)
FEATURES, HIDDEN, CLASSES = 16, 64, 32
DENOMINATOR = RATE * N


class Mlp(nnx.Module):
  """Linear → tanh → LayerNorm → Linear; both kernels have ≥ 1024 entries, so they are split."""

  def __init__(self, rngs):
    self.fc1 = nnx.Linear(FEATURES, HIDDEN, rngs=rngs)
    self.norm = nnx.LayerNorm(HIDDEN, rngs=rngs)
    self.head = nnx.Linear(HIDDEN, CLASSES, rngs=rngs)

  def __call__(self, x):
    return self.head(self.norm(jnp.tanh(self.fc1(x))))


MODEL = tapped_model(Mlp(nnx.Rngs(0)))
PARAMS, LOSS = MODEL.params, classification_loss(MODEL.apply)
rng = np.random.default_rng(0)
DATA = {"image": rng.normal(size=(N, FEATURES)).astype(np.float32),
        "label": rng.integers(0, CLASSES, size=N).astype(np.int32)}
OPTIMIZERS = {
    "dp_sgd": lambda: dp_sgd(0.5, CLIP, SIGMA, DENOMINATOR, key=3, momentum=0.9),
    "dp_muon": lambda: dp_muon(0.02, CLIP, SIGMA, DENOMINATOR, key=3),
    "dp_muon_im": lambda: dp_muon_im(0.02, CLIP, SIGMA, DENOMINATOR, key=3, history=2),
}
CASES = (("dp_sgd", "vmap"), ("dp_muon", "vmap"), ("dp_muon_im", "ghost"))


def train(name, method, mesh):
  """RELEASES private steps on ``mesh``: the parameters, their layouts, the per-device bytes."""
  sampler = PoissonSampler(N, RATE, capacity=sharded_capacity(N, RATE, 8), key=5)
  opt = OPTIMIZERS[name]()
  step = make_private_step(opt, LOSS, mesh=mesh, clipped_sum_method=method)
  params, state = shard_train_state(mesh, PARAMS, opt.init(PARAMS))
  for t in range(RELEASES):
    chunks = [shard_batch(mesh, gather(DATA, chunk), chunk.mask) for chunk in sampler.sample(t)]
    out = step(params, state, chunks)
    params, state = out.params, out.opt_state
  flat = jax.tree_util.tree_flatten_with_path(params)[0]
  return {"params": {jax.tree_util.keystr(k): np.asarray(v).tolist() for k, v in flat},
          "param_specs": {jax.tree_util.keystr(k): str(v.sharding.spec) for k, v in flat},
          "state_specs": sorted({str(x.sharding.spec) for x in jax.tree.leaves(state)
                                 if np.ndim(x) >= 2}),
          "moved": max(float(np.max(np.abs(np.asarray(v) - np.asarray(p))))
                       for (_, v), p in zip(flat, jax.tree.leaves(PARAMS))),
          "bytes": per_device_bytes((params, state)),
          "total_bytes": sum(x.nbytes for x in jax.tree.leaves((params, state))),
          "replicated_bytes": sum(x.nbytes for x in jax.tree.leaves((params, state))
                                  if x.sharding.is_fully_replicated)}


def noise_under(mesh):
  """One key's noise for the parameters, generated with the parameters' layouts on ``mesh``."""
  key = jax.random.key_data(jax.random.key(11))
  fn = lambda k: gaussian_noise_like(PARAMS, k, 1.0)
  if mesh is not None:
    specs = param_specs(PARAMS, dict(mesh.shape)["model"])
    fn = jax.jit(fn, out_shardings=shardings(mesh, specs))
  return jax.tree.map(np.asarray, fn(key))


def zero_gradient_noise(mesh):
  """-(θ₁ − θ₀)·D of one DP-SGD release (lr 1) of a zero-gradient loss: the noise on the sum."""
  big = {"v": jnp.zeros(NOISE_SHAPE, jnp.float32)}
  loss = lambda p, b: 0.0 * (jnp.sum(p["v"]) + jnp.sum(b["image"]))
  opt = dp_sgd(1.0, CLIP, SIGMA, DENOMINATOR, key=23)
  params, state = shard_train_state(mesh, big, opt.init(big))
  sampler = PoissonSampler(N, RATE, capacity=sharded_capacity(N, RATE, 8), key=5)
  chunk = sampler.sample(0)[0]
  step = make_private_step(opt, loss, mesh=mesh)
  out = step(params, state, [shard_batch(mesh, gather(DATA, chunk), chunk.mask)])
  return out.params["v"], -np.asarray(out.params["v"]) * DENOMINATOR


def main(path):
  results = {"devices": jax.device_count(), "runs": {}, "noise_equal": {}}
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    for name, method in CASES:
      results["runs"][f"{name}/{method}"] = {
          f"{data}x{model}": train(name, method, model_mesh(data, model))
          for data, model in MESHES}
    reference = noise_under(None)
    for data, model in MESHES:
      noise = noise_under(model_mesh(data, model))
      results["noise_equal"][f"{data}x{model}"] = all(
          np.array_equal(a, b) for a, b in zip(jax.tree.leaves(reference), jax.tree.leaves(noise)))
    sharded, noise = zero_gradient_noise(model_mesh(2, 4))
  results["noise_spec"] = str(sharded.sharding.spec)
  results["noise_rms_over_std"] = float(np.sqrt(np.mean(noise ** 2)) / (SIGMA * CLIP))
  results["noise_size"] = int(noise.size)
  results["noise_mean"] = float(np.mean(noise))
  specs = param_specs(PARAMS, 8)
  results["specs_1x8"] = {jax.tree_util.keystr(k): str(v) for k, v in
                          jax.tree_util.tree_flatten_with_path(specs)[0]}
  with open(path, "w") as out:
    json.dump(results, out)
  print(f"wrote {path}")


if __name__ == "__main__":
  main(sys.argv[1])
