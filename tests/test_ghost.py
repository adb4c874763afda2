"""Ghost clipping gives the vmap path's clipped sum, norms and stats, and the same sensitivity."""

import json
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from devices import host_devices_env
from flax import nnx

from dpmuon_jax.models.cnn import SmallCNN
from dpmuon_jax.models.common import classification_loss, pure_model
from dpmuon_jax.models.taps import TappedEmbed, tapped, tapped_model
from dpmuon_jax.optimizers import dp_disk_muon_im, dp_disk_sgd, dp_muon_im, dp_sgd
from dpmuon_jax.privacy.clipping import (
  Clipping,
  automatic_clipping,
  flat_clipping,
  flat_norm,
  per_layer_clipping,
)
from dpmuon_jax.privacy.disk_query import (
  DISK_PRESETS,
  disk_points,
  disk_query,
  disk_terms,
  disk_weight,
)
from dpmuon_jax.privacy.ghost import (
  ghost_clipped_sum,
  ghost_coverage,
  ghost_norms,
  ghost_query_sum,
  resolve_method,
)
from dpmuon_jax.privacy.inner_momentum import (
  InnerMomentumInputs,
  grouped_inner_momentum_query,
  inner_momentum_terms,
)
from dpmuon_jax.privacy.query import clipped_sum, gradient_query
from dpmuon_jax.text.gpt2 import GPT2, GPT2Config, gpt2_model, lm_loss
from dpmuon_jax.training.step import make_private_step
from dpmuon_jax.transforms.history import ParamHistoryState

# dim 8, T = 12: the 8×8 attention matrices take the direct form (T² > 64), the
# 8×32 MLP matrices and the embeddings the Gram form.
CONFIG = GPT2Config(vocab_size=23, max_positions=16, dim=8, num_layers=1, num_heads=2)


def _first(batch):
  return jax.tree.map(lambda x: x[0], batch)


def _vmap_norms(loss_fn, params, batch):
  per_example = jax.vmap(gradient_query(loss_fn), in_axes=(None, 0))
  return jax.jit(lambda p: jax.vmap(flat_norm)(per_example(p, batch)))(params)


def _vmap_sum(loss_fn, params, batch, mask, clipping):
  return jax.jit(lambda p: clipped_sum(gradient_query(loss_fn), p, batch, mask, clipping)
                 )(params)


def _ghost_sum(loss_fn, params, batch, mask, clipping, microbatch_size=None):
  return jax.jit(lambda p: ghost_clipped_sum(loss_fn, p, batch, mask, clipping, microbatch_size)
                 )(params)


def _ghost_norms(loss_fn, params, batch):
  return jax.jit(lambda p: ghost_norms(loss_fn, p, batch))(params)


def _assert_trees_close(got, want, rtol=1e-4):
  """Leafwise within rtol of the largest entry of the whole sum (some leaves are ~0)."""
  scale = max(float(jnp.max(jnp.abs(w))) for w in jax.tree.leaves(want))
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(g, w, rtol=rtol, atol=rtol * scale)


def _assert_upper_bounds(got, exact, slack=1e-2):
  """Ghost norms bound the exact (vmap) ones from above: ``factor_sq_norm`` adds the
  worst-case float32 rounding of the Gram form, documented as under 1 % of the norm."""
  got, exact = np.asarray(got), np.asarray(exact)
  assert np.all(got >= exact * (1 - 1e-6)), (got, exact)
  assert np.all(got <= exact * (1 + slack)), (got, exact)


def _l2(a, b):
  return float(jnp.sqrt(sum(jnp.sum(jnp.square(x - y))
                            for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))))


@pytest.fixture(scope="module")
def gpt2():
  module = GPT2(CONFIG, rngs=nnx.Rngs(0))
  apply, params = gpt2_model(tapped(module))
  tokens = jax.random.randint(jax.random.key(1), (6, 12), 0, CONFIG.vocab_size)
  loss_mask = (jax.random.uniform(jax.random.key(2), (6, 12)) < 0.7).astype(jnp.int32)
  batch = {"tokens": tokens, "loss_mask": loss_mask}
  return module, apply, params, batch


class Mlp(nnx.Module):
  """Linear → tanh → LayerNorm → Linear."""

  def __init__(self, rngs):
    self.fc1, self.norm = nnx.Linear(5, 7, rngs=rngs), nnx.LayerNorm(7, rngs=rngs)
    self.head = nnx.Linear(7, 3, rngs=rngs)

  def __call__(self, x):
    return self.head(self.norm(jnp.tanh(self.fc1(x))))


def _mlp_batch():
  x = jax.random.normal(jax.random.key(3), (8, 5))
  return {"image": x * jnp.linspace(0.2, 3.0, 8)[:, None], "label": jnp.arange(8) % 3}


@pytest.fixture(scope="module")
def mlp():
  """The tapped Mlp on 5 features, 8 examples."""
  model = tapped_model(Mlp(nnx.Rngs(0)))
  return classification_loss(model.apply), model.params, _mlp_batch()


def test_tapped_model_computes_the_same_function_and_leaves_the_original(gpt2):
  module, apply, params, batch = gpt2
  plain_apply, plain_params = gpt2_model(module)
  np.testing.assert_array_equal(apply(params, batch["tokens"]),
                                plain_apply(plain_params, batch["tokens"]))
  assert type(module.token_embed) is nnx.Embed
  assert isinstance(tapped(module).token_embed, TappedEmbed)


def test_gpt2_ghost_matches_vmap_with_the_tied_embedding(gpt2):
  _, apply, params, batch = gpt2
  loss_fn = lm_loss(apply)
  coverage = ghost_coverage(loss_fn, params, _first(batch))
  assert {p[:-1] for p in coverage.exact} == {("blocks", 0, "norm1"), ("blocks", 0, "norm2"),
                                             ("norm",)}
  assert ("token_embed", "embedding") in coverage.ghost
  want_norms = _vmap_norms(loss_fn, params, batch)
  _assert_upper_bounds(_ghost_norms(loss_fn, params, batch), want_norms)
  clip = float(jnp.median(want_norms))  # some rows clipped, some not
  mask = jnp.array([True, True, True, False, True, True])
  want = _vmap_sum(loss_fn, params, batch, mask, clip)
  got = jax.jit(lambda p: ghost_clipped_sum(loss_fn, p, batch, mask, clip))(params)
  assert 0 < float(got.stats.num_clipped) < 5
  assert got.l2_sensitivity == want.l2_sensitivity == clip
  _assert_trees_close(got.total, want.total, rtol=1e-2)  # clipped rows scaled by ≤ 1 % less
  for g, w in zip(got.stats, want.stats, strict=True):
    np.testing.assert_allclose(g, w, rtol=1e-2)


@pytest.mark.parametrize("microbatch", [3, 4], ids=["dividing", "padded"])
def test_cnn_patch_conv_ghost_matches_vmap_microbatched_with_group_norm(microbatch):
  model = tapped_model(SmallCNN(4, 2, image_shape=(8, 8), groups=4, rngs=nnx.Rngs(0)))
  loss_fn = classification_loss(model.apply)
  batch = {"image": jax.random.normal(jax.random.key(4), (6, 8, 8, 2)),
           "label": jnp.arange(6) % 4}
  mask = jnp.array([True, False, True, True, True, True])
  assert {p[0] for p in ghost_coverage(loss_fn, model.params, _first(batch)).exact} == {
      "norm0", "norm1", "norm2"}
  norms = _vmap_norms(loss_fn, model.params, batch)
  clip = float(jnp.median(norms))
  want = _vmap_sum(loss_fn, model.params, batch, mask, clip)
  got = jax.jit(lambda p: ghost_clipped_sum(loss_fn, p, batch, mask, clip, microbatch)
                )(model.params)  # 4 rows: 2 masked-out padding rows in the second microbatch
  assert 0 < float(got.stats.num_clipped) < 5
  _assert_trees_close(got.total, want.total, rtol=1e-2)  # the norms bound from above
  for g, w in zip(got.stats, want.stats, strict=True):  # the norms of the real rows
    np.testing.assert_allclose(g, w, rtol=1e-2)
  _assert_upper_bounds(_ghost_norms(loss_fn, model.params, batch), norms)


@pytest.mark.parametrize("clipping", [per_layer_clipping(0.3), automatic_clipping(0.5),
                                      Clipping(0.4, per_layer=True, automatic=True)],
                         ids=["per_layer", "automatic", "automatic_per_layer"])
def test_every_clipping_rule_matches_vmap(mlp, clipping):
  loss_fn, params, batch = mlp
  want = _vmap_sum(loss_fn, params, batch, None, clipping)
  got = _ghost_sum(loss_fn, params, batch, None, clipping)
  _assert_trees_close(got.total, want.total)
  np.testing.assert_allclose(got.stats.num_clipped, want.stats.num_clipped)


def test_nonfinite_example_contributes_zero_as_in_vmap(mlp):
  loss_fn, params, batch = mlp
  bad = {**batch, "image": batch["image"].at[2, 0].set(jnp.inf)}
  want = _vmap_sum(loss_fn, params, bad, None, 1.0)
  got = _ghost_sum(loss_fn, params, bad, None, 1.0)
  assert float(got.stats.num_nonfinite) == float(want.stats.num_nonfinite) == 1.0
  assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(got.total))
  _assert_trees_close(got.total, want.total)
  drop = jnp.arange(8) != 2
  _assert_trees_close(got.total, _ghost_sum(loss_fn, params, batch, drop, 1.0).total)


def test_grid_mode_is_refused(mlp):
  loss_fn, params, batch = mlp
  with pytest.raises(ValueError, match="grid"):
    ghost_clipped_sum(loss_fn, params, batch, None, Clipping(1.0, grid_bits=10))


def test_neighbouring_batches_differ_by_at_most_c_even_with_a_huge_gradient(mlp):
  loss_fn, params, batch = mlp
  weighted = lambda p, b: loss_fn(p, b) * b["weight"][0]
  huge = {**batch, "weight": jnp.ones(8).at[5].set(1e6)}
  clip = 0.5
  run = jax.jit(lambda b, m: ghost_clipped_sum(weighted, params, b, m, clip))
  full = run(huge, None)
  for i in (0, 5):
    removed = jax.tree.map(lambda x, i=i: jnp.delete(x, i, axis=0), huge)
    diff = _l2(full.total, run(removed, None).total)
    assert diff <= clip * (1 + 1e-5)
  assert float(full.stats.norm_max) > 1e4 * clip


def _cancelling_batch(seq=16, width=16, size=64, scale=1e6):
  """Sequence regression through one tapped 16 → 16 Linear, whose per-example loss
  ½Σ_t‖x_t W − y_t‖² lets each example's writer set its output gradients
  g_t = x_t W − y_t. Every example has x_t = a and g_t = (−1)^t·scale·v + noise_t: its
  gradient a(Σ_t noise_t)ᵀ is moderate, while its Gram form adds seq² terms of size
  ~scale² that cancel (seq² ≤ width², so the Gram form is the one used)."""
  model = tapped_model(nnx.Linear(width, width, use_bias=False, rngs=nnx.Rngs(0)))
  rng = np.random.default_rng(0)
  a, v = rng.normal(size=width), rng.normal(size=width)
  signs = np.where(np.arange(seq) % 2 == 0, 1.0, -1.0)[None, :, None]
  g = signs * scale * v / np.linalg.norm(v) + 10.0 * rng.normal(size=(size, seq, width))
  x = np.broadcast_to(a, (size, seq, width))
  y = x @ np.asarray(model.params["kernel"]) - g
  loss_fn = lambda p, b: 0.5 * jnp.sum((model.apply(p, b["x"]) - b["y"]) ** 2)
  return loss_fn, model.params, {"x": jnp.asarray(x, jnp.float32), "y": jnp.asarray(y, jnp.float32)}


def test_cancelling_gram_terms_cannot_shrink_a_ghost_norm():
  """The float32 Gram of these examples loses most of their norm to cancellation; the
  bound ghost clips by stays above the exact norm, so each moves the sum by ≤ C."""
  loss_fn, params, batch = _cancelling_batch()
  exact = _vmap_norms(loss_fn, params, batch)
  got = _ghost_norms(loss_fn, params, batch)
  assert np.all(np.asarray(got) >= np.asarray(exact) * (1 - 1e-6))
  clip = 1.0
  run = jax.jit(lambda m: ghost_clipped_sum(loss_fn, params, batch, m, clip))
  full = run(jnp.ones(64, bool))
  for i in np.argsort(np.asarray(got) / np.asarray(exact))[:4]:
    assert _l2(full.total, run(jnp.arange(64) != i).total) <= clip * (1 + 1e-5)


def test_a_negative_token_id_is_the_row_the_lookup_reads():
  """The lookup reads id −1 as row V − 1 (and the book-keeping adds it there), so the
  ghost norm must count −1 and V − 1 as one row."""
  vocab = 8
  model = tapped_model(nnx.Embed(vocab, 4, rngs=nnx.Rngs(0)))
  loss_fn = lambda p, b: jnp.sum(model.apply(p, b["tokens"]))
  batch = {"tokens": jnp.asarray([[-1, vocab - 1] * 3, [0, 1, 2, 3, 4, 5]], jnp.int32)}
  np.testing.assert_allclose(_ghost_norms(loss_fn, model.params, batch),
                             _vmap_norms(loss_fn, model.params, batch), rtol=1e-5)
  run = jax.jit(lambda m: ghost_clipped_sum(loss_fn, model.params, batch, m, 0.1))
  assert _l2(run(jnp.array([True, True])).total, run(jnp.array([False, True])).total) <= 0.1 * (
      1 + 1e-5)


def test_each_gpt2_example_moves_the_sum_by_its_clipped_norm(gpt2):
  """Removing example i changes S by exactly min(C, ‖g_i‖): the tied-embedding cross
  term is in the norm the factor used, so a clipped example moves S by C, not more."""
  _, apply, params, batch = gpt2
  loss_fn = lm_loss(apply)
  norms = _vmap_norms(loss_fn, params, batch)
  clip = float(jnp.median(norms))
  run = jax.jit(lambda m: ghost_clipped_sum(loss_fn, params, batch, m, clip))
  full = run(jnp.ones(6, bool))
  for i in range(6):
    diff = _l2(full.total, run(jnp.arange(6) != i).total)
    assert diff <= clip * (1 + 1e-5)
    np.testing.assert_allclose(diff, min(clip, float(norms[i])), rtol=1e-3)


def test_an_untapped_use_of_a_tapped_weight_cannot_raise_the_sensitivity(mlp):
  """The sum is assembled from the factors whose norms were taken: a use no tap sees
  makes it differ from the gradient, never lets one example move it by more than C."""
  loss_fn, params, batch = mlp
  sneaky = lambda p, b: loss_fn(p, b) + 50.0 * jnp.sum(p["fc1"]["kernel"] * b["image"][0, 0])
  clip = 0.5
  run = jax.jit(lambda m: ghost_clipped_sum(sneaky, params, batch, m, clip))
  full = run(jnp.ones(8, bool))
  vmap_sum = _vmap_sum(sneaky, params, batch, None, clip)
  assert _l2(full.total, vmap_sum.total) > 0.1  # the untapped use is missing ...
  for i in range(8):
    diff = _l2(full.total, run(jnp.arange(8) != i).total)
    assert diff <= clip * (1 + 1e-5)  # ... but every example is still clipped to C


def test_untapped_model_falls_back_to_exact_gradients_and_automatic_picks_vmap():
  model = pure_model(Mlp(nnx.Rngs(1)))
  loss_fn = classification_loss(model.apply)
  batch = _mlp_batch()
  assert ghost_coverage(loss_fn, model.params, _first(batch)).ghost == ()
  assert resolve_method("automatic", loss_fn, model.params, _first(batch)) == "vmap"
  want = _vmap_sum(loss_fn, model.params, batch, None, 0.1)
  _assert_trees_close(_ghost_sum(loss_fn, model.params, batch, None, 0.1).total,
                      want.total)


def test_private_step_with_ghost_gives_the_vmap_update(gpt2):
  _, apply, params, batch = gpt2
  loss_fn = lm_loss(apply)
  assert resolve_method("automatic", loss_fn, params, _first(batch)) == "ghost"
  mask = jnp.array([True, True, True, True, False, True])
  outs = {}
  for method in ("vmap", "ghost"):
    # One optimizer per path, of one seed: the same noise, and no key used on two sums.
    opt = dp_sgd(0.5, 0.1, 1.0, denominator=6.0, key=7)
    step = make_private_step(opt, loss_fn, clipped_sum_method=method)
    outs[method] = step(params, opt.init(params), [(batch, mask)])
  _assert_trees_close(outs["ghost"].params, outs["vmap"].params)
  assert float(outs["ghost"].stats.num_examples) == 5.0
  with pytest.raises(ValueError, match="custom query needs 'vmap'"):
    make_private_step(opt, query=gradient_query(loss_fn), clipped_sum_method="ghost")
  with pytest.raises(ValueError, match="clipped_sum_method"):
    make_private_step(opt, loss_fn, clipped_sum_method="fast")


def test_flat_clipping_factors_match_clip():
  g = {"a": jnp.array([3.0, 0.0]), "b": jnp.array([[4.0]])}
  for rule in (flat_clipping(1.0), per_layer_clipping(2.0), automatic_clipping(1.0)):
    sq = jax.tree.map(lambda x: jnp.sum(x**2), g)
    scaled = rule.factors(sq)
    clipped = rule.clip(g)
    np.testing.assert_allclose(scaled.norm, clipped.norm)
    for f, x, c in zip(jax.tree.leaves(scaled.clipped), jax.tree.leaves(g),
                       jax.tree.leaves(clipped.clipped), strict=True):
      np.testing.assert_allclose(f * x, c, rtol=1e-6)
  bad = flat_clipping(1.0).factors({"a": jnp.array(jnp.nan), "b": jnp.array(1.0)})
  assert not bool(bad.is_finite) and float(bad.clipped["b"]) == 0.0


def test_inner_momentum_ghost_matches_vmap_with_cross_terms_between_states(gpt2):
  """q_i = Σ_k w_k ∇ℓ(θ_{t−k}; x_i) clipped as one vector: the norm needs the cross
  terms Σ_{k,l} w_k w_l Σ_{t,s}(a_{k,t}·a_{l,s})(g_{k,t}·g_{l,s}) (and, for the tied
  embedding, the lookup × head terms across states). With 2 stored states the Muon
  group (K = 2) weighs θ_t, θ_{t−1}, θ_{t−2}; the fallback (K = 1) gives θ_{t−2} weight 0."""
  count = 2
  _, apply, params, batch = gpt2
  loss_fn = lm_loss(apply)
  keys = iter(jax.random.split(jax.random.key(9), 100))
  states = jax.tree.map(
      lambda p: jnp.stack([p + 0.05 * jax.random.normal(next(keys), p.shape) for _ in range(2)]),
      params)
  inputs = InnerMomentumInputs(params, ParamHistoryState(states, jnp.asarray(count, jnp.int32)))
  in_muon = lambda p: jax.tree.map(lambda x: x.ndim >= 2, p)
  query = grouped_inner_momentum_query(loss_fn, in_muon, 2, 0.5, 1, 0.7)
  ghost = ghost_query_sum(loss_fn, inner_momentum_terms(in_muon, 2, 0.5, 1, 0.7))
  norms = jax.jit(lambda i: jax.vmap(lambda ex: flat_norm(query(i, ex)))(batch))(inputs)
  clip = float(jnp.median(norms))
  mask = jnp.array([True, True, False, True, True, True])
  want = jax.jit(lambda i: clipped_sum(query, i, batch, mask, clip))(inputs)
  got = jax.jit(lambda i: ghost(i, batch, mask, clip))(inputs)
  assert 0 < float(got.stats.num_clipped) < 5
  _assert_trees_close(got.total, want.total)
  for g, w in zip(got.stats, want.stats, strict=True):
    np.testing.assert_allclose(g, w, rtol=1e-4)


@pytest.mark.parametrize("history", [0, 2])
def test_multi_term_ghost_mixes_gram_factors_and_accumulated_gradients(history):
  """At width 32 and T = 4 a query of several terms keeps every term's factors for
  the kernels (Gram form, cross terms between states) and sums the per-example
  gradient over the terms for the biases and the tied embedding (lookup + head);
  with two terms (DiSK-like, history 0 plus the fallback) the position table takes
  the Gram form of onehot rows. Both forms together give the vmap path's sum."""
  config = GPT2Config(vocab_size=23, max_positions=16, dim=32, num_layers=1, num_heads=2)
  apply, params = gpt2_model(tapped(GPT2(config, rngs=nnx.Rngs(0))))
  loss_fn = lm_loss(apply)
  batch = {"tokens": jax.random.randint(jax.random.key(5), (6, 4), 0, 23),
           "loss_mask": jnp.ones((6, 4), jnp.int32)}
  num_terms = history + 1 if history else 2
  coverage = ghost_coverage(loss_fn, params, _first(batch), num_terms)
  assert ghost_coverage(loss_fn, params, _first(batch)).accumulated == ()
  accumulated = {"/".join(map(str, p)) for p in coverage.accumulated}
  assert "token_embed/embedding" in accumulated
  assert not any(name.endswith("kernel") for name in accumulated)
  assert ("pos_embed/embedding" in accumulated) == (num_terms == 3)
  if history:
    keys = iter(jax.random.split(jax.random.key(9), 100))
    states = jax.tree.map(lambda p: jnp.stack(
        [p + 0.05 * jax.random.normal(next(keys), p.shape) for _ in range(history)]), params)
    inputs = InnerMomentumInputs(params, ParamHistoryState(states, jnp.asarray(history)))
    in_muon = lambda p: jax.tree.map(lambda x: x.ndim >= 2, p)
    query = grouped_inner_momentum_query(loss_fn, in_muon, history, 0.5, 1, 0.7)
    terms = inner_momentum_terms(in_muon, history, 0.5, 1, 0.7)
  else:
    kappa, gamma = DISK_PRESETS["paper2"]
    keys = iter(jax.random.split(jax.random.key(4), 100))
    update = jax.tree.map(lambda p: 0.1 * jax.random.normal(next(keys), p.shape), params)
    inputs = disk_points(params, update, gamma)
    query, terms = disk_query(loss_fn, kappa, gamma), disk_terms(kappa, gamma)
  norms = jax.jit(lambda i: jax.vmap(lambda ex: flat_norm(query(i, ex)))(batch))(inputs)
  clip = float(jnp.median(norms))
  mask = jnp.array([True, True, False, True, True, True])
  want = jax.jit(lambda i: clipped_sum(query, i, batch, mask, clip))(inputs)
  got = jax.jit(lambda i: ghost_query_sum(loss_fn, terms)(i, batch, mask, clip))(inputs)
  assert 0 < float(got.stats.num_clipped) < 5
  _assert_trees_close(got.total, want.total)
  for g, w in zip(got.stats, want.stats, strict=True):
    np.testing.assert_allclose(g, w, rtol=1e-4)


@pytest.mark.parametrize("preset", ["paper2", "paper1"])
def test_disk_two_point_ghost_matches_vmap(gpt2, preset):
  """q_i = c ∇ℓ(θ + γd; x_i) + (1 − c) ∇ℓ(θ; x_i) clipped as one vector. paper2's
  κ = 0.5, γ = 0.8 gives c = 1.25, so the current point's weight 1 − c is NEGATIVE
  and the cross terms between the two points enter with a minus sign; paper1's
  κ = 1.5, γ = −1 extrapolates backwards with c = 1/3."""
  kappa, gamma = DISK_PRESETS[preset]
  assert preset != "paper2" or disk_weight(kappa, gamma) > 1
  _, apply, params, batch = gpt2
  loss_fn = lm_loss(apply)
  keys = iter(jax.random.split(jax.random.key(4), 100))
  update = jax.tree.map(lambda p: 0.1 * jax.random.normal(next(keys), p.shape), params)
  inputs = disk_points(params, update, gamma)
  query = disk_query(loss_fn, kappa, gamma)
  norms = jax.jit(lambda i: jax.vmap(lambda ex: flat_norm(query(i, ex)))(batch))(inputs)
  clip = float(jnp.median(norms))
  mask = jnp.array([True, False, True, True, True, True])
  want = jax.jit(lambda i: clipped_sum(query, i, batch, mask, clip))(inputs)
  ghost = ghost_query_sum(loss_fn, disk_terms(kappa, gamma))
  got = jax.jit(lambda i: ghost(i, batch, mask, clip, 3))(inputs)  # in 2 microbatches
  assert 0 < float(got.stats.num_clipped) < 5
  _assert_trees_close(got.total, want.total)
  for g, w in zip(got.stats, want.stats, strict=True):
    np.testing.assert_allclose(g, w, rtol=1e-4)


def test_disk_ghost_sensitivity_with_a_negative_weight(gpt2):
  """Adding one example (however large its two gradients) moves the ghost sum by ≤ C."""
  kappa, gamma = DISK_PRESETS["paper2"]
  _, apply, params, batch = gpt2
  weighted = lambda p, b: lm_loss(apply)(p, b) * (1.0 + 1e4 * b["big"][0])
  batch = dict(batch, big=jnp.array([0, 0, 0, 1, 0, 0], jnp.float32))
  update = jax.tree.map(lambda p: 0.05 * jnp.ones_like(p), params)
  inputs = disk_points(params, update, gamma)
  ghost = jax.jit(lambda m: ghost_query_sum(weighted, disk_terms(kappa, gamma))(
      inputs, batch, m, 0.5))
  with_it = ghost(jnp.ones(6, bool))
  without = ghost(jnp.array([True, True, True, False, True, True]))
  assert float(with_it.stats.num_clipped) >= 1
  assert _l2(with_it.total, without.total) <= 0.5 * (1 + 1e-5)


@pytest.mark.parametrize("optimizer", ["dp_disk_sgd", "dp_muon_im", "dp_disk_muon_im"])
def test_private_steps_of_every_query_match_vmap_with_ghost(gpt2, optimizer):
  """Three releases, so DiSK's applied update and inner momentum's history are
  non-zero when the ghost path reads them from the optimizer state."""
  _, apply, params, batch = gpt2
  loss_fn = lm_loss(apply)
  make = {
      "dp_disk_sgd": lambda: dp_disk_sgd(0.3, 0.1, 1.0, 6.0, key=3,
                                         **DISK_PRESETS["paper2"]._asdict()),
      "dp_muon_im": lambda: dp_muon_im(0.02, 0.1, 1.0, 6.0, key=3, history=2, decay=0.5),
      "dp_disk_muon_im": lambda: dp_disk_muon_im(0.02, 0.1, 1.0, 6.0, key=3, history=1),
  }[optimizer]
  mask = jnp.array([True, True, True, True, False, True])
  final = {}
  for method in ("vmap", "ghost"):
    opt = make()
    step = make_private_step(opt, loss_fn, clipped_sum_method=method)
    p, s = params, opt.init(params)
    for _ in range(3):
      out = step(p, s, [(batch, mask)])
      p, s = out.params, out.opt_state
    final[method] = p
  assert _l2(final["vmap"], params) > 1e-3
  _assert_trees_close(final["ghost"], final["vmap"], rtol=2e-4)


_MESH_SCRIPT = textwrap.dedent("""
    import json
    import jax, jax.numpy as jnp
    from flax import nnx
    from dpmuon_jax.distributed.mesh import data_mesh
    from dpmuon_jax.models.taps import tapped
    from dpmuon_jax.optimizers import dp_muon_im
    from dpmuon_jax.text.gpt2 import GPT2, GPT2Config, gpt2_model, lm_loss
    from dpmuon_jax.training.step import make_private_step

    config = GPT2Config(vocab_size=23, max_positions=16, dim=8, num_layers=1, num_heads=2)
    apply, params = gpt2_model(tapped(GPT2(config, rngs=nnx.Rngs(0))))
    loss_fn = lm_loss(apply)
    tokens = jax.random.randint(jax.random.key(1), (8, 12), 0, 23)
    batch = {"tokens": tokens, "loss_mask": jnp.ones((8, 12), jnp.int32)}
    mask = jnp.array([True] * 5 + [False] + [True] * 2)

    def run(**kw):
      opt = dp_muon_im(0.02, 0.1, 1.0, 7.0, key=3, history=2)
      step = make_private_step(opt, loss_fn, **kw)
      p, s = params, opt.init(params)
      for _ in range(2):
        out = step(p, s, [(batch, mask)])
        p, s = out.params, out.opt_state
      return p

    single = run(clipped_sum_method="vmap")
    mesh = run(clipped_sum_method="ghost", mesh=data_mesh(4), microbatch_size=1)
    diff = max(float(jnp.max(jnp.abs(a - b)))
               for a, b in zip(jax.tree.leaves(single), jax.tree.leaves(mesh)))
    moved = max(float(jnp.max(jnp.abs(a - b)))
                for a, b in zip(jax.tree.leaves(single), jax.tree.leaves(params)))
    print("RESULT" + json.dumps({"devices": jax.device_count(), "diff": diff, "moved": moved}))
    """)


def test_ghost_inner_momentum_on_a_four_device_mesh_matches_one_device_vmap():
  """Each device ghost-clips its rows (in microbatches of 1), the sums are added once:
  two DP-Muon-IM releases equal the single-device vmap path's."""
  env = host_devices_env(4)
  proc = subprocess.run([sys.executable, "-c", _MESH_SCRIPT], env=env, capture_output=True,
                        text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")][-1]
  result = json.loads(line[len("RESULT"):])
  assert result["devices"] == 4
  assert result["moved"] > 1e-3
  assert result["diff"] < 1e-4 * result["moved"] + 1e-6
