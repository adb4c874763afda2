"""Host-side Poisson sampling into static, masked batches (privacy invariant 4, docs/design.md).

At step t every example i ∈ {0, …, N−1} is included independently with
probability q, so the realised batch size is Binomial(N, q), as the
accountant's ``PoissonSampled(q, ·)`` event assumes. The draw is ONE global
draw per step: it depends only on the sampling stream of the run's root key
and on t, so every host derives the same sample and resuming at step t
reproduces it. Concretely, the numpy generator of step t is ::

    Generator(PCG64(SeedSequence(entropy=sampling_stream_words, spawn_key=(t,))))

i.e. the t-th spawned child of the sampling stream (numpy's own construction
of independent child streams). The sampling stream is the ``sampling`` stream
of :mod:`dpmuon_jax.privacy.keys`; the noise uses a different stream of the
same root, so the sample reveals nothing about the noise and vice versa.

The sampled indices are returned in batches padded to a static ``capacity``
with a boolean mask, so a jitted step compiles once. Padding rows carry the
index :data:`PADDING_INDEX` and :func:`gather` fills them with zeros: they are
dummies, never copies of real examples. A sample larger than ``capacity`` is
never cut: it is returned as several chunks (whose clipped sums must be added
BEFORE the single release of the step), or an error says which capacity is
needed.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import numpy as np

from dpmuon_jax.privacy.keys import KeyLike, stream_key

PyTree = Any

PADDING_INDEX = -1
"""Index stored in padding rows; never a valid example index."""

CHUNK = "chunk"
RAISE = "raise"


class PaddedBatch(NamedTuple):
  """Indices of one chunk of a Poisson sample, padded to a static capacity.

  Attributes:
    indices: int32, shape ``(capacity,)``; sampled example indices in
      ascending order, then :data:`PADDING_INDEX` in the padding rows.
    mask: bool, shape ``(capacity,)``; True exactly on the real rows.
  """

  indices: np.ndarray
  mask: np.ndarray


def default_capacity(dataset_size: int, sampling_rate: float, multiple_of: int = 8) -> int:
  """A static batch capacity that a Poisson sample rarely exceeds.

  capacity = ⌈qN + 6·sqrt(qN(1−q))⌉ + 1 (six binomial standard deviations
  above the mean), at most N, rounded up to a multiple of ``multiple_of``.
  Exceeding it is rare and never silent (see :meth:`PoissonSampler.sample`).
  """
  mean = sampling_rate * dataset_size
  bound = math.ceil(mean + 6.0 * math.sqrt(mean * (1.0 - sampling_rate))) + 1
  bound = min(bound, dataset_size)
  return max(multiple_of, -(-bound // multiple_of) * multiple_of)


PARTITION_SPAWN_KEY = 2**31
"""The spawn key of the cyclic partition's generator: one past the last step (steps are int32)."""


class PoissonSampler:
  """Poisson sampling with rate q over a dataset of N examples, optionally cyclic.

  With ``cycle_length`` b > 1 (cyclic Poisson sampling, the participation BandMF's
  amplification needs: Choquette-Choo et al. 2023, "(Amplified) Banded Matrix
  Factorization", §4): each example is put in one of b groups, independently and
  uniformly at random, once, from the sampling stream (secret; an independent
  partition keeps add/remove adjacency); step t samples only group t mod b, each of its
  examples with probability q. An example then takes part only in steps b apart, at most
  ⌈T/b⌉ times, and the accountant composes ⌈T/b⌉ PoissonSampled(q, ·) events.

  Attributes:
    dataset_size: N.
    sampling_rate: q; each eligible example is in a step's sample independently with
      probability q.
    cycle_length: b, the number of groups (1: plain Poisson sampling, every example
      eligible at every step).
    expected_batch_size: qN/b (the default public denominator D).
    capacity: static number of rows of every returned batch.
    on_overflow: ``"chunk"`` or ``"raise"`` (see :meth:`sample`).
    seeded: whether the sampling randomness came from a user seed (reproducible)
      rather than OS entropy.
  """

  def __init__(
      self,
      dataset_size: int,
      sampling_rate: float,
      capacity: int | None = None,
      key: KeyLike = None,
      on_overflow: str = CHUNK,
      multiple_of: int = 8,
      cycle_length: int = 1,
  ):
    """Builds the sampler.

    Args:
      dataset_size: N ≥ 1 (below 2³¹: indices are int32).
      sampling_rate: q in (0, 1].
      capacity: rows per batch; default :func:`default_capacity`.
      key: root key or int seed of the run (only its ``sampling`` stream is
        used). ``None`` draws the root from OS entropy. With several hosts,
        every host must be given the same root so they draw the same sample.
      on_overflow: ``"chunk"`` returns a sample larger than ``capacity`` as
        several batches; ``"raise"`` raises a ValueError instead.
      multiple_of: the default capacity is rounded up to a multiple of this.
      cycle_length: b ≥ 1 groups sampled in turn (see the class docstring).
    """
    if isinstance(dataset_size, bool) or not isinstance(dataset_size, (int, np.integer)):
      raise TypeError(f"dataset_size must be an int, got {dataset_size!r}.")
    if not 1 <= dataset_size < 2**31:
      raise ValueError(f"dataset_size must be in [1, 2**31), got {dataset_size}.")
    if not 0.0 < sampling_rate <= 1.0:
      raise ValueError(f"sampling_rate must be in (0, 1], got {sampling_rate}.")
    if on_overflow not in (CHUNK, RAISE):
      raise ValueError(f"on_overflow must be {CHUNK!r} or {RAISE!r}, got {on_overflow!r}.")
    if multiple_of < 1:
      raise ValueError(f"multiple_of must be >= 1, got {multiple_of}.")
    if isinstance(cycle_length, bool) or not isinstance(cycle_length, (int, np.integer)) or (
        cycle_length < 1):
      raise ValueError(f"cycle_length must be an int >= 1, got {cycle_length!r}.")
    if capacity is None:  # a step's sample is Binomial(N, q/b): each example eligible 1/b
      capacity = default_capacity(int(dataset_size), float(sampling_rate) / cycle_length,
                                  multiple_of)
    if capacity < 1:
      raise ValueError(f"capacity must be >= 1, got {capacity}.")
    self.dataset_size = int(dataset_size)
    self.sampling_rate = float(sampling_rate)
    self.capacity = int(capacity)
    self.on_overflow = on_overflow
    self.cycle_length = int(cycle_length)
    sampling_key, self.seeded = stream_key(key, "sampling")
    self._entropy = [int(w) for w in np.asarray(sampling_key, dtype=np.uint32)]
    self._groups: np.ndarray | None = None

  @property
  def expected_batch_size(self) -> float:
    """qN/b, the expected number of sampled examples per step."""
    return self.sampling_rate * self.dataset_size / self.cycle_length

  @property
  def steps_per_epoch(self) -> int:
    """round(b/q) = round(N/B) (at least 1): the steps in which each example is sampled once
    in expectation (b steps per cycle: under cyclic sampling not round(1/q))."""
    return max(1, round(self.cycle_length / self.sampling_rate))

  def groups(self) -> np.ndarray:
    """Each example's group in {0, …, b−1} (SECRET), drawn once from the sampling stream."""
    if self._groups is None:
      seed = np.random.SeedSequence(entropy=self._entropy, spawn_key=(PARTITION_SPAWN_KEY,))
      rng = np.random.Generator(np.random.PCG64(seed))
      self._groups = rng.integers(0, self.cycle_length, self.dataset_size).astype(np.int32)
    return self._groups

  def sample_indices(self, step: int) -> np.ndarray:
    """The sorted indices of step ``step``'s sample, unpadded (SECRET)."""
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
      raise ValueError(f"step must be an int >= 0, got {step!r}.")
    seed = np.random.SeedSequence(entropy=self._entropy, spawn_key=(int(step),))
    rng = np.random.Generator(np.random.PCG64(seed))
    included = rng.random(self.dataset_size) < self.sampling_rate
    if self.cycle_length > 1:
      included &= self.groups() == step % self.cycle_length
    return np.flatnonzero(included).astype(np.int32)

  def sample(self, step: int) -> list[PaddedBatch]:
    """Step ``step``'s Poisson sample as padded batches of ``capacity`` rows.

    Returns one batch, or, when the sample has more than ``capacity`` examples
    and ``on_overflow="chunk"``, ⌈size/capacity⌉ batches that together hold
    every sampled index exactly once. Their clipped sums belong to ONE release:
    add them up before the noise. An empty sample gives one all-padding batch
    (the release is then pure noise, which is correct).

    Raises:
      ValueError: with ``on_overflow="raise"``, when the sample exceeds
        ``capacity``.
    """
    indices = self.sample_indices(step)
    if len(indices) > self.capacity and self.on_overflow == RAISE:
      raise ValueError(
          f"Step {step} sampled {len(indices)} examples, more than capacity={self.capacity}. "
          f"Raise `capacity` (expected batch size {self.expected_batch_size:.1f}), or use "
          f"on_overflow='chunk' to process the extra examples in further chunks."
      )
    num_chunks = max(1, -(-len(indices) // self.capacity))
    return [
        _pad(indices[c * self.capacity : (c + 1) * self.capacity], self.capacity)
        for c in range(num_chunks)
    ]


def _pad(indices: np.ndarray, capacity: int) -> PaddedBatch:
  padded = np.full((capacity,), PADDING_INDEX, np.int32)
  padded[: len(indices)] = indices
  return PaddedBatch(padded, np.arange(capacity) < len(indices))


def gather(arrays: PyTree, batch: PaddedBatch) -> PyTree:
  """Rows ``batch.indices`` of every array (leading axis = examples).

  ``arrays`` is an array or a pytree (e.g. a dict) of arrays with the
  examples on axis 0. Padding rows are ZEROS: dummies, never copies of a real
  example; the mask tells the release to ignore them.
  """
  real = batch.mask
  rows = batch.indices[real]

  def take(a):
    a = np.asarray(a)
    out = np.zeros((len(batch.indices),) + a.shape[1:], a.dtype)
    out[real] = a[rows]
    return out

  return jax.tree.map(take, arrays)
