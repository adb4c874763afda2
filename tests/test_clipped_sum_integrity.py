"""Privacy invariant 8: a releasable clipped sum only comes from the library's clipping code.

Pytree operations on a ``ClippedSum`` (``jax.tree.map``, ``jax.tree.unflatten``)
and ``s + s`` must not give a sum that the release accepts with sensitivity C;
the clipping rule a sum was made with must be the release's. Each test here
fails on a ``ClippedSum`` without a seal, a norm bound or a recorded rule.
"""

import copy
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dpmuon_jax as dm
from dpmuon_jax.privacy.clipping import flat_clipping, per_layer_clipping
from dpmuon_jax.privacy.ghost import ghost_clipped_sum
from dpmuon_jax.privacy.query import (
  ClippedSum,
  clip_and_sum,
  clipped_sum,
  fingerprint,
  gradient_query,
  zeros_clipped_sum,
)
from dpmuon_jax.privacy.release import gaussian_noise_like
from dpmuon_jax.training.step import make_private_step

C, SIGMA, D = 1.0, 1.0, 8.0
pytestmark = pytest.mark.filterwarnings("ignore:noise_multiplier=0")


def _loss(params, batch):
  pred = batch["x"] @ params["w"] + params["b"]
  return jnp.mean((pred - batch["y"]) ** 2)


def _problem(n=8, seed=1):
  rng = np.random.default_rng(seed)
  params = {"w": jnp.zeros((3, 2)), "b": jnp.zeros(2)}
  batch = {
      "x": jnp.asarray(rng.standard_normal((n, 3)) * 10, jnp.float32),
      "y": jnp.asarray(rng.standard_normal((n, 2)) * 10, jnp.float32),
  }
  return params, batch, jnp.ones(n, bool)


def _genuine():
  params, batch, mask = _problem()
  return params, clipped_sum(gradient_query(_loss), params, batch, mask, C)


def _release():
  return dm.dp_release(C, SIGMA, D, key=0)


def _reference(release, state, total):
  """The release as it was before the seal: (S + N(0, σ²C²)) / D with key fold_in(stream, k)."""
  key = jax.random.fold_in(state.noise_key, state.count)
  noise = gaussian_noise_like(total, key, SIGMA * C)
  return jax.tree.map(lambda s, z: (s + z) / D, total, noise)


def _assert_bitwise(got, want):
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_a_scaled_sum_is_refused_eagerly_and_poisoned_under_jit():
  params, cs = _genuine()
  inflated = jax.tree.map(lambda x: 1000 * x, cs)
  assert isinstance(inflated, ClippedSum) and inflated.l2_sensitivity == C
  release = _release()
  state = release.init(params)
  with pytest.raises(ValueError, match="changed after clipping"):
    release.update(inflated, state, params)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    out, _ = jax.jit(release.update)(inflated, state, params)
    jax.effects_barrier()
  assert all(bool(jnp.all(jnp.isnan(x))) for x in jax.tree.leaves(out))
  assert any("refused a ClippedSum under jit" in str(w.message) for w in caught)
  # The genuine sum under jit is released, finite (another release: a key is used once).
  other = _release()
  good, _ = jax.jit(other.update)(cs, other.init(params), params)
  assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(good))


def test_a_sum_unflattened_from_other_leaves_is_refused():
  params, cs = _genuine()
  leaves, treedef = jax.tree.flatten(cs)
  num_total = len(jax.tree.leaves(cs.total))
  other = [jnp.full_like(x, 5.0) if i < num_total else x for i, x in enumerate(leaves)]
  forged = jax.tree.unflatten(treedef, other)
  release = _release()
  with pytest.raises(ValueError, match="seal does not match"):
    release.update(forged, release.init(params), params)
  # Unflattening the SAME leaves (what jit and scan do) keeps the sum releasable.
  same = jax.tree.unflatten(treedef, leaves)
  _assert_bitwise(release.update(same, release.init(params), params)[0],
                  release.update(cs, release.init(params), params)[0])


@pytest.mark.parametrize("rule", ["bound", "per_layer"])
def test_the_leaves_of_a_sum_clipped_with_another_rule_are_refused(rule):
  """The seal binds the clipping rule: C = 10 leaves under a C = 1 treedef are not a C = 1 sum.

  256 examples of norm 10 in 64 dimensions sum to a norm (about 160) far below
  n·C = 256, so the norm bound alone would let this sum of sensitivity 10 pass.
  """
  params = {"w": jnp.zeros(64)}
  rng = np.random.default_rng(0)
  per_example = {"w": jnp.asarray(rng.standard_normal((256, 64)) * 100, jnp.float32)}
  release = _release()
  target = flat_clipping(C) if rule == "bound" else per_layer_clipping(C)
  if rule == "per_layer":
    release = dm.dp_release(C, SIGMA, D, key=0, clipping=target)
  source = flat_clipping(10 * C) if rule == "bound" else flat_clipping(C)
  _, treedef = jax.tree.flatten(clip_and_sum(per_example, None, target))
  forged = jax.tree.unflatten(treedef, jax.tree.leaves(clip_and_sum(per_example, None, source)))
  assert forged.clipping.matches(target)
  norm, bound = forged.norm_and_bound()
  if rule == "bound":
    assert 10 * C < float(norm) < float(bound)
  with pytest.raises(ValueError, match="seal does not match"):
    release.update(forged, release.init(params), params)


def test_adding_a_sum_to_itself_is_refused():
  _, cs = _genuine()
  with pytest.raises(TypeError, match="add_disjoint"):
    _ = cs + cs
  with pytest.raises(TypeError, match="add_disjoint"):
    sum([cs, cs])
  with pytest.raises(ValueError, match="twice"):
    cs.add_disjoint(cs)


def test_a_sum_added_to_a_copy_of_itself_is_refused_eagerly_and_under_jit():
  """2S over the same examples (a copy, an identity map, the same sum passed twice to a
  jitted function) would be released at sensitivity C: its seal fails instead."""
  params, cs = _genuine()
  doubled = [cs.add_disjoint(copy.copy(cs)), cs.add_disjoint(jax.tree.map(lambda x: x, cs)),
             jax.jit(lambda a, b: a.add_disjoint(b))(cs, cs)]
  for twice in doubled:
    assert float(twice.stats.num_examples) == 2 * float(cs.stats.num_examples)
    assert not bool(twice.seal_holds())
    release = _release()
    with pytest.raises(ValueError, match="changed after clipping"):
      release.update(twice, release.init(params), params)
  # Empty sums (an empty overflow chunk) still add, to each other and to a real sum.
  empty = zeros_clipped_sum(params, C)
  assert bool(empty.add_disjoint(zeros_clipped_sum(params, C)).seal_holds())
  assert bool(cs.add_disjoint(empty).seal_holds())


def _psum_over_lanes(parts: ClippedSum) -> ClippedSum:
  """ClippedSum.psum over a vmapped axis of parts; the (identical) result of lane 0."""
  summed = jax.vmap(lambda s: s.psum("lanes"), axis_name="lanes")(parts)
  return jax.tree.map(lambda x: x[0], summed)


def test_psum_of_disjoint_parts_is_the_whole_sum_and_psum_of_copies_is_refused():
  """k copies of one sum (a batch replicated over devices instead of sharded) would be a
  sum over k·n examples at sensitivity C: the psum's seal fails instead, eagerly and
  under jit, while disjoint parts still make the whole batch's releasable sum."""
  params, batch, mask = _problem(16)
  query = gradient_query(_loss)
  whole = clipped_sum(query, params, batch, mask, C)
  quarters = jax.tree.map(lambda x: x.reshape((4, 4) + x.shape[1:]), (batch, mask))
  parts = jax.vmap(lambda b, m: clipped_sum(query, params, b, m, C))(*quarters)
  disjoint = _psum_over_lanes(parts)
  assert bool(disjoint.seal_holds())
  assert float(disjoint.stats.num_examples) == 16
  for got, want in zip(jax.tree.leaves(disjoint.total), jax.tree.leaves(whole.total),
                       strict=True):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  release = _release()
  release.update(disjoint, release.init(params), params)

  copies = jax.tree.map(lambda x: jnp.stack([x] * 4), whole)
  for copied in (_psum_over_lanes(copies), jax.jit(_psum_over_lanes)(copies)):
    assert float(copied.stats.num_examples) == 4 * float(whole.stats.num_examples)
    assert not bool(copied.seal_holds())
    release = _release()
    with pytest.raises(ValueError, match="copies of one sum"):
      release.update(copied, release.init(params), params)
  # Empty parts (devices with only padding) beside one real part still add, and so do
  # equal parts of zero queries (a zero gradient): k copies of the zero sum are the zero sum.
  empty = zeros_clipped_sum(params, C)
  lone = jax.tree.map(lambda *xs: jnp.stack(xs), whole, empty, empty, empty)
  assert bool(_psum_over_lanes(lone).seal_holds())
  flat = jax.vmap(lambda b, m: clipped_sum(gradient_query(lambda p, b: 0.0 * _loss(p, b)),
                                           params, b, m, C))(*quarters)
  assert bool(_psum_over_lanes(flat).seal_holds())
  assert float(_psum_over_lanes(flat).stats.num_examples) == 16


def test_add_disjoint_equals_the_sum_of_the_totals_and_is_released():
  params, batch, mask = _problem(16)
  query = gradient_query(_loss)
  first = clipped_sum(query, params, jax.tree.map(lambda x: x[:8], batch), mask[:8], C)
  second = clipped_sum(query, params, jax.tree.map(lambda x: x[8:], batch), mask[8:], C)
  both = first.add_disjoint(second)
  _assert_bitwise(both.total, jax.tree.map(jnp.add, first.total, second.total))
  assert float(both.stats.num_examples) == 16
  release = _release()
  state = release.init(params)
  _assert_bitwise(release.update(both, state, params)[0],
                  _reference(release, state, both.total))
  # A tampered operand is not laundered by the addition.
  tampered = first.add_disjoint(jax.tree.map(lambda x: 2 * x, second))
  with pytest.raises(ValueError, match="changed after clipping"):
    release.update(tampered, state, params)
  with pytest.raises(ValueError, match="same clipping rule"):
    first.add_disjoint(clip_and_sum(jax.tree.map(lambda p: jnp.ones((2,) + p.shape), params),
                                    None, per_layer_clipping(C)))


def test_a_sum_above_num_examples_times_c_is_refused():
  params = {"w": jnp.zeros(3)}
  release = _release()
  # ‖(1, 1, 1)‖ = 1.73 > 1·C: not a sum of one clipped vector, whatever the seal says.
  vouched = ClippedSum.assume_clipped({"w": jnp.ones(3)}, C, num_examples=1)
  with pytest.raises(ValueError, match="exceeds num_examples"):
    release.update(vouched, release.init(params), params)
  two = ClippedSum.assume_clipped({"w": jnp.ones(3)}, C, num_examples=2)
  release.update(two, release.init(params), params)
  with pytest.raises(ValueError, match="num_examples"):
    ClippedSum.assume_clipped({"w": jnp.ones(3)}, C)


def _fingerprint_by_its_equation(tree) -> list[int]:
  """fingerprint's documented equation, one word at a time, in Python integers mod 2³²."""
  mod, lanes, j = 2**32, [0, 0], 0
  for leaf_index, leaf in enumerate(jax.tree.leaves(tree)):
    leaf = np.asarray(leaf)
    bits = leaf.astype(np.float32 if leaf.dtype.kind == "f" else np.int32).view(np.uint32)
    for w in bits.ravel().tolist():
      x = w ^ ((j * 0x9E3779B9 + leaf_index * 0x7F4A7C15) % mod)
      x ^= x >> 16
      x = x * 0x85EBCA6B % mod
      x ^= x >> 13
      x = x * 0xC2B2AE35 % mod
      x ^= x >> 16
      lanes = [(lanes[0] + x) % mod, (lanes[1] + x * (2 * j + 1)) % mod]
      j += 1
  return lanes


def test_the_seal_fingerprint_follows_its_equation_whatever_the_leaf_sizes():
  """Leaves of one size are hashed in one pass; the lanes are those of the equation
  taken leaf by leaf (so moving a value to another leaf of that size changes them)."""
  rng = np.random.default_rng(0)
  tree = {"a": rng.standard_normal((2, 3)).astype(np.float32), "b": np.arange(6, dtype=np.int32),
          "c": rng.standard_normal(6).astype(np.float32), "d": np.float32(-0.5),
          "e": np.array([True, False]), "f": rng.standard_normal((3, 2)).astype(np.float32)}
  want = _fingerprint_by_its_equation(tree)
  assert np.asarray(jax.jit(fingerprint)(tree)).tolist() == want
  assert np.asarray(fingerprint(tree)).tolist() == want
  swapped = dict(tree, a=tree["f"].reshape(2, 3), f=tree["a"].reshape(3, 2))
  assert np.asarray(fingerprint(swapped)).tolist() != want


def test_a_grid_sum_is_sealed_too():
  params = {"w": jnp.zeros((3, 2))}
  release = dm.dp_release(C, SIGMA, D, key=0, secure_noise=True)
  per_example = {"w": jnp.full((4, 3, 2), 0.4)}
  cs = clip_and_sum(per_example, None, release.release.clipping)
  with pytest.raises(ValueError, match="changed after clipping"):
    release.update(jax.tree.map(lambda x: 3 * x, cs), release.init(params), params)


@pytest.mark.parametrize("bad", [float("inf"), float("nan"), 0.0, -1.0])
def test_per_layer_weights_must_be_positive_and_finite(bad):
  with pytest.raises(ValueError, match="positive finite"):
    per_layer_clipping(C, {"b": bad, "w": 1.0})


def test_a_flat_sum_is_refused_by_a_per_layer_release():
  params, batch, mask = _problem()
  opt = dm.dp_sgd(0.1, l2_clip_norm=C, noise_multiplier=0.0, denominator=D, key=0,
                  clipping=per_layer_clipping(C))
  flat = clipped_sum(gradient_query(_loss), params, batch, mask, flat_clipping(C))
  with pytest.raises(ValueError, match="clipped with .*flat_clip.* the release with"):
    opt.update(flat, opt.init(params), params)
  per_layer = clipped_sum(gradient_query(_loss), params, batch, mask, per_layer_clipping(C))
  opt.update(per_layer, opt.init(params), params)


@pytest.mark.parametrize("method", ["microbatched", "ghost"])
def test_genuine_sums_are_released_as_before(method):
  params, batch, mask = _problem(16)
  if method == "ghost":
    cs = ghost_clipped_sum(_loss, params, batch, mask, C, microbatch_size=4)
  else:
    cs = clipped_sum(gradient_query(_loss), params, batch, mask, C, microbatch_size=4)
  release = _release()
  state = release.init(params)
  _assert_bitwise(release.update(cs, state, params)[0], _reference(release, state, cs.total))


def test_overflow_chunks_of_a_private_step_are_released_as_before():
  params, batch, mask = _problem(16)
  opt = dm.dp_sgd(1.0, l2_clip_norm=C, noise_multiplier=SIGMA, denominator=D, key=0)
  step = make_private_step(opt, _loss, microbatch_size=4)
  state = opt.init(params)
  chunks = [(jax.tree.map(lambda x, i=i: x[i:i + 8], batch), mask[i:i + 8]) for i in (0, 8)]
  out = step(params, state, chunks)
  parts = [step.clipped_sum(params, state, b, m).total for b, m in chunks]
  total = jax.tree.map(jnp.add, *parts)
  release_state = state[0]
  want = jax.tree.map(jnp.subtract, params, _reference(None, release_state, total))
  for g, w in zip(jax.tree.leaves(out.params), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6, atol=1e-7)
  assert float(out.stats.num_examples) == 16
  # A tampered overflow poisons the step instead of being released (a fresh optimizer
  # and state, so that no noise key is used twice).
  opt = dm.dp_sgd(1.0, l2_clip_norm=C, noise_multiplier=SIGMA, denominator=D, key=1)
  step = make_private_step(opt, _loss, microbatch_size=4)
  state = opt.init(params)
  overflow = jax.tree.map(lambda x: 10 * x, step.clipped_sum(params, state, *chunks[1]))
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    bad = step.step(params, state, *chunks[0], overflow)
    jax.effects_barrier()
  assert all(bool(jnp.all(jnp.isnan(x))) for x in jax.tree.leaves(bad.params))
  assert any("refused a ClippedSum under jit" in str(w.message) for w in caught)
