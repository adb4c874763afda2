"""DP-Muon and DP-Muon-S: the private release followed by routed Muon post-processing.

    G̃_t = (Σ_i clip_C(g_i) + N(0, σ²C² I)) / D          ONE release, whole tree
    Muon group:      θ ← θ − η_t · (Ĝ_t + λ θ)            Ĝ_t from scale_by_muon(_s)
    fallback group:  θ ← θ − η′_t · (u_t + λ′ θ)          u_t: DP-SGD momentum or Adam

The release happens once, on the whole parameter tree, before the partition
into groups (privacy invariant 7, docs/design.md); everything after it is
post-processing. Weight decay is decoupled (not fed into the momentum) and, as
in Keller Jordan's Muon, multiplied by the learning rate.

Paper 1's presets (paper 1: "Spectral Gradient Orthogonalization Improves
Differentially Private Training at Scale", its reported hyperparameters;
CIFAR-10 WRN-16-4, 50 epochs, ε = 4, cosine decay with 5% warm-up, e.g.
``optax.warmup_cosine_decay_schedule``):

======================  =======  ====  ============================
method                  lr       β     post-processing
======================  =======  ====  ============================
DP-SGD (fallback)       0.3      0.9   heavy-ball momentum
DP-Muon                 0.02     0.95  Nesterov EMA, NS₅, aspect
DP-Muon-S               0.3      0.9   EMA, σ₁(M)·NS₅, aspect
======================  =======  ====  ============================

CIFAR-100 tuned: DP-Muon 0.1, DP-Muon-S 0.5; ViT-Small fine-tuning: DP-Muon
0.002. Paper 1 routes only biases and norm scales to DP-SGD (``"paper1"``).
"""

from __future__ import annotations

import optax

from dpmuon_jax import checks
from dpmuon_jax.linalg.newton_schulz import DEFAULT_NS_COEFFS, CoeffsLike
from dpmuon_jax.linalg.scaling import DimensionNumbers
from dpmuon_jax.privacy.clipping import Clipping
from dpmuon_jax.privacy.keys import KeyLike
from dpmuon_jax.privacy.release import ADD_REMOVE, PrivateTransformation, dp_release, privatize
from dpmuon_jax.transforms.momentum import EMA
from dpmuon_jax.transforms.muon import scale_by_muon, scale_by_muon_s
from dpmuon_jax.transforms.routing import Routing, partition_muon

SGD = "sgd"
ADAMW = "adamw"


def fallback_optimizer(
    kind: str,
    learning_rate: optax.ScalarOrSchedule,
    momentum: float = 0.9,
    nesterov: bool = False,
    weight_decay: float = 0.0,
    b2: float = 0.999,
    eps: float = 1e-8,
) -> optax.GradientTransformation:
  """Post-processing for the non-Muon group.

  ``"sgd"``: DP-SGD's momentum step, u = β′u + G̃ (PyTorch/optax ``trace``
  heavy-ball, as paper 1's DP-SGD), Nesterov optional. ``"adamw"``: AdamW with
  b1 = ``momentum``. Both with decoupled weight decay.
  """
  checks.check_learning_rate("learning_rate", learning_rate)
  checks.check_in_range("momentum", momentum, 0.0, 1.0, high_inclusive=False)
  checks.check_nonnegative("weight_decay", weight_decay)
  checks.check_in_range("b2", b2, 0.0, 1.0, high_inclusive=False)
  checks.check_nonnegative("eps", eps)
  return _fallback_group(kind, learning_rate, momentum, nesterov, weight_decay, b2, eps)


def _fallback_group(
    kind: str,
    learning_rate: optax.ScalarOrSchedule,
    momentum: float,
    nesterov: bool,
    weight_decay: float,
    b2: float = 0.999,
    eps: float = 1e-8,
) -> optax.GradientTransformation:
  if kind == SGD:
    return optax.chain(
        optax.trace(decay=momentum, nesterov=nesterov),
        optax.add_decayed_weights(weight_decay),
        optax.scale_by_learning_rate(learning_rate),
    )
  if kind == ADAMW:
    return optax.adamw(learning_rate, b1=momentum, b2=b2, eps=eps, weight_decay=weight_decay)
  raise ValueError(f"fallback must be {SGD!r} or {ADAMW!r}, got {kind!r}.")


def routed_post_processing(
    muon_post: optax.GradientTransformation,
    learning_rate: optax.ScalarOrSchedule,
    weight_decay: float,
    routing: Routing,
    fallback: str | None,
    fallback_learning_rate: optax.ScalarOrSchedule | None,
    fallback_momentum: float,
    fallback_nesterov: bool,
    fallback_weight_decay: float,
) -> optax.GradientTransformationExtraArgs:
  """Muon group: ``muon_post`` → decoupled weight decay → −η; the rest: the fallback.

  Shared by every Muon-family optimizer (DP-Muon(-S), DiSK/DOPPLER-Muon,
  DP-Muon-IM/-BC); the release comes before it, over the whole tree. It
  checks the learning rates, momentum and weight decays of both groups.
  """
  checks.check_learning_rate("learning_rate", learning_rate)
  checks.check_nonnegative("weight_decay", weight_decay)
  checks.check_in_range("fallback_momentum", fallback_momentum, 0.0, 1.0, high_inclusive=False)
  checks.check_nonnegative("fallback_weight_decay", fallback_weight_decay)
  kind = fallback or (ADAMW if routing == "paper2" else SGD)
  if fallback_learning_rate is None:
    if kind == ADAMW:
      raise ValueError("An AdamW fallback group needs its own fallback_learning_rate.")
    fallback_learning_rate = learning_rate
  else:
    checks.check_learning_rate("fallback_learning_rate", fallback_learning_rate)
  muon_group = optax.chain(
      muon_post,
      optax.add_decayed_weights(weight_decay),
      optax.scale_by_learning_rate(learning_rate),
  )
  fallback_group = _fallback_group(
      kind, fallback_learning_rate, fallback_momentum, fallback_nesterov, fallback_weight_decay
  )
  return partition_muon(muon_group, fallback_group, routing)


def _private(
    post: optax.GradientTransformation,
    l2_clip_norm: float,
    noise_multiplier: float,
    denominator: float,
    key: KeyLike,
    clipping: Clipping | None,
    neighbouring: str,
) -> PrivateTransformation:
  release = dp_release(l2_clip_norm, noise_multiplier, denominator, key, clipping, neighbouring)
  return privatize(release, post)


def dp_muon(
    learning_rate: optax.ScalarOrSchedule,
    l2_clip_norm: float,
    noise_multiplier: float,
    denominator: float,
    key: KeyLike = None,
    *,
    beta: float = 0.95,
    nesterov: bool = True,
    ns_steps: int = 5,
    ns_coeffs: CoeffsLike = DEFAULT_NS_COEFFS,
    eps: float = 1e-7,
    ns_dtype=None,
    precision=None,
    dimension_numbers: DimensionNumbers = None,
    mu_dtype=None,
    weight_decay: float = 0.0,
    routing: Routing = "paper1",
    fallback: str | None = None,
    fallback_learning_rate: optax.ScalarOrSchedule | None = None,
    fallback_momentum: float = 0.9,
    fallback_nesterov: bool = False,
    fallback_weight_decay: float = 0.0,
    clipping: Clipping | None = None,
    neighbouring: str = ADD_REMOVE,
) -> PrivateTransformation:
  """DP-Muon (paper 1, §Method): the Gaussian release, then routed Muon post-processing.

  ``update(per_example_grads, state, params, *, mask=None)`` takes per-example
  gradients on a leading batch axis (or a ``ClippedSum``), like
  :func:`dpmuon_jax.dp_release`, and returns parameter updates.

  Args:
    learning_rate: η of the Muon group, float or optax schedule (paper 1: 0.02).
    l2_clip_norm, noise_multiplier, denominator, key, clipping, neighbouring:
      the release, see :func:`dpmuon_jax.dp_release`.
    beta, nesterov, ns_steps, ns_coeffs, eps, ns_dtype, precision,
      dimension_numbers, mu_dtype: see :func:`dpmuon_jax.scale_by_muon`
      (paper 1: β = 0.95, Nesterov, 5 steps of (3.4445, −4.7750, 2.0315)).
    weight_decay: decoupled weight decay λ of the Muon group.
    routing: ``"paper1"`` (default), ``"muon"``, ``"paper2"`` or a callable
      (path, leaf) -> bool; see :mod:`dpmuon_jax.transforms.routing`.
    fallback: ``"sgd"`` (DP-SGD momentum; default except under ``"paper2"``)
      or ``"adamw"`` (default under ``"paper2"``).
    fallback_learning_rate: η′ of the fallback group; ``None``: η (SGD only;
      an AdamW group must be given its own).
    fallback_momentum: β′ of DP-SGD's heavy-ball momentum, or AdamW's b1.
    fallback_nesterov: Nesterov for the SGD fallback.
    fallback_weight_decay: decoupled weight decay λ′ of the fallback group.

  Returns:
    A :class:`~dpmuon_jax.privacy.release.PrivateTransformation`.
  """
  post = scale_by_muon(
      beta, nesterov, ns_steps, ns_coeffs, eps, dimension_numbers, ns_dtype, precision, mu_dtype
  )
  routed = routed_post_processing(
      post, learning_rate, weight_decay, routing, fallback, fallback_learning_rate,
      fallback_momentum, fallback_nesterov, fallback_weight_decay,
  )
  return _private(routed, l2_clip_norm, noise_multiplier, denominator, key, clipping, neighbouring)


def dp_muon_s(
    learning_rate: optax.ScalarOrSchedule,
    l2_clip_norm: float,
    noise_multiplier: float,
    denominator: float,
    key: KeyLike = None,
    *,
    beta: float = 0.9,
    buffer: str = EMA,
    power_iterations: int = 3,
    exact_svd: bool = False,
    ns_steps: int = 5,
    ns_coeffs: CoeffsLike = DEFAULT_NS_COEFFS,
    eps: float = 1e-7,
    ns_dtype=None,
    precision=None,
    dimension_numbers: DimensionNumbers = None,
    mu_dtype=None,
    weight_decay: float = 0.0,
    routing: Routing = "paper1",
    fallback: str | None = None,
    fallback_learning_rate: optax.ScalarOrSchedule | None = None,
    fallback_momentum: float = 0.9,
    fallback_nesterov: bool = False,
    fallback_weight_decay: float = 0.0,
    clipping: Clipping | None = None,
    neighbouring: str = ADD_REMOVE,
) -> PrivateTransformation:
  """DP-Muon-S (paper 1, design 4): Ĝ = σ₁(M_t)·sqrt(max(1, fan_out/fan_in))·NS₅(M_t).

  The release, then :func:`dpmuon_jax.scale_by_muon_s` on the Muon group
  (paper 1's preset: lr 0.3, β = 0.9). ``buffer="heavy_ball"`` selects the
  un-normalised M_t = βM_{t−1} + G̃_t; ``power_iterations`` warm-started
  iterations per step give σ₁ (``exact_svd`` for checks). Other arguments as
  in :func:`dp_muon`.
  """
  post = scale_by_muon_s(
      beta, buffer, power_iterations, exact_svd, ns_steps, ns_coeffs, eps, dimension_numbers,
      ns_dtype, precision, mu_dtype,
  )
  routed = routed_post_processing(
      post, learning_rate, weight_decay, routing, fallback, fallback_learning_rate,
      fallback_momentum, fallback_nesterov, fallback_weight_decay,
  )
  return _private(routed, l2_clip_norm, noise_multiplier, denominator, key, clipping, neighbouring)
