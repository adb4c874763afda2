"""Paper 2's optimizers: DP-Muon-IM, and the baselines DP-Muon-BC and DP-AdamBC.

::

    DP-Muon-IM  query  q_i = Σ_k w_k ∇ℓ(θ_{t−k}; x_i)  (inner momentum), then DP-Muon
    DP-Muon-BC  release, heavy-ball M = βM + G̃, bias-corrected Newton–Schulz
    DP-AdamBC   release, Adam with the noise variance Φ = (σC/D)² removed from v̂

Paper 2 is the inner-momentum DP-Muon paper. Each optimizer is ONE release
over the whole tree followed by post-processing (privacy invariant 7,
docs/design.md); :func:`muon_bc` and :func:`adam_bc` are the post-processing
alone. DP-Muon-IM changes only the query: its ``optimizer.query`` (used by
:func:`dpmuon_jax.make_private_step`) reads the past states from the
:func:`~dpmuon_jax.transforms.history.param_history` transform in its chain;
each example still contributes one clipped vector.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from dpmuon_jax import checks
from dpmuon_jax.optimizers.filters import disk_muon, disk_query_spec
from dpmuon_jax.optimizers.muon import muon, routed_post_processing
from dpmuon_jax.optimizers.options import Buffer, NewtonSchulz, forwards_options
from dpmuon_jax.optimizers.private import ReleaseSettings, private
from dpmuon_jax.privacy.clipping import Clipping
from dpmuon_jax.privacy.composition import substitute_current
from dpmuon_jax.privacy.correlated import IID, Noise
from dpmuon_jax.privacy.disk_query import DISK_PRESETS
from dpmuon_jax.privacy.inner_momentum import (
  InnerMomentumInputs,
  MuonGroup,
  grouped_inner_momentum_query,
  inner_momentum_settings,
  inner_momentum_terms,
)
from dpmuon_jax.privacy.keys import KeyLike, root_key
from dpmuon_jax.privacy.query import LossFn, QueryFn, QuerySpec
from dpmuon_jax.privacy.release import ADD_REMOVE, Neighbouring, PrivateTransformation
from dpmuon_jax.transforms.bias_correction import (
  scale_by_adam_bc,
  scale_by_bias_corrected_orthogonalization,
)
from dpmuon_jax.transforms.history import find_history, param_history
from dpmuon_jax.transforms.momentum import HEAVY_BALL, muon_momentum
from dpmuon_jax.transforms.muon import SPLIT, AttentionBlocks
from dpmuon_jax.transforms.routing import MUON, Routing, muon_labels


def muon_group(routing: Routing) -> MuonGroup:
  """``params -> `` True for the leaves ``routing`` sends to Muon (the IM query's groups)."""
  return lambda params: jax.tree.map(lambda label: label == MUON, muon_labels(params, routing))


def inner_momentum_query(
    loss_fn: LossFn,
    history: int,
    decay: float,
    fallback_history: int | None = None,
    fallback_decay: float | None = None,
    routing: Routing = "paper1",
) -> QueryFn:
  """q_i = Σ_k w^{(g)}_k ∇ℓ(θ_{t−k}; x_i), the groups g given by ``routing``.

  :func:`~dpmuon_jax.privacy.inner_momentum.grouped_inner_momentum_query` with
  the Muon group of ``routing`` (see :mod:`dpmuon_jax.transforms.routing`; it
  must match the optimizer's). ``query(inputs, example)`` takes an
  :class:`~dpmuon_jax.privacy.inner_momentum.InnerMomentumInputs`.
  """
  return grouped_inner_momentum_query(
      loss_fn, muon_group(routing), history, decay, fallback_history, fallback_decay
  )


def inner_momentum_spec(
    history: int,
    decay: float,
    fallback_history: int | None = None,
    fallback_decay: float | None = None,
    routing: Routing = "paper1",
) -> QuerySpec:
  """The :class:`~dpmuon_jax.privacy.query.QuerySpec` of DP-Muon-IM.

  Its inputs are (θ_t, the :class:`~dpmuon_jax.transforms.history.ParamHistoryState`
  found in the optimizer state): both post-processing of earlier releases,
  never the noise stream.
  """
  inner_momentum_settings(history, decay, fallback_history, fallback_decay)  # validate eagerly
  make_query: Callable[[LossFn], QueryFn] = lambda loss_fn: inner_momentum_query(
      loss_fn, history, decay, fallback_history, fallback_decay, routing
  )
  inputs = lambda params, opt_state: InnerMomentumInputs(params, find_history(opt_state))
  terms = inner_momentum_terms(muon_group(routing), history, decay, fallback_history,
                               fallback_decay)
  return QuerySpec(make_query, inputs, terms)


@forwards_options(muon)
def dp_muon_im(
    learning_rate: optax.ScalarOrSchedule, l2_clip_norm: float, noise_multiplier: float,
    denominator: float, key: KeyLike = None, *, history: int = 1, decay: float = 0.5,
    fallback_history: int | None = None, fallback_decay: float | None = None,
    routing: Routing = "paper1", clipping: Clipping | None = None,
    neighbouring: Neighbouring = ADD_REMOVE, noise: Noise = IID, bands: int | None = None,
    steps: int | None = None, **options: Any,
) -> PrivateTransformation:
  """DP-Muon-IM (paper 2, §4): inner-momentum query, then DP-Muon's post-processing.

  Query of example i at step t (:mod:`dpmuon_jax.privacy.inner_momentum`)::

      q_i = Σ_{k=0}^{K_t} w_k ∇ℓ(θ_{t−k}; x_i),  w_k = γ^k / Σ_{j≤K_t} γ^j,  K_t = min(K, t)

  clipped as ONE vector at C; the release and its accounting are DP-Muon's.
  Train it with :func:`dpmuon_jax.make_private_step` (which uses
  ``optimizer.query``); ``update`` itself takes the clipped sum (or
  per-example queries) like every ``dp_*`` optimizer. K = 0 in both groups is
  DP-Muon, bit for bit.

  Args:
    history, decay: (K, γ) of the Muon group, an int K >= 0 and γ in (0, 1]
      (γ = 1: a plain average). Default (1, 0.5): paper 2 finds
      K = 1 within 0.06 validation BLEU of K = 4 in under half the time
      (§5.3), and γ = 0.5 is the decay of all its E2E presets.
    fallback_history, fallback_decay: (K′, γ′) of the fallback group;
      ``None``: the Muon group's. Paper 2's presets:
      ``**PAPER2_PRESETS[name]._asdict()`` (appendix C), with
      ``routing="paper2"`` and an AdamW fallback with its own learning rate
      (ε = 8 on E2E: learning rates 0.002 / 0.0035).
    routing: the groups of both the query and the post-processing.
    Other arguments: as in :func:`dpmuon_jax.dp_muon` (``options``:
      :func:`~dpmuon_jax.optimizers.muon.muon`'s).

  Cost: K_max + 1 gradient evaluations per example and K_max stored copies of
  the parameters (``benchmarks/bench_inner_momentum.py``).
  """
  query = inner_momentum_spec(history, decay, fallback_history, fallback_decay, routing)
  slots = max(history, history if fallback_history is None else fallback_history)
  post = muon(learning_rate, routing=routing, **options)
  release = ReleaseSettings(l2_clip_norm, noise_multiplier, denominator, key, clipping,
                            neighbouring, noise, bands, steps)
  return private(release, param_history(slots), post, query=query)


@forwards_options(disk_muon)
def dp_disk_muon_im(
    learning_rate: optax.ScalarOrSchedule, l2_clip_norm: float, noise_multiplier: float,
    denominator: float, key: KeyLike = None, *, history: int = 1, decay: float = 0.5,
    fallback_history: int | None = None, fallback_decay: float | None = None,
    kappa: float = DISK_PRESETS["paper2"].kappa, gamma: float = DISK_PRESETS["paper2"].gamma,
    routing: Routing = "paper1", clipping: Clipping | None = None,
    neighbouring: Neighbouring = ADD_REMOVE, noise: Noise = IID, bands: int | None = None,
    steps: int | None = None, **options: Any,
) -> PrivateTransformation:
  """KF + IM (paper 2, appendix C's joint ablation): DiSK inside inner momentum, then DiSK-Muon.

  Query (:func:`~dpmuon_jax.privacy.composition.substitute_current` of inner
  momentum and DiSK's two-point query)::

      q_i = w_0 [c ∇ℓ(θ_t + γ d_t; x_i) + (1 − c) ∇ℓ(θ_t; x_i)] + Σ_{k≥1} w_k ∇ℓ(θ_{t−k}; x_i)

  with c = (1 − κ)/(κγ), clipped as ONE vector at C; one Gaussian release per
  step, accounted as DP-Muon's. Post-processing: DiSK's Kalman filter with
  gain κ, then routed Muon (:func:`~dpmuon_jax.optimizers.filters.disk_muon`).
  K + 2 gradient evaluations per example (K + 1 at t = 0, where d_0 = 0).

  Args:
    history, decay, fallback_history, fallback_decay, routing: inner
      momentum's, as in :func:`dp_muon_im`.
    kappa, gamma: DiSK's; default paper 2's KF baseline (κ = 0.5,
      extrapolation 0.8).
    Other arguments: as in :func:`dp_muon_im`; ``options`` go to
      :func:`~dpmuon_jax.optimizers.filters.disk_muon` (``composition`` and
      :func:`~dpmuon_jax.optimizers.muon.muon`'s).
  """
  query = substitute_current(
      inner_momentum_spec(history, decay, fallback_history, fallback_decay, routing),
      disk_query_spec(kappa, gamma))
  slots = max(history, history if fallback_history is None else fallback_history)
  post = disk_muon(learning_rate, kappa=kappa, routing=routing, **options)
  release = ReleaseSettings(l2_clip_norm, noise_multiplier, denominator, key, clipping,
                            neighbouring, noise, bands, steps)
  return private(release, param_history(slots), post, query=query)


@forwards_options(routed_post_processing)
def muon_bc(
    learning_rate: optax.ScalarOrSchedule,
    *,
    noise_std: float,
    key: KeyLike = None,
    beta: float = 0.95,
    buffer: Buffer = HEAVY_BALL,
    nesterov: bool = False,
    num_samples: int = 1,
    antithetic: bool = True,
    mu_dtype: jnp.dtype | None = None,
    ns: NewtonSchulz = NewtonSchulz(),
    attention_blocks: AttentionBlocks = SPLIT,
    attention_heads: int | None = None,
    **groups: Any,
) -> optax.GradientTransformationExtraArgs:
  """Bias-corrected Muon (Kim & Fan 2026; paper 2's baseline), with OUR bias estimator.

  M_t = β M_{t−1} + G̃_t (heavy-ball), then
  Ĝ = aspect · [2 NS(M_t) − E_Z NS(M_t + s_t Z)] with s_t² = s₀² Σ_{j<t} β^{2j}
  the exact per-entry noise variance of the buffer after t inputs of
  per-entry noise std s₀, Z from the post-processing stream of ``key`` (see
  :func:`~dpmuon_jax.transforms.bias_correction.scale_by_bias_corrected_orthogonalization`);
  routed as :func:`~dpmuon_jax.optimizers.muon.muon`.

  Args:
    learning_rate: η of the Muon group.
    noise_std: s₀, the per-coordinate noise std of the input (σC/D after a release).
    key: the run's root key or seed; only its ``"postprocessing"`` stream is used.
    beta, buffer, nesterov, mu_dtype: the momentum. Kim & Fan's own estimator,
      κ, q and β were not available; β = 0.95 makes the buffer DP-Muon's
      without look-ahead (NS is scale-invariant).
    num_samples, antithetic: Monte-Carlo draws of Z per step (±Z pairs).
    ns: the orthogonalisation; its coefficients default to Kim & Fan's
      convergent quintic (1.875, −1.25, 0.375): with Keller Jordan's the
      correction does not reduce the bias (see
      :mod:`dpmuon_jax.transforms.bias_correction`).
    attention_blocks, attention_heads: the blocks orthogonalised, as in
      :func:`~dpmuon_jax.optimizers.muon.muon`.
    **groups: ``weight_decay``, ``routing``, ``fallback`` as in
      :func:`~dpmuon_jax.optimizers.muon.muon`.
  """
  post = optax.chain(
      muon_momentum(beta, nesterov, buffer, mu_dtype),
      scale_by_bias_corrected_orthogonalization(
          noise_std, beta, key, buffer, nesterov, num_samples, antithetic,
          attention_blocks=attention_blocks, attention_heads=attention_heads,
          ns=ns,
      ),
  )
  return routed_post_processing(post, learning_rate, **groups)


@forwards_options(muon_bc)
def dp_muon_bc(
    learning_rate: optax.ScalarOrSchedule, l2_clip_norm: float, noise_multiplier: float,
    denominator: float, key: KeyLike = None, *, clipping: Clipping | None = None,
    neighbouring: Neighbouring = ADD_REMOVE, noise: Noise = IID, bands: int | None = None,
    steps: int | None = None, **options: Any,
) -> PrivateTransformation:
  """DP-Muon-BC (Kim & Fan 2026; paper 2's baseline): the release, then :func:`muon_bc`.

  s₀ = σC/D is the release's noise std and Z comes from the post-processing
  stream of the run's root key (the release uses its noise stream). Arguments
  as in :func:`dpmuon_jax.dp_muon`; ``options``: :func:`muon_bc`'s.
  """
  root = root_key(key)
  release = ReleaseSettings(l2_clip_norm, noise_multiplier, denominator, root, clipping,
                            neighbouring, noise, bands, steps).build()
  post = muon_bc(learning_rate, noise_std=release.release.noise_std, key=root, **options)
  return private(release, post)


def adam_bc(
    learning_rate: optax.ScalarOrSchedule,
    *,
    noise_variance: float,
    b1: float = 0.9,
    b2: float = 0.999,
    eps_root: float = 1e-8,
    weight_decay: float = 0.0,
) -> optax.GradientTransformation:
  """AdamBC (Tang, Shpilevskiy, Lécuyer, AAAI 2024), the post-processing of DP-AdamBC.

  θ ← θ − η (m̂_t / sqrt(max(v̂_t − Φ, eps_root)) + λθ), no +eps.

  ``noise_variance``: Φ, the per-coordinate noise variance of the input
  ((σC/D)² after a release). Defaults are the official code's (β₁ = 0.9,
  β₂ = 0.999, eps_root = 1e-8; no +eps).
  """
  checks.check_learning_rate("learning_rate", learning_rate)
  checks.check_nonnegative("weight_decay", weight_decay)
  return optax.chain(
      scale_by_adam_bc(noise_variance, b1, b2, eps_root),
      optax.add_decayed_weights(weight_decay),
      optax.scale_by_learning_rate(learning_rate),
  )


@forwards_options(adam_bc)
def dp_adam_bc(
    learning_rate: optax.ScalarOrSchedule, l2_clip_norm: float, noise_multiplier: float,
    denominator: float, key: KeyLike = None, *, clipping: Clipping | None = None,
    neighbouring: Neighbouring = ADD_REMOVE, noise: Noise = IID, bands: int | None = None,
    steps: int | None = None, **options: Any,
) -> PrivateTransformation:
  """DP-AdamBC (Tang, Shpilevskiy, Lécuyer, AAAI 2024): the release, then :func:`adam_bc`.

  Φ = (σC/D)² is read from the release (D, not the realised batch size).
  Arguments as in :func:`dpmuon_jax.dp_muon`; ``options``: :func:`adam_bc`'s.
  """
  release = ReleaseSettings(l2_clip_norm, noise_multiplier, denominator, key, clipping,
                            neighbouring, noise, bands, steps).build()
  return private(release, adam_bc(learning_rate, noise_variance=release.release.noise_std**2,
                                  **options))
