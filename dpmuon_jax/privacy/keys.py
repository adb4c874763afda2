"""Root randomness and its named, independent streams (threat model: docs/design.md).

Whoever knows the noise key can subtract the noise, so by default the root key
is drawn from OS entropy. A user-given key or integer seed is allowed for
reproducible research; the run then records that it was *seeded*.

The root key is split ONCE into named streams. Each consumer (the Poisson
sampler, the Gaussian release, data augmentation, randomised post-processing)
takes its own stream, so e.g. the sampling stream never sees noise randomness
and post-processing never draws from the noise stream.
"""

from __future__ import annotations

import secrets
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


class KeyStreams(NamedTuple):
  """Independent PRNG streams derived from one root key by a single split."""

  sampling: jax.Array
  noise: jax.Array
  augmentation: jax.Array
  postprocessing: jax.Array


class RootKey(NamedTuple):
  """A raw uint32 root key and whether it came from a user seed.

  Pass a ``RootKey`` on (e.g. to the sampler and the release of one run) to
  share one root drawn from OS entropy while keeping ``seeded=False``.
  """

  key: jax.Array
  seeded: bool


KeyLike = RootKey | jax.Array | int | None


def _entropy_key() -> jax.Array:
  words = np.array([secrets.randbits(32), secrets.randbits(32)], dtype=np.uint32)
  return jnp.asarray(words)


def _as_raw_key(key: jax.Array) -> jax.Array:
  if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
    return jax.random.key_data(key)
  if key.dtype != jnp.uint32:
    raise TypeError(f"A PRNG key must be a typed key or a uint32 array, got dtype {key.dtype}.")
  return key


def root_key(key: KeyLike = None) -> RootKey:
  """Returns the run's root key.

  Args:
    key: ``None`` draws 64 bits from the operating system (``secrets``), the
      default for private training. An ``int`` seed or a JAX key makes the run
      reproducible and is recorded as ``seeded=True``. A :class:`RootKey` is
      returned as it is.
  """
  if key is None:
    return RootKey(_entropy_key(), seeded=False)
  if isinstance(key, RootKey):
    return RootKey(_as_raw_key(jnp.asarray(key.key)), bool(key.seeded))
  if isinstance(key, (int, np.integer)):
    if isinstance(key, bool):
      raise TypeError("A seed must be an int, not a bool.")
    return RootKey(jax.random.key_data(jax.random.key(int(key))), seeded=True)
  return RootKey(_as_raw_key(jnp.asarray(key)), seeded=True)


def split_streams(key: KeyLike = None) -> tuple[KeyStreams, bool]:
  """Splits a root key once into the named streams; returns them and ``seeded``."""
  root = root_key(key)
  sampling, noise, augmentation, postprocessing = jax.random.split(root.key, 4)
  return KeyStreams(sampling, noise, augmentation, postprocessing), root.seeded


def stream_key(key: KeyLike, stream: str) -> tuple[jax.Array, bool]:
  """One named stream of the root ``key`` (see :class:`KeyStreams`)."""
  if stream not in KeyStreams._fields:
    raise ValueError(f"Unknown stream {stream!r}; expected one of {KeyStreams._fields}.")
  streams, seeded = split_streams(key)
  return getattr(streams, stream), seeded
