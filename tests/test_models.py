"""Models: per-example independence, per-example gradient shapes, no BatchNorm,
parameter-path convention, reference sizes."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from dpmuon_jax.models.common import classification_loss, pure_model
from dpmuon_jax.models.registry import MODEL_NAMES, create_model, model_and_loss
from dpmuon_jax.models.vit import VisionTransformer, patches
from dpmuon_jax.models.wrn import WideResNet
from dpmuon_jax.privacy.query import gradient_query

NUM_CLASSES = 5
BATCH = 3

# Tiny configurations of every registered model, on 8×8 images.
TINY = {
    "cnn": (lambda: create_model("cnn", NUM_CLASSES, (8, 8, 3), seed=0), (8, 8, 3)),
    "mlp": (lambda: create_model("mlp", NUM_CLASSES, (8, 8, 3), seed=0, hidden=(16, 8)),
            (8, 8, 3)),
    "wrn": (lambda: WideResNet(10, 1, NUM_CLASSES, rngs=nnx.Rngs(0)), (8, 8, 3)),
    "resnet": (
        lambda: create_model(
            "resnet18", NUM_CLASSES, (8, 8, 1), seed=0, stage_sizes=(1, 1), width=8, groups=4
        ),
        (8, 8, 1),
    ),
    "vit": (
        lambda: create_model(
            "vit_small", NUM_CLASSES, (8, 8, 3), seed=0, dim=16, depth=1, num_heads=2
        ),
        (8, 8, 3),
    ),
}


def _random_params(make):
  """The model with numpy-drawn parameters (N(0, 1/fan_in) matrices, perturbed
  norms/biases): avoids compiling one PRNG kernel per parameter shape, which
  dominates eager init time on CPU. Initialisers are covered elsewhere."""
  graphdef, state = nnx.split(nnx.eval_shape(make))
  rng = np.random.default_rng(0)

  def draw(leaf):
    if len(leaf.shape) >= 2:
      std = 1.0 / np.sqrt(np.prod(leaf.shape[:-1]))
      return jnp.asarray(rng.normal(0.0, std, leaf.shape), leaf.dtype)
    return jnp.asarray(rng.normal(0.0, 0.1, leaf.shape), leaf.dtype)

  params = jax.tree.map(draw, nnx.to_pure_dict(state))
  params = jax.tree_util.tree_map_with_path(
      lambda path, x: x + 1.0 if str(getattr(path[-1], "key", "")) == "scale" else x, params
  )
  nnx.replace_by_pure_dict(state, params)
  return nnx.merge(graphdef, state)


def _batch(shape, seed=0):
  rng = np.random.default_rng(seed)
  images = jnp.asarray(rng.normal(size=(BATCH, *shape)), jnp.float32)
  labels = jnp.asarray(rng.integers(0, NUM_CLASSES, BATCH), jnp.int32)
  return images, labels


def _probe(apply):
  """Outputs, ∇ of example 0's loss from a forward pass of the WHOLE batch, and
  the per-example query vmap(grad) on single examples; one compiled function."""
  per_example_query = jax.vmap(gradient_query(classification_loss(apply)), (None, 0))

  def loss_0(params, images, labels):
    return optax.softmax_cross_entropy_with_integer_labels(apply(params, images), labels)[0]

  def probe(params, images, labels):
    per_example = per_example_query(params, {"image": images, "label": labels})
    return apply(params, images), jax.grad(loss_0)(params, images, labels), per_example

  return jax.jit(probe)


def _check_independence(apply, params, shape):
  """Changing example j = 2 leaves example 0's output and in-batch gradient unchanged."""
  images, labels = _batch(shape)
  changed = images.at[2].set(images[2] * -3.0 + 1.0)
  probe = _probe(apply)
  (out, grad, per_example), (out_changed, grad_changed, _) = (
      probe(params, x, labels) for x in (images, changed)
  )
  assert not np.allclose(out[2], out_changed[2])  # the change is visible ...
  np.testing.assert_allclose(out[:2], out_changed[:2], rtol=1e-6, atol=1e-6)  # ... only at j
  assert float(jnp.abs(grad["head"]["kernel"]).sum()) > 0
  chex.assert_trees_all_close(grad, grad_changed, rtol=1e-5, atol=1e-7)
  return grad, per_example


@pytest.mark.parametrize("make, shape", TINY.values(), ids=TINY.keys())
def test_per_example_independence_and_gradient_shapes(make, shape):
  pm = pure_model(_random_params(make))
  in_batch, per_example = _check_independence(pm.apply, pm.params, shape)
  # The per-example query has the params' structure with a batch axis, and
  # its row 0 is example 0's gradient within the batch forward pass.
  chex.assert_trees_all_equal_structs(per_example, pm.params)
  jax.tree.map(lambda g, p: chex.assert_shape(g, (BATCH, *p.shape)), per_example, pm.params)
  chex.assert_trees_all_close(
      jax.tree.map(lambda g: g[0], per_example), in_batch, rtol=1e-4, atol=1e-6
  )


def test_independence_check_catches_batchnorm():
  """The check above fails for a model with batch statistics (negative control)."""

  class BatchNormNet(nnx.Module):
    def __init__(self, rngs):
      self.conv = nnx.Conv(3, 4, (3, 3), rngs=rngs)
      self.norm = nnx.BatchNorm(4, use_running_average=False, rngs=rngs)
      self.head = nnx.Linear(4, NUM_CLASSES, rngs=rngs)

    def __call__(self, x):
      return self.head(jnp.mean(self.norm(self.conv(x)), axis=(1, 2)))

  pm = pure_model(BatchNormNet(nnx.Rngs(0)))
  with pytest.raises(AssertionError):
    _check_independence(pm.apply, pm.params, (8, 8, 3))


def _check_no_batchnorm_and_paths(model, num_classes):
  modules = [node for _, node in nnx.iter_graph(model) if isinstance(node, nnx.Module)]
  assert not any(isinstance(m, nnx.BatchNorm) for m in modules)
  assert any(isinstance(m, (nnx.GroupNorm, nnx.LayerNorm)) for m in modules)
  norms = [m for m in modules if isinstance(m, (nnx.GroupNorm, nnx.LayerNorm))]
  params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  assert params["head"]["kernel"].shape[-1] == num_classes
  for path, leaf in jax.tree_util.tree_leaves_with_path(params):
    names = [str(getattr(k, "key", k)) for k in path]
    if names[-1] == "scale":
      assert any("norm" in n for n in names[:-1]), names
    if not any("embed" in n for n in names):
      assert names[-1] in ("kernel", "bias", "scale"), names
    if names[-1] == "kernel":
      assert leaf.ndim in (2, 4), names  # Dense (in, out) or Conv (kh, kw, in, out)
  return norms


@pytest.mark.parametrize(
    "name, count",
    [("wrn16_4", 2_748_890), ("wrn28_10", 36_479_194), ("resnet18", 11_173_962),
     ("vit_small", 21_342_346)],
)
def test_full_size_models(name, count):
  """Reference sizes (CIFAR-10, 32×32×3) from abstract shapes, no allocation."""
  model = nnx.eval_shape(lambda: create_model(name, 10, (32, 32, 3), seed=0))
  params = nnx.state(model, nnx.Param)
  assert sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params)) == count
  norms = _check_no_batchnorm_and_paths(model, 10)
  if name.startswith(("wrn", "resnet")):
    assert all(isinstance(m, nnx.GroupNorm) for m in norms)
  else:
    assert all(isinstance(m, nnx.LayerNorm) for m in norms)


def test_registry_names_and_paths():
  assert set(MODEL_NAMES) == {"cnn", "mlp", "wrn16_4", "wrn28_10", "resnet18", "vit_small"}
  for name, (make, _) in TINY.items():
    if name not in ("cnn", "mlp"):  # SmallCNN's norms are optional; the MLP has none
      _check_no_batchnorm_and_paths(nnx.eval_shape(make), NUM_CLASSES)
  vit_params = nnx.state(nnx.eval_shape(TINY["vit"][0]), nnx.Param)
  assert vit_params["pos_embed"].shape == (1 + 16, 16)  # 2×2 patches on 8×8: 16 + cls
  assert vit_params["cls_embed"].shape == (16,)
  with pytest.raises(ValueError, match="valid names: cnn"):
    create_model("resnet50", 10, (32, 32, 3), seed=0)
  with pytest.raises(ValueError, match="WRN depth"):
    WideResNet(15, 1, 10, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="not divisible by patch size"):
    VisionTransformer(10, image_shape=(30, 30, 3), rngs=nnx.Rngs(0))


def test_mlp_is_dense_layers_on_the_flattened_image():
  model, _ = model_and_loss("mlp", NUM_CLASSES, (8, 8, 1), seed=0)
  p = model.params
  assert sum(x.size for x in jax.tree.leaves(p)) == 64 * 128 + 128 + 128 * NUM_CLASSES + (
      NUM_CLASSES)
  images, _ = _batch((8, 8, 1))
  hidden = jax.nn.relu(images.reshape(len(images), -1) @ p["dense0"]["kernel"]
                       + p["dense0"]["bias"])
  np.testing.assert_allclose(model.apply(p, images),
                             hidden @ p["head"]["kernel"] + p["head"]["bias"], rtol=1e-5,
                             atol=1e-6)
  with pytest.raises(ValueError, match="at least one positive width"):
    create_model("mlp", NUM_CLASSES, (8, 8, 1), seed=0, hidden=())
  with pytest.raises(ValueError, match="activation"):
    create_model("mlp", NUM_CLASSES, (8, 8, 1), seed=0, activation="gelu")


def test_model_and_loss_is_mean_cross_entropy():
  model, loss_fn = model_and_loss("resnet18", NUM_CLASSES, (8, 8, 1), seed=3,
                                  stage_sizes=(1,), width=4, groups=2)
  images, labels = _batch((8, 8, 1))
  logits = jax.jit(model.apply)(model.params, images)
  expected = -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], 1))
  np.testing.assert_allclose(jax.jit(loss_fn)(model.params, {"image": images, "label": labels}),
                             expected, rtol=1e-6)
  # The seed is the only source of initialisation randomness.
  same, _ = model_and_loss("resnet18", NUM_CLASSES, (8, 8, 1), seed=3,
                           stage_sizes=(1,), width=4, groups=2)
  other, _ = model_and_loss("resnet18", NUM_CLASSES, (8, 8, 1), seed=4,
                            stage_sizes=(1,), width=4, groups=2)
  chex.assert_trees_all_equal(model.params, same.params)
  assert not np.array_equal(model.params["head"]["kernel"], other.params["head"]["kernel"])


def test_vit_patches_are_a_strided_conv():
  """patch_embed on flattened patches == a stride-p conv with the reshaped kernel."""
  x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 8, 8, 3)), jnp.float32)
  kernel = jnp.asarray(np.random.default_rng(1).normal(size=(4, 4, 3, 5)), jnp.float32)
  conv = jax.lax.conv_general_dilated(x, kernel, (4, 4), "VALID",
                                      dimension_numbers=("NHWC", "HWIO", "NHWC"))
  dense = patches(x, 4) @ kernel.reshape(4 * 4 * 3, 5)
  np.testing.assert_allclose(dense, conv.reshape(2, 4, 5), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "name, overrides",
    [("wrn16_4", {"depth": 10, "width": 1}),
     ("resnet18", {"stage_sizes": (1, 1), "width": 4, "groups": 2})],
)
def test_patch_conv_option_matches_lax_conv(name, overrides):
  """``conv_impl="patches"`` is the same function as ``lax.conv`` (strides, 1×1 shortcuts)."""
  make = lambda impl: create_model(name, NUM_CLASSES, (8, 8, 3), seed=0, conv_impl=impl,
                                   **overrides)
  lax_model, patch_model = pure_model(make("lax")), pure_model(make("patches"))
  chex.assert_trees_all_equal(lax_model.params, patch_model.params)
  images, _ = _batch((8, 8, 3))
  np.testing.assert_allclose(patch_model.apply(patch_model.params, images),
                             lax_model.apply(lax_model.params, images), rtol=1e-4, atol=1e-5)
  with pytest.raises(ValueError, match="conv_impl"):
    make("fft")


def test_wrn_depth_and_width_overrides():
  """The WRN names take ``depth``/``width`` overrides (CPU-scale configs)."""
  model = nnx.eval_shape(lambda: create_model("wrn28_10", 10, (32, 32, 3), seed=0, depth=10,
                                              width=2))
  assert len(model.stages) == 3 and all(len(stage) == 1 for stage in model.stages)
  assert model.head.in_features == 128  # 64 · width
