"""Root randomness and its named, independent streams (threat model: docs/design.md).

Whoever knows the noise key can subtract the noise, so by default the root key
is drawn from OS entropy. A user-given key or integer seed is allowed for
reproducible research; the run then records that it was *seeded*.

The root key is split ONCE into named streams. Each consumer (the Poisson
sampler, the Gaussian release, data augmentation, randomised post-processing)
takes its own stream, so e.g. the sampling stream never sees noise randomness
and post-processing never draws from the noise stream.

One noise stream per release, ever: every Gaussian release built from one
:class:`RootKey` object *claims* its own noise stream (:func:`claim_noise_stream`):
the first takes the root's noise stream N, the i-th ``fold_in(P, i)`` with
``P = fold_in(N, 2³² − 1)``. Release k of a stream S uses ``fold_in(S, k)``
with k < 2³¹ (an int32 counter), so P, and every key below it, is none of
the first stream's keys: ``fold_in(N, i)`` would be the first release's key
at index i (JAX's ``split`` is ``fold_in`` of the counter), and its leaf keys
the i-th stream's release keys.
So two optimizers built from one :func:`~dpmuon_jax.make_private` setup never
add the same noise to different sums. The claims are counted in program order,
so a program rebuilt the same way (a resumed run, the processes of one
multi-process run, a seeded rerun) gets the same streams. An int seed builds a
new ``RootKey`` each time it is given: the same seed names the same stream,
which is what a user asks for by seeding (reproducible research).
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import secrets
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

# The index under the root's noise stream that the claimed streams 1, 2, ... hang from: above
# every release index k (an int32 counter), so no claimed stream is a release key of stream 0.
_CLAIMS_INDEX = 2**32 - 1


class KeyStreams(NamedTuple):
  """Independent PRNG streams derived from one root key by a single split."""

  sampling: jax.Array
  noise: jax.Array
  augmentation: jax.Array
  postprocessing: jax.Array


@dataclasses.dataclass(frozen=True, eq=False)
class RootKey:
  """A raw uint32 root key, whether it came from a user seed, and its stream claims.

  Pass a ``RootKey`` on (e.g. to the sampler and the release of one run) to
  share one root drawn from OS entropy while keeping ``seeded=False``. Each
  release built from it claims a noise stream of its own (``claims`` counts
  them), so sharing a ``RootKey`` never shares noise.
  """

  key: jax.Array
  seeded: bool
  claims: itertools.count = dataclasses.field(default_factory=itertools.count, repr=False)

  def __post_init__(self):
    object.__setattr__(self, "key", _as_raw_key(jnp.asarray(self.key)))
    object.__setattr__(self, "seeded", bool(self.seeded))

  def __copy__(self) -> RootKey:
    """The root itself: a copy with its own claim counter would hand out the same streams."""
    return self

  def __deepcopy__(self, memo: dict) -> RootKey:
    """The root itself (``copy.deepcopy(setup.release_kwargs)`` shares the claims)."""
    return self


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


def _checked_seed(seed: int) -> int:
  """``seed`` if ``jax.random.key`` maps it to a key of its own, else a one-line ``ValueError``.

  Without ``jax_enable_x64`` JAX keeps a seed's low 32 bits only, so 5 and
  2³² + 5 would name one noise stream (and −5 the stream of 2³² − 5); with it,
  seeds from 2⁶³ on do not convert.
  """
  bits = 63 if jax.config.read("jax_enable_x64") else 32
  if not 0 <= seed < 2**bits:
    raise ValueError(
        f"A seed must be an int in [0, 2**{bits}), got {seed}: JAX would map it onto another "
        "seed's key (it keeps the low 32 bits without jax_enable_x64) or refuse it."
    )
  return seed


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
    return key
  if isinstance(key, (int, np.integer)):
    if isinstance(key, bool):
      raise TypeError("A seed must be an int, not a bool.")
    return RootKey(jax.random.key_data(jax.random.key(_checked_seed(int(key)))), seeded=True)
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


def claim_noise_stream(key: KeyLike = None) -> tuple[jax.Array, bool]:
  """A noise stream that no other release built from ``key`` uses; and ``seeded``.

  ``None`` draws a new root from OS entropy; an int seed or JAX key names a
  new seeded root (the same seed, the same stream: reproducible by request).
  A :class:`RootKey` hands out ``noise``, ``fold_in(P, 1)``,
  ``fold_in(P, 2)``, ... to the releases built from it, in program order,
  with ``P = fold_in(noise, 2³² − 1)``: an index no release counter reaches.
  """
  root = root_key(key)
  noise = split_streams(root)[0].noise
  claim = next(root.claims)
  if claim == 0:
    return noise, root.seeded
  claims = jax.random.fold_in(noise, jnp.uint32(_CLAIMS_INDEX))
  return jax.random.fold_in(claims, claim), root.seeded


def named_seed(seed: int, name: str) -> int:
  """A seed of its own for the run called ``name`` of a family seeded with ``seed``.

  Runs seeded alike would share every stream (the same noise on different
  sums, the same Poisson samples); ``named_seed(seed, name)`` gives each named
  run its own, reproducibly: the first 31 bits of SHA-256 of ``"seed/name"``.
  """
  digest = hashlib.sha256(f"{int(seed)}/{name}".encode()).digest()
  return int.from_bytes(digest[:4], "big") >> 1
