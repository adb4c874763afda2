"""Correlated noise: the banded matrix-factorization (BandMF) release.

Choquette-Choo, McMahan, Rush and Thakurta, "(Amplified) Banded Matrix Factorization:
A unified approach to private training" (NeurIPS 2023), §3–4. Release t adds the t-th
row of C⁻¹Z instead of fresh noise::

    G̃_t = (Σ_i clip_C(q_i) + σC·(C⁻¹Z)_t) / D,

where Z's rows z_0, z_1, … are independent N(0, I) draws, z_j from the key
``fold_in(noise_key, j)`` (exactly the draw of :func:`~dpmuon_jax.privacy.release.dp_release`'s
release j), and C is lower-triangular, banded with b bands and column-normalised (every
column has norm 1), the banded Toeplitz strategy jax_privacy optimises for the prefix-sum
workload (``jax_privacy.matrix_factorization.toeplitz.optimize_banded_toeplitz``; the
``mf`` extra). C⁻¹Z is computed streaming (jax_privacy's
``ColumnNormalizedBanded.inverse_as_streaming_matrix``), holding the last b solves: b
copies of the parameters.

Privacy: under b-cyclic Poisson sampling (``PoissonSampler(..., cycle_length=b)``) an
example takes part in releases at least b apart, whose columns of C have disjoint supports,
so the mechanism is ⌈T/b⌉ Poisson-subsampled Gaussian mechanisms of noise multiplier σ
(their Theorem 4): the ledger accounts exactly that, and refuses a BandMF release whose
sampler has fewer than b groups. Everything after the release (momentum, Newton–Schulz) is
post-processing. b = 1 (C = I) returns :func:`~dpmuon_jax.privacy.release.dp_release` itself.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dpmuon_jax.extras import requires
from dpmuon_jax.privacy.clipping import Clipping
from dpmuon_jax.privacy.keys import KeyLike
from dpmuon_jax.privacy.release import (
    ADD_REMOVE,
    BandMFReleaseState,
    Neighbouring,
    NoiseKeyUses,
    PrivateTransformation,
    _checked_clipped_sum,
    _refuse_masked_params,
    _release_spec,
    add_noise,
    dp_release,
    independent_noise,
)

PyTree = Any


class BandMFStrategy(NamedTuple):
  """C, a b-banded Toeplitz strategy for T releases, column-normalised when used.

  Attributes:
    steps: T, the releases it is built for (the release refuses more).
    coefficients: c_0, …, c_{b−1} of the band (float64, unit norm).
  """

  steps: int
  coefficients: np.ndarray

  @property
  def bands(self) -> int:
    return len(self.coefficients)


@functools.lru_cache(maxsize=32)
def _optimized_coefficients(steps: int, bands: int) -> tuple[float, ...]:
  with requires("mf", "BandMF's strategy optimisation"):
    from jax_privacy.matrix_factorization import toeplitz
  return tuple(float(c) for c in np.asarray(toeplitz.optimize_banded_toeplitz(steps, bands)))


def bandmf_strategy(steps: int, bands: int) -> BandMFStrategy:
  """The b-banded Toeplitz strategy of least mean error on the prefix sums of T releases.

  b = 1 is the identity (independent noise) and needs no optimisation. Cached per (T, b).
  """
  if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or steps < 1:
    raise ValueError(f"steps must be an int >= 1, got {steps!r}.")
  if isinstance(bands, bool) or not isinstance(bands, (int, np.integer)) or not (
      1 <= bands <= steps):
    raise ValueError(f"bands must be an int in [1, steps={steps}], got {bands!r}.")
  coefficients = (1.0,) if bands == 1 else _optimized_coefficients(int(steps), int(bands))
  return BandMFStrategy(int(steps), np.asarray(coefficients, np.float64))


def _banded(strategy: BandMFStrategy):
  with requires("mf", "The BandMF release"):
    from jax_privacy.matrix_factorization import banded
  return banded.ColumnNormalizedBanded.from_banded_toeplitz(
      strategy.steps, jnp.asarray(strategy.coefficients, jnp.float32))


def strategy_matrix(strategy: BandMFStrategy) -> np.ndarray:
  """C as a dense T × T array (float64): lower-triangular, b bands, unit columns."""
  return np.asarray(_banded(strategy).materialize(), np.float64)


def dp_bandmf_release(
    l2_clip_norm: float,
    noise_multiplier: float,
    denominator: float,
    strategy: BandMFStrategy,
    key: KeyLike = None,
    clipping: Clipping | None = None,
    neighbouring: Neighbouring = ADD_REMOVE,
) -> PrivateTransformation:
  """The BandMF release G̃_t = (Σ_i clip_C(q_i) + σC·(C⁻¹Z)_t) / D (module docstring).

  Same contract as :func:`~dpmuon_jax.privacy.release.dp_release`: per-example queries
  (with an optional ``mask``) or a sealed ``ClippedSum``; D public; the noise key of
  release t is ``fold_in(noise_key, t)`` and is never used on two sums; a release past
  ``strategy.steps`` is NaN (C has no row for it). Secure (discrete) noise is not
  available here.

  Args:
    l2_clip_norm: C.
    noise_multiplier: σ, calibrated for ⌈T/b⌉ participations at the within-group rate q.
    denominator: D, public (e.g. the sampler's ``expected_batch_size``).
    strategy: from :func:`bandmf_strategy`.
    key: root key or int seed of the run (its ``noise`` stream).
    clipping: the per-example rule (default flat clipping at C).
    neighbouring: ``"add_remove"`` or ``"replace_one"``, for the accountant.
  """
  if not isinstance(strategy, BandMFStrategy):
    raise TypeError(f"strategy must be a BandMFStrategy (bandmf_strategy), got {strategy!r}.")
  if strategy.bands == 1:  # C = I: independent noise, no row limit
    return dp_release(l2_clip_norm, noise_multiplier, denominator, key, clipping, neighbouring)
  spec, noise_key = _release_spec(
      l2_clip_norm, noise_multiplier, denominator, key, clipping, neighbouring, False)
  if spec.secure_noise:
    raise ValueError("The BandMF release adds float noise; secure (discrete) noise is "
                     "available with dp_release only.")
  spec = dataclasses.replace(spec, bands=strategy.bands)
  inverse = _banded(strategy).inverse_as_streaming_matrix()
  key_uses = NoiseKeyUses()

  def init_fn(params):
    _refuse_masked_params(params)
    zeros = jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), jnp.float32), params)
    return BandMFReleaseState(jnp.zeros((), jnp.int32), noise_key, inverse.init_multiply(zeros))

  def update_fn(updates, state, params=None, *, mask=None, **extra_args):
    del extra_args
    clipped = _checked_clipped_sum(updates, params, mask, spec)
    noise = independent_noise(clipped.total, state.noise_key, state.count, spec)
    noise, buffers = inverse.multiply_next(noise, state.buffers)
    released = add_noise(clipped, noise, params, state.noise_key, state.count, spec, key_uses)
    in_range = state.count < strategy.steps
    released = jax.tree.map(lambda x: jnp.where(in_range, x, jnp.nan), released)
    return released, BandMFReleaseState(state.count + 1, state.noise_key, buffers)

  return PrivateTransformation.wrap(optax.GradientTransformationExtraArgs(init_fn, update_fn), spec)
