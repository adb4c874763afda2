"""DiSK and DOPPLER: the private release, a temporal filter, then SGD or Muon.

    G̃_t = (Σ_i clip_C(q_i) + N(0, σ²C² I)) / D        ONE release, whole tree
    F_t = filter(G̃_0 … G̃_t)                             DiSK Kalman / DOPPLER low-pass
    SGD:  θ ← θ − η F_t
    Muon: see ``composition`` below; the fallback group as in :func:`dpmuon_jax.dp_muon`

DiSK's q_i combines gradients at θ_t and θ_t + γ d_t
(:mod:`dpmuon_jax.privacy.disk_query`); DOPPLER's is the plain gradient.
Build the step with :func:`dpmuon_jax.make_private_step`, which feeds each
optimizer its own query (``optimizer.query``).

The filter runs on the whole release, before the Muon/fallback partition. Both
filters are elementwise and linear, so this equals filtering each group
separately; one state covers both groups, and both are smoothed, as DiSK-SGD
and DOPPLER-SGD smooth every parameter.

How a filter composes with Muon is not specified by paper 1 ("Spectral Gradient
Orthogonalization Improves Differentially Private Training at Scale"), so it is
the option ``composition``:

* ``"replace"``: the filter output replaces Muon's momentum:
  Ĝ_t = aspect · NS₅(F_t), and the fallback group takes F_t without momentum
  (unless ``fallback_momentum`` is given). Default of DOPPLER-Muon: paper 1's
  Table 15 lists it as "EMA + UVᵀ" with no β and no Nesterov.
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
"""

from __future__ import annotations

from collections.abc import Sequence

import optax

from dpmuon_jax import checks
from dpmuon_jax.linalg.newton_schulz import DEFAULT_NS_COEFFS, CoeffsLike
from dpmuon_jax.linalg.scaling import DP_MUON_MAX_ASPECT_RATIO, DimensionNumbers
from dpmuon_jax.optimizers_muon import routed_post_processing
from dpmuon_jax.privacy.clipping import Clipping
from dpmuon_jax.privacy.disk_query import (
    DISK_PRESETS,
    disk_noise_multiplier,
    disk_points,
    disk_query,
    single_point,
)
from dpmuon_jax.privacy.keys import KeyLike
from dpmuon_jax.privacy.query import GRADIENT_QUERY, QuerySpec
from dpmuon_jax.privacy.release import ADD_REMOVE, PrivateTransformation, dp_release, privatize
from dpmuon_jax.transforms.filters import (
    DOPPLER_PRESETS,
    applied_update,
    kalman_filter,
    low_pass_filter,
    record_applied_update,
)
from dpmuon_jax.transforms.muon import scale_by_muon, scale_by_orthogonalization
from dpmuon_jax.transforms.routing import Routing

REPLACE = "replace"
FEED = "feed"
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
  )


def _release(
    l2_clip_norm: float,
    noise_multiplier: float,
    denominator: float,
    key: KeyLike,
    clipping: Clipping | None,
    neighbouring: str,
    filter_: optax.GradientTransformation,
    *post_processing: optax.GradientTransformation,
    query: QuerySpec = GRADIENT_QUERY,
) -> PrivateTransformation:
  release = dp_release(l2_clip_norm, noise_multiplier, denominator, key, clipping, neighbouring)
  return privatize(release, filter_, *post_processing, query=query)


def _muon_post(
    composition: str,
    beta: float,
    nesterov: bool,
    ns_steps: int,
    ns_coeffs: CoeffsLike,
    eps: float,
    dimension_numbers: DimensionNumbers,
    ns_dtype,
    precision,
    mu_dtype,
) -> optax.GradientTransformation:
  if composition == REPLACE:
    return scale_by_orthogonalization(
        ns_steps, ns_coeffs, eps, dimension_numbers, ns_dtype, precision,
        DP_MUON_MAX_ASPECT_RATIO,
    )
  if composition == FEED:
    return scale_by_muon(
        beta, nesterov, ns_steps, ns_coeffs, eps, dimension_numbers, ns_dtype, precision, mu_dtype
    )
  raise ValueError(f"composition must be one of {COMPOSITIONS}, got {composition!r}.")


def _fallback_momentum(composition: str, fallback_momentum: float | None) -> float:
  if fallback_momentum is not None:
    return fallback_momentum
  return 0.0 if composition == REPLACE else 0.9


def dp_disk_sgd(
    learning_rate: optax.ScalarOrSchedule,
    l2_clip_norm: float,
    noise_multiplier: float,
    denominator: float,
    key: KeyLike = None,
    *,
    kappa: float = _DISK.kappa,
    gamma: float = _DISK.gamma,
    reference_noise_rescaling: bool = False,
    clipping: Clipping | None = None,
    neighbouring: str = ADD_REMOVE,
) -> PrivateTransformation:
  """DiSK-SGD (DiSK §3): DiSK's query and release, g_t = (1−κ)g_{t−1} + κG̃_t, θ ← θ − ηg_t.

  Args:
    learning_rate: η (paper 1: 0.01 with κ = 1.5).
    l2_clip_norm, noise_multiplier, denominator, key, clipping, neighbouring:
      the release, see :func:`dpmuon_jax.dp_release`.
    kappa, gamma: DiSK's κ in (0, 2] and γ, any real; defaults are the DiSK
      paper's (0.7, 0.5). Presets in
      :data:`dpmuon_jax.privacy.disk_query.DISK_PRESETS`.
    reference_noise_rescaling: add σ/√(c²+(1−c)²)·C of noise as the reference
      code (Opacus, KalmanDP) does instead of exactly σC. Off by default; the
      ledger accounts whatever is added.

  Returns:
    A :class:`~dpmuon_jax.privacy.release.PrivateTransformation` whose
    ``query`` is DiSK's; ``update`` also accepts plain per-example queries.
  """
  checks.check_learning_rate("learning_rate", learning_rate)
  sigma = disk_noise_multiplier(noise_multiplier, kappa, gamma, reference_noise_rescaling)
  return _release(
      l2_clip_norm, sigma, denominator, key, clipping, neighbouring,
      kalman_filter(kappa), optax.sgd(learning_rate), record_applied_update(),
      query=disk_query_spec(kappa, gamma),
  )


def dp_doppler_sgd(
    learning_rate: optax.ScalarOrSchedule,
    l2_clip_norm: float,
    noise_multiplier: float,
    denominator: float,
    key: KeyLike = None,
    *,
    a: Sequence[float] = _EMA.a,
    b: Sequence[float] = _EMA.b,
    bias_correction: bool = True,
    clipping: Clipping | None = None,
    neighbouring: str = ADD_REMOVE,
) -> PrivateTransformation:
  """DOPPLER-SGD (DOPPLER §3): the DP-SGD release, the low-pass filter m̂_t, θ ← θ − ηm̂_t.

  Args:
    learning_rate: η (paper 1: 3.0 with EMA 0.9).
    l2_clip_norm, noise_multiplier, denominator, key, clipping, neighbouring:
      the release, see :func:`dpmuon_jax.dp_release`.
    a, b, bias_correction: see :func:`dpmuon_jax.transforms.filters.low_pass_filter`;
      default paper 1's EMA(0.9). Presets in
      :data:`dpmuon_jax.transforms.filters.DOPPLER_PRESETS`.
  """
  checks.check_learning_rate("learning_rate", learning_rate)
  return _release(
      l2_clip_norm, noise_multiplier, denominator, key, clipping, neighbouring,
      low_pass_filter(a, b, bias_correction), optax.sgd(learning_rate),
  )


def dp_disk_muon(
    learning_rate: optax.ScalarOrSchedule,
    l2_clip_norm: float,
    noise_multiplier: float,
    denominator: float,
    key: KeyLike = None,
    *,
    kappa: float = _DISK.kappa,
    gamma: float = _DISK.gamma,
    reference_noise_rescaling: bool = False,
    composition: str = FEED,
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
    fallback_momentum: float | None = None,
    fallback_nesterov: bool = False,
    fallback_weight_decay: float = 0.0,
    clipping: Clipping | None = None,
    neighbouring: str = ADD_REMOVE,
) -> PrivateTransformation:
  """DiSK-Muon (paper 1, Table 15): DiSK's query, release and Kalman filter, then routed Muon.

  Args:
    kappa, gamma, reference_noise_rescaling: as in :func:`dp_disk_sgd`.
    composition: ``"feed"`` (default: the filter feeds Muon's momentum) or
      ``"replace"`` (NS₅ of the filter output); see the module docstring.
    beta, nesterov, mu_dtype: Muon's momentum, used by ``"feed"`` only.
    fallback_momentum: β′ of the fallback group; ``None``: 0.9 under
      ``"feed"``, 0 under ``"replace"`` (the filter replaces all momentum).
    Other arguments: as in :func:`dpmuon_jax.dp_muon`.

  The applied update d_t (after learning rate and weight decay, both groups)
  is recorded last in the chain for the next step's query.
  """
  sigma = disk_noise_multiplier(noise_multiplier, kappa, gamma, reference_noise_rescaling)
  post = _muon_post(
      composition, beta, nesterov, ns_steps, ns_coeffs, eps, dimension_numbers, ns_dtype,
      precision, mu_dtype,
  )
  routed = routed_post_processing(
      post, learning_rate, weight_decay, routing, fallback, fallback_learning_rate,
      _fallback_momentum(composition, fallback_momentum), fallback_nesterov,
      fallback_weight_decay,
  )
  return _release(
      l2_clip_norm, sigma, denominator, key, clipping, neighbouring,
      kalman_filter(kappa), routed, record_applied_update(),
      query=disk_query_spec(kappa, gamma),
  )


def dp_doppler_muon(
    learning_rate: optax.ScalarOrSchedule,
    l2_clip_norm: float,
    noise_multiplier: float,
    denominator: float,
    key: KeyLike = None,
    *,
    a: Sequence[float] = _EMA.a,
    b: Sequence[float] = _EMA.b,
    bias_correction: bool = True,
    composition: str = REPLACE,
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
    fallback_momentum: float | None = None,
    fallback_nesterov: bool = False,
    fallback_weight_decay: float = 0.0,
    clipping: Clipping | None = None,
    neighbouring: str = ADD_REMOVE,
) -> PrivateTransformation:
  """DOPPLER-Muon (paper 1, Table 15, "EMA + UVᵀ", lr 0.02): release, low-pass, routed Muon.

  Args:
    a, b, bias_correction: as in :func:`dp_doppler_sgd` (default EMA(0.9)).
    composition: ``"replace"`` (default: Ĝ = aspect · NS₅(m̂_t), no Muon
      momentum) or ``"feed"``; see the module docstring.
    beta, nesterov, mu_dtype: Muon's momentum, used by ``"feed"`` only.
    fallback_momentum: as in :func:`dp_disk_muon`.
    Other arguments: as in :func:`dpmuon_jax.dp_muon`.
  """
  post = _muon_post(
      composition, beta, nesterov, ns_steps, ns_coeffs, eps, dimension_numbers, ns_dtype,
      precision, mu_dtype,
  )
  routed = routed_post_processing(
      post, learning_rate, weight_decay, routing, fallback, fallback_learning_rate,
      _fallback_momentum(composition, fallback_momentum), fallback_nesterov,
      fallback_weight_decay,
  )
  return _release(
      l2_clip_norm, noise_multiplier, denominator, key, clipping, neighbouring,
      low_pass_filter(a, b, bias_correction), routed,
  )
