"""A cheap bit-level fingerprint of a pytree of arrays, computed on the device.

Two uint32 words that change whenever any bit of any leaf changes (up to a
2⁻⁶⁴-scale collision chance for unrelated inputs), in O(d) integer operations
and no randomness. The release uses it to recognise a noise key used again on
a *different* clipped sum (:func:`~dpmuon_jax.privacy.release.dp_release`).
It is a checksum against accidents, not a cryptographic hash.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

PyTree = Any

_MIX = (0x9E3779B1, 0x85EBCA77)  # odd multipliers (golden ratio, murmur3)
_LEAF = 0xC2B2AE3D


def _as_words(x: jax.Array) -> jax.Array:
  """The bits of ``x`` as a flat uint32 vector (float32 and int32 bit for bit)."""
  x = jnp.asarray(x)
  if x.dtype.itemsize != 4:
    x = x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x.astype(jnp.int32)
  return jax.lax.bitcast_convert_type(x, jnp.uint32).reshape(-1)


def _leaf_words(x: jax.Array) -> jax.Array:
  words = _as_words(x)
  position = jnp.arange(words.shape[0], dtype=jnp.uint32)
  first = jnp.sum(words * (position * jnp.uint32(2) + jnp.uint32(1)) * jnp.uint32(_MIX[0]),
                  dtype=jnp.uint32)
  mixed = words ^ (words >> jnp.uint32(16))
  second = jnp.sum((mixed + position) * jnp.uint32(_MIX[1]), dtype=jnp.uint32)
  return jnp.stack([first, second])


def tree_fingerprint(tree: PyTree) -> jax.Array:
  """``uint32[2]`` digest of every leaf's bits, their shapes' order and the leaf order."""
  digest = jnp.zeros(2, jnp.uint32)
  for leaf in jax.tree.leaves(tree):
    digest = digest * jnp.uint32(_LEAF) + _leaf_words(leaf) + jnp.uint32(jnp.size(leaf))
  return digest
