"""Privacy invariants 2 and 3: noise σC on the sum, fresh per release; public denominator D.

The privacy invariants are numbered in docs/design.md.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from scipy.stats import norm
from stats import std_interval

import dpmuon_jax as dm
from dpmuon_jax.privacy.accounting import RDP_ORDERS, release_rdp
from dpmuon_jax.privacy.keys import split_streams
from dpmuon_jax.privacy.release import gaussian_noise_like

SIGMA, C, D = 1.3, 0.7, 16.0


def _zeros_per_example(batch_size, shapes=((200, 150), (300,))):
  return {f"w{i}": jnp.zeros((batch_size,) + s) for i, s in enumerate(shapes)}


def _release_noise(release, per_example, mask=None, steps=1):
  params = jax.tree.map(lambda x: x[0], per_example)
  state = release.init(params)
  update = jax.jit(release.update)
  outs = []
  for _ in range(steps):
    out, state = update(per_example, state, params, mask=mask)
    outs.append(out)
  return outs, state


def _flat(tree):
  return np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(tree)])


@pytest.mark.parametrize("num_real", [8, 3, 0])
def test_noise_std_is_sigma_c_over_d_two_sided(num_real):
  # Zero gradients, so the release is pure noise; padded rows must not change it.
  mask = jnp.arange(8) < num_real
  (out,), _ = _release_noise(dm.dp_release(C, SIGMA, D, key=11), _zeros_per_example(8), mask)
  z = _flat(out)
  rms = np.sqrt(np.mean(z**2))
  lo, hi = std_interval(z.size, SIGMA * C / D)
  assert lo <= rms <= hi, (rms, lo, hi)
  # The two classic bugs are far outside the interval.
  wrong = [SIGMA * C / (D * np.sqrt(8)), np.sqrt(8) * SIGMA * C / D]
  if num_real:
    wrong.append(SIGMA * C / num_real)  # dividing by the realised batch size
  for std in wrong:
    assert not lo <= std <= hi, std


def test_denominator_does_not_depend_on_the_mask():
  v = {"w": jnp.full((6, 4), 0.1)}  # each row has norm 0.2 < C: unclipped
  # Two releases of one seed: the same noise stream, by request (one release object
  # would refuse its key on a second, different sum).
  first, second = dm.dp_release(C, SIGMA, D, key=3), dm.dp_release(C, SIGMA, D, key=3)
  params = {"w": jnp.zeros(4)}
  out_all, _ = first.update(v, first.init(params), params, mask=jnp.ones(6, bool))
  out_two, _ = second.update(v, second.init(params), params, mask=jnp.arange(6) < 2)
  # Same key and step, so the noise cancels: the difference is (6 − 2)·v / D.
  np.testing.assert_allclose(out_all["w"] - out_two["w"], 4 * 0.1 / D, rtol=1e-4)


def test_fresh_noise_each_step_and_reproducible_from_the_root_key():
  per_example = _zeros_per_example(2, shapes=((64,),))
  outs_a, state = _release_noise(dm.dp_release(C, SIGMA, D, key=5), per_example, steps=3)
  outs_b, _ = _release_noise(dm.dp_release(C, SIGMA, D, key=5), per_example, steps=3)
  for a, b in zip(outs_a, outs_b):
    chex.assert_trees_all_equal(a, b)
  assert int(state.count) == 3
  flat = [_flat(o) for o in outs_a]
  for i in range(3):
    for j in range(i + 1, 3):
      assert abs(np.corrcoef(flat[i], flat[j])[0, 1]) < 0.5  # 64 samples: |r| ~ 0.125
      assert not np.allclose(flat[i], flat[j])


def test_os_entropy_by_default_and_recorded_as_unseeded():
  per_example = _zeros_per_example(2, shapes=((64,),))
  r1, r2 = dm.dp_release(C, SIGMA, D), dm.dp_release(C, SIGMA, D)
  assert not r1.release.seeded and dm.dp_release(C, SIGMA, D, key=1).release.seeded
  (a,), _ = _release_noise(r1, per_example)
  (b,), _ = _release_noise(r2, per_example)
  assert not np.allclose(_flat(a), _flat(b))


def test_leaves_get_independent_noise():
  per_example = {"a": jnp.zeros((1, 20000)), "b": jnp.zeros((1, 20000))}
  (out,), _ = _release_noise(dm.dp_release(C, SIGMA, D, key=2), per_example)
  r = np.corrcoef(np.asarray(out["a"]), np.asarray(out["b"]))[0, 1]
  assert abs(r) < 5 / np.sqrt(20000)


@pytest.mark.parametrize("key", [jax.random.key(5), jax.random.PRNGKey(5)])
def test_leaves_of_one_shape_get_their_own_keys_draws(key):
  """Leaf l's noise is std · normal(k_l, shape_l), (k_1, …, k_L) = split(key, L), however
  the leaves of one shape are batched: the same bits; XLA may round the Gaussian
  transform of one program differently from another's in the last place (rtol 2⁻²¹)."""
  tree = {"a": jnp.zeros((4, 3)), "b": jnp.zeros(3), "c": jnp.zeros((4, 3)), "d": jnp.zeros(3),
          "e": jnp.zeros((2, 2, 2)), "f": jnp.zeros((4, 3))}
  noise = jax.jit(lambda k: gaussian_noise_like(tree, k, 0.7))(key)
  keys = jax.random.split(key, 6)
  for k, (got, leaf) in zip(keys, zip(jax.tree.leaves(noise), jax.tree.leaves(tree)),
                            strict=True):
    want = 0.7 * jax.random.normal(k, leaf.shape, jnp.float32)
    np.testing.assert_allclose(got, want, rtol=2**-21, atol=1e-7)
  assert not np.allclose(noise["a"], noise["c"]) and not np.allclose(noise["b"], noise["d"])


def test_sampling_and_noise_streams_are_independent():
  streams, seeded = split_streams(7)
  assert seeded
  keys = [np.asarray(k) for k in streams]
  assert len({k.tobytes() for k in keys}) == len(keys)
  per_example = {"w": jnp.zeros((1, 20000))}
  (out,), _ = _release_noise(dm.dp_release(C, SIGMA, D, key=7), per_example)
  sampling_draws = jax.random.normal(jax.random.fold_in(streams.sampling, 0), (20000,))
  r = np.corrcoef(np.asarray(out["w"]), np.asarray(sampling_draws))[0, 1]
  assert abs(r) < 5 / np.sqrt(20000)


def test_clipped_sum_path_equals_per_example_path():
  rng = np.random.default_rng(0)
  g = {"w": jnp.asarray(rng.normal(size=(5, 3, 2)) * 3, jnp.float32)}
  mask = jnp.array([1, 1, 0, 1, 0], bool)
  params = {"w": jnp.zeros((3, 2))}
  release = dm.dp_release(C, SIGMA, D, key=9)
  state = release.init(params)
  direct, _ = release.update(g, state, params, mask=mask)
  clipped = dm.clip_and_sum(g, mask, C)
  via_sum, _ = release.update(clipped, state, params)
  chex.assert_trees_all_close(direct, via_sum, rtol=1e-6)


def test_release_refuses_a_sum_of_another_sensitivity():
  g = {"w": jnp.ones((2, 3))}
  release = dm.dp_release(C, SIGMA, D, key=9)
  state = release.init({"w": jnp.zeros(3)})
  with pytest.raises(ValueError, match="sensitivity"):
    release.update(dm.clip_and_sum(g, None, 2 * C), state, {"w": jnp.zeros(3)})


def test_release_spec_and_validation():
  release = dm.dp_release(C, SIGMA, D, key=1)
  assert release.release.noise_std == pytest.approx(SIGMA * C / D)
  with pytest.warns(UserWarning, match="NO differential privacy"):
    dm.dp_release(C, 0.0, D, key=1)
  for kwargs in ({"noise_multiplier": -1.0}, {"denominator": 0.0}, {"l2_clip_norm": 0.0}):
    args = {"l2_clip_norm": C, "noise_multiplier": SIGMA, "denominator": D, **kwargs}
    with pytest.raises(ValueError):
      dm.dp_release(**args)


def test_replace_one_adjacency_halves_the_accounted_sigma():
  release = dm.dp_release(C, SIGMA, D, key=1, neighbouring="replace_one")
  assert release.release.accounting_noise_multiplier == pytest.approx(SIGMA / 2)


def _renyi(log_p, log_q, dx, order):
  """D_α(P ‖ Q) = log ∫ p^α q^(1−α) / (α − 1), on a uniform grid."""
  return (np.logaddexp.reduce(order * log_p + (1 - order) * log_q) + np.log(dx)) / (order - 1)


@pytest.mark.parametrize("sigma", [0.6, 1.0, 2.0])
@pytest.mark.parametrize("q", [0.01, 0.1, 0.5])
def test_replace_one_accounting_bounds_the_replace_one_divergence(sigma, q):
  """The ledger accounts a replace-one release as add/remove at σ/2. One release on
  neighbours that swap a query +C for −C (C = 1; the sampled slot's two values as far
  apart as clipping allows) or for 0 is a pair of Gaussian mixtures; its Rényi
  divergence, integrated numerically both ways, must stay below the accounted curve."""
  release = dm.dp_release(1.0, sigma, D, key=1, neighbouring="replace_one")
  accounted = release_rdp(release.release.accounting_noise_multiplier, q)
  x, dx = np.linspace(-40 * sigma, 40 * sigma, 200_001, retstep=True)
  log_mix = lambda mu: np.logaddexp(np.log1p(-q) + norm.logpdf(x, 0, sigma),
                                    np.log(q) + norm.logpdf(x, mu, sigma))
  for order in (2.0, 8.0, 32.0):
    bound = accounted[list(RDP_ORDERS).index(order)]
    for other in (-1.0, 0.0):
      p, r = log_mix(1.0), log_mix(other)
      assert max(_renyi(p, r, dx, order), _renyi(r, p, dx, order)) <= bound


@pytest.mark.parametrize("make", [dm.dp_sgd, dm.dp_adam, dm.dp_adamw])
def test_private_optimizers_chain_and_apply_under_jit(make):
  params = {"w": jnp.ones((3, 2)), "b": jnp.zeros(2)}
  per_example = jax.tree.map(lambda p: jnp.ones((4,) + p.shape), params)
  opt = make(0.1, C, SIGMA, D, key=4)
  assert opt.release.noise_multiplier == SIGMA
  chained = dm.privatize(dm.dp_release(C, SIGMA, D, key=4), optax.scale(-1.0))
  for tx in (opt, chained):
    state = tx.init(params)
    new_params, state = _jitted_step(tx)(params, state, per_example, jnp.ones(4, bool))
    chex.assert_trees_all_equal_shapes_and_dtypes(new_params, params)
    assert not np.allclose(new_params["w"], params["w"])


def _jitted_step(tx):
  @jax.jit
  def step(params, state, per_example, mask):
    updates, state = tx.update(per_example, state, params, mask=mask)
    return optax.apply_updates(params, updates), state

  return step


@pytest.mark.parametrize("make", [dm.dp_sgd, dm.dp_adam, dm.dp_adamw, dm.dp_muon])
def test_every_private_optimizer_records_its_adjacency(make):
  assert make(0.1, C, SIGMA, D, key=1).release.neighbouring == "add_remove"
  replace = make(0.1, C, SIGMA, D, key=1, neighbouring="replace_one").release
  assert replace.accounting_noise_multiplier == pytest.approx(SIGMA / 2)
