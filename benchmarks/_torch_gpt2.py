"""A PyTorch twin of :class:`dpmuon_jax.text.gpt2.GPT2`, for timing Opacus on the same model.

Same architecture and shapes as the Flax model for a given
:class:`~dpmuon_jax.text.gpt2.GPT2Config` (Radford et al., 2019, "Language
Models are Unsupervised Multitask Learners", §2.3, as Hugging Face's
``GPT2LMHeadModel`` without dropout):

    h₀ = token_embed[x] + pos_embed[0..T−1]
    h ← h + attn(norm1(h));  h ← h + mlp(norm2(h))       (num_layers times)
    logits = norm(h) · token_embedᵀ                       (tied head)

with separate q, k, v, out projections, causal softmax(q kᵀ / √d_head) v and
the tanh GELU. Every parameter lives in an ``nn.Embedding``, ``nn.Linear`` or
``nn.LayerNorm``, the layers Opacus computes per-sample gradients (and ghost
norms) for. The head is an ``nn.Linear`` whose weight IS the token table, so
the parameter count equals the Flax model's (:func:`parameter_count`), or,
with ``tied_head=False``, a separate (vocab_size, dim) matrix of the same
shape and cost: Opacus's ghost clipping refuses tied parameters ("Parameter
tying is not supported with Ghost Clipping").

:class:`SequenceLoss` is :func:`dpmuon_jax.text.gpt2.lm_loss`: each example's
mean target-token NLL, averaged (or summed) over examples, or per example
under ``reduction="none"`` (what Opacus's ghost clipping wraps).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dpmuon_jax.text.gpt2 import GPT2Config


class CausalSelfAttention(nn.Module):
  """Multi-head causal self-attention with separate q, k, v and output projections."""

  def __init__(self, dim: int, num_heads: int):
    super().__init__()
    self.num_heads = num_heads
    self.query, self.key, self.value, self.out = (nn.Linear(dim, dim) for _ in range(4))

  def forward(self, x: torch.Tensor) -> torch.Tensor:
    b, t, d = x.shape
    split = lambda y: y.view(b, t, self.num_heads, d // self.num_heads).transpose(1, 2)
    q, k, v = split(self.query(x)), split(self.key(x)), split(self.value(x))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return self.out(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
  """Pre-norm decoder block: x + attn(norm1(x)), then + fc2(gelu_tanh(fc1(norm2(x))))."""

  def __init__(self, config: GPT2Config):
    super().__init__()
    self.norm1 = nn.LayerNorm(config.dim, eps=config.layer_norm_eps)
    self.attn = CausalSelfAttention(config.dim, config.num_heads)
    self.norm2 = nn.LayerNorm(config.dim, eps=config.layer_norm_eps)
    self.fc1 = nn.Linear(config.dim, config.mlp_dim)
    self.fc2 = nn.Linear(config.mlp_dim, config.dim)

  def forward(self, x: torch.Tensor) -> torch.Tensor:
    x = x + self.attn(self.norm1(x))
    return x + self.fc2(F.gelu(self.fc1(self.norm2(x)), approximate="tanh"))


class TorchGPT2(nn.Module):
  """``tokens (B, T) int64 → logits (B, T, vocab_size)``; weights N(0, 0.02²), biases 0.

  ``tied_head=False`` gives the head its own weight (vocab_size · dim more
  parameters).
  """

  def __init__(self, config: GPT2Config, tied_head: bool = True):
    super().__init__()
    self.token_embed = nn.Embedding(config.vocab_size, config.dim)
    self.pos_embed = nn.Embedding(config.max_positions, config.dim)
    self.blocks = nn.ModuleList([Block(config) for _ in range(config.num_layers)])
    self.norm = nn.LayerNorm(config.dim, eps=config.layer_norm_eps)
    self.head = nn.Linear(config.dim, config.vocab_size, bias=False)
    if tied_head:
      self.head.weight = self.token_embed.weight  # as the Flax model's attend
    for module in self.modules():
      if isinstance(module, nn.Linear | nn.Embedding):
        nn.init.normal_(module.weight, std=0.02)
      if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)

  def forward(self, tokens: torch.Tensor) -> torch.Tensor:
    # (B, T) positions, not (T,): Opacus reads the first axis of every input as the batch.
    positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens).contiguous()
    h = self.token_embed(tokens) + self.pos_embed(positions)
    for block in self.blocks:
      h = block(h)
    return self.head(self.norm(h))


def parameter_count(model: nn.Module) -> int:
  """Number of scalars in the parameters, a tied parameter once."""
  return sum(p.numel() for p in model.parameters())


class SequenceLoss(nn.Module):
  """ℓ_i = Σ_t m_{i,t+1} nll_{i,t} / max(1, Σ_t m_{i,t+1}); reduced by ``reduction``.

  ``reduction``: ``"mean"`` or ``"sum"`` over examples, ``"none"`` for the (B,)
  per-example losses. Opacus's ghost clipping sets it to ``"none"`` itself.
  """

  def __init__(self, reduction: str = "mean"):
    super().__init__()
    self.reduction = reduction

  def forward(self, logits: torch.Tensor, tokens: torch.Tensor, loss_mask: torch.Tensor
              ) -> torch.Tensor:
    nll = F.cross_entropy(logits[:, :-1].transpose(1, 2), tokens[:, 1:], reduction="none")
    weights = loss_mask[:, 1:].to(nll.dtype)
    per_example = (nll * weights).sum(1) / weights.sum(1).clamp(min=1.0)
    if self.reduction == "none":
      return per_example
    return per_example.mean() if self.reduction == "mean" else per_example.sum()
