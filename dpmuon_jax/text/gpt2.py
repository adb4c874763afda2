"""GPT-2 (Radford et al., 2019) in Flax NNX, and its per-example causal LM loss.

Pre-norm decoder blocks with learned positions and a head tied to the token
embedding, as in Hugging Face's ``GPT2LMHeadModel``::

    h₀ = token_embed[x] + pos_embed[0..T−1]
    h ← h + attn(norm1(h));  h ← h + mlp(norm2(h))       (num_layers times)
    logits = norm(h) · token_embedᵀ                       (tied head)

with causal softmax(q kᵀ / √d_head) v attention and the tanh-approximated GELU
(``gelu_new``). No dropout: it would need per-step randomness and does not
change the privacy analysis.

Parameter paths follow :mod:`dpmuon_jax.models.common`: ``token_embed`` and
``pos_embed`` (``nnx.Embed``, leaf ``embedding``), then
``blocks/<i>/{norm1,attn/{query,key,value,out},norm2,mlp/{fc1,fc2}}`` and
``norm``. Attention keeps separate (dim, dim) ``query``, ``key``, ``value``
projections (Hugging Face's fused ``c_attn`` is split on loading), so Muon
orthogonalises each on its own. The tied head has no parameter of its own: it
is ``token_embed``, so the ``"paper2"`` routing sends it, with the positions,
to AdamW together with biases and norm scales, and every hidden matrix to
Muon (paper 2, §5 and appendix C).

The LM loss scores only target tokens. A batch is ``{"tokens", "loss_mask"}``
with ``tokens`` (B, T) int32, right-padded, and ``loss_mask`` (B, T) equal to
1 where ``tokens[t]`` is a target token (the ``target`` part of
``source <|endoftext|> target <|endoftext|>``, see :mod:`dpmuon_jax.text.data`).
Position t's logits predict token t + 1, so the weight of that prediction is
``loss_mask[t + 1]``. Right padding needs no attention mask: causal attention
never lets a real token see a later padding token.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from dpmuon_jax import checks

PyTree = Any
ApplyFn = Callable[[PyTree, jax.Array], jax.Array]

_init = nnx.initializers.normal(stddev=0.02)


class GPT2Config(NamedTuple):
  """Sizes of a GPT-2 model (Hugging Face ``GPT2Config`` names in comments)."""

  vocab_size: int = 50257  # vocab_size
  max_positions: int = 1024  # n_positions
  dim: int = 768  # n_embd
  num_layers: int = 12  # n_layer
  num_heads: int = 12  # n_head
  layer_norm_eps: float = 1e-5  # layer_norm_epsilon

  @property
  def mlp_dim(self) -> int:
    return 4 * self.dim


GPT2_SMALL = GPT2Config()
"""GPT-2 small, 124M parameters (Hugging Face ``gpt2``), paper 2's model."""

GPT2_TINY = GPT2Config(max_positions=256, dim=128, num_layers=4, num_heads=4)
"""A 4-layer, 128-wide GPT-2 on the full BPE vocabulary (7.26M parameters, 6.43M
of them the token embedding), for training from scratch on a CPU."""

GPT2_CPU = GPT2Config(vocab_size=4096, max_positions=192, dim=64, num_layers=2, num_heads=2)
"""A 2-layer, 64-wide GPT-2 on GPT-2's BPE cut to 4,096 tokens (375k parameters):
the CPU-scale E2E model of ``experiments/text_configs.py`` (``e2e_cpu_im``)."""


def checked_config(base: GPT2Config, overrides: Mapping[str, Any],
                   source: str = "overrides") -> GPT2Config:
  """``base`` with the fields ``overrides`` gives, refused in one line naming ``source``
  where a field is unknown, a size is not a positive integer, ``layer_norm_eps`` is not
  > 0, or ``dim`` is not a multiple of ``num_heads``: before any parameter exists."""
  for field, value in overrides.items():
    if field not in GPT2Config._fields:
      raise ValueError(f"{source}: GPT-2 has no field {field!r}; its fields: "
                       f"{', '.join(GPT2Config._fields)}.")
    if field == "layer_norm_eps":
      checks.check_positive(f"{source}[{field!r}]", value)
    else:
      checks.check_positive_int(f"{source}[{field!r}]", value)
  config = base._replace(**overrides)
  if config.dim % config.num_heads:
    raise ValueError(f"{source}: dim {config.dim} is not divisible by num_heads "
                     f"{config.num_heads}.")
  return config


class CausalSelfAttention(nnx.Module):
  """Multi-head causal self-attention with separate q, k, v and output projections."""

  def __init__(self, dim: int, num_heads: int, *, rngs: nnx.Rngs):
    if dim % num_heads:
      raise ValueError(f"dim {dim} is not divisible by num_heads {num_heads}.")
    self.num_heads = num_heads
    dense = lambda: nnx.Linear(dim, dim, kernel_init=_init, rngs=rngs)
    self.query, self.key, self.value, self.out = dense(), dense(), dense(), dense()

  def __call__(self, x: jax.Array) -> jax.Array:
    *lead, t, d = x.shape
    split = lambda y: y.reshape(*lead, t, self.num_heads, d // self.num_heads)
    q, k, v = split(self.query(x)), split(self.key(x)), split(self.value(x))
    y = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    return self.out(y.reshape(*lead, t, d))


class Mlp(nnx.Module):
  """fc2(gelu_tanh(fc1(x)))."""

  def __init__(self, dim: int, hidden: int, *, rngs: nnx.Rngs):
    self.fc1 = nnx.Linear(dim, hidden, kernel_init=_init, rngs=rngs)
    self.fc2 = nnx.Linear(hidden, dim, kernel_init=_init, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.fc2(jax.nn.gelu(self.fc1(x), approximate=True))


class Block(nnx.Module):
  """Pre-norm decoder block."""

  def __init__(self, config: GPT2Config, *, rngs: nnx.Rngs):
    norm = lambda: nnx.LayerNorm(config.dim, epsilon=config.layer_norm_eps, rngs=rngs)
    self.norm1 = norm()
    self.attn = CausalSelfAttention(config.dim, config.num_heads, rngs=rngs)
    self.norm2 = norm()
    self.mlp = Mlp(config.dim, config.mlp_dim, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    x = x + self.attn(self.norm1(x))
    return x + self.mlp(self.norm2(x))


class GPT2(nnx.Module):
  """GPT-2 language model: ``tokens (..., T) int → logits (..., T, vocab_size)``.

  Args:
    config: the sizes; :data:`GPT2_SMALL` is the 124M model.
    rngs: initialisation randomness (public; not a privacy key). Weights are
      N(0, 0.02²), biases 0, norms (1, 0), as GPT-2's own initialisation
      without its residual rescaling.
  """

  def __init__(self, config: GPT2Config = GPT2_SMALL, *, rngs: nnx.Rngs):
    self.config = config
    self.token_embed = nnx.Embed(config.vocab_size, config.dim, embedding_init=_init, rngs=rngs)
    self.pos_embed = nnx.Embed(config.max_positions, config.dim, embedding_init=_init, rngs=rngs)
    self.blocks = nnx.List([Block(config, rngs=rngs) for _ in range(config.num_layers)])
    self.norm = nnx.LayerNorm(config.dim, epsilon=config.layer_norm_eps, rngs=rngs)

  def __call__(self, tokens: jax.Array, positions: jax.Array | None = None) -> jax.Array:
    """Logits at every position, or only at ``positions`` (shape ``tokens.shape[:-1]``).

    Decoding needs one position per row; projecting only those onto the
    vocabulary saves a (B, T, V) array.
    """
    t = tokens.shape[-1]
    if t > self.config.max_positions:
      raise ValueError(f"{t} tokens exceed max_positions={self.config.max_positions}.")
    h = self.token_embed(tokens) + self.pos_embed(jnp.arange(t))
    for block in self.blocks:
      h = block(h)
    if positions is not None:
      h = jnp.take_along_axis(h, positions[..., None, None], axis=-2)[..., 0, :]
    return self.token_embed.attend(self.norm(h))


def gpt2_model(module: GPT2) -> tuple[Callable[..., jax.Array], PyTree]:
  """``(apply, params)``: ``apply(params, tokens, positions=None)`` as :meth:`GPT2.__call__`
  and the parameter dict (like :func:`dpmuon_jax.models.common.pure_model`)."""
  graphdef, state = nnx.split(module)

  def apply(params: PyTree, tokens: jax.Array, positions: jax.Array | None = None) -> jax.Array:
    return nnx.merge(graphdef, nnx.State(params))(tokens, positions)

  return apply, nnx.to_pure_dict(state)


def token_nll(apply: ApplyFn, params: PyTree, batch: PyTree) -> tuple[jax.Array, jax.Array]:
  """Per example: (Σ_t m_{t+1} · −log p(x_{t+1} | x_≤t), Σ_t m_{t+1}), nats.

  ``m`` is ``batch["loss_mask"]``; both outputs have shape (B,).
  """
  tokens = batch["tokens"]
  weights = batch["loss_mask"][..., 1:].astype(jnp.float32)
  logits = apply(params, tokens)[..., :-1, :].astype(jnp.float32)
  nll = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[..., 1:])
  return jnp.sum(nll * weights, axis=-1), jnp.sum(weights, axis=-1)


def lm_loss(apply: ApplyFn) -> Callable[[PyTree, PyTree], jax.Array]:
  """``loss_fn(params, batch)``: the mean over examples of each example's mean
  target-token NLL, ℓ_i = Σ_t m_{i,t+1} nll_{i,t} / Σ_t m_{i,t+1}.

  Each example's loss depends on that example alone (padding and source tokens
  carry zero weight), so on a batch of one it is the per-example loss the
  private query differentiates. An example without target tokens has loss 0.
  """

  def loss_fn(params: PyTree, batch: PyTree) -> jax.Array:
    total, count = token_nll(apply, params, batch)
    return jnp.mean(total / jnp.maximum(count, 1.0))

  return loss_fn
