"""Routing presets: which leaves Muon orthogonalises, which the fallback takes (docs/design.md)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dpmuon_jax.optimizers.muon import dp_muon
from dpmuon_jax.optimizers.options import Fallback
from dpmuon_jax.privacy.release import dp_release
from dpmuon_jax.transforms.routing import FALLBACK, MUON, muon_labels, partition_muon

# A ViT/CNN-like tree on the path convention of models/common.py.
PARAMS = {
    "patch_embed": {"kernel": jnp.ones((2, 2, 3, 8)), "bias": jnp.zeros(8)},
    "pos_embed": jnp.zeros((1, 5, 8)),
    "conv1": {"kernel": jnp.ones((3, 3, 8, 8))},
    "block0": {
        "norm1": {"scale": jnp.ones(8), "bias": jnp.zeros(8)},
        "mlp": {"fc1": {"kernel": jnp.ones((8, 16)), "bias": jnp.zeros(16)}},
    },
    "head": {"kernel": jnp.ones((8, 10)), "bias": jnp.zeros(10)},
    # Flax multi-head attention: kernels (d, heads, head_dim), biases (heads, head_dim).
    "attn": {"query": {"kernel": jnp.ones((8, 2, 4)), "bias": jnp.zeros((2, 4))}},
}

def _normal(shape, seed):
  """Standard normal float32 test input (numpy: eager jax.random compiles per shape)."""
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


ALWAYS_FALLBACK = [  # biases and norm scales, whatever their rank
    ("patch_embed", "bias"), ("block0", "norm1", "scale"), ("block0", "norm1", "bias"),
    ("block0", "mlp", "fc1", "bias"), ("head", "bias"), ("attn", "query", "bias"),
]
HIDDEN = [("conv1", "kernel"), ("block0", "mlp", "fc1", "kernel"), ("attn", "query", "kernel")]
EMBED_AND_HEAD = [("patch_embed", "kernel"), ("pos_embed",), ("head", "kernel")]


def _get(tree, path):
  for name in path:
    tree = tree[name]
  return tree


def _expected(preset):
  outer = MUON if preset == "paper1" else FALLBACK
  return {**{p: FALLBACK for p in ALWAYS_FALLBACK}, **{p: MUON for p in HIDDEN},
          **{p: outer for p in EMBED_AND_HEAD}}


@pytest.mark.parametrize("preset", ["paper1", "muon", "paper2"])
def test_presets_route_each_kind_of_leaf(preset):
  labels = muon_labels(PARAMS, preset)
  expected = _expected(preset)
  assert len(expected) == len(jax.tree.leaves(PARAMS))
  for path, label in expected.items():
    assert _get(labels, path) == label, (preset, path)


def test_callable_routing_on_path():
  only_mlp = lambda path, leaf: "mlp" in path and leaf.ndim >= 2
  labels = muon_labels(PARAMS, only_mlp)
  assert _get(labels, ("block0", "mlp", "fc1", "kernel")) == MUON
  assert _get(labels, ("conv1", "kernel")) == FALLBACK
  with pytest.raises(ValueError, match="routing"):
    muon_labels(PARAMS, "muon2")


def test_head_matches_whole_path_entry_only():
  tree = {"num_heads_proj": {"kernel": jnp.ones((4, 4))}, "head": {"kernel": jnp.ones((4, 2))}}
  labels = muon_labels(tree, "muon")
  assert labels["num_heads_proj"]["kernel"] == MUON and labels["head"]["kernel"] == FALLBACK


SMALL = {
    "conv1": {"kernel": jnp.ones((3, 3, 2, 4)), "bias": jnp.zeros(4)},
    "norm": {"scale": jnp.ones(4)},
    "head": {"kernel": jnp.ones((4, 3)), "bias": jnp.zeros(3)},
}


def _per_example(batch=4):
  leaves, treedef = jax.tree.flatten(SMALL)
  return treedef.unflatten([_normal((batch,) + x.shape, i) for i, x in enumerate(leaves)])


def _release(per_example):
  release = dp_release(1.0, 1.0, 4.0, key=3)
  return jax.jit(release.update)(per_example, release.init(SMALL), SMALL)[0]


@pytest.mark.parametrize("preset", ["paper1", "muon"])
def test_dp_muon_applies_muon_and_sgd_momentum_where_labelled(preset):
  # Muon-routed matrices come out as η·(aspect)·NS(M̂) with singular values
  # near 1; fallback leaves get DP-SGD's momentum step −η·G̃ at step 1.
  per_example, lr = _per_example(), 0.5
  opt = dp_muon(lr, 1.0, 1.0, 4.0, key=3, routing=preset)
  updates, _ = jax.jit(opt.update)(per_example, opt.init(SMALL), SMALL)
  g = _release(per_example)
  labels = muon_labels(SMALL, preset)
  assert labels["head"]["kernel"] == (MUON if preset == "paper1" else FALLBACK)
  for path, label in jax.tree_util.tree_leaves_with_path(labels):
    u, gi = _get(updates, [k.key for k in path]), _get(g, [k.key for k in path])
    if label == FALLBACK:
      np.testing.assert_allclose(u, -lr * gi, rtol=1e-6, err_msg=str(path))
    else:
      s = np.linalg.svd(np.asarray(u).reshape(-1, u.shape[-1]) / lr, compute_uv=False)
      assert 0.5 < s.min() and s.max() < 1.25, path


def test_paper2_uses_adamw_with_its_own_settings():
  opt = dp_muon(0.02, 1.0, 1.0, 4.0, key=3, routing="paper2",
                fallback=Fallback(learning_rate=1e-3))
  state = opt.init(SMALL)
  is_adam = lambda x: isinstance(x, optax.ScaleByAdamState)
  fallback_state = state[1].inner_states[FALLBACK]
  assert sum(map(is_adam, jax.tree.leaves(fallback_state, is_leaf=is_adam))) == 1
  # Adam's first step moves every fallback coordinate by lr·sign(G̃) (head included).
  updates, _ = jax.jit(opt.update)(_per_example(), state, SMALL)
  for leaf in (updates["head"]["kernel"], updates["head"]["bias"], updates["norm"]["scale"]):
    np.testing.assert_allclose(np.abs(leaf), 1e-3, rtol=1e-3)
  assert float(jnp.max(jnp.abs(updates["conv1"]["kernel"]))) > 2e-3


def test_partition_muon_accepts_any_post_processing():
  tx = partition_muon(optax.scale(2.0), optax.scale(-1.0), "muon")
  out, _ = tx.update(PARAMS, tx.init(PARAMS))
  np.testing.assert_array_equal(out["conv1"]["kernel"], 2.0)
  np.testing.assert_array_equal(out["head"]["kernel"], -1.0)
