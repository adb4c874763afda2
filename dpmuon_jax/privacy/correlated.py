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

The buffered-linear-Toeplitz (BLT) release (:func:`dp_blt_release`) adds the same σC·(C⁻¹Z)_t
with C lower-triangular Toeplitz, c_0 = 1 and c_j = Σ_i ω_i θ_i^{j−1}: Dvijotham, McMahan,
Pillutla, Steinke and Thakurta, "Efficient and Near-Optimal Noise Generation for Streaming
Differential Privacy" (FOCS 2024), §5; optimised for participations b apart as in McMahan, Xu
and Zhang, "A Hassle-free Algorithm for Private Learning in Practice: Don't Use Tree
Aggregation, Use BLTs" (2024), §3, whose Algorithm 3 applies C⁻¹ streaming with k buffers: k
copies of the parameters, whatever T. C is not banded, so BandMF's amplification does not
apply: the ledger accounts the whole run as ONE Gaussian mechanism on CX, of noise multiplier
σ/Δ, Δ = :func:`blt_sensitivity` over the participations b-cyclic sampling allows (no
amplification by sampling), which holds when each gradient depends on the past releases
(Denisov, McMahan, Rush, Smith and Thakurta, "Improved Differential Privacy for SGD via
Optimal Private Linear Operators on Adaptive Streams", NeurIPS 2022, §2).
"""

from __future__ import annotations

import dataclasses
import functools
import math
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
    GaussianReleaseSpec,
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

IID = "iid"
BANDMF = "bandmf"
BLT = "blt"
NOISES = (IID, BANDMF, BLT)
"""The ``noise`` names of ``make_private`` and the trainers. A ``dp_*`` optimizer takes
``"iid"``, ``"bandmf"`` or a built strategy: its BLT is ``blt_strategy(T, k, b)``, whose
groups b come from the data (``make_private(noise="blt")`` builds it)."""


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


def strategy_matrix(strategy: BandMFStrategy | BLTStrategy) -> np.ndarray:
  """C as a dense T × T array (float64), lower-triangular: BandMF's has b bands and unit
  columns, BLT's is Toeplitz with the coefficients c_0 = 1, c_1, … of its buffers."""
  if isinstance(strategy, BLTStrategy):
    coefficients = _blt_coefficients(strategy)
    rows, cols = np.indices((strategy.steps, strategy.steps))
    return np.where(rows >= cols, coefficients[np.maximum(rows - cols, 0)], 0.0)
  return np.asarray(_banded(strategy).materialize(), np.float64)


def _correlated_spec(name: str, l2_clip_norm, noise_multiplier, denominator, key, clipping,
                     neighbouring) -> tuple[GaussianReleaseSpec, jax.Array]:
  """The spec and noise stream of a correlated release, refusing secure (discrete) noise."""
  spec, noise_key = _release_spec(
      l2_clip_norm, noise_multiplier, denominator, key, clipping, neighbouring, False)
  if spec.secure_noise:
    raise ValueError(f"The {name} release adds float noise; secure (discrete) noise is "
                     "available with dp_release only.")
  return spec, noise_key


def _correlated_release(spec: GaussianReleaseSpec, noise_key: jax.Array, inverse: Any,
                        steps: int) -> PrivateTransformation:
  """Release t adds σC·(C⁻¹Z)_t, C⁻¹ applied streaming by ``inverse`` (a jax_privacy
  ``StreamingMatrix``) to the draws z_t of ``fold_in(noise_key, t)``; NaN past ``steps``."""
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
    in_range = state.count < steps
    released = jax.tree.map(lambda x: jnp.where(in_range, x, jnp.nan), released)
    return released, BandMFReleaseState(state.count + 1, state.noise_key, buffers)

  return PrivateTransformation.wrap(optax.GradientTransformationExtraArgs(init_fn, update_fn), spec)


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
  spec, noise_key = _correlated_spec(
      "BandMF", l2_clip_norm, noise_multiplier, denominator, key, clipping, neighbouring)
  spec = dataclasses.replace(spec, bands=strategy.bands)
  inverse = _banded(strategy).inverse_as_streaming_matrix()
  return _correlated_release(spec, noise_key, inverse, strategy.steps)


MAX_BUFFERS = 15
"""The most buffers jax_privacy's BLT optimisation takes (more are numerically unstable)."""


class BLTStrategy(NamedTuple):
  """C, a buffered-linear-Toeplitz strategy for T releases (module docstring).

  C is lower-triangular Toeplitz with c_0 = 1 and c_j = Σ_i ω_i θ_i^{j−1} for j ≥ 1: one
  term per buffer. The parameters are float32 values (held as float64), those the release
  computes with, so the ledger accounts the C that is applied.

  Attributes:
    steps: T, the releases it is built for (the release refuses more).
    min_sep: b, the separation of one example's releases it is optimised for: the
      sampler's ``cycle_length``.
    buf_decay: θ_1 > … > θ_k, the buffers' decays.
    output_scale: ω_1, …, ω_k, the buffers' weights.
  """

  steps: int
  min_sep: int
  buf_decay: np.ndarray
  output_scale: np.ndarray

  @property
  def buffers(self) -> int:
    return len(self.buf_decay)


def _check_int(name: str, value: Any, low: int, high: int | None = None) -> None:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low or (
      high is not None and value > high):
    bounds = f">= {low}" if high is None else f"in [{low}, {high}]"
    raise ValueError(f"{name} must be an int {bounds}, got {value!r}.")


def blt_groups(dataset_size: float, expected_batch_size: float) -> int:
  """b = ⌊N/B⌋ (at least 1; robust to float rounding of N/B): the groups of the cyclic
  sampler a BLT release is built for, each example in one release per epoch."""
  return max(1, math.floor(dataset_size / expected_batch_size + 1e-9))


@functools.lru_cache(maxsize=32)
def _optimized_blt(steps: int, buffers: int,
                   min_sep: int) -> tuple[tuple[float, ...], tuple[float, ...]]:
  with requires("mf", "BLT's strategy optimisation"):
    from jax_privacy.matrix_factorization import buffered_toeplitz
  as_float32 = lambda x: tuple(float(v) for v in np.asarray(x).astype(np.float32))
  with jax.enable_x64():
    blt = buffered_toeplitz.optimize(n=steps, min_sep=min_sep, max_participations=None,
                                     min_buffers=buffers, max_buffers=buffers)
    return as_float32(blt.buf_decay), as_float32(blt.output_scale)


def blt_strategy(steps: int, buffers: int, min_sep: int) -> BLTStrategy:
  """The k-buffer BLT of least maximum error on the prefix sums of T releases, for one
  example taking part in ⌈T/b⌉ releases at least b = ``min_sep`` apart.

  jax_privacy's optimisation (``buffered_toeplitz.optimize``, in float64) with exactly
  ``buffers`` buffers; its coefficients are then non-negative and non-increasing, which
  :func:`blt_sensitivity` needs. Cached per (T, k, b).
  """
  _check_int("steps", steps, 1)
  _check_int("buffers", buffers, 1, MAX_BUFFERS)
  _check_int("min_sep", min_sep, 1)
  buf_decay, output_scale = _optimized_blt(int(steps), int(buffers), int(min_sep))
  return BLTStrategy(int(steps), int(min_sep), np.asarray(buf_decay, np.float64),
                     np.asarray(output_scale, np.float64))


def _blt(strategy: BLTStrategy, dtype: Any):
  with requires("mf", "The BLT release"):
    from jax_privacy.matrix_factorization import buffered_toeplitz
  return buffered_toeplitz.BufferedToeplitz.build(
      strategy.buf_decay, strategy.output_scale, dtype=dtype)


def _blt_coefficients(strategy: BLTStrategy) -> np.ndarray:
  """c_0, …, c_{T−1} of C (float64)."""
  with jax.enable_x64():
    return np.asarray(_blt(strategy, jnp.float64).toeplitz_coefs(strategy.steps), np.float64)


@functools.lru_cache(maxsize=1024)
def _blt_sensitivity(buf_decay: tuple[float, ...], output_scale: tuple[float, ...],
                     releases: int, separation: int) -> float:
  with requires("mf", "BLT's sensitivity"):
    from jax_privacy.matrix_factorization import toeplitz
  strategy = BLTStrategy(releases, separation, np.asarray(buf_decay), np.asarray(output_scale))
  with jax.enable_x64():
    coefficients = _blt(strategy, jnp.float64).toeplitz_coefs(releases)
    squared = toeplitz.minsep_sensitivity_squared(
        coefficients, min_sep=separation, max_participations=None)
    return math.sqrt(float(squared))


def blt_sensitivity(strategy: BLTStrategy, releases: int | None = None,
                    separation: int | None = None) -> float:
  """Δ_t = max_u ‖C_t u‖₂, the L2 sensitivity (in units of C) of the first t releases.

  C_t is C's leading t × t block, t = ``releases`` ∈ [1, T] (default T); u ranges over the
  0/1 vectors of an example's participations, at most ⌈t/b⌉ of them at least b =
  ``separation`` apart (default ``strategy.min_sep``). C's coefficients are non-negative and
  non-increasing, so the maximum is at u = 1 on releases 0, b, 2b, … (Kalinin and Lampert,
  "Banded Square Root Matrix Factorization for Differentially Private Model Training",
  NeurIPS 2024, Theorem 2; jax_privacy's ``toeplitz.minsep_sensitivity_squared``, which
  checks the coefficients), and since CᵀC ≥ 0 entrywise no vector-valued contributions of
  norm ≤ 1 do more: ‖Σ_s C_s g_sᵀ‖² = Σ_{s,r} (CᵀC)_{sr} ⟨g_s, g_r⟩ ≤ ‖C u‖².
  """
  releases = strategy.steps if releases is None else releases
  separation = strategy.min_sep if separation is None else separation
  _check_int("releases", releases, 1, strategy.steps)
  _check_int("separation", separation, 1)
  return _blt_sensitivity(tuple(float(v) for v in strategy.buf_decay),
                          tuple(float(v) for v in strategy.output_scale),
                          int(releases), int(separation))


def dp_blt_release(
    l2_clip_norm: float,
    noise_multiplier: float,
    denominator: float,
    strategy: BLTStrategy,
    key: KeyLike = None,
    clipping: Clipping | None = None,
    neighbouring: Neighbouring = ADD_REMOVE,
) -> PrivateTransformation:
  """The BLT release G̃_t = (Σ_i clip_C(q_i) + σC·(C⁻¹Z)_t) / D (module docstring).

  The contract of :func:`dp_bandmf_release`, with C a BLT: per-example queries (with an
  optional ``mask``) or a sealed ``ClippedSum``; D public; release t's draw z_t comes from
  the key ``fold_in(noise_key, t)``, then C⁻¹ is applied streaming with its k buffers
  (jax_privacy's ``BufferedToeplitz.inverse_as_streaming_matrix``, float32): k copies of
  the parameters. A release past ``strategy.steps`` is NaN. Secure (discrete) noise is not
  available here.

  Args:
    l2_clip_norm: C.
    noise_multiplier: σ; the run is (ε, δ)-DP for ε that of one Gaussian mechanism of noise
      multiplier σ/Δ (Δ = :func:`blt_sensitivity`; calibrate with
      :func:`~dpmuon_jax.privacy.accounting.calibrate_blt_noise_multiplier`).
    denominator: D, public (e.g. the sampler's ``expected_batch_size``).
    strategy: from :func:`blt_strategy`.
    key: root key or int seed of the run (its ``noise`` stream).
    clipping: the per-example rule (default flat clipping at C).
    neighbouring: ``"add_remove"`` or ``"replace_one"``, for the accountant.
  """
  if not isinstance(strategy, BLTStrategy):
    raise TypeError(f"strategy must be a BLTStrategy (blt_strategy), got {strategy!r}.")
  spec, noise_key = _correlated_spec(
      "BLT", l2_clip_norm, noise_multiplier, denominator, key, clipping, neighbouring)
  spec = dataclasses.replace(
      spec, blt_steps=strategy.steps, blt_min_sep=strategy.min_sep,
      blt_buf_decay=tuple(float(v) for v in strategy.buf_decay),
      blt_output_scale=tuple(float(v) for v in strategy.output_scale))
  inverse = _blt(strategy, jnp.float32).inverse_as_streaming_matrix()
  return _correlated_release(spec, noise_key, inverse, strategy.steps)


Noise = str | BandMFStrategy | BLTStrategy
"""The ``noise`` of a release: ``"iid"``, ``"bandmf"``, or a built :class:`BandMFStrategy`
or :class:`BLTStrategy`."""


def noise_strategy(noise: Noise, bands: int | None = None,
                   steps: int | None = None) -> BandMFStrategy | BLTStrategy | None:
  """The strategy ``noise`` names (``None``: independent noise), checked.

  ``"bandmf"`` needs ``bands`` b and ``steps`` T (:func:`bandmf_strategy`); a built
  strategy (:func:`bandmf_strategy`, :func:`blt_strategy`) and ``"iid"`` take neither.
  """
  if isinstance(noise, (BandMFStrategy, BLTStrategy)):
    if bands is not None or steps is not None:
      raise ValueError(f"noise is a {type(noise).__name__} already: it fixes its "
                       "strategy and steps, pass neither bands nor steps.")
    return noise
  if noise == BLT:
    raise ValueError("noise='blt' is built by make_private (and the trainers), which know "
                     "the groups b = ⌊N/B⌋ it is optimised for; to a dp_* optimizer pass the "
                     "built strategy, noise=blt_strategy(steps, buffers, min_sep).")
  if noise not in NOISES:
    raise ValueError(f"noise must be one of {', '.join(NOISES)}, a BandMFStrategy or a "
                     f"BLTStrategy, got {noise!r}.")
  if noise == IID:
    if bands is not None or steps is not None:
      raise ValueError("bands and steps are settings of noise='bandmf'; independent "
                       "noise (noise='iid') takes neither.")
    return None
  if bands is None or steps is None:
    raise ValueError("noise='bandmf' needs bands=b and steps=T (its strategy is optimised "
                     "for T releases and releases no more).")
  return bandmf_strategy(steps, bands)


def gaussian_release(
    l2_clip_norm: float,
    noise_multiplier: float,
    denominator: float,
    key: KeyLike = None,
    clipping: Clipping | None = None,
    neighbouring: Neighbouring = ADD_REMOVE,
    noise: Noise = IID,
    bands: int | None = None,
    steps: int | None = None,
) -> PrivateTransformation:
  """:func:`~dpmuon_jax.privacy.release.dp_release`, or the correlated release ``noise``
  names (:func:`dp_bandmf_release`, :func:`dp_blt_release`)."""
  strategy = noise_strategy(noise, bands, steps)
  if strategy is None:
    return dp_release(l2_clip_norm, noise_multiplier, denominator, key, clipping, neighbouring)
  if isinstance(strategy, BLTStrategy):
    return dp_blt_release(l2_clip_norm, noise_multiplier, denominator, strategy, key,
                          clipping, neighbouring)
  return dp_bandmf_release(l2_clip_norm, noise_multiplier, denominator, strategy, key,
                           clipping, neighbouring)
