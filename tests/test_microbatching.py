"""Microbatched clipped sums equal the unchunked ones; the step compiles once;
``patch_conv`` is ``lax.conv_general_dilated``."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from dpmuon_jax.models.cnn import SmallCNN, patch_conv, small_cnn
from dpmuon_jax.models.common import classification_loss
from dpmuon_jax.privacy.clipping import per_layer_clipping
from dpmuon_jax.privacy.query import clipped_sum, gradient_query, pad_to_multiple
from dpmuon_jax.privacy.release import dp_release

B = 16
CLIP = 0.5


def _cnn_setup(image_shape=(8, 8), channels=3):
  model = small_cnn(4, channels, key=jax.random.key(0), image_shape=image_shape)
  k1, k2 = jax.random.split(jax.random.key(1))
  batch = {
      "image": jax.random.normal(k1, (B, *image_shape, channels)),
      "label": jax.random.randint(k2, (B,), 0, 4),
  }
  return model.params, gradient_query(classification_loss(model.apply)), batch


def _toy_setup():
  """Linear regression with a 2-leaf pytree; some rows get huge gradients (clipped)."""
  params = {"w": jnp.arange(6.0).reshape(3, 2) / 6, "b": jnp.ones((2,))}

  def loss_fn(p, batch):
    pred = batch["x"] @ p["w"] + p["b"]
    return jnp.mean(jnp.sum((pred - batch["y"]) ** 2, axis=-1))

  k1, k2 = jax.random.split(jax.random.key(2))
  x = jax.random.normal(k1, (B, 3)) * jnp.where(jnp.arange(B) % 3 == 0, 100.0, 0.1)[:, None]
  return params, gradient_query(loss_fn), {"x": x, "y": jax.random.normal(k2, (B, 2))}


# Drops rows 1, 5, 6, 14: every chunking below has chunks with and without padding.
MASK = jnp.array([i not in (1, 5, 6, 14) for i in range(B)])


def _assert_sums_close(a, b):
  chex.assert_trees_all_close(a.total, b.total, rtol=1e-5, atol=1e-6)
  chex.assert_trees_all_close(a.stats.num_examples, b.stats.num_examples)
  chex.assert_trees_all_close(a.stats.num_clipped, b.stats.num_clipped)
  chex.assert_trees_all_close(a.stats.norm_sum, b.stats.norm_sum, rtol=1e-5)
  chex.assert_trees_all_close(a.stats.norm_max, b.stats.norm_max, rtol=1e-6)


@pytest.mark.parametrize(
    ("setup", "microbatches"),
    [(_cnn_setup, (2, 8, 3)), (_toy_setup, (1, 4, 8, B, 3, 5, 6, 7))],  # 3, 5-7: padded
    ids=["cnn", "toy"],
)
def test_chunked_equals_unchunked(setup, microbatches):
  params, query, batch = setup()
  fn = jax.jit(clipped_sum, static_argnums=(0, 4, 5))
  full = fn(query, params, batch, MASK, CLIP, None)
  assert float(full.stats.num_examples) == 12.0
  assert float(full.stats.num_clipped) > 0  # the clipping is active
  for microbatch in microbatches:
    _assert_sums_close(fn(query, params, batch, MASK, CLIP, microbatch), full)
  # A dropped row really is excluded: changing it changes nothing.
  poisoned = jax.tree.map(
      lambda x: x.at[5].multiply(-7) if x.dtype == jnp.float32 else x.at[5].set(3 - x[5]), batch
  )
  _assert_sums_close(fn(query, params, poisoned, MASK, CLIP, 4), full)
  _assert_sums_close(fn(query, params, poisoned, MASK, CLIP, 5), full)


def test_chunked_equals_unchunked_per_layer_clipping():
  params, query, batch = _toy_setup()
  clipping = per_layer_clipping(CLIP)
  full = clipped_sum(query, params, batch, MASK, clipping)
  _assert_sums_close(clipped_sum(query, params, batch, MASK, clipping, 4), full)


def test_chunked_equals_unmasked_reference():
  """Against an explicit per-example loop (no vmap, no chunking)."""
  params, query, batch = _toy_setup()
  expected = jax.tree.map(jnp.zeros_like, params)
  for i in range(B):
    if MASK[i]:
      g = query(params, jax.tree.map(lambda x, i=i: x[i], batch))
      norm = jnp.sqrt(sum(jnp.sum(v**2) for v in jax.tree.leaves(g)))
      scale = jnp.minimum(1.0, CLIP / (norm + 1e-6))
      expected = jax.tree.map(lambda e, v, s=scale: e + s * v, expected, g)
  got = clipped_sum(query, params, batch, MASK, CLIP, microbatch_size=8)
  chex.assert_trees_all_close(got.total, expected, rtol=1e-5, atol=1e-6)


def test_microbatch_padding_rows_are_zero_dummies_never_copies_of_a_real_row():
  """Like the sampler's padding: a masked-out row of zeros, whatever the last row holds."""
  _, _, batch = _toy_setup()
  batch = {**batch, "label": jnp.arange(1, B + 1)}
  padded, mask = pad_to_multiple(batch, MASK, 5)
  assert mask.shape == (20,) and not mask[B:].any()
  np.testing.assert_array_equal(mask[:B], MASK)
  for name, x in padded.items():
    assert x.shape == (20,) + batch[name].shape[1:] and x.dtype == batch[name].dtype
    np.testing.assert_array_equal(x[:B], batch[name])
    assert not np.any(x[B:])
  same, same_mask = pad_to_multiple(batch, MASK, 8)  # already a multiple: unchanged
  assert same is batch and same_mask is MASK


@pytest.mark.parametrize("microbatch", [0, -4, True])
def test_bad_microbatch_size_raises(microbatch):
  params, query, batch = _toy_setup()
  with pytest.raises(ValueError, match="microbatch_size"):
    clipped_sum(query, params, batch, MASK, CLIP, microbatch_size=microbatch)


@pytest.mark.parametrize("mask", [jnp.where(MASK, 1.0, 0.0), jnp.full(B, 0.5), jnp.arange(B) % 3],
                         ids=["0/1", "half", "labels"])
def test_a_mask_that_is_not_boolean_is_refused(mask):
  """Floats read like per-example weights, which a clipped sum does not apply; integers like
  labels passed where the mask goes, whose 0 class would silently drop out."""
  params, query, batch = _toy_setup()
  with pytest.raises(ValueError, match="mask must be boolean"):
    clipped_sum(query, params, batch, mask, CLIP)


def test_private_step_traces_once_across_sampled_counts():
  params, query, batch = _cnn_setup()
  opt = optax.chain(dp_release(CLIP, 1.0, denominator=8.0, key=3), optax.sgd(0.1))

  @jax.jit
  @chex.assert_max_traces(n=1)
  def step(params, state, batch, mask):
    total = clipped_sum(query, params, batch, mask, CLIP, microbatch_size=4)
    updates, state = opt.update(total, state, params)
    return optax.apply_updates(params, updates), state, total.stats.num_examples

  state = opt.init(params)
  for count in (0, 3, 11, B):
    mask = jnp.arange(B) < count
    params, state, n = step(params, state, batch, mask)
    assert float(n) == count
  chex.assert_tree_all_finite(params)


@pytest.mark.parametrize(
    ("shape", "kernel", "strides", "padding"),
    [
        ((2, 9, 9, 5), (3, 3, 5, 7), (1, 1), "SAME"),
        ((2, 9, 8, 5), (3, 2, 5, 7), (2, 2), "VALID"),
        ((2, 9, 8, 5), (3, 3, 5, 7), (2, 1), ((1, 2), (0, 1))),
        ((2, 10, 4), (3, 4, 6), (1,), "SAME"),
    ],
)
def test_patch_conv_matches_lax(shape, kernel, strides, padding):
  x = jax.random.normal(jax.random.key(0), shape)
  k = jax.random.normal(jax.random.key(1), kernel)
  spec = ("NWC", "WIO", "NWC") if len(shape) == 3 else ("NHWC", "HWIO", "NHWC")
  dn = jax.lax.conv_dimension_numbers(x.shape, k.shape, spec)

  def loss(conv, x, k):
    return jnp.sum(jnp.sin(conv(x, k, strides, padding, dimension_numbers=dn)))

  ref = jax.value_and_grad(loss, argnums=(1, 2))(jax.lax.conv_general_dilated, x, k)
  got = jax.value_and_grad(loss, argnums=(1, 2))(patch_conv, x, k)
  chex.assert_trees_all_close(got, ref, rtol=1e-4, atol=1e-4)


def test_patch_conv_rejects_unsupported():
  x, k = jnp.ones((1, 6, 6, 2)), jnp.ones((3, 3, 2, 4))
  with pytest.raises(ValueError, match="dilation"):
    patch_conv(x, k, (1, 1), "SAME", rhs_dilation=(2, 2))
  with pytest.raises(ValueError, match="feature_group_count"):
    patch_conv(x, jnp.ones((3, 3, 1, 4)), (1, 1), "SAME", feature_group_count=2)
  nchw = jax.lax.conv_dimension_numbers(x.shape, k.shape, ("NCHW", "OIHW", "NCHW"))
  with pytest.raises(ValueError, match="channels-last"):
    patch_conv(x, k, (1, 1), "SAME", dimension_numbers=nchw)


def test_small_cnn_sizes_and_conv_impls_agree():
  count = lambda m: sum(x.size for x in jax.tree.leaves(nnx.state(m, nnx.Param)))  # noqa: E731
  cifar = nnx.eval_shape(lambda: SmallCNN(rngs=nnx.Rngs(0)))
  mnist = nnx.eval_shape(lambda: SmallCNN(10, 1, image_shape=(28, 28), rngs=nnx.Rngs(0)))
  assert count(cifar) == 156_074  # the documented "about 156k parameters"
  assert count(mnist) == 98_442
  assert hasattr(cifar, "head") and cifar.head.out_features == 10
  x = jax.random.normal(jax.random.key(2), (3, 8, 8, 3))
  for kw in ({}, {"groups": 4, "activation": "tanh"}):
    a = small_cnn(4, key=jax.random.key(0), image_shape=(8, 8), **kw)
    b = small_cnn(4, key=jax.random.key(0), image_shape=(8, 8), conv_impl="lax", **kw)
    chex.assert_trees_all_close(a.params, b.params)
    np.testing.assert_allclose(a.apply(a.params, x), b.apply(b.params, x), rtol=1e-5, atol=1e-5)
  with pytest.raises(ValueError, match="too small"):
    SmallCNN(image_shape=(4, 4), rngs=nnx.Rngs(0))
