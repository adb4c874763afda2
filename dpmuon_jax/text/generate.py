"""Greedy and beam-search decoding with a length cap, jit-compiled.

Prompts are right-padded (B, L) with their lengths; decoding writes into a
fixed (B, L + N) buffer, N = ``max_new_tokens``, so the loop compiles once
for any prompt lengths. Each step runs the whole model on the buffer (no
key/value cache): causal attention makes the logits at position
``length + s − 1`` independent of the not-yet-written positions after it. That
costs N forward passes of length L + N, which is fine at E2E / DART lengths
(L ≈ 60–120, N ≈ 60–100) on an accelerator. Only the needed position is
projected onto the vocabulary, so memory is O(B·K·(L + N)·d), not ·V; decode
a split in chunks of prompts that fit.

Outputs are the N generated ids per prompt, ``eos_id`` from the first end
token on, and the number of ids before it.

Beam search keeps K hypotheses per prompt; a finished hypothesis stays in the
beam with its score frozen (it only extends by ``eos_id`` at log-probability 0).
The result is the hypothesis with the best Σ log p / n^α, n the number of
generated tokens including the end token and α = ``length_penalty`` (α = 1,
Hugging Face's default, is the per-token mean).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

PyTree = Any
ApplyFn = Callable[[PyTree, jax.Array, jax.Array], jax.Array]


class Generation(NamedTuple):
  tokens: jax.Array  # (B, N) int32, eos_id after the end
  lengths: jax.Array  # (B,) ids before the first eos_id (or N)


def _buffer(prompts: jax.Array, max_new_tokens: int, eos_id: int) -> jax.Array:
  pad = jnp.full(prompts.shape[:-1] + (max_new_tokens,), eos_id, prompts.dtype)
  return jnp.concatenate([prompts, pad], axis=-1)


def _logits_at(apply: ApplyFn, params: PyTree, buffer: jax.Array, pos: jax.Array) -> jax.Array:
  """log p(· | buffer[:pos + 1]) for each row: (R, V) float32."""
  return jax.nn.log_softmax(apply(params, buffer, pos).astype(jnp.float32), axis=-1)


def _output(buffer: jax.Array, lengths: jax.Array, max_new_tokens: int, eos_id: int) -> Generation:
  idx = lengths[:, None] + jnp.arange(max_new_tokens)
  gen = jnp.take_along_axis(buffer, idx, axis=1)
  is_end = gen == eos_id
  n = jnp.where(jnp.any(is_end, axis=1), jnp.argmax(is_end, axis=1), max_new_tokens)
  gen = jnp.where(jnp.arange(max_new_tokens) < n[:, None], gen, eos_id)
  return Generation(gen.astype(jnp.int32), n.astype(jnp.int32))


@partial(jax.jit, static_argnums=(0, 4, 5))
def greedy_decode(
    apply: ApplyFn,
    params: PyTree,
    prompts: jax.Array,
    lengths: jax.Array,
    max_new_tokens: int,
    eos_id: int,
) -> Generation:
  """argmax decoding of up to ``max_new_tokens`` ids after each prompt.

  Args:
    apply: ``apply(params, tokens (R, T), positions (R,)) -> logits (R, V)`` at
      the given positions (:func:`dpmuon_jax.text.gpt2.gpt2_model`).
    prompts: (B, L) int, right-padded; lengths: (B,) prompt lengths ≥ 1.
  """
  buffer = _buffer(prompts, max_new_tokens, eos_id)
  rows = jnp.arange(buffer.shape[0])

  def body(carry):
    s, buffer, done = carry
    pos = lengths + s
    token = jnp.argmax(_logits_at(apply, params, buffer, pos - 1), axis=-1)
    token = jnp.where(done, eos_id, token).astype(buffer.dtype)
    return s + 1, buffer.at[rows, pos].set(token), done | (token == eos_id)

  cond = lambda c: (c[0] < max_new_tokens) & ~jnp.all(c[2])
  done = jnp.zeros(buffer.shape[:1], bool)
  _, buffer, _ = jax.lax.while_loop(cond, body, (jnp.int32(0), buffer, done))
  return _output(buffer, lengths, max_new_tokens, eos_id)


@partial(jax.jit, static_argnums=(0, 4, 5, 6))
def beam_search(
    apply: ApplyFn,
    params: PyTree,
    prompts: jax.Array,
    lengths: jax.Array,
    max_new_tokens: int,
    eos_id: int,
    num_beams: int,
    length_penalty: float = 1.0,
) -> Generation:
  """Beam search with ``num_beams`` hypotheses per prompt (arguments as :func:`greedy_decode`)."""
  b, k = prompts.shape[0], num_beams
  buffer = jnp.repeat(_buffer(prompts, max_new_tokens, eos_id)[:, None], k, axis=1)
  total = buffer.shape[-1]
  flat_lengths = jnp.repeat(lengths, k)
  scores = jnp.tile(jnp.where(jnp.arange(k) == 0, 0.0, -jnp.inf), (b, 1))
  done = jnp.zeros((b, k), bool)
  gen_len = jnp.zeros((b, k), jnp.float32)

  def body(carry):
    s, buffer, scores, done, gen_len = carry
    logp = _logits_at(apply, params, buffer.reshape(b * k, total), flat_lengths + s - 1)
    v = logp.shape[-1]
    logp = logp.reshape(b, k, v)
    frozen = jnp.where(jnp.arange(v) == eos_id, 0.0, -jnp.inf)
    logp = jnp.where(done[..., None], frozen, logp)
    cand = (scores[..., None] + logp).reshape(b, k * v)
    scores, idx = jax.lax.top_k(cand, k)
    beam, token = idx // v, (idx % v).astype(buffer.dtype)
    pick = lambda x: jnp.take_along_axis(x, beam.reshape(beam.shape + (1,) * (x.ndim - 2)), 1)
    buffer, was_done, gen_len = pick(buffer), pick(done), pick(gen_len)
    pos = (lengths + s)[:, None, None]
    buffer = jnp.where(jnp.arange(total) == pos, token[..., None], buffer)
    gen_len = jnp.where(was_done, gen_len, gen_len + 1.0)
    return s + 1, buffer, scores, was_done | (token == eos_id), gen_len

  cond = lambda c: (c[0] < max_new_tokens) & ~jnp.all(c[3])
  init = (jnp.int32(0), buffer, scores, done, gen_len)
  _, buffer, scores, _, gen_len = jax.lax.while_loop(cond, body, init)
  best = jnp.argmax(scores / jnp.maximum(gen_len, 1.0) ** length_penalty, axis=1)
  buffer = jnp.take_along_axis(buffer, best[:, None, None], axis=1)[:, 0]
  return _output(buffer, lengths, max_new_tokens, eos_id)


def decode_texts(tokenizer, generation: Generation) -> list[str]:
  """The generated ids as stripped strings (one per prompt)."""
  tokens, lengths = np.asarray(generation.tokens), np.asarray(generation.lengths)
  return [tokenizer.decode(t[:n].tolist()).strip() for t, n in zip(tokens, lengths)]
