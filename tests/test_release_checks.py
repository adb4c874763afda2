"""The release checks what it is given, and the optimizer carries its clipping rule.

Each test here fails on a release that clips whatever leading axis it is handed,
accepts a hand-made ``ClippedSum``, or lets a step builder swap the clipping rule.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from packaging.version import Version

import dpmuon_jax as dm
from dpmuon_jax.distributed.mesh import data_mesh
from dpmuon_jax.privacy.clipping import flat_clipping, per_layer_clipping
from dpmuon_jax.privacy.query import ClippedSum, clip_and_sum
from dpmuon_jax.training.step import make_private_step

C = 1.0
pytestmark = pytest.mark.filterwarnings("ignore:noise_multiplier=0")


def _square_dense(width=64):
  return {"kernel": jnp.zeros((width, width)), "bias": jnp.zeros((width,))}


def test_a_summed_gradient_of_a_square_layer_is_refused():
  # A params-shaped gradient whose leaves share a leading axis of 64 used to be
  # clipped row by row as if it held 64 examples.
  params = _square_dense()
  summed = jax.tree.map(jnp.ones_like, params)
  opt = dm.dp_sgd(0.1, l2_clip_norm=C, noise_multiplier=0.0, denominator=10.0, key=0)
  state = opt.init(params)
  with pytest.raises(ValueError, match=r"\(B,\) \+ \(64,\) was expected"):
    opt.update(summed, state, params)


def test_a_single_leaf_model_cannot_pass_its_gradient_as_examples():
  params = jnp.zeros((5,))
  release = dm.dp_release(C, 0.0, 4.0, key=0)
  with pytest.raises(ValueError, match="per-example"):
    release.update(jnp.ones((5,)), release.init(params), params)


def test_neighbouring_sums_differ_by_at_most_c():
  # The measured break: 10 vs 11 examples summed first, then "released".
  # Now only per-example input is accepted, and then the two updates differ by ≤ C/D.
  params = _square_dense(8)
  rng = np.random.default_rng(0)
  per_example = jax.tree.map(
      lambda p: jnp.asarray(rng.standard_normal((11,) + p.shape) * 5, jnp.float32), params
  )
  release = dm.dp_release(C, 0.0, 1.0, key=0)
  state = release.init(params)
  out11, _ = release.update(per_example, state, params)
  out10, _ = release.update(per_example, state, params, mask=jnp.arange(11) < 10)
  diff = jnp.sqrt(sum(jnp.sum((a - b) ** 2) for a, b in zip(
      jax.tree.leaves(out11), jax.tree.leaves(out10))))
  assert float(diff) <= C * (1 + 1e-5)


def test_per_example_leaves_must_agree_on_b():
  params = {"a": jnp.zeros(3), "b": jnp.zeros(2)}
  release = dm.dp_release(C, 0.0, 1.0, key=0)
  bad = {"a": jnp.ones((4, 3)), "b": jnp.ones((5, 2))}
  with pytest.raises(ValueError, match="batch size"):
    release.update(bad, release.init(params), params)


def test_an_empty_parameter_tree_is_refused_in_one_line():
  release = dm.dp_release(C, 1.0, 4.0, key=0)
  with pytest.raises(ValueError, match="without leaves"):
    release.update({}, release.init({}), {})


def test_the_release_needs_params():
  params = {"w": jnp.zeros(3)}
  release = dm.dp_release(C, 0.0, 1.0, key=0)
  with pytest.raises(ValueError, match="needs params"):
    release.update({"w": jnp.ones((2, 3))}, release.init(params))


def test_a_clipped_sum_cannot_be_built_by_accident():
  with pytest.raises(TypeError, match="assume_clipped"):
    ClippedSum({"w": jnp.ones(3)}, C, None)
  vouched = ClippedSum.assume_clipped({"w": jnp.ones(3)}, C, num_examples=2)
  assert vouched.l2_sensitivity == C
  # Pytree round trips (jit, scan) keep working.
  again = jax.jit(lambda s: s)(vouched)
  np.testing.assert_array_equal(again.total["w"], np.ones(3))


def test_a_clipped_sum_must_have_the_parameter_shapes():
  params = {"w": jnp.zeros(3)}
  release = dm.dp_release(C, 0.0, 1.0, key=0)
  wrong = clip_and_sum({"w": jnp.ones((2, 4))}, None, C)
  with pytest.raises(ValueError, match="shape"):
    release.update(wrong, release.init(params), params)


def test_the_update_has_the_parameter_shapes_and_dtypes():
  params = {"w": jnp.zeros((3, 2), jnp.bfloat16), "b": jnp.zeros(2)}
  release = dm.dp_release(C, 1.0, 1.0, key=0)
  per_example = jax.tree.map(lambda p: jnp.ones((4,) + p.shape, p.dtype), params)
  out, _ = release.update(per_example, release.init(params), params)
  for o, p in zip(jax.tree.leaves(out), jax.tree.leaves(params)):
    assert o.shape == p.shape and o.dtype == p.dtype


def _loss(params, batch):
  pred = batch["x"] @ params["w"] + params["b"]
  return jnp.mean((pred - batch["y"]) ** 2)


def _problem():
  rng = np.random.default_rng(1)
  params = {"w": jnp.zeros((3, 2)), "b": jnp.zeros(2)}
  batch = {
      "x": jnp.asarray(rng.standard_normal((8, 3)) * 10, jnp.float32),
      "y": jnp.asarray(rng.standard_normal((8, 2)) * 10, jnp.float32),
  }
  return params, batch, jnp.ones(8, bool)


@pytest.mark.parametrize("sharded", [False, True])
def test_step_builders_clip_with_the_optimizers_rule(sharded):
  params, batch, mask = _problem()
  rule = per_layer_clipping(C)
  opt = dm.dp_sgd(0.1, l2_clip_norm=C, noise_multiplier=0.0, denominator=8.0, key=0,
                  clipping=rule)
  mesh = data_mesh(1) if sharded else None
  build = lambda o, **kw: make_private_step(o, _loss, mesh=mesh, **kw)
  step = build(opt)
  got = step.clipped_sum(params, opt.init(params), batch, mask).total
  grads = jax.vmap(lambda ex: jax.grad(_loss)(params, jax.tree.map(lambda x: x[None], ex)))(batch)
  want_per_layer = clip_and_sum(grads, mask, rule).total
  want_flat = clip_and_sum(grads, mask, flat_clipping(C)).total
  np.testing.assert_allclose(got["w"], want_per_layer["w"], rtol=1e-5)
  assert not np.allclose(want_per_layer["w"], want_flat["w"], rtol=1e-3)
  with pytest.raises(ValueError, match="was built with clipping"):
    build(opt, clipping=flat_clipping(C))
  # Repeating the optimizer's own rule is allowed.
  build(opt, clipping=per_layer_clipping(C))


def test_make_private_passes_its_clipping_to_the_optimizer():
  setup = dm.make_private(
      target_epsilon=4.0, target_delta=1e-5, dataset_size=1000, expected_batch_size=50,
      l2_clip_norm=C, steps=10, key=0, clipping=per_layer_clipping(C),
  )
  opt = dm.dp_sgd(0.1, **setup.release_kwargs)
  assert opt.release.clipping.per_layer
  assert setup.release.release.clipping.per_layer


@pytest.mark.parametrize("wrap", ["masked", "partition"])
def test_a_release_inside_optax_masked_or_partition_is_refused(wrap):
  """Either wrapper would update the leaves the release does not see with their raw rows."""
  params = _square_dense(4)
  release = dm.dp_sgd(0.1, l2_clip_norm=C, noise_multiplier=1.0, denominator=10.0, key=0)
  if wrap == "masked":
    opt = optax.masked(release, {"kernel": True, "bias": False})
  else:
    opt = optax.partition({"private": release, "frozen": optax.set_to_zero()},
                          {"kernel": "private", "bias": "frozen"})
  with pytest.raises(ValueError, match="inside optax.masked or optax.partition"):
    opt.init(params)
  # The supported order: the release sees the whole tree, the mask acts after it.
  opt = dm.privatize(dm.dp_release(C, 1.0, 10.0, key=0),
                     optax.masked(optax.sgd(0.1), {"kernel": True, "bias": False}))
  per_example = jax.tree.map(lambda p: jnp.ones((3,) + p.shape), params)
  updates, _ = opt.update(per_example, opt.init(params), params)
  assert jax.tree.map(jnp.shape, updates) == jax.tree.map(jnp.shape, params)


@pytest.mark.parametrize("chunks", ["pair", "empty", "batch"])
def test_a_private_step_names_the_chunks_it_takes(chunks):
  params = _square_dense(4)
  opt = dm.dp_sgd(0.1, l2_clip_norm=C, noise_multiplier=1.0, denominator=10.0, key=0)
  step = make_private_step(opt, lambda p, b: jnp.sum(b["x"] @ p["kernel"] + p["bias"]))
  batch, mask = {"x": jnp.ones((3, 4))}, jnp.ones(3, bool)
  given = {"pair": (batch, mask), "empty": [], "batch": batch}[chunks]
  with pytest.raises(TypeError, match=r"a non-empty list of \(batch, mask\) chunks"):
    step(params, opt.init(params), given)


def test_optax_multisteps_around_a_release_is_refused_naming_the_fix():
  params = _square_dense(4)
  opt = optax.MultiSteps(dm.dp_sgd(0.1, l2_clip_norm=C, noise_multiplier=1.0,
                                   denominator=10.0, key=0), every_k_schedule=2)
  per_example = jax.tree.map(lambda p: jnp.ones((3,) + p.shape), params)
  # Optax >= 0.2.8 hands the release its params-shaped accumulator, refused naming the fix;
  # older MultiSteps already fails in its own lax.cond on the per-example shapes.
  old_optax = Version(optax.__version__) < Version("0.2.8")
  refused = (ValueError, TypeError) if old_optax else ValueError
  with pytest.raises(refused) as refusal:
    opt.update(per_example, opt.init(params), params, mask=jnp.ones(3, bool))
  if not old_optax:
    assert refusal.match(r"optax.MultiSteps .* dm.clipped_sum")
