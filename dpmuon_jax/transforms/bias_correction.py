"""Removing the known DP-noise bias after a nonlinear map of the release.

Both transforms are post-processing: they use only the release and the PUBLIC
per-coordinate noise standard deviation s₀ = σC/D of G̃_t.

DP-Muon-BC (Kim & Fan 2026, "DP-Muon: Differentially Private Optimization via
Matrix-Orthogonalized Momentum", arXiv 2605.12994). The momentum buffer is
linear in the releases, so its noise N is Gaussian with a known per-entry
variance s_t², but Newton–Schulz F is nonlinear:
E[F(M + N)] = F(M) + (s_t²/2)·ΔF(M) + O(s_t⁴) (heat smoothing). Kim & Fan
remove the leading term; their estimator was not available, so OUR estimator
is the Richardson form ::

    F_BC(M̃) = 2 F(M̃) − E_Z F(M̃ + s_t Z),    Z ~ N(0, I),

whose expectation is F(M) + O(s_t⁴). E_Z is estimated with ``num_samples``
draws (antithetic pairs ±Z by default, which cancels the odd terms of the
estimator's own noise) from the POST-PROCESSING key stream, never the noise
stream. s_t is the EXACT noise std of the buffer F sees after t releases
(M₀ = 0; w = 1 for the heavy-ball buffer M = βM + G̃, w = 1−β for the EMA)::

    M_t:  s_t² = s₀² w² Σ_{j<t} β^{2j} = s₀² w² (1 − β^{2t}) / (1 − β²)
    M̂_t = w G̃_t + β M_t (Nesterov):  s_t² = s₀² w² [(1+β)² + β⁴ Σ_{j<t−1} β^{2j}]

(as t → ∞ at β = 0.95: std 0.160 s₀ for the EMA M_t, 0.174 s₀ for its
Nesterov look-ahead M̂_t).

The expansion needs a smooth F. The default F is Kim & Fan's convergent
Newton–Schulz quintic p₂ = (15/8, −10/8, 3/8), five steps, on
X₀ = M/‖M‖_F. With Keller Jordan's (3.4445, −4.7750, 2.0315), whose polynomial
has slope ≈ 3.4 at 0 and leaves singular values oscillating in [0.47, 1.2],
the expansion fails for the noise bulk: on a rank-2 16×16 M with s = 0.1 the
correction INCREASES the signal-block bias (0.062 → 0.068) where with p₂ it
cuts it 7× (0.034 → 0.005; ``tests/test_bias_correction.py``). Kim & Fan
normalise by max(1, ‖M‖_F) instead; we keep the scale-invariant ‖M‖_F.

DP-AdamBC (Tang, Shpilevskiy, Lécuyer, AAAI 2024; the official
``ubc-systopia/DP-AdamBC`` JAX code): Adam's second moment of G̃ includes the
noise variance Φ = s₀² per coordinate, which is subtracted::

    m_t = β₁ m + (1−β₁) G̃,  v_t = β₂ v + (1−β₂) G̃²,  m̂ = m/(1−β₁^t),  v̂ = v/(1−β₂^t)
    update = m̂ / sqrt(max(v̂ − Φ, eps_root))        (no +eps, as the official code)
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from dpmuon_jax import checks
from dpmuon_jax.linalg.newton_schulz import Coeffs, NewtonSchulz
from dpmuon_jax.linalg.scaling import (
    DP_MUON_MAX_ASPECT_RATIO,
    aspect_factor,
    dimension_numbers_fn,
)
from dpmuon_jax.privacy.keys import KeyLike, stream_key
from dpmuon_jax.transforms.momentum import EMA, HEAVY_BALL
from dpmuon_jax.transforms.muon import (
    SPLIT,
    AttentionBlocks,
    check_attention_blocks,
    matrix_blocks,
)

PyTree = Any

KIM_FAN_NS_COEFFS: Coeffs = (1.875, -1.25, 0.375)
"""The Newton–Schulz series p₂(λ) = Σ_{s≤2} (2s)!/(4^s (s!)²)(1−λ)^s as a quintic."""


def buffer_noise_variance(
    num_releases: jax.Array | int, beta: float, buffer: str = HEAVY_BALL, nesterov: bool = False
) -> jax.Array:
  """s_t² / s₀²: per-entry noise variance of the momentum output after t releases.

  Args:
    num_releases: t, the number of releases the buffer has absorbed (0: none).
    beta: β of :func:`dpmuon_jax.muon_momentum`.
    buffer: ``"heavy_ball"`` (w = 1) or ``"ema"`` (w = 1 − β).
    nesterov: the look-ahead M̂_t = w G̃_t + β M_t instead of M_t.
  """
  if buffer not in (EMA, HEAVY_BALL):
    raise ValueError(f"buffer must be {EMA!r} or {HEAVY_BALL!r}, got {buffer!r}.")
  w2 = (1.0 - beta) ** 2 if buffer == EMA else 1.0
  t = jnp.asarray(num_releases, jnp.float32)
  b2 = beta * beta

  def geometric(n):  # Σ_{j<n} β^{2j}, n ≥ 0
    n = jnp.maximum(n, 0.0)
    return n if b2 == 1.0 else (1.0 - b2**n) / (1.0 - b2)

  if not nesterov:
    return w2 * geometric(t)
  return jnp.where(t > 0, w2 * ((1.0 + beta) ** 2 + b2 * b2 * geometric(t - 1.0)), 0.0)


class BiasCorrectionState(NamedTuple):
  """Releases absorbed so far and the post-processing key (not the noise key)."""

  count: jax.Array  # int32
  key: jax.Array  # raw uint32 key of the post-processing stream


def scale_by_bias_corrected_orthogonalization(
    noise_std: float,
    beta: float,
    key: KeyLike = None,
    buffer: str = HEAVY_BALL,
    nesterov: bool = False,
    num_samples: int = 1,
    antithetic: bool = True,
    ns: NewtonSchulz = NewtonSchulz(),
    max_aspect_ratio: float | None = DP_MUON_MAX_ASPECT_RATIO,
    attention_blocks: AttentionBlocks = SPLIT,
    attention_heads: int | None = None,
) -> optax.GradientTransformation:
  """Ĝ = aspect · [2 F(M̃) − mean_i F(M̃ + s_t Z_i)], F = NS_K (DP-Muon-BC, our estimator).

  Chain it after :func:`dpmuon_jax.muon_momentum` with the same ``beta``,
  ``buffer`` and ``nesterov``: s_t comes from :func:`buffer_noise_variance`.

  Args:
    noise_std: s₀ = σC/D, the release's per-coordinate noise std
      (``GaussianReleaseSpec.noise_std``).
    beta, buffer, nesterov: the momentum feeding this transform.
    key: the run's root key (or seed); only its ``"postprocessing"`` stream
      is used. ``None``: OS entropy.
    num_samples: Monte-Carlo draws of Z per step (pairs ±Z if ``antithetic``);
      cost: 1 + num_samples·(2 if antithetic else 1) Newton–Schulz calls.
    antithetic: use ±Z pairs.
    ns, max_aspect_ratio: as in
      :func:`~dpmuon_jax.transforms.muon.scale_by_orthogonalization`, except the
      default coefficients (``ns.coeffs=None``): :data:`KIM_FAN_NS_COEFFS` (see above).
    attention_blocks, attention_heads: the blocks F sees, as in
      :func:`~dpmuon_jax.transforms.muon.scale_by_orthogonalization` (a fused q, k, v block
      gets one Z of its own d × 3d shape).
  """
  checks.check_nonnegative("noise_std", noise_std)
  checks.check_in_range("beta", beta, 0.0, 1.0, high_inclusive=False)
  checks.check_positive_int("num_samples", num_samples)
  if max_aspect_ratio is not None:
    checks.check_positive("max_aspect_ratio", max_aspect_ratio)
  check_attention_blocks(attention_blocks, attention_heads)
  buffer_noise_variance(1, beta, buffer, nesterov)  # validate eagerly
  pp_key, _ = stream_key(key, "postprocessing")
  spec_fn = dimension_numbers_fn(ns.dimension_numbers)
  signs = (1.0, -1.0) if antithetic else (1.0,)

  def orthogonalize(x):
    return ns.orthogonalize(x, KIM_FAN_NS_COEFFS)

  def block_update(m, block_key, s):
    m = m.astype(jnp.promote_types(m.dtype, jnp.float32))
    z = jax.random.normal(block_key, (num_samples,) + m.shape, m.dtype)
    smoothed = sum(jax.vmap(lambda zi, c=c: orthogonalize(m + (c * s) * zi))(z).mean(0)
                   for c in signs)
    corrected = 2.0 * orthogonalize(m) - smoothed / len(signs)
    return aspect_factor(m.shape[-2], m.shape[-1], max_aspect_ratio) * corrected

  def init_fn(params):
    del params
    return BiasCorrectionState(jnp.zeros((), jnp.int32), pp_key)

  def update_fn(updates, state, params=None):
    del params
    count = state.count + 1
    s = noise_std * jnp.sqrt(buffer_noise_variance(count, beta, buffer, nesterov))
    blocks = matrix_blocks(updates, spec_fn, attention_blocks, attention_heads)
    keys = jax.random.split(jax.random.fold_in(state.key, state.count),
                            max(len(blocks.matrices), 1))
    out = [block_update(m, k, s) for m, k in zip(blocks.matrices, keys)]
    return blocks.unblock(out), BiasCorrectionState(count, state.key)

  return optax.GradientTransformation(init_fn, update_fn)


class ScaleByAdamBCState(NamedTuple):
  """Adam's step count and (uncorrected) moments."""

  count: jax.Array  # int32
  mu: PyTree
  nu: PyTree


def scale_by_adam_bc(
    noise_variance: float,
    b1: float = 0.9,
    b2: float = 0.999,
    eps_root: float = 1e-8,
    mu_dtype: jnp.dtype | None = None,
) -> optax.GradientTransformation:
  """DP-AdamBC's direction m̂ / sqrt(max(v̂ − Φ, eps_root)) (Tang et al. 2024, Alg. 1).

  Args:
    noise_variance: Φ = (σC/D)², the per-coordinate variance of the release's
      noise (``GaussianReleaseSpec.noise_std ** 2``).
    b1, b2: Adam's decays (official defaults 0.9, 0.999).
    eps_root: the clamp; the official default 1e-8 (README runs 1e-9, 7e-9).
      It is the floor of v̂ itself, not of its square root, and no +eps is
      added, as in the official code.
    mu_dtype: dtype of the first moment; ``None``: the parameters'.
  """
  checks.check_nonnegative("noise_variance", noise_variance)
  checks.check_in_range("b1", b1, 0.0, 1.0, high_inclusive=False)
  checks.check_in_range("b2", b2, 0.0, 1.0, high_inclusive=False)
  checks.check_positive("eps_root", eps_root)  # it floors v̂ − Φ

  def init_fn(params):
    zeros = lambda dtype: jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), dtype or p.dtype), params)
    return ScaleByAdamBCState(jnp.zeros((), jnp.int32), zeros(mu_dtype), zeros(None))

  def update_fn(updates, state, params=None):
    del params
    mu = optax.tree.update_moment(updates, state.mu, b1, 1)
    nu = optax.tree.update_moment_per_elem_norm(updates, state.nu, b2, 2)
    count: jax.Array = optax.safe_increment(state.count)  # pyright: ignore[reportAssignmentType]
    mu_hat = optax.tree.bias_correction(mu, b1, count)
    nu_hat = optax.tree.bias_correction(nu, b2, count)
    out = jax.tree.map(
        lambda m, v, g: (m / jnp.sqrt(jnp.maximum(v - noise_variance, eps_root))).astype(g.dtype),
        mu_hat, nu_hat, updates,
    )
    cast = lambda new, old: jax.tree.map(lambda n, o: n.astype(o.dtype), new, old)
    return out, ScaleByAdamBCState(count, cast(mu, state.mu), cast(nu, state.nu))

  return optax.GradientTransformation(init_fn, update_fn)
