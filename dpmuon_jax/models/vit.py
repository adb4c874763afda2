"""Vision Transformer (ViT-Small by default) with LayerNorm.

Dosovitskiy et al., "An Image is Worth 16x16 Words" (2021); ViT-Small
(dim 384, 6 heads, 12 layers, MLP 4·dim) as in Touvron et al. (DeiT, 2021),
with 4×4 patches for 32×32 images. Pre-norm blocks, no dropout::

    z₀ = [cls_embed; patch_embed(patches(x))] + pos_embed
    z ← z + attn(norm1(z));  z ← z + mlp(norm2(z))        (depth times)
    logits = head(norm(z)[cls])

LayerNorm acts on each token of each example, so no statistic is shared
across the examples of a batch (per-example privacy: privacy invariant 1,
docs/design.md).

Every matrix is a 2-D (in, out) ``kernel``: the patch embedding is a Dense
layer on flattened p×p×C patches (ordered (p, p, C), i.e. a stride-p conv
kernel reshaped), and the attention uses separate ``query``, ``key``,
``value`` and ``out`` projections of shape (dim, dim), so Muon orthogonalises
each one on its own. Parameter paths (``models/common.py``): ``patch_embed``,
``pos_embed`` (tokens, dim), ``cls_embed`` (dim,),
``blocks/<i>/{norm1,attn/{query,key,value,out},norm2,mlp/{fc1,fc2}}``,
``norm``, ``head``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

_dense_init = nnx.initializers.xavier_uniform()
_embed_init = nnx.initializers.truncated_normal(stddev=0.02)


def _dense(d_in: int, d_out: int, rngs: nnx.Rngs) -> nnx.Linear:
  return nnx.Linear(d_in, d_out, kernel_init=_dense_init, rngs=rngs)


def patches(images: jax.Array, patch_size: int) -> jax.Array:
  """(..., H, W, C) → (..., (H/p)·(W/p), p·p·C), patches in row-major order."""
  *lead, h, w, c = images.shape
  p = patch_size
  x = images.reshape(*lead, h // p, p, w // p, p, c)
  x = jnp.moveaxis(x, -4, -3)  # (..., H/p, W/p, p, p, C)
  return x.reshape(*lead, (h // p) * (w // p), p * p * c)


class SelfAttention(nnx.Module):
  """Multi-head self-attention: softmax(q kᵀ / √d_head) v, per head."""

  def __init__(self, dim: int, num_heads: int, *, rngs: nnx.Rngs):
    if dim % num_heads:
      raise ValueError(f"dim {dim} is not divisible by num_heads {num_heads}.")
    self.num_heads = num_heads
    self.query = _dense(dim, dim, rngs)
    self.key = _dense(dim, dim, rngs)
    self.value = _dense(dim, dim, rngs)
    self.out = _dense(dim, dim, rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    *lead, t, d = x.shape
    split = lambda y: y.reshape(*lead, t, self.num_heads, d // self.num_heads)
    q, k, v = split(self.query(x)), split(self.key(x)), split(self.value(x))
    y = jax.nn.dot_product_attention(q, k, v)
    return self.out(y.reshape(*lead, t, d))


class Mlp(nnx.Module):
  """fc2(gelu(fc1(x)))."""

  def __init__(self, dim: int, hidden: int, *, rngs: nnx.Rngs):
    self.fc1 = _dense(dim, hidden, rngs)
    self.fc2 = _dense(hidden, dim, rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.fc2(jax.nn.gelu(self.fc1(x)))


class EncoderBlock(nnx.Module):
  """Pre-norm transformer block."""

  def __init__(self, dim: int, num_heads: int, mlp_dim: int, *, rngs: nnx.Rngs):
    self.norm1 = nnx.LayerNorm(dim, rngs=rngs)
    self.attn = SelfAttention(dim, num_heads, rngs=rngs)
    self.norm2 = nnx.LayerNorm(dim, rngs=rngs)
    self.mlp = Mlp(dim, mlp_dim, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    x = x + self.attn(self.norm1(x))
    return x + self.mlp(self.norm2(x))


class VisionTransformer(nnx.Module):
  """ViT classifier on the class token; defaults are ViT-Small/4 on 32×32×3.

  Args:
    num_classes: outputs of ``head``.
    image_shape: (H, W, C) of the inputs; H and W divisible by ``patch_size``.
    patch_size: side p of the square patches.
    dim, depth, num_heads: width, number of blocks, attention heads.
    mlp_dim: hidden width of the MLPs (default 4·dim).
    rngs: initialisation randomness (public; not a privacy key).
  """

  def __init__(
      self,
      num_classes: int,
      *,
      image_shape: tuple[int, int, int] = (32, 32, 3),
      patch_size: int = 4,
      dim: int = 384,
      depth: int = 12,
      num_heads: int = 6,
      mlp_dim: int | None = None,
      rngs: nnx.Rngs,
  ):
    h, w, c = image_shape
    if h % patch_size or w % patch_size:
      raise ValueError(f"Image size {h}x{w} is not divisible by patch size {patch_size}.")
    self.patch_size = patch_size
    num_tokens = (h // patch_size) * (w // patch_size) + 1
    self.patch_embed = _dense(patch_size * patch_size * c, dim, rngs)
    self.cls_embed = nnx.Param(_embed_init(rngs.params(), (dim,)))
    self.pos_embed = nnx.Param(_embed_init(rngs.params(), (num_tokens, dim)))
    self.blocks = nnx.List(
        [EncoderBlock(dim, num_heads, mlp_dim or 4 * dim, rngs=rngs) for _ in range(depth)]
    )
    self.norm = nnx.LayerNorm(dim, rngs=rngs)
    self.head = _dense(dim, num_classes, rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    tokens = self.patch_embed(patches(x, self.patch_size))
    cls = jnp.broadcast_to(self.cls_embed[...], (*tokens.shape[:-2], 1, tokens.shape[-1]))
    z = jnp.concatenate([cls, tokens], axis=-2) + self.pos_embed[...]
    for block in self.blocks:
      z = block(z)
    return self.head(self.norm(z)[..., 0, :])
