"""Shared conformance suite that every registered private optimizer runs.

The pattern of Optax's ``contrib/_common_test.py``: one list of optimizers,
every test parameterised over it. The list is the registry
(:mod:`dpmuon_jax.optimizers.registry`) alone: every name with its default
workload's preset options, and again on each workload whose options differ
(e.g. paper 2's ``"paper2"`` routing with an AdamW group). A newly registered
optimizer runs the suite without touching this file. The learning rate is
this problem's, not the preset's, and so is an SGD fallback group's.
"""

import dataclasses
import pickle

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dpmuon_jax.optimizers import registry

LEARNING_RATE = 0.05


def _cases() -> list[tuple[str, str]]:
  cases = []
  for name in registry.names():
    default = registry.preset(name).kwargs
    cases += [(name, workload) for workload in registry.WORKLOADS
              if workload in registry.OPTIMIZERS[name].presets
              and (workload == registry.DEFAULT_WORKLOAD
                   or registry.preset(name, workload).kwargs != default)]
  return cases


CASES = _cases()
IDS = [f"{name}-{workload}" for name, workload in CASES]

C, D, BATCH = 100.0, 32.0, 32


def _make(case, noise_multiplier, key):
  name, workload = case
  release = {"l2_clip_norm": C, "noise_multiplier": noise_multiplier, "denominator": D,
             "key": key}
  fallback = registry.preset(name, workload).kwargs.get("fallback")
  if fallback is not None and fallback.kind == "sgd":  # its 1-D rate is this problem's too
    return registry.build(name, LEARNING_RATE, release, workload,
                          fallback=dataclasses.replace(fallback, learning_rate=LEARNING_RATE))
  return registry.build(name, LEARNING_RATE, release, workload)


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


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_jit_once_dtypes_and_bitwise_checkpoint_restore(case):
  """Traces once; state keeps shapes/dtypes; params keep dtypes; a checkpoint
  (pickle of ``jax.device_get``) restored and continued equals the
  uninterrupted run bit-for-bit, without retracing the step."""
  opt = _make(case, 1.0, key=1234)
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


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_noise_off_halves_least_squares_loss_within_100_steps(case):
  with pytest.warns(UserWarning, match="no noise"):
    opt = _make(case, 0.0, key=0)
  params, batch = _problem()
  state, step = opt.init(params), _step_fn(opt)
  initial = float(_loss(params, batch))
  for _ in range(100):
    params, state = step(params, state, batch)
  assert float(_loss(params, batch)) < 0.5 * initial


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_one_noise_draw_of_std_sigma_c_over_the_whole_tree_per_update(case, monkeypatch):
  """Measured, not read from a label: each update of every registered optimizer draws
  Gaussian noise exactly once, with std σ·C, over a tree shaped like the parameters (the
  one release, before any post-processing)."""
  from dpmuon_jax.privacy import release

  draws = []
  real_draw = release.gaussian_noise_like

  def recorded(tree, key, std):
    draws.append(([jnp.shape(x) for x in jax.tree.leaves(tree)], float(std)))
    return real_draw(tree, key, std)

  monkeypatch.setattr(release, "gaussian_noise_like", recorded)
  sigma = 0.7
  opt = _make(case, sigma, key=5)
  params, batch = _problem()
  grads = jax.vmap(jax.grad(_loss), in_axes=(None, 0))(params, batch)
  opt.update(grads, opt.init(params), params, mask=jnp.ones(BATCH, bool))
  assert draws == [([jnp.shape(x) for x in jax.tree.leaves(params)], pytest.approx(sigma * C))]
