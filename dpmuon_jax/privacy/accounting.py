"""Privacy accounting with Google's dp-accounting (privacy invariant 5, docs/design.md).

One release of the Gaussian mechanism on a Poisson sample is the event
``PoissonSampled(q, Gaussian(σ))``; T releases are that event self-composed T
times. ε(σ, q, T, δ) is computed by dp-accounting's RDP accountant (default)
or its PLD accountant, for add/remove-one adjacency. Replace-one adjacency
doubles the L2 sensitivity, so its events are accounted with σ/2
(:attr:`~dpmuon_jax.privacy.release.GaussianReleaseSpec.accounting_noise_multiplier`),
which upper-bounds the replace-one guarantee.

:class:`PrivacyLedger` records the releases actually made. It reads q, σ, C,
D, the neighbouring relation and whether the run was seeded from the sampler
and release objects themselves, refuses a release made under other settings,
serialises to JSON, and tells a training loop when the next release would
exceed the budget.

A BLT release (:func:`~dpmuon_jax.privacy.correlated.dp_blt_release`) is not banded, so no
amplification by sampling is claimed for it: its first t releases are post-processing of ONE
Gaussian mechanism on C_t X of noise multiplier σ/Δ_t, Δ_t its sensitivity when one example
takes part in releases b apart (b the sampler's ``cycle_length``;
:func:`~dpmuon_jax.privacy.correlated.blt_sensitivity`), and ε(t) is that event's.

dp-accounting logs warnings when a fractional RDP order does not converge
(that order is then excluded, which can only increase ε); they are kept out of
the user's output. The ε returned is always a valid upper bound.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import os
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple, cast

import dp_accounting
import numpy as np
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.rdp import rdp_privacy_accountant

from dpmuon_jax import checks
from dpmuon_jax.privacy.correlated import BLTStrategy, blt_sensitivity
from dpmuon_jax.privacy.release import GaussianReleaseSpec, Neighbouring

RDP = "rdp"
PLD = "pld"
ACCOUNTANTS = (RDP, PLD)

RDP_ORDERS: tuple[float, ...] = tuple(
    float(a)
    for a in np.unique(
        np.round(
            np.concatenate([
                np.arange(1.01, 1.1, 0.01),
                np.arange(1.1, 3.0, 0.05),
                np.arange(3.0, 11.0, 0.1),
                np.arange(11.0, 64.0, 0.5),
                np.arange(64.0, 129.0, 4.0),
                [160, 192, 256, 384, 512, 1024],
            ]),
            4,
        )
    )
)
"""RDP orders: steps 0.01 below 1.1, 0.05 below 3, 0.1 below 11, 0.5 below 64, then coarser.

A superset of dp-accounting's default orders (so ε is never larger than with
them); integer orders cost O(α) each, so few large ones are kept.
"""

PLD_VALUE_DISCRETIZATION = 1e-3
"""Privacy-loss discretisation of the PLD accountant (pessimistic rounding)."""

_DP_ACCOUNTING_DIR = os.path.dirname(dp_accounting.__file__)


class _DropDpAccountingRecords(logging.Filter):

  def filter(self, record: logging.LogRecord) -> bool:
    return not record.pathname.startswith(_DP_ACCOUNTING_DIR)


@contextlib.contextmanager
def quiet_dp_accounting() -> Iterator[None]:
  """Silences dp-accounting's log warnings for the duration of a computation.

  dp-accounting 0.6 reports through logging, not ``warnings``: the RDP
  accountant via absl ("_compute_log_a_frac failed to converge ... Excluding
  this order", "Negative Renyi divergence"), the PLD code via the root logger.
  Only records from files of the dp_accounting package are dropped.
  """
  loggers = (logging.getLogger("absl"), logging.getLogger())
  drop = _DropDpAccountingRecords()
  for logger in loggers:
    logger.addFilter(drop)
  try:
    yield
  finally:
    for logger in loggers:
      logger.removeFilter(drop)


def _check_accountant(accountant: str) -> None:
  if accountant not in ACCOUNTANTS:
    raise ValueError(f"accountant must be one of {ACCOUNTANTS}, got {accountant!r}.")


def _check_delta(target_delta: float) -> None:
  checks.check_in_range("target_delta", target_delta, 0.0, 1.0, False, False)


def _warn_large_delta(target_delta: float, dataset_size: int | None, stacklevel: int) -> None:
  """Warns when δ ≥ 1/N: then publishing one random example is (0, δ)-DP."""
  if dataset_size is None:
    return
  if target_delta >= 1.0 / checks.check_positive_int("dataset_size", dataset_size):
    warnings.warn(
        f"target_delta={target_delta:g} >= 1/N = {1.0 / dataset_size:g}: a mechanism that "
        f"publishes one random example satisfies this δ. Use δ well below 1/N.",
        UserWarning,
        stacklevel=stacklevel + 1,
    )


def _check_rate(sampling_rate: float) -> None:
  checks.check_in_range("sampling_rate", sampling_rate, 0.0, 1.0, False, True)


def _check_steps(steps: int) -> None:
  if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or steps < 0:
    raise ValueError(f"steps must be an int >= 0, got {steps!r}.")


def _check_sigma(noise_multiplier: float) -> None:
  checks.check_nonnegative("noise_multiplier", noise_multiplier)


def _check_epsilon(target_epsilon: float) -> None:
  checks.check_positive("target_epsilon", target_epsilon)


def make_accountant(accountant: str = RDP) -> dp_accounting.PrivacyAccountant:
  """A fresh add/remove-one accountant of the named kind (``"rdp"`` or ``"pld"``)."""
  _check_accountant(accountant)
  relation = dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE
  if accountant == RDP:
    return rdp_privacy_accountant.RdpAccountant(RDP_ORDERS, relation)
  return pld_privacy_accountant.PLDAccountant(relation, PLD_VALUE_DISCRETIZATION)


def gaussian_release_event(
    noise_multiplier: float, sampling_rate: float, steps: int = 1
) -> dp_accounting.DpEvent:
  """``steps`` self-composed releases of PoissonSampled(q, Gaussian(σ)) (none: NoOp)."""
  if steps == 0:
    return dp_accounting.NoOpDpEvent()
  event = dp_accounting.PoissonSampledDpEvent(
      sampling_rate, dp_accounting.GaussianDpEvent(noise_multiplier)
  )
  return dp_accounting.SelfComposedDpEvent(event, int(steps))


@functools.lru_cache(maxsize=1024)
def _rdp_of_one_release(noise_multiplier: float, sampling_rate: float) -> np.ndarray:
  """ε(λ) of ONE PoissonSampled(q, Gaussian(σ)) release at :data:`RDP_ORDERS` (read-only)."""
  with quiet_dp_accounting():
    acc = cast(rdp_privacy_accountant.RdpAccountant, make_accountant(RDP))
    acc.compose(gaussian_release_event(noise_multiplier, sampling_rate, 1))
    rdp = np.asarray(acc.rdp, dtype=np.float64)
  rdp.setflags(write=False)
  return rdp


def release_rdp(noise_multiplier: float, sampling_rate: float, steps: int = 1) -> np.ndarray:
  """ε(λ) at :data:`RDP_ORDERS` of ``steps`` PoissonSampled(q, Gaussian(σ)) releases.

  RDP composes linearly, T·ε₁(λ): exactly what dp-accounting's ``RdpAccountant``
  computes for SelfComposed(event, T), bit for bit; ε₁ is computed once per (σ, q).
  """
  return steps * _rdp_of_one_release(float(noise_multiplier), float(sampling_rate))


def epsilon_from_rdp(rdp: np.ndarray, target_delta: float) -> float:
  """ε at δ of an RDP curve at :data:`RDP_ORDERS` (dp-accounting's conversion)."""
  with quiet_dp_accounting():
    epsilon, _ = rdp_privacy_accountant.compute_epsilon(
        RDP_ORDERS, np.asarray(rdp).tolist(), target_delta)
  return float(epsilon)


@functools.lru_cache(maxsize=4096)
def _epsilon(
    noise_multiplier: float, sampling_rate: float, steps: int, target_delta: float, accountant: str
) -> float:
  if steps == 0:
    return 0.0
  if noise_multiplier == 0.0:
    return math.inf
  if accountant == RDP:
    return epsilon_from_rdp(release_rdp(noise_multiplier, sampling_rate, steps), target_delta)
  with quiet_dp_accounting():
    acc = make_accountant(accountant)
    acc.compose(gaussian_release_event(noise_multiplier, sampling_rate, steps))
    return float(acc.get_epsilon(target_delta))


@functools.lru_cache(maxsize=4096)
def _gaussian_epsilon(noise_multiplier: float, target_delta: float, accountant: str) -> float:
  """ε at δ of ONE Gaussian mechanism of noise multiplier σ (no sampling), add/remove-one."""
  if noise_multiplier == 0.0:
    return math.inf
  with quiet_dp_accounting():
    acc = make_accountant(accountant)
    acc.compose(dp_accounting.GaussianDpEvent(noise_multiplier))
    return float(acc.get_epsilon(target_delta))


def compute_epsilon(
    noise_multiplier: float,
    sampling_rate: float,
    steps: int,
    target_delta: float,
    accountant: str = RDP,
    *,
    dataset_size: int | None = None,
) -> float:
  """ε after ``steps`` releases of PoissonSampled(q, Gaussian(σ)), add/remove-one.

  Args:
    noise_multiplier: σ as the accountant sees it (noise std over the L2
      sensitivity; for replace-one adjacency pass σ/2). σ = 0 gives ε = inf.
    sampling_rate: q in (0, 1].
    steps: T ≥ 0 (T = 0 gives ε = 0).
    target_delta: δ in (0, 1).
    accountant: ``"rdp"`` (default) or ``"pld"``.
    dataset_size: N; if given, warns when δ ≥ 1/N.
  """
  _check_sigma(noise_multiplier)
  _check_rate(sampling_rate)
  _check_steps(steps)
  _check_delta(target_delta)
  _warn_large_delta(target_delta, dataset_size, stacklevel=2)
  _check_accountant(accountant)
  return _epsilon(
      float(noise_multiplier), float(sampling_rate), int(steps), float(target_delta), accountant
  )


CALIBRATION_RTOL = 1e-3
"""Calibration stops once ε(σ) is within this relative distance below the target."""


def refine_bracket(
    log_gap: Callable[[float], float],
    fits: float,
    fails: float,
    integer: bool,
    close_enough: Callable[[float, float, float], bool],
) -> float:
  """Shrinks a bracket of a monotone ε(x) and returns its end that fits the budget.

  ``log_gap(x) = log(ε(x)/target)`` is ≤ 0 at ``fits`` and > 0 at ``fails``.
  Each step is a false-position step in (log x, log ε), where ε is close to a
  power of x, with the Illinois rule (an end kept twice has its gap halved so
  the next step lands past the root), or a bisection step in log x when ε is
  0 or inf at an end. Integer points stay strictly inside the bracket.
  """
  gap_fits, gap_fails = log_gap(fits), log_gap(fails)
  weight_fits, weight_fails, last_moved = 1.0, 1.0, None
  while not close_enough(fits, fails, gap_fits):
    u_fits, u_fails = math.log(fits), math.log(fails)
    if math.isfinite(gap_fits) and math.isfinite(gap_fails):
      g_fits, g_fails = weight_fits * gap_fits, weight_fails * gap_fails
      u = u_fits - g_fits * (u_fails - u_fits) / (g_fails - g_fits)
    else:
      u = (u_fits + u_fails) / 2
    low, high = min(fits, fails), max(fits, fails)
    if integer:
      x = min(max(round(math.exp(u)), low + 1), high - 1)
    else:
      margin = 1e-3 * (high - low)
      x = min(max(math.exp(u), low + margin), high - margin)
    gap = log_gap(x)
    moved_fits = gap <= 0
    if moved_fits:
      fits, gap_fits, weight_fits = x, gap, 1.0
      weight_fails = weight_fails / 2 if last_moved is True else 1.0
    else:
      fails, gap_fails, weight_fails = x, gap, 1.0
      weight_fits = weight_fits / 2 if last_moved is False else 1.0
    last_moved = moved_fits
  return fits


def log_gap(epsilon: float, target_epsilon: float) -> float:
  """log(ε / target): the residual :func:`refine_bracket` drives below zero."""
  if epsilon == 0.0:
    return -math.inf
  return math.log(epsilon / target_epsilon)


def calibrate_noise_multiplier(
    target_epsilon: float,
    target_delta: float,
    sampling_rate: float,
    steps: int,
    accountant: str = RDP,
    *,
    dataset_size: int | None = None,
) -> float:
  """The σ with ε(σ, q, T, δ) ≤ target ε and within 0.1% of it.

  ε decreases in σ. A geometric search brackets σ by factors of 2 from σ = 1,
  then secant steps in (log σ, log ε) safeguarded by bisection
  (:func:`refine_bracket`) shrink the bracket; the end with ε ≤ target is returned.
  Add/remove-one adjacency; for replace-one adjacency, double the result.
  """
  _check_epsilon(target_epsilon)
  _check_rate(sampling_rate)
  _check_steps(steps)
  if steps == 0:
    raise ValueError("steps must be >= 1 to calibrate a noise multiplier.")
  _check_delta(target_delta)
  _warn_large_delta(target_delta, dataset_size, stacklevel=2)
  _check_accountant(accountant)
  q, delta, steps = float(sampling_rate), float(target_delta), int(steps)
  return _calibrate(lambda sigma: _epsilon(sigma, q, steps, delta, accountant), target_epsilon)


def _calibrate(epsilon: Callable[[float], float], target_epsilon: float) -> float:
  """The σ with ε(σ) ≤ target and within :data:`CALIBRATION_RTOL` of it, ε decreasing in σ.

  A geometric search brackets σ by factors of 2 from σ = 1, then :func:`refine_bracket`
  shrinks the bracket; the end with ε ≤ target is returned.
  """
  fails, fits = 0.5, 1.0
  while epsilon(fits) > target_epsilon:
    fails, fits = fits, 2.0 * fits
  while epsilon(fails) <= target_epsilon:
    fails, fits = fails / 2.0, fails
  close_enough = lambda fits, fails, gap_fits: (
      gap_fits >= math.log1p(-CALIBRATION_RTOL) or fits - fails <= 1e-9 * fits
  )
  return refine_bracket(
      lambda sigma: log_gap(epsilon(sigma), target_epsilon),
      fits, fails, integer=False, close_enough=close_enough,
  )


def _check_blt_strategy(strategy: Any) -> None:
  if not isinstance(strategy, BLTStrategy):
    raise TypeError(f"strategy must be a BLTStrategy (blt_strategy), got {strategy!r}.")


def calibrate_blt_noise_multiplier(
    target_epsilon: float,
    target_delta: float,
    strategy: BLTStrategy,
    accountant: str = RDP,
    *,
    cycle_length: int | None = None,
    dataset_size: int | None = None,
) -> float:
  """The σ of a BLT release whose T releases are (ε, δ)-DP, ε ≤ target and within 0.1%.

  ε(σ) is that of ONE Gaussian mechanism of noise multiplier σ/Δ_T (module docstring), Δ_T
  = :func:`~dpmuon_jax.privacy.correlated.blt_sensitivity` for releases ``cycle_length``
  apart (default the strategy's ``min_sep``), searched as in
  :func:`calibrate_noise_multiplier`. Add/remove-one adjacency; for replace-one adjacency,
  double the result.
  """
  _check_blt_strategy(strategy)
  _check_epsilon(target_epsilon)
  _check_delta(target_delta)
  _warn_large_delta(target_delta, dataset_size, stacklevel=2)
  _check_accountant(accountant)
  sensitivity = blt_sensitivity(strategy, separation=cycle_length)
  delta = float(target_delta)
  return _calibrate(
      lambda sigma: _gaussian_epsilon(sigma / sensitivity, delta, accountant), target_epsilon)


def compute_blt_epsilon(
    noise_multiplier: float,
    target_delta: float,
    strategy: BLTStrategy,
    accountant: str = RDP,
    *,
    cycle_length: int | None = None,
) -> float:
  """ε at δ of a BLT release's T releases: ONE Gaussian mechanism of noise multiplier σ/Δ_T.

  Δ_T = :func:`~dpmuon_jax.privacy.correlated.blt_sensitivity` for releases ``cycle_length``
  apart (default the strategy's ``min_sep``); no amplification by sampling. Add/remove-one
  adjacency (for replace-one, pass σ/2). The inverse of :func:`calibrate_blt_noise_multiplier`.
  """
  _check_blt_strategy(strategy)
  _check_sigma(noise_multiplier)
  _check_delta(target_delta)
  _check_accountant(accountant)
  sensitivity = blt_sensitivity(strategy, separation=cycle_length)
  return _gaussian_epsilon(float(noise_multiplier) / sensitivity, float(target_delta),
                           accountant)


class LedgerConfig(NamedTuple):
  """The privacy configuration a ledger accounts for (public settings)."""

  sampling_rate: float
  noise_multiplier: float
  l2_clip_norm: float
  denominator: float
  neighbouring: str
  dataset_size: int
  target_delta: float
  target_epsilon: float | None
  accountant: str
  # What N counts and the guarantee protects: one example, or one user's records.
  privacy_unit: str = "example"
  # Cyclic Poisson sampling's b groups (1: plain Poisson), and the release's BandMF bands
  # (1: independent noise); bands ≤ cycle_length, and T releases are ⌈T/b⌉ participations.
  cycle_length: int = 1
  bands: int = 1
  # A BLT release's strategy (GaussianReleaseSpec's fields of the same names; 0 steps: none).
  blt_steps: int = 0
  blt_min_sep: int = 1
  blt_buf_decay: tuple[float, ...] = ()
  blt_output_scale: tuple[float, ...] = ()

  def blt_strategy(self) -> BLTStrategy | None:
    """The BLT strategy of the release (``None`` for any other release)."""
    if not self.blt_steps:
      return None
    return BLTStrategy(self.blt_steps, self.blt_min_sep, np.asarray(self.blt_buf_decay),
                       np.asarray(self.blt_output_scale))


def participations(steps: int, cycle_length: int = 1) -> int:
  """⌈T/b⌉: the most releases one example takes part in under b-cyclic sampling."""
  return -(-int(steps) // int(cycle_length))


def _release_spec(release: Any) -> GaussianReleaseSpec:
  spec = getattr(release, "release", release)
  if not isinstance(spec, GaussianReleaseSpec):
    raise TypeError(
        "release must be a PrivateTransformation (e.g. from dp_release) or a "
        f"GaussianReleaseSpec, got {type(release).__name__}."
    )
  return spec


def _config(sampler: Any, release: Any, target_delta, target_epsilon, accountant) -> LedgerConfig:
  spec = _release_spec(release)
  cycle_length = int(getattr(sampler, "cycle_length", 1))
  if spec.bands > cycle_length:
    raise ValueError(
        f"A BandMF release with {spec.bands} bands is private only under cyclic Poisson "
        f"sampling with at least {spec.bands} groups (an example's releases {spec.bands} "
        f"apart); the sampler has cycle_length={cycle_length}. Build it with "
        f"PoissonSampler(..., cycle_length={spec.bands}).")
  if spec.blt_steps and spec.blt_min_sep > cycle_length:
    raise ValueError(
        f"A BLT release optimised for releases {spec.blt_min_sep} apart is accounted under "
        f"cyclic Poisson sampling with at least {spec.blt_min_sep} groups; the sampler has "
        f"cycle_length={cycle_length}. Build it with "
        f"PoissonSampler(..., cycle_length={spec.blt_min_sep}).")
  return LedgerConfig(
      sampling_rate=float(sampler.sampling_rate),
      noise_multiplier=spec.noise_multiplier,
      l2_clip_norm=spec.l2_clip_norm,
      denominator=spec.denominator,
      neighbouring=spec.neighbouring,
      dataset_size=int(sampler.dataset_size),
      target_delta=float(target_delta),
      target_epsilon=None if target_epsilon is None else float(target_epsilon),
      accountant=accountant,
      privacy_unit=spec.clipping.unit,
      cycle_length=cycle_length,
      bands=spec.bands,
      blt_steps=spec.blt_steps,
      blt_min_sep=spec.blt_min_sep,
      blt_buf_decay=spec.blt_buf_decay,
      blt_output_scale=spec.blt_output_scale,
  )


def _differences(ours: LedgerConfig, theirs: LedgerConfig, fields: tuple[str, ...]) -> list[str]:
  return [
      f"{f}: {getattr(ours, f)!r} != {getattr(theirs, f)!r}"
      for f in fields
      if getattr(ours, f) != getattr(theirs, f)
  ]


_RELEASE_FIELDS = (
    "sampling_rate",
    "noise_multiplier",
    "l2_clip_norm",
    "denominator",
    "neighbouring",
    "dataset_size",
    "privacy_unit",
    "cycle_length",
    "bands",
    "blt_steps",
    "blt_min_sep",
    "blt_buf_decay",
    "blt_output_scale",
)


class PrivacyLedger:
  """The releases actually made, and the ε they spent.

  Built from the sampler and the release that produce the releases: q and N
  are read from ``sampler`` (``sampling_rate``, ``dataset_size``, ``seeded``),
  σ, C, D, the neighbouring relation and ``seeded`` from ``release`` (a
  :class:`~dpmuon_jax.privacy.release.PrivateTransformation` or its
  :class:`~dpmuon_jax.privacy.release.GaussianReleaseSpec`).

  A training loop calls ``can_release()`` before a step and ``record(sampler,
  release)`` after it. ``record`` always counts a release that was made (even
  over budget: forgetting one would understate ε) but refuses one made under
  other settings.

  Attributes:
    config: the :class:`LedgerConfig` accounted for.
    count: number of releases recorded.
    seeded: whether any recorded randomness came from a user seed.
  """

  def __init__(
      self,
      sampler: Any,
      release: Any,
      target_delta: float,
      target_epsilon: float | None = None,
      accountant: str = RDP,
  ):
    config = _config(sampler, release, target_delta, target_epsilon, accountant)
    self._set(config, 0, bool(sampler.seeded or _release_spec(release).seeded))
    _warn_large_delta(config.target_delta, config.dataset_size, stacklevel=2)

  def _set(self, config: LedgerConfig, count: int, seeded: bool) -> None:
    _check_rate(config.sampling_rate)
    _check_delta(config.target_delta)
    _check_accountant(config.accountant)
    _check_steps(count)
    if config.target_epsilon is not None:
      _check_epsilon(config.target_epsilon)
    self.config = config
    self.count = int(count)
    self.seeded = seeded
    self._max_steps: int | None = None
    self._blt = config.blt_strategy()

  @property
  def accounting_noise_multiplier(self) -> float:
    """σ as the accountant sees it (σ/2 under replace-one adjacency)."""
    c = self.config
    spec = GaussianReleaseSpec(
        c.l2_clip_norm, c.noise_multiplier, c.denominator, self.seeded,
        cast(Neighbouring, c.neighbouring),
    )
    return spec.accounting_noise_multiplier

  def _blt_noise_multiplier(self, steps: int) -> float:
    """σ/Δ_t of a BLT release's first t releases; t ≤ T (those past T are NaN: no data)."""
    assert self._blt is not None
    t = min(int(steps), self._blt.steps)
    return self.accounting_noise_multiplier / blt_sensitivity(
        self._blt, t, self.config.cycle_length)

  def event(self, steps: int | None = None) -> dp_accounting.DpEvent:
    """The dp-accounting event of ``steps`` releases (default: those recorded)."""
    steps = self.count if steps is None else steps
    if self._blt is not None:
      if steps == 0:
        return dp_accounting.NoOpDpEvent()
      return dp_accounting.GaussianDpEvent(self._blt_noise_multiplier(steps))
    return gaussian_release_event(
        self.accounting_noise_multiplier, self.config.sampling_rate,
        participations(steps, self.config.cycle_length),
    )

  def check(self, sampler: Any, release: Any) -> None:
    """Refuses ``sampler`` and ``release`` unless they release as the ledger accounts.

    Call it before the first release (as the trainer does): :meth:`record` makes the
    same comparison, but only after a release was made.

    Raises:
      ValueError: if q, N, σ, C, D or the neighbouring relation read from the
        objects differ from the ledger's.
    """
    c = self.config
    theirs = _config(sampler, release, c.target_delta, c.target_epsilon, c.accountant)
    diff = _differences(c, theirs, _RELEASE_FIELDS)
    if diff:
      raise ValueError(
          "This release is made under other privacy settings than the ledger accounts for ("
          + "; ".join(diff)
          + "). Build a new ledger for a new configuration."
      )

  def record(self, sampler: Any, release: Any, count: int = 1, seeded: bool = False) -> None:
    """Records ``count`` releases made with ``sampler`` and ``release``.

    ``seeded``: the releases came from a user seed even if ``sampler`` and
    ``release`` do not say so (lost releases of a seeded run, charged after a
    resume with a fresh root); the ledger then stays seeded.

    Raises:
      ValueError: if q, N, σ, C, D or the neighbouring relation read from the
        objects differ from the ledger's (:meth:`check`).
    """
    _check_steps(count)
    self.check(sampler, release)
    self.seeded = bool(self.seeded or seeded or sampler.seeded or _release_spec(release).seeded)
    self.count += int(count)

  def epsilon_after(self, extra_steps: int) -> float:
    """ε after the recorded releases plus ``extra_steps`` more."""
    _check_steps(extra_steps)
    c = self.config
    steps = self.count + int(extra_steps)
    if self._blt is not None:
      if steps == 0:
        return 0.0
      return _gaussian_epsilon(self._blt_noise_multiplier(steps), c.target_delta, c.accountant)
    return _epsilon(
        self.accounting_noise_multiplier,
        c.sampling_rate,
        participations(steps, c.cycle_length),
        c.target_delta,
        c.accountant,
    )

  def epsilon(self) -> float:
    """ε spent by the recorded releases."""
    return self.epsilon_after(0)

  def max_steps(self) -> int:
    """The largest T with ε(T) ≤ target ε.

    Brackets T from one epoch (1/q) upwards by extrapolation in (log T,
    log ε), then :func:`refine_bracket` on the integers. Cached: a ledger's
    configuration never changes. Under b-cyclic sampling the search runs over
    participations P = ⌈T/b⌉, and T = b·P. A BLT release makes at most its strategy's T
    releases: the largest t ≤ T, by bisection (ε(t) grows with t).
    """
    c = self.config
    if c.target_epsilon is None:
      raise ValueError("max_steps needs a ledger built with target_epsilon.")
    target: float = c.target_epsilon
    if self._max_steps is None and self._blt is not None:
      epsilon = lambda t: _gaussian_epsilon(self._blt_noise_multiplier(t), c.target_delta,
                                            c.accountant)
      fits, fails = 0, self._blt.steps + 1  # ε(0) = 0 fits; past T nothing is released
      while fails - fits > 1:
        middle = (fits + fails) // 2
        fits, fails = (middle, fails) if epsilon(middle) <= target else (fits, middle)
      self._max_steps = fits
    if self._max_steps is None:
      sigma = self.accounting_noise_multiplier
      epsilon = lambda t: _epsilon(sigma, c.sampling_rate, t, c.target_delta, c.accountant)
      if epsilon(1) > c.target_epsilon:
        self._max_steps = 0
        return 0
      fits, fails = 1, max(2, round(1.0 / c.sampling_rate))
      while epsilon(fails) <= c.target_epsilon:
        # Extrapolate log ε linearly in log T through the last two points. The
        # log-log slope grows with T, so this overshoots: one step usually brackets.
        eps_fits, eps_fails = epsilon(fits), epsilon(fails)
        growth = 4.0
        if 0.0 < eps_fits < eps_fails:
          slope = math.log(eps_fails / eps_fits) / math.log(fails / fits)
          growth = (c.target_epsilon / eps_fails) ** (1.0 / slope)
        fits, fails = fails, max(fails + 1, math.ceil(1.1 * fails * min(growth, 1e3)))
      self._max_steps = c.cycle_length * int(
          refine_bracket(
              lambda t: log_gap(epsilon(t), target),
              fits, fails, integer=True,
              close_enough=lambda fits, fails, gap_fits: fails - fits == 1,
          )
      )
    return self._max_steps

  def can_release(self, n: int = 1) -> bool:
    """Whether ``n`` more releases keep ε ≤ target ε."""
    _check_steps(n)
    return self.count + int(n) <= self.max_steps()

  def to_dict(self) -> dict[str, Any]:
    """The configuration, count and seeded flag, plus the ε spent (informative)."""
    return {
        **self.config._asdict(),
        "count": self.count,
        "seeded": self.seeded,
        "epsilon": self.epsilon(),
    }

  def to_json(self) -> str:
    """:meth:`to_dict` as a JSON string (ε = inf is written as ``Infinity``)."""
    return json.dumps(self.to_dict(), sort_keys=True)

  @classmethod
  def from_json(cls, data: str | dict[str, Any]) -> PrivacyLedger:
    """Rebuilds a ledger from :meth:`to_json` (or :meth:`to_dict`) output."""
    d = json.loads(data) if isinstance(data, str) else dict(data)
    # A ledger saved before a field existed has that field's default.
    config = LedgerConfig(**{f: d[f] for f in LedgerConfig._fields if f in d})
    config = config._replace(  # JSON has lists for tuples
        blt_buf_decay=tuple(config.blt_buf_decay),
        blt_output_scale=tuple(config.blt_output_scale))
    ledger = cls.__new__(cls)
    ledger._set(config, d["count"], bool(d["seeded"]))
    return ledger

  def check_compatible(self, other: PrivacyLedger) -> None:
    """Raises ValueError if ``other`` accounts for a different configuration.

    Used when resuming: a checkpoint's ledger must have been made under the
    same q, N, σ, C, D, neighbouring relation, δ, target ε and accountant.
    """
    diff = _differences(self.config, other.config, LedgerConfig._fields)
    if diff:
      raise ValueError(
          "changed privacy configuration (" + "; ".join(diff) + ")"
      )

  def __repr__(self) -> str:
    c = self.config
    return (
        f"PrivacyLedger(count={self.count}, q={c.sampling_rate:g}, σ={c.noise_multiplier:g}, "
        f"C={c.l2_clip_norm:g}, D={c.denominator:g}, δ={c.target_delta:g}, "
        f"target_ε={c.target_epsilon}, {c.neighbouring}, {c.accountant}, seeded={self.seeded})"
    )


def composed_ledgers_epsilon(ledgers: Sequence[PrivacyLedger], target_delta: float,
                             accountant: str = RDP) -> float:
  """ε at δ of several runs that are ALL published: their ledgers' events composed.

  Each ledger contributes :meth:`PrivacyLedger.event` of the releases it recorded, so
  independent, BandMF (⌈T/b⌉ participations at the within-group rate) and BLT (one Gaussian
  mechanism, no amplification) runs compose as each was accounted. The runs must be
  independent: different root keys, so no shared noise or samples.
  """
  _check_delta(target_delta)
  _check_accountant(accountant)
  for ledger in ledgers:
    if not isinstance(ledger, PrivacyLedger):
      raise TypeError(f"ledgers must be PrivacyLedgers, got {type(ledger).__name__}.")
  with quiet_dp_accounting():
    acc = make_accountant(accountant)
    for ledger in ledgers:
      acc.compose(ledger.event())
    return float(acc.get_epsilon(float(target_delta)))
