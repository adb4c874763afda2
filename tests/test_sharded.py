"""Data-parallel private step on 8 simulated CPU devices (run in one subprocess).

The device count must be set before JAX starts, so one subprocess runs a
script that checks several things and prints them as JSON.
"""

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from devices import host_devices_env
from stats import std_interval

NUM_DEVICES = 8
DENOMINATOR = 24.0
CLIP = 1.0
SIGMA = 1.3
NOISE_DIM = 16 * 1024

_SCRIPT = textwrap.dedent(
    """
    import json, warnings
    import jax, jax.numpy as jnp, numpy as np, optax
    from dpmuon_jax.distributed.mesh import data_mesh, shard_batch, sharded_capacity
    from dpmuon_jax.optimizers import dp_sgd
    from dpmuon_jax.privacy.sampling import PoissonSampler, gather
    from dpmuon_jax.training.step import make_private_step

    D, C, SIGMA, DIM = {denominator}, {clip}, {sigma}, {noise_dim}
    out = {{"num_devices": jax.device_count()}}
    rng = np.random.default_rng(0)
    x = rng.normal(size=(300, 12)).astype(np.float32)
    y = rng.integers(0, 3, size=300).astype(np.int32)
    params = {{"w": jnp.asarray(rng.normal(size=(12, 3)).astype(np.float32)),
               "b": jnp.zeros((3,), jnp.float32)}}

    def loss_fn(p, batch):
      logits = batch["x"] @ p["w"] + p["b"]
      return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    sampler = PoissonSampler(300, 0.08, capacity=sharded_capacity(300, 0.08, 8, 2), key=5)
    out["capacity"] = sampler.capacity
    chunk = sampler.sample(0)[0]
    batch = gather({{"x": x, "y": y}}, chunk)

    def run(step_fn, sigma, n_steps=1):
      opt = dp_sgd(1.0, C, sigma, D, key=11)
      p, s = params, opt.init(params)
      for t in range(n_steps):
        chunks = [(batch, jnp.asarray(chunk.mask))]
        o = step_fn(opt)(p, s, chunks)
        p, s = o.params, o.opt_state
      return p, o.stats

    with warnings.catch_warnings():
      warnings.simplefilter("ignore")
      single = lambda opt: make_private_step(opt, loss_fn)
      mesh8, mesh1 = data_mesh(8), data_mesh(1)
      sharded8 = lambda opt: make_private_step(opt, loss_fn, mesh=mesh8, microbatch_size=2)
      sharded1 = lambda opt: make_private_step(opt, loss_fn, mesh=mesh1)
      p_single, st_single = run(single, SIGMA, 2)
      p8, st8 = run(sharded8, SIGMA, 2)
      p1, _ = run(sharded1, SIGMA, 2)
      out["max_diff_8_vs_single"] = max(
          float(jnp.max(jnp.abs(p_single[k] - p8[k]))) for k in params)
      out["max_diff_1_vs_single"] = max(
          float(jnp.max(jnp.abs(p_single[k] - p1[k]))) for k in params)
      out["param_scale"] = float(jnp.max(jnp.abs(p_single["w"] - params["w"])))
      out["examples_single"] = float(st_single.num_examples)
      out["examples_8"] = float(st8.num_examples)
      out["norm_max_equal"] = bool(jnp.allclose(st_single.norm_max, st8.norm_max))
      out["params_replicated"] = bool(p8["w"].sharding.is_fully_replicated)

      # Noise: same batch and key, sigma vs sigma=0; difference = -noise/D (lr 1).
      big = {{"v": jnp.zeros((DIM,), jnp.float32)}}
      def big_loss(p, b):
        return jnp.sum(b["x"][:, :1]) * jnp.sum(p["v"])
      def delta(sigma):
        opt = dp_sgd(1.0, C, sigma, D, key=23)
        step = make_private_step(opt, big_loss, mesh=mesh8)
        o = step(big, opt.init(big), [(batch, jnp.asarray(chunk.mask))])
        return o.params["v"]
      noise = np.asarray(delta(SIGMA) - delta(0.0))
      out["noise_rms"] = float(np.sqrt(np.mean(noise ** 2)))
      out["noise_mean"] = float(np.mean(noise))

      # The same release from two disjoint chunks (an overflow) with ghost clipping on the
      # mesh: one noise draw, the one-chunk single-device parameters.
      half = jnp.arange(sampler.capacity) < sampler.capacity // 2
      mask = jnp.asarray(chunk.mask)
      two_chunks = [(batch, mask & half), (batch, mask & ~half)]
      def delta_chunks(sigma):
        opt = dp_sgd(1.0, C, sigma, D, key=23)
        step = make_private_step(opt, big_loss, mesh=mesh8, clipped_sum_method="ghost")
        o = step(big, opt.init(big), two_chunks)
        return o.params["v"], float(o.stats.num_examples)
      (with_noise, n_chunks), (without, _) = delta_chunks(SIGMA), delta_chunks(0.0)
      noise2 = np.asarray(with_noise - without)
      out["noise_rms_two_chunks"] = float(np.sqrt(np.mean(noise2 ** 2)))
      out["examples_two_chunks"] = n_chunks
      out["examples_one_chunk"] = float(mask.sum())
      out["two_chunks_vs_single"] = float(jnp.max(jnp.abs(with_noise - delta(SIGMA))))

    # A batch replicated over the mesh (in_specs=P()) instead of sharded: eight copies of one
    # sum, refused; the sharded batch's sum, replicated on the mesh, released eagerly as under
    # jit.
    from jax.sharding import PartitionSpec as P
    from dpmuon_jax.distributed.mesh import DATA_AXIS
    from dpmuon_jax.privacy.query import clipped_sum, gradient_query
    from dpmuon_jax.privacy.release import dp_release
    query, rows = gradient_query(loss_fn), jnp.asarray(chunk.mask)
    def over_mesh(spec):
      part = lambda b, m: clipped_sum(query, params, b, m, C).psum(DATA_AXIS)
      return jax.shard_map(part, mesh=mesh8, in_specs=(spec, spec), out_specs=P(),
                           check_vma=False)(batch, rows)
    sharded_sum, replicated_sum = over_mesh(P(DATA_AXIS)), over_mesh(P())
    out["sharded_sum"] = [float(sharded_sum.stats.num_examples), bool(sharded_sum.seal_holds())]
    out["replicated_sum"] = [float(replicated_sum.stats.num_examples),
                             bool(replicated_sum.seal_holds())]
    release = dp_release(C, SIGMA, D, key=3)
    state = release.init(params)
    eager, _ = release.update(sharded_sum, state, params)
    jitted, _ = jax.jit(release.update)(sharded_sum, state, params)
    out["eager_release_vs_jit"] = max(float(jnp.max(jnp.abs(eager[k] - jitted[k])))
                                      for k in params)
    try:
      release.update(replicated_sum, release.init(params), params)
      out["replicated_release"] = "released"
    except ValueError as e:
      out["replicated_release"] = str(e)

    # No example twice: indices gathered per device shard.
    seen, total = [], 0
    dup_free = True
    for t in range(5):
      for c in sampler.sample(t):
        idx, mask = shard_batch(mesh8, jnp.asarray(c.indices), c.mask)
        per_device = [np.asarray(s.data)[np.asarray(m.data)]
                      for s, m in zip(idx.addressable_shards, mask.addressable_shards)]
        out.setdefault("rows_per_device", [int(s.data.shape[0]) for s in idx.addressable_shards])
        flat = np.concatenate(per_device)
        dup_free &= len(flat) == len(set(flat.tolist()))
        dup_free &= sorted(flat.tolist()) == sorted(c.indices[c.mask].tolist())
        total += len(flat)
    out["dup_free"] = bool(dup_free)
    out["sampled_total"] = total
    print("RESULT" + json.dumps(out))
    """
)


@pytest.fixture(scope="module")
def results():
  script = _SCRIPT.format(
      denominator=DENOMINATOR, clip=CLIP, sigma=SIGMA, noise_dim=NOISE_DIM
  )
  env = host_devices_env(NUM_DEVICES)
  proc = subprocess.run(
      [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")][-1]
  return json.loads(line[len("RESULT"):])


def test_eight_simulated_devices(results):
  assert results["num_devices"] == NUM_DEVICES
  assert results["capacity"] % (NUM_DEVICES * 2) == 0
  assert results["rows_per_device"] == [results["capacity"] // NUM_DEVICES] * NUM_DEVICES


def test_sharded_release_equals_single_device(results):
  assert results["param_scale"] > 1e-2  # the steps moved the parameters
  assert results["max_diff_8_vs_single"] < 1e-5
  assert results["max_diff_1_vs_single"] < 1e-5
  assert results["examples_8"] == results["examples_single"] > 0
  assert results["norm_max_equal"]
  assert results["params_replicated"]


def test_noise_is_added_once_on_the_global_sum(results):
  rms = results["noise_rms"]
  expected = SIGMA * CLIP / DENOMINATOR
  lo, hi = std_interval(NOISE_DIM, expected)
  assert lo <= rms <= hi
  # Per-device noise, averaged (privacy bug) or summed (utility bug), must fail.
  for wrong in (expected / np.sqrt(NUM_DEVICES), expected * np.sqrt(NUM_DEVICES)):
    lo_w, hi_w = std_interval(NOISE_DIM, wrong)
    assert not lo_w <= rms <= hi_w
  assert abs(results["noise_mean"]) < 6 * expected / np.sqrt(NOISE_DIM)


def test_overflow_chunks_with_ghost_on_the_mesh_make_one_release(results):
  """Two disjoint chunks of one step, ghost-clipped on 8 devices: every example counted
  once, the noise drawn once (σC/D, two-sided), the one-chunk release's parameters."""
  assert results["examples_two_chunks"] == results["examples_one_chunk"] > 0
  rms, expected = results["noise_rms_two_chunks"], SIGMA * CLIP / DENOMINATOR
  lo, hi = std_interval(NOISE_DIM, expected)
  assert lo <= rms <= hi
  for wrong in (expected / np.sqrt(NUM_DEVICES), expected * np.sqrt(2)):  # per device / chunk
    lo_w, hi_w = std_interval(NOISE_DIM, wrong)
    assert not lo_w <= rms <= hi_w
  assert results["two_chunks_vs_single"] < 1e-5


def test_a_batch_replicated_over_the_mesh_is_refused_and_a_sharded_one_released_eagerly(
    results):
  """psum over devices that all hold the same rows adds 8 copies of one sum: its seal
  fails and the release refuses it; the sharded batch's sum (replicated on the mesh after
  its psum) is released eagerly, as under jit (the same key and sum: the same noise)."""
  examples = results["examples_one_chunk"]
  assert results["sharded_sum"] == [examples, True]
  assert results["replicated_sum"] == [NUM_DEVICES * examples, False]
  assert "copies of one sum" in results["replicated_release"]
  assert results["eager_release_vs_jit"] < 1e-6  # one noise draw; float rounding apart


def test_no_example_enters_a_step_twice(results):
  assert results["dup_free"]
  assert results["sampled_total"] > 0


_TRAINER_SCRIPT = textwrap.dedent(
    """
    import json
    import jax
    from dpmuon_jax.training.trainer import TrainConfig, train
    out = {}
    for devices in (1, 2):
      cfg = TrainConfig(model="mlp", devices=devices, max_steps=2, seed=1, batch_size=64,
                        epochs=1, output_dir=f"{out_dir}/d{devices}", progress=False, plot=False)
      out[devices] = train(cfg)
    print(json.dumps(out))
    """
)


def test_trainer_with_two_devices_matches_one_device(tmp_path):
  env = host_devices_env(2)
  proc = subprocess.run(
      [sys.executable, "-c", _TRAINER_SCRIPT.replace("{out_dir}", str(tmp_path))],
      capture_output=True, text=True, env=env, timeout=600,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  results = json.loads(proc.stdout.strip().splitlines()[-1])
  one, two = results["1"], results["2"]
  assert one["releases"] == two["releases"] == 2
  assert one["epsilon_spent"] == two["epsilon_spent"]
  # Same sample, same noise key: the same model up to summation order.
  np.testing.assert_allclose(one["final_test_loss"], two["final_test_loss"], rtol=1e-4)
