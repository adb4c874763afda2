"""make_private: one privacy target gives a sampler, release and ledger that agree."""

import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import dpmuon_jax as dm
from dpmuon_jax.privacy.accounting import PrivacyLedger, compute_epsilon
from dpmuon_jax.privacy.keys import stream_key
from dpmuon_jax.privacy.query import ClippedSum
from dpmuon_jax.privacy.release import PrivateTransformation
from dpmuon_jax.privacy.sampling import PoissonSampler
from dpmuon_jax.privacy.setup import make_private

EPS, DELTA, N, B, C = 2.0, 1e-6, 20_000, 200, 0.7


@pytest.fixture(scope="module")
def setup():
  return make_private(
      target_epsilon=EPS, target_delta=DELTA, dataset_size=N, expected_batch_size=B,
      l2_clip_norm=C, epochs=3, key=0,
  )


def test_q_sigma_d_t_agree_across_objects(setup):
  q = B / N
  spec = setup.release.release
  assert setup.sampler.sampling_rate == q and setup.sampler.dataset_size == N
  assert setup.steps == round(3 / q) == 300
  assert spec.noise_multiplier == setup.noise_multiplier
  assert spec.l2_clip_norm == C
  assert spec.denominator == setup.sampler.expected_batch_size == pytest.approx(B)
  config = setup.ledger.config
  assert (config.sampling_rate, config.noise_multiplier, config.denominator) == (
      q, setup.noise_multiplier, spec.denominator
  )
  assert (config.target_epsilon, config.target_delta, config.dataset_size) == (EPS, DELTA, N)
  assert setup.ledger.count == 0
  kwargs = setup.release_kwargs
  assert (kwargs["l2_clip_norm"], kwargs["noise_multiplier"], kwargs["denominator"]) == (
      C, setup.noise_multiplier, spec.denominator
  )


def test_calibrated_sigma_meets_the_target(setup):
  q = setup.sampler.sampling_rate
  eps = compute_epsilon(setup.noise_multiplier, q, setup.steps, DELTA)
  assert 0.99 * EPS <= eps <= EPS
  assert setup.ledger.can_release(setup.steps)
  assert setup.ledger.epsilon_after(setup.steps) == eps


def test_release_kwargs_build_the_same_private_optimizer(setup):
  opt = dm.dp_sgd(0.1, **setup.release_kwargs)
  assert opt.release == setup.release.release
  ledger = PrivacyLedger(setup.sampler, setup.release, DELTA)
  ledger.record(setup.sampler, opt)  # accepted: same q, sigma, C, D
  assert ledger.count == 1
  params = {"w": jnp.ones((3,))}
  # Same root key: the optimizer's noise equals the setup's release noise.
  grads = {"w": jnp.zeros((4, 3))}
  a, _ = setup.release.update(grads, setup.release.init(params), params)
  b, _ = dm.dp_release(**setup.release_kwargs).update(grads, setup.release.init(params), params)
  np.testing.assert_array_equal(a["w"], b["w"])


def test_private_optimizer_chains_post_processing(setup):
  opt = setup.private_optimizer(optax.scale_by_adam(), optax.scale(-0.1))
  assert isinstance(opt, PrivateTransformation)
  assert opt.release == setup.release.release
  params = {"w": jnp.zeros((2, 3))}
  grads = {"w": jnp.ones((5, 2, 3))}

  @jax.jit
  def step(params, state):
    updates, state = opt.update(grads, state, params, mask=jnp.array([1, 1, 0, 0, 0], bool))
    return optax.apply_updates(params, updates), state

  new_params, _ = step(params, opt.init(params))
  assert new_params["w"].shape == (2, 3) and bool(jnp.all(jnp.isfinite(new_params["w"])))


def test_clipped_sum_uses_the_setup_bound(setup):
  loss = lambda p, x: jnp.sum(p["w"] * x["x"])
  out = setup.clipped_sum(
      dm.gradient_query(loss), {"w": jnp.ones(3)}, {"x": 100 * jnp.ones((4, 3))},
      jnp.array([1, 1, 1, 0], bool),
  )
  assert isinstance(out, ClippedSum) and out.l2_sensitivity == C
  np.testing.assert_allclose(jnp.linalg.norm(out.total["w"]), 3 * C, rtol=1e-5)


def test_key_none_is_unseeded_and_shares_one_root():
  s = make_private(
      target_epsilon=EPS, target_delta=DELTA, dataset_size=N, expected_batch_size=B,
      l2_clip_norm=C, steps=50, noise_multiplier=1.0,
  )
  assert s.sampler.seeded is False and s.release.release.seeded is False
  assert s.ledger.seeded is False and s.release_kwargs["key"].seeded is False
  root = s.release_kwargs["key"]
  # Sampler and release use two different streams of the same root.
  np.testing.assert_array_equal(
      s.sampler.sample_indices(4), PoissonSampler(N, B / N, key=root).sample_indices(4)
  )
  noise_key = s.release.init({"w": jnp.zeros(2)}).noise_key
  np.testing.assert_array_equal(noise_key, stream_key(root, "noise")[0])
  assert not np.array_equal(noise_key, stream_key(root, "sampling")[0])
  # Two calls without a key draw different roots.
  other = make_private(
      target_epsilon=EPS, target_delta=DELTA, dataset_size=N, expected_batch_size=B,
      l2_clip_norm=C, steps=50, noise_multiplier=1.0,
  )
  assert not np.array_equal(other.release_kwargs["key"].key, root.key)


def test_given_steps_sigma_and_denominator_are_used():
  s = make_private(
      target_epsilon=EPS, target_delta=DELTA, dataset_size=N, expected_batch_size=B,
      l2_clip_norm=C, steps=123, noise_multiplier=1.3, denominator=256.0, capacity=40, key=1,
  )
  assert (s.steps, s.noise_multiplier) == (123, 1.3)
  assert s.release.release.denominator == 256.0 and s.sampler.capacity == 40
  assert s.ledger.config.target_epsilon == EPS and s.ledger.seeded is True
  assert s.ledger.epsilon_after(7) == compute_epsilon(1.3, B / N, 7, DELTA)


def test_large_delta_warns_once():
  with pytest.warns(UserWarning, match="1/N") as record:
    make_private(
        target_epsilon=EPS, target_delta=1e-2, dataset_size=1000, expected_batch_size=10,
        l2_clip_norm=C, steps=5, noise_multiplier=1.0, key=0,
    )
  assert sum("1/N" in str(w.message) for w in record) == 1


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(expected_batch_size=N + 1, epochs=1), "expected_batch_size"),
        (dict(expected_batch_size=0, epochs=1), "expected_batch_size"),
        (dict(expected_batch_size=B), "exactly one"),
        (dict(expected_batch_size=B, epochs=1, steps=10), "exactly one"),
        (dict(expected_batch_size=B, epochs=0), "epochs"),
        (dict(expected_batch_size=B, steps=0), "steps"),
        (dict(expected_batch_size=B, steps=1.5), "steps"),
        (dict(expected_batch_size=B, steps=10, dataset_size=0), "dataset_size"),
    ],
)
def test_invalid_requests_raise(kwargs, match):
  args = dict(target_epsilon=EPS, target_delta=DELTA, dataset_size=N, l2_clip_norm=C, key=0,
              noise_multiplier=1.0)
  args.update(kwargs)
  with pytest.raises(ValueError, match=match):
    make_private(**args)


def test_no_warnings_on_a_normal_setup():
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    s = make_private(
        target_epsilon=EPS, target_delta=DELTA, dataset_size=N, expected_batch_size=B,
        l2_clip_norm=C, steps=10, noise_multiplier=2.0, key=0,
    )
  assert math.isfinite(s.ledger.epsilon_after(10))
