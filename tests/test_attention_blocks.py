"""How Muon blocks an attention's q, k, v for orthogonalisation: "split", "fused" or "heads".

Paper 2 ("Inner Momentum for DP-Muon") trains Hugging Face GPT-2, whose ``c_attn``
fuses q, k, v into one d × 3d matrix, and leaves open which blocks Muon
orthogonalised; ``attention_blocks`` makes the choice explicit. Checked here
on a tiny :class:`~dpmuon_jax.text.gpt2.GPT2` against the blocks built by hand.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dpmuon_jax.linalg.newton_schulz import NewtonSchulz
from dpmuon_jax.linalg.newton_schulz import newton_schulz as _newton_schulz
from dpmuon_jax.linalg.scaling import aspect_factor, matrix_view
from dpmuon_jax.models.cnn import small_cnn
from dpmuon_jax.optimizers.filters import dp_disk_muon, dp_doppler_muon
from dpmuon_jax.optimizers.muon import dp_muon, dp_muon_s, muon
from dpmuon_jax.optimizers.options import ATTENTION_BLOCKS, Fallback
from dpmuon_jax.optimizers.paper2 import dp_muon_bc, dp_muon_im
from dpmuon_jax.text.gpt2 import GPT2, GPT2Config, gpt2_model, lm_loss
from dpmuon_jax.training.step import make_private_step
from dpmuon_jax.transforms.bias_correction import (
    KIM_FAN_NS_COEFFS,
    scale_by_bias_corrected_orthogonalization,
)
from dpmuon_jax.transforms.muon import QKV, matrix_blocks, scale_by_orthogonalization

CONFIG = GPT2Config(vocab_size=97, max_positions=16, dim=16, num_layers=1, num_heads=2)
D, H = CONFIG.dim, CONFIG.num_heads
newton_schulz = jax.jit(_newton_schulz)  # one compile per shape


def _gpt2():
  return gpt2_model(GPT2(CONFIG, rngs=nnx.Rngs(0)))


def _matrix_updates(params, seed=0):
  """Standard normal updates for every rank >= 2 leaf of ``params`` (the others dropped)."""
  rng = np.random.default_rng(seed)
  return jax.tree.map(
      lambda p: jnp.asarray(rng.standard_normal(p.shape), jnp.float32) if p.ndim >= 2 else None,
      params)


def _orthogonalise(updates, **kwargs):
  tx = scale_by_orthogonalization(**kwargs)
  return jax.jit(tx.update)(updates, tx.init(updates))[0]


def _attn(tree):
  return tree["blocks"][0]["attn"]


def _ns(m):
  """aspect · NS₅(m) of one fan_in × fan_out matrix (DP-Muon's cap and coefficients)."""
  return aspect_factor(*m.shape) * newton_schulz(m[None])[0]


@pytest.fixture(scope="module")
def updates():
  return _matrix_updates(_gpt2()[1])


@pytest.fixture(scope="module")
def split(updates):
  return _orthogonalise(updates)


def test_split_is_bit_identical_to_the_per_leaf_update(updates, split):
  @jax.jit
  def per_leaf(tree):  # the orthogonalisation before attention blocks existed, leaf by leaf
    def leaf(g):
      view = matrix_view(g.shape)
      x = _newton_schulz(view.to_matrices(g))
      return view.from_matrices(aspect_factor(view.fan_in, view.fan_out) * x).astype(g.dtype)
    return jax.tree.map(leaf, tree)

  explicit = _orthogonalise(updates, attention_blocks="split")
  for a, b, c in zip(jax.tree.leaves(split), jax.tree.leaves(explicit),
                     jax.tree.leaves(per_leaf(updates)), strict=True):
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(a, c)


def test_fused_is_concatenate_then_ns_then_split(updates, split):
  fused = _orthogonalise(updates, attention_blocks="fused")
  qkv = jnp.concatenate([_attn(updates)[n]["kernel"] for n in QKV], axis=1)
  assert qkv.shape == (D, 3 * D)  # Hugging Face's c_attn
  by_hand = np.split(np.asarray(_ns(qkv)), 3, axis=1)
  for name, expected in zip(QKV, by_hand, strict=True):
    np.testing.assert_allclose(_attn(fused)[name]["kernel"], expected, atol=2e-6)
    assert np.max(np.abs(_attn(fused)[name]["kernel"] - _attn(split)[name]["kernel"])) > 0.1
  for path in (("attn", "out"), ("mlp", "fc1"), ("mlp", "fc2")):  # not q, k, v: as split
    a, b = fused["blocks"][0], split["blocks"][0]
    for key in path:
      a, b = a[key], b[key]
    np.testing.assert_allclose(a["kernel"], b["kernel"], atol=1e-7)


def test_heads_orthogonalises_each_heads_columns(updates, split):
  heads = _orthogonalise(updates, attention_blocks="heads", attention_heads=H)
  dh = D // H
  for name in QKV:
    g, out = _attn(updates)[name]["kernel"], _attn(heads)[name]["kernel"]
    for h in range(H):
      cols = slice(h * dh, (h + 1) * dh)
      np.testing.assert_allclose(out[:, cols], _ns(g[:, cols]), atol=2e-6)
    assert np.max(np.abs(out - _attn(split)[name]["kernel"])) > 0.1
  np.testing.assert_allclose(heads["blocks"][0]["mlp"]["fc1"]["kernel"],
                             split["blocks"][0]["mlp"]["fc1"]["kernel"], atol=1e-7)


def test_fused_block_is_orthogonalised_as_one_d_by_3d_matrix(updates):
  """With a convergent NS, [Ĝ_Q | Ĝ_K | Ĝ_V] = √3 · U Vᵀ of [Q | K | V] (all σ = √3).

  Split's concatenation also has σ = √3 (three orthogonal d × d blocks), but it
  is not the polar factor of [Q | K | V]: only "fused" is.
  """
  kw = dict(ns=NewtonSchulz(steps=25, coeffs=KIM_FAN_NS_COEFFS))
  updates = {"blocks": {0: {"attn": {n: _attn(updates)[n] for n in QKV}}}}
  qkv = jnp.concatenate([_attn(updates)[n]["kernel"] for n in QKV], axis=1)
  u, _, vt = np.linalg.svd(np.asarray(qkv, np.float64), full_matrices=False)
  polar = math.sqrt(3.0) * u @ vt
  joined = {}
  for choice in ("fused", "split"):
    out = _orthogonalise(updates, attention_blocks=choice, **kw)
    joined[choice] = np.concatenate([_attn(out)[n]["kernel"] for n in QKV], axis=1)
    np.testing.assert_allclose(np.linalg.svd(joined[choice], compute_uv=False), math.sqrt(3.0),
                               rtol=1e-4)
  np.testing.assert_allclose(joined["fused"], polar, atol=1e-4)
  assert np.max(np.abs(joined["split"] - polar)) > 0.1


def test_a_model_without_attention_is_unchanged():
  updates = _matrix_updates(small_cnn(4, 1, image_shape=(8, 8), key=jax.random.key(0)).params)
  split = matrix_blocks(updates).matrices
  for kwargs in ({"attention_blocks": "fused"},
                 {"attention_blocks": "heads", "attention_heads": 2}):
    for a, b in zip(split, matrix_blocks(updates, **kwargs).matrices, strict=True):
      np.testing.assert_array_equal(a, b)
  fused = _orthogonalise(updates, attention_blocks="fused")
  for a, b in zip(jax.tree.leaves(_orthogonalise(updates)), jax.tree.leaves(fused), strict=True):
    np.testing.assert_array_equal(a, b)


def test_matrix_blocks_round_trip(updates):
  for kwargs in ({"attention_blocks": "split"}, {"attention_blocks": "fused"},
                 {"attention_blocks": "heads", "attention_heads": H}):
    blocks = matrix_blocks(updates, **kwargs)
    shapes = sorted(m.shape for m in blocks.matrices)
    if kwargs["attention_blocks"] == "fused":
      assert (1, D, 3 * D) in shapes and (1, D, D) in shapes  # [Q | K | V], the output
    if kwargs["attention_blocks"] == "heads":
      assert shapes.count((H, D, D // H)) == 3
    for a, b in zip(jax.tree.leaves(blocks.unblock(blocks.matrices)), jax.tree.leaves(updates),
                    strict=True):
      np.testing.assert_array_equal(a, b)


def test_bad_choices_are_refused(updates):
  with pytest.raises(ValueError, match=r"attention_blocks must be one of \('split', 'fused'"):
    scale_by_orthogonalization(attention_blocks="qkv")
  with pytest.raises(ValueError, match="attention_blocks must be one of"):
    muon(0.02, attention_blocks="Fused")
  with pytest.raises(ValueError, match="attention_blocks must be one of"):
    dp_muon(0.02, 1.0, 1.0, 8.0, jax.random.key(0), attention_blocks="per_head")
  with pytest.raises(ValueError, match="attention_heads"):
    muon(0.02, attention_blocks="heads")
  with pytest.raises(ValueError, match="attention_heads is used by attention_blocks='heads' only"):
    muon(0.02, attention_blocks="fused", attention_heads=2)
  with pytest.raises(ValueError, match="not divisible by attention_heads=3"):
    _orthogonalise(updates, attention_blocks="heads", attention_heads=3)
  only_query = jax.tree_util.tree_map_with_path(
      lambda p, x: None if any(getattr(k, "key", None) in ("key", "value") for k in p) else x,
      updates)
  with pytest.raises(ValueError, match="only \\['query'\\] are"):
    _orthogonalise(only_query, attention_blocks="fused")


def test_options_reach_muon_through_every_paper2_optimizer():
  release = (0.02, 1.0, 1.0, 8.0, jax.random.key(0))
  builds = (dp_muon_im, dp_disk_muon, dp_muon_bc, dp_doppler_muon,
            functools.partial(dp_disk_muon, composition="replace"))
  for build in builds:
    build(*release, attention_blocks="fused")
    with pytest.raises(ValueError, match="attention_heads"):
      build(*release, attention_blocks="heads")  # checked by the orthogonalising transform


def test_dp_muon_s_refuses_attention_blocks_in_one_line():
  with pytest.raises(ValueError, match="muon_s orthogonalises each leaf"):
    dp_muon_s(0.3, 1.0, 1.0, 8.0, jax.random.key(0), attention_blocks="fused")


# "heads" is a slow variant: per-head blocks are pinned fast by
# test_heads_orthogonalises_each_heads_columns, the bias correction's use of them by "fused".
@pytest.mark.parametrize("choice", ["fused", pytest.param("heads", marks=pytest.mark.slow)])
def test_bias_correction_sees_the_same_blocks(updates, choice):
  """With s₀ = 0, 2F(M) − F(M + 0·Z) = F(M): DP-Muon-BC's step is the blocked NS step."""
  kwargs = {"attention_heads": H} if choice == "heads" else {}
  tx = scale_by_bias_corrected_orthogonalization(0.0, 0.95, jax.random.key(0),
                                                 attention_blocks=choice, **kwargs)
  corrected = jax.jit(tx.update)(updates, tx.init(updates))[0]
  plain = _orthogonalise(updates, attention_blocks=choice,
                         ns=NewtonSchulz(coeffs=KIM_FAN_NS_COEFFS), **kwargs)
  for a, b in zip(jax.tree.leaves(corrected), jax.tree.leaves(plain), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  per_leaf = _orthogonalise(updates, ns=NewtonSchulz(coeffs=KIM_FAN_NS_COEFFS))
  assert not np.allclose(_attn(corrected)["query"]["kernel"], _attn(per_leaf)["query"]["kernel"])


def _private_step_outputs(choice):
  kwargs = {"attention_heads": H} if choice == "heads" else {}
  opt = dp_muon(0.02, 0.5, 1.0, 8.0, jax.random.key(3), routing="paper2",
                fallback=Fallback(kind="adamw", learning_rate=1e-3), attention_blocks=choice,
                **kwargs)
  apply, params = _gpt2()
  rng = np.random.default_rng(2)
  batch = {"tokens": jnp.asarray(rng.integers(0, CONFIG.vocab_size, (4, 8)), jnp.int32),
           "loss_mask": jnp.ones((4, 8), jnp.float32)}
  state = opt.init(params)
  out = make_private_step(opt, lm_loss(apply))(params, state, [(batch, jnp.ones(4, bool))])
  return params, state, out


# Slow, end to end; pinned fast by the transform tests above (each choice's blocks, split
# bit-identical to per leaf) and by test_options_reach_muon_through_every_paper2_optimizer.
@pytest.mark.slow
def test_private_step_runs_with_each_choice_and_only_the_attention_differs():
  runs = {choice: _private_step_outputs(choice) for choice in ATTENTION_BLOCKS}
  params, state, split = runs["split"]
  for choice, (_, other_state, out) in runs.items():
    assert jax.tree.structure(other_state) == jax.tree.structure(state)  # momentum per leaf
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(out.params))
    assert float(out.stats.norm_max) == float(split.stats.norm_max)  # same release
    new, ref = out.params["blocks"][0], split.params["blocks"][0]
    for leaf in ("token_embed", "pos_embed", "norm"):  # AdamW group under "paper2"
      for a, b in zip(jax.tree.leaves(out.params[leaf]), jax.tree.leaves(split.params[leaf]),
                      strict=True):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(new["mlp"]["fc1"]["kernel"], ref["mlp"]["fc1"]["kernel"],
                               atol=1e-7)
    moved = np.max(np.abs(new["attn"]["query"]["kernel"] - ref["attn"]["query"]["kernel"]))
    assert (moved > 1e-4) == (choice != "split")
    assert not np.allclose(new["attn"]["query"]["kernel"],
                           params["blocks"][0]["attn"]["query"]["kernel"])
