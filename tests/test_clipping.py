"""Privacy invariant 1 (sensitivity): every clipped contribution has L2 norm ≤ C.

The privacy invariants are numbered in docs/design.md.
"""

import json
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dpmuon_jax as dm
from dpmuon_jax.privacy.clipping import (
    CLIPPING_STYLES,
    automatic_clipping,
    clipping_by_name,
    flat_clipping,
    flat_norm,
    per_layer_clipping,
)

C = 1.5
ROUNDING = 1 + 1e-6  # float32 rounding of g · C/‖g‖


def _random_tree(rng, scale):
  return {
      "conv": {"kernel": jnp.asarray(rng.normal(size=(3, 3, 2, 4)) * scale, jnp.float32)},
      "dense": {
          "kernel": jnp.asarray(rng.normal(size=(8, 5)) * scale, jnp.float32),
          "bias": jnp.asarray(rng.normal(size=(5,)) * scale, jnp.float32),
      },
  }


def _per_example_batch(seed=0):
  rng = np.random.default_rng(seed)
  scales = [1e12, 1e3, 1.0, 1e-3, 1e-30, 0.0]
  trees = [_random_tree(rng, s) for s in scales]
  nan_tree = _random_tree(rng, 1.0)
  nan_tree["dense"]["bias"] = nan_tree["dense"]["bias"].at[2].set(jnp.nan)
  inf_tree = _random_tree(rng, 1.0)
  inf_tree["conv"]["kernel"] = inf_tree["conv"]["kernel"].at[0, 0, 0, 0].set(jnp.inf)
  trees += [nan_tree, inf_tree]
  return jax.tree.map(lambda *xs: jnp.stack(xs), *trees), len(scales)


@pytest.mark.parametrize(
    "clipping",
    [
        dm.flat_clipping(C),
        dm.per_layer_clipping(C),
        dm.per_layer_clipping(
            C, layer_weights={"conv": {"kernel": 3.0}, "dense": {"kernel": 1.0, "bias": 0.5}}
        ),
        dm.automatic_clipping(C),
        dm.automatic_clipping(C, per_layer=True),
    ],
    ids=lambda c: c.name + ("_weighted" if c.layer_weights is not None else ""),
)
def test_every_clipped_contribution_is_bounded(clipping):
  batch, num_finite = _per_example_batch()
  clipped = jax.vmap(clipping.clip)(batch)
  norms = jax.vmap(flat_norm)(clipped.clipped)
  assert np.all(np.asarray(norms) <= C * ROUNDING), norms
  # Non-finite examples contribute exactly zero and are flagged.
  np.testing.assert_array_equal(np.asarray(clipped.is_finite), [True] * num_finite + [False] * 2)
  assert np.all(np.asarray(norms[num_finite:]) == 0.0)
  for leaf in jax.tree.leaves(clipped.clipped):
    assert np.all(np.isfinite(np.asarray(leaf)))


def test_clip_and_sum_counts_and_never_propagates_nan():
  batch, num_finite = _per_example_batch()
  out = dm.clip_and_sum(batch, None, dm.flat_clipping(C))
  for leaf in jax.tree.leaves(out.total):
    assert np.all(np.isfinite(np.asarray(leaf)))
  assert float(out.stats.num_nonfinite) == 2
  assert float(out.stats.num_examples) == num_finite + 2
  # 1e12, 1e3 and 1.0-scale trees exceed C; the tiny and zero ones do not.
  assert float(out.stats.num_clipped) == 3
  assert flat_norm(out.total) <= (num_finite + 2) * C * ROUNDING


def test_flat_clipping_uses_the_norm_over_all_leaves():
  # Two leaves of norm 1 each: the flat norm is √2 > C = 1.2, so both are scaled
  # by 1.2/√2; per-leaf clipping at C would leave each leaf untouched.
  g = {"a": jnp.array([1.0, 0.0]), "b": jnp.array([0.0, 1.0])}
  out = dm.flat_clipping(1.2).clip(g)
  expected = 1.2 / math.sqrt(2)
  np.testing.assert_allclose(out.clipped["a"], [expected, 0.0], rtol=1e-5)
  np.testing.assert_allclose(out.clipped["b"], [0.0, expected], rtol=1e-5)
  np.testing.assert_allclose(flat_norm(out.clipped), 1.2, rtol=1e-5)


def test_per_layer_thresholds_square_sum_to_c():
  tree = {"a": jnp.ones(3), "b": jnp.ones(4), "c": jnp.ones(5)}
  for clipping in (
      dm.per_layer_clipping(C),
      dm.per_layer_clipping(C, layer_weights={"a": 1.0, "b": 2.0, "c": 3.0}),
  ):
    thresholds = jax.tree.leaves(clipping.layer_thresholds(tree))
    np.testing.assert_allclose(sum(t**2 for t in thresholds), C**2, rtol=1e-6)


def test_per_layer_clipping_clips_each_leaf_to_its_threshold():
  g = {"a": jnp.array([10.0, 0.0]), "b": jnp.array([0.0, 0.1])}
  out = dm.per_layer_clipping(1.0).clip(g)
  c_l = 1.0 / math.sqrt(2)
  np.testing.assert_allclose(jnp.linalg.norm(out.clipped["a"]), c_l, rtol=1e-5)
  np.testing.assert_allclose(out.clipped["b"], g["b"], rtol=1e-5)


def test_automatic_clipping_formula():
  g = {"a": jnp.array([3.0, 4.0])}
  out = dm.automatic_clipping(2.0, gamma=0.01).clip(g)
  np.testing.assert_allclose(out.clipped["a"], g["a"] * 2.0 / (5.0 + 0.01), rtol=1e-6)


def test_norm_is_float32_on_the_vector_summed():
  # bfloat16 queries are upcast before the norm and the sum.
  g = {"w": jnp.full((64, 64), 3.0, jnp.bfloat16)}
  out = dm.flat_clipping(1.0).clip(g)
  chex.assert_trees_all_equal_dtypes(out.clipped, {"w": jnp.zeros((), jnp.float32)})
  assert float(flat_norm(out.clipped)) <= 1.0 * ROUNDING


@pytest.mark.parametrize("bad", [0.0, -1.0, float("inf"), float("nan")])
def test_bad_clip_norm_is_rejected(bad):
  with pytest.raises(ValueError, match="l2_clip_norm"):
    dm.flat_clipping(bad)


@pytest.mark.parametrize("style", CLIPPING_STYLES)
def test_clipping_by_name_bounds_every_example_by_c(style):
  """Every named style keeps one example's total contribution within C."""
  rule = clipping_by_name(style, 1.5)
  assert rule.l2_clip_norm == 1.5
  rng = np.random.default_rng(0)
  grads = {"a": jnp.asarray(rng.normal(size=(6, 4, 3)) * 10, jnp.float32),
           "b": jnp.asarray(rng.normal(size=(6, 5)), jnp.float32)}
  clipped = jax.vmap(lambda g: rule.clip(g).clipped)(grads)
  norms = np.sqrt(sum(np.sum(np.asarray(v).reshape(6, -1) ** 2, axis=1) for v in clipped.values()))
  assert np.all(norms <= 1.5 * (1 + 1e-5))
  assert rule.per_layer == style.endswith("per_layer")
  assert rule.automatic == style.startswith("automatic")


def test_clipping_by_name_refuses_unknown_style():
  with pytest.raises(ValueError, match="clipping must be one of"):
    clipping_by_name("per_example", 1.0)


def test_numpy_scalars_become_python_floats_and_a_mismatch_is_refused_when_built():
  clipping = automatic_clipping(np.float32(0.5), gamma=np.float64(0.01))
  assert type(clipping.l2_clip_norm) is float and type(clipping.gamma) is float
  json.dumps(clipping.describe())  # recorded in results and exports
  with pytest.raises(ValueError, match="differs from l2_clip_norm"):
    dm.dp_sgd(0.1, np.float32(0.1), 1.0, 8.0, key=0, clipping=flat_clipping(0.1))


@pytest.mark.parametrize("weights", [{"w": 1.0, "x": 2.0}, [1.0, 2.0], {"w": 1.0}],
                         ids=["other keys", "list", "subset"])
def test_per_layer_weights_of_another_structure_are_refused_in_one_line(weights):
  per_example = {"w": jnp.ones((3, 4, 2)), "b": jnp.ones((3, 2))}
  with pytest.raises(ValueError, match="the query's tree structure") as info:
    dm.clip_and_sum(per_example, None, per_layer_clipping(1.0, weights))
  assert "\n" not in str(info.value)
