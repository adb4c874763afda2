"""One noise key per clipped sum, ever: across optimizers of one setup, runs, and reused states.

Privacy invariant 6 (docs/design.md): whoever sees two releases made with the
same noise key on two different clipped sums learns their difference without
noise. These tests build each way a careless user could get there.
"""

import json
import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import dpmuon_jax as dm
from dpmuon_jax.privacy.keys import claim_noise_stream, named_seed, root_key, stream_key
from dpmuon_jax.privacy.release import GaussianReleaseState, noise_counter, with_noise_counter
from dpmuon_jax.training.checkpoint import latest_good_step, restore_metadata
from dpmuon_jax.training.compare import compare_optimizers
from dpmuon_jax.training.trainer import TrainConfig, train
from tests.run_files import public_files

PARAMS = {"w": jnp.zeros((3,))}


def _noise_key(opt, params=PARAMS):
  states = [s for s in jax.tree.leaves(opt.init(params),
                                       is_leaf=lambda x: isinstance(x, GaussianReleaseState))
            if isinstance(s, GaussianReleaseState)]
  assert len(states) == 1
  return np.asarray(states[0].noise_key)


def _setup(key=None):
  return dm.make_private(target_epsilon=2.0, target_delta=1e-5, dataset_size=1000,
                         expected_batch_size=50, l2_clip_norm=1.0, epochs=1, key=key)


@pytest.mark.parametrize("key", [None, 7])
def test_optimizers_built_from_one_setup_get_their_own_noise_streams(key):
  s = _setup(key)
  keys = [_noise_key(dm.dp_sgd(0.3, **s.release_kwargs)),
          _noise_key(dm.dp_adam(1e-3, **s.release_kwargs)),
          _noise_key(s.private_optimizer(optax.sgd(0.1))),
          _noise_key(s.private_optimizer(optax.sgd(0.1))),
          _noise_key(s.release)]
  assert len({k.tobytes() for k in keys}) == len(keys)
  # The sampler draws from the same root's sampling stream, which is none of them.
  sampling = np.asarray(stream_key(s.release_kwargs["key"], "sampling")[0], np.uint32)
  assert [int(w) for w in sampling] == s.sampler._entropy
  assert all(k.tobytes() != sampling.tobytes() for k in keys)


def test_copies_of_a_setups_release_kwargs_share_its_root_and_never_its_streams():
  """copy.deepcopy(setup.release_kwargs) must not duplicate the root's claim counter: the
  copy's optimizer would claim the stream the original's next optimizer claims."""
  import copy

  s = _setup()
  copies = [copy.deepcopy(s.release_kwargs), copy.copy(s.release_kwargs),
            copy.deepcopy(s.release_kwargs)]
  assert all(c["key"] is s.release_kwargs["key"] for c in copies)
  keys = [_noise_key(dm.dp_sgd(0.3, **s.release_kwargs))]
  keys += [_noise_key(dm.dp_sgd(0.3, **c)) for c in copies]
  assert len({k.tobytes() for k in keys}) == len(keys)


def test_a_seeded_setup_rebuilt_the_same_way_gets_the_same_streams():
  """Claims are counted in program order: a resumed or multi-process run rebuilds them."""
  first = [_noise_key(dm.dp_sgd(0.3, **_setup(7).release_kwargs)) for _ in range(2)]
  s = _setup(7)
  second = [_noise_key(dm.dp_sgd(0.3, **s.release_kwargs)) for _ in range(2)]
  assert first[0].tobytes() == first[1].tobytes() == second[0].tobytes()
  assert second[0].tobytes() != second[1].tobytes()


def test_an_int_seed_names_one_stream_and_the_first_claim_is_the_root_noise_stream():
  root = root_key(5)
  assert np.array_equal(claim_noise_stream(5)[0], stream_key(5, "noise")[0])
  assert np.array_equal(claim_noise_stream(root)[0], stream_key(5, "noise")[0])
  assert not np.array_equal(claim_noise_stream(root)[0], stream_key(5, "noise")[0])
  assert claim_noise_stream(None)[1] is False and claim_noise_stream(5)[1] is True


def test_no_claimed_stream_is_a_key_of_another_streams_releases():
  """Release k of stream S draws from fold_in(S, k) and its leaf keys (split = fold_in of the
  counter), so the i-th claim must not be fold_in(noise, i): that is release i's key of the
  first stream, and the first stream's leaf keys would be the i-th stream's release keys."""
  root = root_key(7)
  streams = [np.asarray(claim_noise_stream(root)[0]) for _ in range(4)]
  used = []
  for stream in streams:
    for k in range(8):
      step = jax.random.fold_in(stream, k)
      used += [step, *jax.random.split(step, 3)]
  used = {np.asarray(k).tobytes() for k in used}
  assert len(used) == 4 * 8 * 4  # every key of every release distinct
  assert not used & {s.tobytes() for s in streams}


@pytest.mark.parametrize("seed", [2**32 + 5, -5, 2**70])
def test_a_seed_jax_would_fold_onto_another_is_refused(seed):
  """Without x64, JAX keeps a seed's low 32 bits: 2**32 + 5 would be seed 5's noise stream."""
  assert jax.random.key_data(jax.random.key(5)).tolist() == [0, 5]
  with pytest.raises(ValueError, match=r"A seed must be an int in \[0, 2\*\*32\)"):
    root_key(seed)
  assert root_key(2**32 - 1).seeded


def test_named_seeds_differ_per_name_and_are_reproducible():
  assert named_seed(0, "dp_sgd") == named_seed(0, "dp_sgd")
  assert len({named_seed(0, "dp_sgd"), named_seed(0, "dp_adam"), named_seed(1, "dp_sgd")}) == 3
  assert all(0 <= named_seed(s, "x") < 2**31 for s in range(20))


def _per_example(value, n=4):
  return {"w": value * jnp.ones((n, 3))}


@pytest.mark.parametrize("jit", [False, True])
def test_a_state_used_twice_on_different_sums_releases_nan(jit):
  opt = dm.dp_release(1.0, 1.0, 4.0)
  update = jax.jit(opt.update) if jit else opt.update
  state = opt.init(PARAMS)
  first, _ = update(_per_example(1.0), state, PARAMS)
  replay, _ = update(_per_example(1.0), state, PARAMS)  # the same sum: a replay, allowed
  np.testing.assert_array_equal(first["w"], replay["w"])
  assert np.all(np.isfinite(first["w"]))
  with pytest.warns(RuntimeWarning, match="noise key index 0 was already used"):
    other, _ = update(_per_example(2.0), state, PARAMS)
    jax.block_until_ready(other)
  assert np.all(np.isnan(other["w"]))


def test_init_called_again_mid_training_cannot_reuse_a_key():
  opt = dm.dp_muon(0.02, 1.0, 1.0, 4.0)
  params = {"w": jnp.zeros((3, 2))}
  grads = lambda v: {"w": v * jnp.ones((4, 3, 2))}
  state = opt.init(params)
  update = jax.jit(opt.update)
  for v in (1.0, 2.0):
    out, state = update(grads(v), state, params)
    assert np.all(np.isfinite(out["w"]))
  with pytest.warns(RuntimeWarning, match="already used"):
    out, _ = update(grads(3.0), opt.init(params), params)
    jax.block_until_ready(out)
  assert np.all(np.isnan(out["w"]))


def test_threaded_states_never_warn():
  opt = dm.dp_sgd(0.1, 1.0, 1.0, 4.0, key=0)
  state = opt.init(PARAMS)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    for v in range(5):
      out, state = jax.jit(opt.update)(_per_example(float(v)), state, PARAMS)
      assert np.all(np.isfinite(out["w"]))


def _root_of(run_dir):
  ckpt = os.path.join(run_dir, "checkpoints")
  return tuple(restore_metadata(ckpt, latest_good_step(ckpt))["root_key"])


@pytest.mark.parametrize("seed", [None, 0])
def test_compare_gives_every_run_its_own_root_and_keeps_the_seed_out_of_results(
    tmp_path, tiny_data, seed
):
  config = TrainConfig(model="mlp", dataset="tiny", epsilon=3.0, delta=1e-3, batch_size=16,
                       epochs=1, max_steps=2, seed=seed, output_dir=str(tmp_path / "cmp"),
                       progress=False, plot=False)
  compare_optimizers(config, ["dp_sgd", "dp_adam"], tiny_data)
  roots = {name: _root_of(str(tmp_path / "cmp" / name)) for name in ("dp_sgd", "dp_adam")}
  assert roots["dp_sgd"] != roots["dp_adam"]
  for name in roots:
    with open(tmp_path / "cmp" / name / "results.json") as f:
      results = json.load(f)
    assert results["seeded"] is (seed is not None)
    assert results["config"]["seed"] is None  # the root key of a seeded run is secret
  if seed is not None:  # reproducible: the same derived seed rebuilds the same root
    assert roots["dp_sgd"] == tuple(np.asarray(root_key(named_seed(0, "dp_sgd")).key).tolist())


def test_a_seeded_run_writes_no_seed_into_its_public_outputs(tmp_path, tiny_data):
  """A seeded run's root key is (0, seed): the seed stays in the secret files."""
  out = tmp_path / "seeded"
  train(TrainConfig(model="mlp", dataset="tiny", epsilon=3.0, delta=1e-3, batch_size=16,
                    epochs=1, max_steps=1, seed=908172635, output_dir=str(out), progress=False,
                    plot=True), tiny_data)
  public = public_files(out)
  assert {"results.json", "history.csv", "curves.png"} <= {p.name for p in public}
  for path in public:
    assert b"908172635" not in path.read_bytes(), path


def test_dpmuon_compare_defaults_to_os_entropy():
  from dpmuon_jax.cli import _parser

  assert _parser().parse_args(["compare"]).seed is None


def test_the_noise_counter_only_moves_forward_and_keeps_its_placement():
  """A resumption sets the next key index; it may skip keys, never reuse one."""
  opt = dm.dp_sgd(0.1, l2_clip_norm=1.0, noise_multiplier=1.0, denominator=4.0, key=0)
  state = jax.device_put(opt.init({"w": jnp.zeros(3)}), jax.devices()[0])  # as restored
  moved = with_noise_counter(state, 5)
  assert noise_counter(moved) == 5
  assert all(leaf.committed for leaf in jax.tree.leaves(moved))
  with pytest.raises(ValueError, match="only moves forward"):
    with_noise_counter(moved, 4)
