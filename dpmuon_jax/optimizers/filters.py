"""DiSK and DOPPLER: a temporal filter on the release, then SGD or Muon.

::

    G̃_t = (Σ_i clip_C(q_i) + N(0, σ²C² I)) / D        ONE release, whole tree
    F_t = filter(G̃_0 … G̃_t)                             DiSK Kalman / DOPPLER low-pass
    SGD:  θ ← θ − η F_t
    Muon: see ``composition`` below; the fallback group as in :func:`dpmuon_jax.dp_muon`

:func:`disk_sgd`, :func:`doppler_sgd`, :func:`disk_muon` and
:func:`doppler_muon` are the post-processing alone (plain Optax); the ``dp_*``
names add the release. DiSK's q_i combines gradients at θ_t and θ_t + γ d_t
(:mod:`dpmuon_jax.privacy.disk_query`), so DiSK's private optimizers carry
their own query (``optimizer.query``, :func:`disk_query_spec`); DOPPLER's is
the plain gradient. Build the step with :func:`dpmuon_jax.make_private_step`,
which feeds each optimizer its own query.

The filter runs on the whole release, before the Muon/fallback partition. Both
filters are elementwise and linear, so this equals filtering each group
separately; one state covers both groups, and both are smoothed, as DiSK-SGD
and DOPPLER-SGD smooth every parameter.

How a filter composes with Muon is not specified by paper 1 ("Spectral Gradient
Orthogonalization Improves Differentially Private Training at Scale"), so it is
the option ``composition``:

* ``"replace"``: the filter output replaces Muon's momentum:
  Ĝ_t = aspect · NS₅(F_t), and the fallback group takes F_t without momentum
  (unless the ``Fallback`` gives a ``momentum``). Default of DOPPLER-Muon:
  paper 1's Table 15 lists it as "EMA + UVᵀ" with no β and no Nesterov.
* ``"feed"``: the filter output is the gradient Muon sees: M_t = βM_{t−1} +
  (1−β)F_t, Nesterov, then NS₅; the fallback group keeps DP-SGD's momentum
  (β′ = 0.9 unless given). Default of DiSK-Muon: DiSK is defined as a wrapper
  that hands its filtered gradient to an unchanged base optimizer ("BaseOpt",
  DiSK §3; Adam keeps its moments), paper 1 describes DiSK-Muon as "Kalman
  filter on DP-Muon", and paper 2's KF baselines "apply DiSK's simplified
  Kalman filter before optimizer updates".

Paper 1's learning rates (Table 15): DiSK-SGD 0.01 (κ = 1.5),
DOPPLER-SGD 3.0 (EMA 0.9), DOPPLER-Muon 0.02; DiSK-Muon's is not printed
(0.02, DP-Muon's, is the natural start).

DiSK-SGD's 0.01 does not carry over as η. It is the DiSK authors' command-line
default (KalmanDP ``init_utils.py``: lr 0.01, κ = 1.5, γ = −1), and their
``KFOptimizer.step`` divides the filtered gradient by its global L2 norm
before the base SGD, so there 0.01 is the LENGTH of every step. Here, as in
DiSK's algorithm (§3), θ ← θ − ηg_t with g_t unnormalised; the filter passes a
constant gradient unchanged (DC gain κ/(1 − (1−κ)) = 1), so η is on plain
SGD's scale: about 1, 100× the authors' default (the registry's preset, with
its evidence).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import optax

from dpmuon_jax import checks
from dpmuon_jax.optimizers.muon import muon, routed_post_processing
from dpmuon_jax.optimizers.options import (
    FEED,
    REPLACE,
    Composition,
    Fallback,
    NewtonSchulz,
    forwards_options,
)
from dpmuon_jax.optimizers.private import ReleaseSettings, private
from dpmuon_jax.privacy.clipping import Clipping
from dpmuon_jax.privacy.correlated import IID, Noise
from dpmuon_jax.privacy.disk_query import (
    DISK_PRESETS,
    disk_noise_multiplier,
    disk_points,
    disk_query,
    disk_terms,
    single_point,
)
from dpmuon_jax.privacy.keys import KeyLike
from dpmuon_jax.privacy.query import QuerySpec
from dpmuon_jax.privacy.release import ADD_REMOVE, Neighbouring, PrivateTransformation
from dpmuon_jax.transforms.filters import (
    DOPPLER_PRESETS,
    applied_update,
    kalman_filter,
    low_pass_filter,
    record_applied_update,
)
from dpmuon_jax.transforms.muon import SPLIT, AttentionBlocks, scale_by_orthogonalization

COMPOSITIONS = (REPLACE, FEED)

_DISK = DISK_PRESETS["disk"]
_EMA = DOPPLER_PRESETS["ema0.9"]


def disk_query_spec(kappa: float, gamma: float) -> QuerySpec:
  """The :class:`~dpmuon_jax.privacy.query.QuerySpec` of DiSK with gain κ, extrapolation γ.

  The query is :func:`~dpmuon_jax.privacy.disk_query.disk_query` at
  (θ_t, θ_t + γ d_t), with d_t read by
  :func:`~dpmuon_jax.transforms.filters.applied_update` from the
  ``record_applied_update`` state in the optimizer state.
  """
  single_point(kappa, gamma)  # validate eagerly
  return QuerySpec(
      lambda loss_fn: disk_query(loss_fn, kappa, gamma),
      lambda params, opt_state: disk_points(params, applied_update(opt_state), gamma),
      disk_terms(kappa, gamma),
  )


@forwards_options(routed_post_processing)
def _replacing_muon(
    learning_rate: optax.ScalarOrSchedule,
    *,
    beta: float = 0.95,
    nesterov: bool = True,
    mu_dtype: Any = None,
    ns: NewtonSchulz = NewtonSchulz(),
    fallback: Fallback = Fallback(),
    attention_blocks: AttentionBlocks = SPLIT,
    attention_heads: int | None = None,
    **groups: Any,
) -> optax.GradientTransformationExtraArgs:
  """``"replace"``: Ĝ = aspect · NS₅(F_t) (no Muon momentum), fallback momentum 0 unless given.

  ``attention_blocks``, ``attention_heads``: as in :func:`muon`."""
  del beta, nesterov, mu_dtype  # the filter output replaces Muon's momentum
  if fallback.momentum is None:
    fallback = dataclasses.replace(fallback, momentum=0.0)
  post = scale_by_orthogonalization(attention_blocks=attention_blocks,
                                    attention_heads=attention_heads, ns=ns)
  return routed_post_processing(post, learning_rate, fallback=fallback, **groups)


def _filtered_muon(
    learning_rate: optax.ScalarOrSchedule, composition: Composition, options: dict[str, Any]
) -> optax.GradientTransformationExtraArgs:
  """The routed Muon step after a filter, composed as ``composition`` says."""
  if composition == REPLACE:
    return _replacing_muon(learning_rate, **options)
  if composition == FEED:
    return muon(learning_rate, **options)
  raise ValueError(f"composition must be one of {COMPOSITIONS}, got {composition!r}.")


def disk_sgd(
    learning_rate: optax.ScalarOrSchedule, *, kappa: float = _DISK.kappa
) -> optax.GradientTransformation:
  """DiSK-SGD's post-processing (DiSK §3): g_t = (1−κ)g_{t−1} + κG̃_t, θ ← θ − ηg_t.

  g_t is not normalised (the DiSK authors' code divides it by its global norm;
  see the module docstring), so η is on plain SGD's scale. The applied update
  d_t = −ηg_t is recorded last, for DiSK's next query.
  """
  checks.check_learning_rate("learning_rate", learning_rate)
  return optax.chain(kalman_filter(kappa), optax.sgd(learning_rate), record_applied_update())


def doppler_sgd(
    learning_rate: optax.ScalarOrSchedule,
    *,
    a: Sequence[float] = _EMA.a,
    b: Sequence[float] = _EMA.b,
    bias_correction: bool = True,
) -> optax.GradientTransformation:
  """DOPPLER-SGD's post-processing (DOPPLER §3): the low-pass filter m̂_t, θ ← θ − ηm̂_t.

  ``a``, ``b``, ``bias_correction``: see
  :func:`dpmuon_jax.transforms.filters.low_pass_filter`; default paper 1's
  EMA(0.9). Presets in :data:`dpmuon_jax.transforms.filters.DOPPLER_PRESETS`.
  """
  checks.check_learning_rate("learning_rate", learning_rate)
  return optax.chain(low_pass_filter(a, b, bias_correction), optax.sgd(learning_rate))


@forwards_options(muon, _replacing_muon)
def disk_muon(
    learning_rate: optax.ScalarOrSchedule,
    *,
    kappa: float = _DISK.kappa,
    composition: Composition = FEED,
    **options: Any,
) -> optax.GradientTransformation:
  """DiSK-Muon's post-processing (paper 1, Table 15): DiSK's Kalman filter, then routed Muon.

  Args:
    learning_rate: η of the Muon group.
    kappa: DiSK's gain κ in (0, 2].
    composition: ``"feed"`` (default: the filter feeds Muon's momentum) or
      ``"replace"`` (NS₅ of the filter output); see the module docstring.
    **options: :func:`~dpmuon_jax.optimizers.muon.muon`'s; ``beta``,
      ``nesterov`` and ``mu_dtype`` are used by ``"feed"`` only, and a
      ``fallback`` without ``momentum`` gets β′ = 0.9 under ``"feed"``, 0 under
      ``"replace"`` (the filter replaces all momentum).

  The applied update d_t (after learning rate and weight decay, both groups)
  is recorded last in the chain for the next step's query.
  """
  return optax.chain(
      kalman_filter(kappa),
      _filtered_muon(learning_rate, composition, options),
      record_applied_update(),
  )


@forwards_options(muon, _replacing_muon)
def doppler_muon(
    learning_rate: optax.ScalarOrSchedule,
    *,
    a: Sequence[float] = _EMA.a,
    b: Sequence[float] = _EMA.b,
    bias_correction: bool = True,
    composition: Composition = REPLACE,
    **options: Any,
) -> optax.GradientTransformation:
  """DOPPLER-Muon's post-processing (paper 1, Table 15, "EMA + UVᵀ"): low-pass, routed Muon.

  Args:
    learning_rate: η of the Muon group (paper 1: 0.02).
    a, b, bias_correction: as in :func:`doppler_sgd` (default EMA(0.9)).
    composition: ``"replace"`` (default: Ĝ = aspect · NS₅(m̂_t), no Muon
      momentum) or ``"feed"``; see the module docstring.
    **options: as in :func:`disk_muon`.
  """
  return optax.chain(
      low_pass_filter(a, b, bias_correction),
      _filtered_muon(learning_rate, composition, options),
  )


@forwards_options()  # to post_processing: each caller declares it with its own
def _disk_private(
    post_processing: Callable[..., optax.GradientTransformation],
    learning_rate: optax.ScalarOrSchedule,
    release: ReleaseSettings,
    *,
    kappa: float = _DISK.kappa,
    gamma: float = _DISK.gamma,
    reference_noise_rescaling: bool = False,
    **options: Any,
) -> PrivateTransformation:
  """DiSK's query and release (σ as the reference code with ``reference_noise_rescaling``)."""
  post = post_processing(learning_rate, kappa=kappa, **options)
  sigma = disk_noise_multiplier(release.noise_multiplier, kappa, gamma, reference_noise_rescaling)
  release = dataclasses.replace(release, noise_multiplier=sigma)
  return private(release, post, query=disk_query_spec(kappa, gamma))


@forwards_options(_disk_private, disk_sgd)
def dp_disk_sgd(
    learning_rate: optax.ScalarOrSchedule, l2_clip_norm: float, noise_multiplier: float,
    denominator: float, key: KeyLike = None, *, clipping: Clipping | None = None,
    neighbouring: Neighbouring = ADD_REMOVE, noise: Noise = IID, bands: int | None = None,
    steps: int | None = None, **options: Any,
) -> PrivateTransformation:
  """DiSK-SGD (DiSK §3): DiSK's query and release, then :func:`disk_sgd`.

  Args:
    learning_rate: η on the unnormalised g_t, plain SGD's scale (the small
      CNN on CIFAR-10 learns for η in [0.3, 3]; paper 1's 0.01 is a
      normalised step length, see the module docstring).
    l2_clip_norm, noise_multiplier, denominator, key: the release, see
      :class:`~dpmuon_jax.optimizers.private.ReleaseSettings`.
    clipping, neighbouring, noise, bands, steps: the release's too (noise="bandmf":
      correlated noise).
    **options: ``kappa``, ``gamma``: DiSK's κ in (0, 2] and γ, any real;
      defaults are the DiSK paper's (0.7, 0.5). Presets in
      :data:`dpmuon_jax.privacy.disk_query.DISK_PRESETS`.
      ``reference_noise_rescaling``: add σ/√(c²+(1−c)²)·C of noise as the
      reference code (Opacus, KalmanDP) does instead of exactly σC. Off by
      default; the ledger accounts whatever is added.

  Returns:
    A :class:`~dpmuon_jax.privacy.release.PrivateTransformation` whose
    ``query`` is DiSK's; ``update`` also accepts plain per-example queries.
  """
  release = ReleaseSettings(l2_clip_norm, noise_multiplier, denominator, key, clipping,
                            neighbouring, noise, bands, steps)
  return _disk_private(disk_sgd, learning_rate, release, **options)


@forwards_options(doppler_sgd)
def dp_doppler_sgd(
    learning_rate: optax.ScalarOrSchedule, l2_clip_norm: float, noise_multiplier: float,
    denominator: float, key: KeyLike = None, *, clipping: Clipping | None = None,
    neighbouring: Neighbouring = ADD_REMOVE, noise: Noise = IID, bands: int | None = None,
    steps: int | None = None, **options: Any,
) -> PrivateTransformation:
  """DOPPLER-SGD (DOPPLER §3): the DP-SGD release, then :func:`doppler_sgd`.

  ``learning_rate``: η (paper 1: 3.0 with EMA 0.9); the release as in
  :func:`dp_disk_sgd`; ``options``: :func:`doppler_sgd`'s ``a``, ``b``,
  ``bias_correction``.
  """
  release = ReleaseSettings(l2_clip_norm, noise_multiplier, denominator, key, clipping,
                            neighbouring, noise, bands, steps)
  return private(release, doppler_sgd(learning_rate, **options))


@forwards_options(_disk_private, disk_muon)
def dp_disk_muon(
    learning_rate: optax.ScalarOrSchedule, l2_clip_norm: float, noise_multiplier: float,
    denominator: float, key: KeyLike = None, *, clipping: Clipping | None = None,
    neighbouring: Neighbouring = ADD_REMOVE, noise: Noise = IID, bands: int | None = None,
    steps: int | None = None, **options: Any,
) -> PrivateTransformation:
  """DiSK-Muon (paper 1, Table 15): DiSK's query and release, then :func:`disk_muon`.

  ``options``: ``gamma`` and ``reference_noise_rescaling`` as in
  :func:`dp_disk_sgd`, and :func:`disk_muon`'s (``kappa``, ``composition``,
  and :func:`~dpmuon_jax.optimizers.muon.muon`'s).
  """
  release = ReleaseSettings(l2_clip_norm, noise_multiplier, denominator, key, clipping,
                            neighbouring, noise, bands, steps)
  return _disk_private(disk_muon, learning_rate, release, **options)


@forwards_options(doppler_muon)
def dp_doppler_muon(
    learning_rate: optax.ScalarOrSchedule, l2_clip_norm: float, noise_multiplier: float,
    denominator: float, key: KeyLike = None, *, clipping: Clipping | None = None,
    neighbouring: Neighbouring = ADD_REMOVE, noise: Noise = IID, bands: int | None = None,
    steps: int | None = None, **options: Any,
) -> PrivateTransformation:
  """DOPPLER-Muon (paper 1, Table 15, "EMA + UVᵀ", lr 0.02): the release, then :func:`doppler_muon`.

  ``options``: :func:`doppler_muon`'s (``a``, ``b``, ``bias_correction``,
  ``composition``, and :func:`~dpmuon_jax.optimizers.muon.muon`'s).
  """
  release = ReleaseSettings(l2_clip_norm, noise_multiplier, denominator, key, clipping,
                            neighbouring, noise, bands, steps)
  return private(release, doppler_muon(learning_rate, **options))
