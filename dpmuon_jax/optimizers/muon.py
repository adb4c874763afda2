"""Muon and Muon-S routed over the parameter tree, and DP-Muon, DP-Muon-S: the release, then them.

::

    G̃_t = (Σ_i clip_C(q_i) + N(0, σ²C² I)) / D          ONE release, whole tree
    Muon group:      θ ← θ − η_t · (Ĝ_t + λ θ)            Ĝ_t from scale_by_muon(_s)
    fallback group:  θ ← θ − η′_t · (u_t + λ′ θ)          u_t: DP-SGD momentum or AdamW

The release happens once, on the whole parameter tree, before the partition
into groups (privacy invariant 7, docs/design.md); everything after it is
post-processing: :func:`muon` and :func:`muon_s` are plain Optax and work
without privacy too. Weight decay is decoupled (not fed into the momentum)
and, as in Keller Jordan's Muon, multiplied by the learning rate. Which leaves
go to Muon is the ``routing`` (:mod:`dpmuon_jax.transforms.routing`); the
other group is a :class:`~dpmuon_jax.optimizers.options.Fallback`.

Paper 1's presets (paper 1: "Spectral Gradient Orthogonalization Improves
Differentially Private Training at Scale", its reported hyperparameters;
CIFAR-10 WRN-16-4, 50 epochs, ε = 4, cosine decay with 5% warm-up, e.g.
``optax.warmup_cosine_decay_schedule``):

======================  =======  ====  ============================
method                  lr       β     post-processing
======================  =======  ====  ============================
DP-SGD (fallback)       0.3      0.9   heavy-ball momentum
DP-Muon                 0.02     0.95  Nesterov EMA, NS₅, aspect
DP-Muon-S               0.3      0.9   heavy-ball, σ₁(M)·NS₅, aspect
======================  =======  ====  ============================

CIFAR-100 tuned: DP-Muon 0.1, DP-Muon-S 0.5; ViT-Small fine-tuning: DP-Muon
0.002 (all in :mod:`dpmuon_jax.optimizers.registry`). Paper 1 routes only
biases and norm scales to DP-SGD (``"paper1"``); paper 2 (the inner-momentum
DP-Muon paper) routes embeddings, the head and 1-D leaves to AdamW with its
own learning rate: ``muon(η, routing="paper2", fallback=Fallback(kind="adamw",
learning_rate=η′))``.
"""

from __future__ import annotations

from typing import Any, cast

import jax.numpy as jnp
import optax

from dpmuon_jax import checks
from dpmuon_jax.optimizers.options import (
    ADAMW,
    SGD,
    Buffer,
    Fallback,
    FallbackKind,
    NewtonSchulz,
    forwards_options,
)
from dpmuon_jax.optimizers.private import ReleaseSettings, private
from dpmuon_jax.privacy.clipping import Clipping
from dpmuon_jax.privacy.correlated import IID, Noise
from dpmuon_jax.privacy.keys import KeyLike
from dpmuon_jax.privacy.release import ADD_REMOVE, Neighbouring, PrivateTransformation
from dpmuon_jax.transforms.momentum import HEAVY_BALL
from dpmuon_jax.transforms.muon import SPLIT, AttentionBlocks, scale_by_muon, scale_by_muon_s
from dpmuon_jax.transforms.routing import Routing, partition_muon


def _fallback_group(fallback: Fallback) -> optax.GradientTransformation:
  """The fallback group of a resolved :class:`Fallback` (kind, learning rate, momentum set)."""
  momentum = cast(float, fallback.momentum)  # resolved: not None
  learning_rate = cast(optax.ScalarOrSchedule, fallback.learning_rate)
  if fallback.kind == SGD:
    return optax.chain(
        optax.trace(decay=momentum, nesterov=fallback.nesterov),
        optax.add_decayed_weights(fallback.weight_decay),
        optax.scale_by_learning_rate(learning_rate),
    )
  if fallback.kind == ADAMW:
    return optax.adamw(
        learning_rate, b1=momentum, b2=fallback.b2, eps=fallback.eps,
        weight_decay=fallback.weight_decay,
    )
  raise ValueError(f"fallback must be {SGD!r} or {ADAMW!r}, got {fallback.kind!r}.")


def fallback_optimizer(
    kind: str,
    learning_rate: optax.ScalarOrSchedule,
    momentum: float = 0.9,
    nesterov: bool = False,
    weight_decay: float = 0.0,
    b2: float = 0.999,
    eps: float = 1e-8,
) -> optax.GradientTransformation:
  """The non-Muon group alone: :class:`~dpmuon_jax.optimizers.options.Fallback` as a transform.

  ``"sgd"``: DP-SGD's momentum step, u = β′u + G̃ (PyTorch/optax ``trace``
  heavy-ball, as paper 1's DP-SGD), Nesterov optional. ``"adamw"``: AdamW with
  b1 = ``momentum``. Both with decoupled weight decay.
  """
  checks.check_learning_rate("learning_rate", learning_rate)
  fallback = Fallback(cast(FallbackKind, kind), learning_rate, momentum, nesterov, weight_decay,
                      b2, eps)  # the kind is checked there
  return _fallback_group(fallback)


def routed_post_processing(
    muon_post: optax.GradientTransformation,
    learning_rate: optax.ScalarOrSchedule,
    *,
    weight_decay: float = 0.0,
    routing: Routing = "paper1",
    fallback: Fallback = Fallback(),
) -> optax.GradientTransformationExtraArgs:
  """Muon group: ``muon_post`` → decoupled weight decay λ → −η; the other leaves: ``fallback``.

  Shared by every Muon-family optimizer (Muon(-S), DiSK/DOPPLER-Muon,
  Muon-BC, and through them every ``dp_*`` Muon); the release, where there is
  one, comes before it over the whole tree. ``fallback.momentum=None`` is 0.9
  here.
  """
  checks.check_learning_rate("learning_rate", learning_rate)
  checks.check_nonnegative("weight_decay", weight_decay)
  muon_group = optax.chain(
      muon_post,
      optax.add_decayed_weights(weight_decay),
      optax.scale_by_learning_rate(learning_rate),
  )
  fallback_group = _fallback_group(fallback.resolve(routing, learning_rate))
  return partition_muon(muon_group, fallback_group, routing)


def muon(
    learning_rate: optax.ScalarOrSchedule,
    *,
    beta: float = 0.95,
    nesterov: bool = True,
    mu_dtype: jnp.dtype | None = None,
    ns: NewtonSchulz = NewtonSchulz(),
    weight_decay: float = 0.0,
    routing: Routing = "paper1",
    fallback: Fallback = Fallback(),
    attention_blocks: AttentionBlocks = SPLIT,
    attention_heads: int | None = None,
) -> optax.GradientTransformationExtraArgs:
  """Muon (paper 1, §Method): Ĝ = sqrt(min(4, max(1, fan_out/fan_in)))·NS₅(M̂_t), routed.

  M_t = βM_{t−1} + (1−β)G̃_t with Nesterov's look-ahead M̂_t = (1−β)G̃_t + βM_t,
  no bias correction; θ ← θ − η(Ĝ_t + λθ) on the Muon group.

  Args:
    learning_rate: η of the Muon group, float or optax schedule (paper 1: 0.02).
    beta, nesterov, mu_dtype: Muon's momentum, see :func:`dpmuon_jax.scale_by_muon`
      (paper 1: β = 0.95, Nesterov).
    ns: the orthogonalisation (paper 1: 5 steps of (3.4445, −4.7750, 2.0315)).
    weight_decay: decoupled weight decay λ of the Muon group.
    routing: ``"paper1"`` (default), ``"muon"``, ``"paper2"`` or a callable
      (path, leaf) -> bool; see :mod:`dpmuon_jax.transforms.routing`.
    fallback: the other group (default DP-SGD's heavy-ball step with β′ = 0.9
      and η′ = η; AdamW under ``"paper2"``, which needs its own η′).
    attention_blocks: how an attention's q, k, v updates are orthogonalised:
      ``"split"`` (default, each d × d), ``"fused"`` (one d × 3d matrix
      ``[Q | K | V]``, Hugging Face's ``c_attn``, aspect factor √3) or ``"heads"``
      (each head's d × d/H block, ``attention_heads`` = H); paper 2 ("Inner
      Momentum for DP-Muon", §5) leaves it open. See
      :func:`dpmuon_jax.transforms.muon.matrix_blocks`. The momentum stays per
      leaf; post-processing only: release, clipping and accounting unchanged.
    attention_heads: H, for ``attention_blocks="heads"`` only.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` (an ``optax.partition``).
  """
  post = scale_by_muon(beta, nesterov=nesterov, mu_dtype=mu_dtype,
                       attention_blocks=attention_blocks, attention_heads=attention_heads,
                       ns=ns)
  return routed_post_processing(
      post, learning_rate, weight_decay=weight_decay, routing=routing, fallback=fallback
  )


@forwards_options(routed_post_processing)
def muon_s(
    learning_rate: optax.ScalarOrSchedule,
    *,
    beta: float = 0.9,
    buffer: Buffer = HEAVY_BALL,
    power_iterations: int = 3,
    exact_svd: bool = False,
    mu_dtype: jnp.dtype | None = None,
    ns: NewtonSchulz = NewtonSchulz(),
    **groups: Any,
) -> optax.GradientTransformationExtraArgs:
  """Muon-S (paper 1, design 4): Ĝ = σ₁(M_t)·sqrt(max(1, fan_out/fan_in))·NS₅(M_t), routed.

  :func:`dpmuon_jax.scale_by_muon_s` on the Muon group (paper 1's preset:
  lr 0.3, β = 0.9). The buffer is paper 1's "heavy-ball momentum matrix"
  M_t = βM_{t−1} + G̃_t (default); ``buffer="ema"`` selects
  M_t = βM_{t−1} + (1−β)G̃_t, whose steps are (1−β) = 10× smaller at the
  same learning rate. ``power_iterations`` warm-started iterations per step
  give σ₁ (``exact_svd`` for checks). ``groups``: ``weight_decay``,
  ``routing`` and ``fallback`` as in :func:`muon` (not ``attention_blocks``:
  each leaf is its own block).
  """
  for name in ("attention_blocks", "attention_heads"):
    if name in groups:
      raise ValueError(f"muon_s orthogonalises each leaf on its own (its σ₁ power iteration "
                       f"keeps one state per leaf): {name} is not supported.")
  post = scale_by_muon_s(
      beta, buffer=buffer, power_iterations=power_iterations, exact_svd=exact_svd,
      mu_dtype=mu_dtype, ns=ns,
  )
  return routed_post_processing(post, learning_rate, **groups)


@forwards_options(muon)
def dp_muon(
    learning_rate: optax.ScalarOrSchedule, l2_clip_norm: float, noise_multiplier: float,
    denominator: float, key: KeyLike = None, *, clipping: Clipping | None = None,
    neighbouring: Neighbouring = ADD_REMOVE, noise: Noise = IID, bands: int | None = None,
    steps: int | None = None, **options: Any,
) -> PrivateTransformation:
  """DP-Muon (paper 1, §Method): the Gaussian release, then :func:`muon`.

  ``update(per_example_grads, state, params, *, mask=None)`` takes per-example
  gradients on a leading batch axis (or a ``ClippedSum``), like
  :func:`dpmuon_jax.dp_release`, and returns parameter updates.

  Args:
    learning_rate: η of the Muon group (paper 1: 0.02).
    l2_clip_norm, noise_multiplier, denominator, key: the release, see
      :class:`~dpmuon_jax.optimizers.private.ReleaseSettings`.
    clipping, neighbouring, noise, bands, steps: the release's too (noise="bandmf":
      correlated noise).
    **options: :func:`muon`'s (``beta``, ``nesterov``, ``ns``, ``weight_decay``,
      ``routing``, ``fallback``, ``attention_blocks``, ...).

  Returns:
    A :class:`~dpmuon_jax.privacy.release.PrivateTransformation`.
  """
  release = ReleaseSettings(l2_clip_norm, noise_multiplier, denominator, key, clipping,
                            neighbouring, noise, bands, steps)
  return private(release, muon(learning_rate, **options))


@forwards_options(muon_s)
def dp_muon_s(
    learning_rate: optax.ScalarOrSchedule, l2_clip_norm: float, noise_multiplier: float,
    denominator: float, key: KeyLike = None, *, clipping: Clipping | None = None,
    neighbouring: Neighbouring = ADD_REMOVE, noise: Noise = IID, bands: int | None = None,
    steps: int | None = None, **options: Any,
) -> PrivateTransformation:
  """DP-Muon-S (paper 1, design 4): the release, then :func:`muon_s` (preset lr 0.3, β 0.9).

  Arguments as in :func:`dp_muon`; ``options`` are :func:`muon_s`'s.
  """
  release = ReleaseSettings(l2_clip_norm, noise_multiplier, denominator, key, clipping,
                            neighbouring, noise, bands, steps)
  return private(release, muon_s(learning_rate, **options))
