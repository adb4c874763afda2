"""Shared conformance suite that every private optimizer of this library runs.

The pattern of Optax's ``contrib/_common_test.py``: one list of optimizers,
every test parameterised over it. A new optimizer joins by one line in
``OPTIMIZERS``: ``(module, name, keyword arguments)``; it is built as
``name(learning_rate, C, σ, D, key, **kwargs)`` and imported lazily, so a
module that does not exist yet is skipped, not an error.
"""

import importlib
import pickle

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

OPTIMIZERS = [
    ("dpmuon_jax.optimizers", "dp_sgd", dict(learning_rate=0.05, momentum=0.9)),
    ("dpmuon_jax.optimizers", "dp_adam", dict(learning_rate=0.05)),
    ("dpmuon_jax.optimizers_muon", "dp_muon", dict(learning_rate=0.05)),
    ("dpmuon_jax.optimizers_muon", "dp_muon_s", dict(learning_rate=0.1)),
    ("dpmuon_jax.optimizers_muon", "dp_muon",
     dict(learning_rate=0.05, routing="paper2", fallback_learning_rate=0.05, weight_decay=1e-3)),
    ("dpmuon_jax.optimizers_filters", "dp_disk_sgd", dict(learning_rate=0.05)),
    ("dpmuon_jax.optimizers_filters", "dp_doppler_sgd", dict(learning_rate=0.05)),
    ("dpmuon_jax.optimizers_filters", "dp_disk_muon", dict(learning_rate=0.05)),
    ("dpmuon_jax.optimizers_filters", "dp_doppler_muon", dict(learning_rate=0.05)),
    ("dpmuon_jax.optimizers_im", "dp_muon_im", dict(learning_rate=0.05, history=2, decay=0.5)),
    ("dpmuon_jax.optimizers_im", "dp_muon_bc", dict(learning_rate=0.05)),
    ("dpmuon_jax.optimizers_im", "dp_adam_bc", dict(learning_rate=0.05)),
]
IDS = ["dp_sgd", "dp_adam", "dp_muon", "dp_muon_s", "dp_muon-paper2",
       "dp_disk_sgd", "dp_doppler_sgd", "dp_disk_muon", "dp_doppler_muon",
       "dp_muon_im", "dp_muon_bc", "dp_adam_bc"]

C, D, BATCH = 100.0, 32.0, 32


def _make(entry, noise_multiplier, key):
  module, name, kwargs = entry
  try:
    factory = getattr(importlib.import_module(module), name)
  except (ImportError, AttributeError) as e:
    pytest.skip(f"{module}.{name} is not available: {e}")
  kwargs = dict(kwargs)
  lr = kwargs.pop("learning_rate")
  return factory(lr, C, noise_multiplier, D, key, **kwargs)


def _problem():
  """A fixed least-squares problem y = x₁W + x₂·K.reshape(12, 4) + b on a tree with
  a Dense kernel, a conv-shaped kernel and a bfloat16 bias."""
  rng = np.random.default_rng(0)
  params = {
      "dense": {"kernel": jnp.zeros((6, 4)), "bias": jnp.zeros(4, jnp.bfloat16)},
      "conv": {"kernel": jnp.zeros((2, 2, 3, 4))},
  }
  x1 = rng.standard_normal((BATCH, 6))
  x2 = rng.standard_normal((BATCH, 12))
  y = x1 @ rng.standard_normal((6, 4)) / 2 + x2 @ rng.standard_normal((12, 4)) / 4 + 0.5
  batch = {k: jnp.asarray(v, jnp.float32) for k, v in dict(x1=x1, x2=x2, y=y).items()}
  return params, batch


def _predict(params, x1, x2):
  kernel = params["conv"]["kernel"].reshape(12, 4)
  return x1 @ params["dense"]["kernel"] + x2 @ kernel + params["dense"]["bias"].astype(jnp.float32)


def _loss(params, batch):
  residual = _predict(params, batch["x1"], batch["x2"]) - batch["y"]
  return 0.5 * jnp.mean(jnp.sum(jnp.square(residual), axis=-1))


def _step_fn(opt):
  chex.clear_trace_counter()  # counters are per function body, shared across tests
  per_example_grads = jax.vmap(jax.grad(_loss), in_axes=(None, 0))

  @jax.jit
  @chex.assert_max_traces(n=1)
  def step(params, state, batch):
    grads = per_example_grads(params, batch)
    updates, state = opt.update(grads, state, params, mask=jnp.ones(BATCH, bool))
    return optax.apply_updates(params, updates), state

  return step


def _shapes_and_dtypes(tree):
  return jax.tree.map(lambda x: (jnp.shape(x), jnp.result_type(x)), tree)


@pytest.mark.parametrize("entry", OPTIMIZERS, ids=IDS)
def test_jit_once_dtypes_and_bitwise_checkpoint_restore(entry):
  """Traces once; state keeps shapes/dtypes; params keep dtypes; a checkpoint
  (pickle of ``jax.device_get``) restored and continued equals the
  uninterrupted run bit-for-bit, without retracing the step."""
  opt = _make(entry, 1.0, key=1234)
  params, batch = _problem()
  state = opt.init(params)
  initial_state, initial_params = _shapes_and_dtypes(state), _shapes_and_dtypes(params)
  step = _step_fn(opt)
  current = (params, state)
  for _ in range(2):
    current = step(*current, batch)
  blob = pickle.dumps(jax.device_get(current))
  for _ in range(2):
    current = step(*current, batch)
  assert _shapes_and_dtypes(current[1]) == initial_state
  assert _shapes_and_dtypes(current[0]) == initial_params
  assert all(np.all(np.isfinite(np.asarray(x, np.float32))) for x in jax.tree.leaves(current[0]))
  assert opt.release.noise_multiplier == 1.0 and opt.release.denominator == D

  restored = jax.tree.map(jnp.asarray, pickle.loads(blob))
  for _ in range(2):
    restored = step(*restored, batch)  # assert_max_traces(1): no retrace
  chex.assert_trees_all_equal(restored, current)


@pytest.mark.parametrize("entry", OPTIMIZERS, ids=IDS)
def test_noise_off_halves_least_squares_loss_within_100_steps(entry):
  with pytest.warns(UserWarning, match="no noise"):
    opt = _make(entry, 0.0, key=0)
  params, batch = _problem()
  state, step = opt.init(params), _step_fn(opt)
  initial = float(_loss(params, batch))
  for _ in range(100):
    params, state = step(params, state, batch)
  assert float(_loss(params, batch)) < 0.5 * initial
