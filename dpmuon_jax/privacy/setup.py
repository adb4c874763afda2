"""One call from a privacy target to a consistent private setup.

The analogue of Opacus' ``make_private_with_epsilon`` and jax_privacy's
execution plan: from (ε, δ, N, expected batch size, epochs or steps, C) it
derives ::

    q = B/N,   T = steps or round(epochs/q),   σ = calibrate(ε, δ, q, T),   D = qN

With ``noise="bandmf", bands=b`` (correlated noise, :mod:`~dpmuon_jax.privacy.correlated`)
the sampler is b-cyclic Poisson: each example in one of b secret groups, group t mod b
sampled at q_b = bB/N at release t (expected batch still B), and σ is calibrated for the
⌈T/b⌉ releases an example can take part in at rate q_b (the banded mechanism's
amplification, Choquette-Choo et al., "(Amplified) Banded Matrix Factorization", §4).

and builds the sampler, the release and the ledger from these numbers ONCE,
so q, σ, D and T cannot disagree: the ledger reads them back from the
sampler and release objects. The sampler and the release share one root key
(drawn once from OS entropy when ``key=None``) and use its different named
streams; every release built from the setup claims a noise stream of its own.

With ``noise="blt", buffers=k`` (buffered-linear-Toeplitz noise) the sampler is b-cyclic
with b = ⌊N/B⌋ groups (one participation per epoch, the most separation at rate ≤ 1), C is
the k-buffer BLT optimised for T releases b apart
(:func:`~dpmuon_jax.privacy.correlated.blt_strategy`), and σ is calibrated for ONE Gaussian
mechanism of noise multiplier σ/Δ_T, without amplification (McMahan, Xu and Zhang, "A
Hassle-free Algorithm for Private Learning in Practice", §3).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, cast

import optax

from dpmuon_jax import checks
from dpmuon_jax.privacy.accounting import (
    RDP,
    PrivacyLedger,
    calibrate_blt_noise_multiplier,
    calibrate_noise_multiplier,
    participations,
)
from dpmuon_jax.privacy.clipping import EXAMPLE, Clipping, as_clipping
from dpmuon_jax.privacy.correlated import (
    BANDMF,
    BLT,
    IID,
    NOISES,
    BLTStrategy,
    blt_groups,
    blt_strategy,
    gaussian_release,
)
from dpmuon_jax.privacy.keys import KeyLike, root_key
from dpmuon_jax.privacy.query import ClippedSum, QueryFn, clipped_sum
from dpmuon_jax.privacy.release import (
    DEFAULT_GRID_BITS,
    PrivateTransformation,
    privatize,
)
from dpmuon_jax.privacy.sampling import PoissonSampler

PyTree = Any


class PrivateSetup(NamedTuple):
  """A consistent private training setup (see :func:`make_private`).

  Attributes:
    sampler: the :class:`~dpmuon_jax.privacy.sampling.PoissonSampler` (q, N).
    steps: T, the number of releases the budget was calibrated for.
    noise_multiplier: σ.
    release: the ``dp_release`` transform (C, σ, D); post-process it with
      :meth:`private_optimizer`.
    ledger: a :class:`~dpmuon_jax.privacy.accounting.PrivacyLedger` with the
      target ε, read from ``sampler`` and ``release``.
    release_kwargs: ``l2_clip_norm``, ``noise_multiplier``, ``denominator``,
      ``key`` and ``clipping`` for building a ``dp_*`` optimizer with the same
      release settings, e.g. ``dp_sgd(learning_rate, **setup.release_kwargs)``.
      ``key`` is the run's :class:`~dpmuon_jax.privacy.keys.RootKey`: every
      optimizer built from it claims a noise stream of its own, so two
      optimizers of one setup never add the same noise.
  """

  sampler: PoissonSampler
  steps: int
  noise_multiplier: float
  release: PrivateTransformation
  ledger: PrivacyLedger
  release_kwargs: dict[str, Any]

  def private_optimizer(
      self, *post_processing: optax.GradientTransformation
  ) -> PrivateTransformation:
    """``optax.chain(release, *post_processing)``: a complete private optimizer.

    Each call builds a new release with these settings and a noise stream of its own.
    """
    return privatize(gaussian_release(**self.release_kwargs), *post_processing)

  def clipped_sum(
      self,
      query: QueryFn,
      query_inputs: PyTree,
      batch: PyTree,
      mask,
      microbatch_size: int | None = None,
  ) -> ClippedSum:
    """The per-example clipped sum with this setup's clipping (bound C)."""
    clipping = self.release.release.clipping
    return clipped_sum(query, query_inputs, batch, mask, clipping, microbatch_size)


def make_private(
    *,
    target_epsilon: float,
    target_delta: float,
    dataset_size: int,
    expected_batch_size: float,
    l2_clip_norm: float,
    epochs: float | None = None,
    steps: int | None = None,
    key: KeyLike = None,
    accountant: str = RDP,
    clipping: Clipping | None = None,
    capacity: int | None = None,
    denominator: float | None = None,
    noise_multiplier: float | None = None,
    secure_noise: bool = False,
    privacy_unit: str | None = None,
    noise: str = IID,
    bands: int | None = None,
    buffers: int | None = None,
) -> PrivateSetup:
  """From a privacy target to the sampler, release and ledger of one run.

  Args:
    target_epsilon: ε of the whole run.
    target_delta: δ (warns when δ ≥ 1/N).
    dataset_size: N.
    expected_batch_size: B = qN, so q = B/N; B need not be an integer.
    l2_clip_norm: C.
    epochs: training length in epochs (T = round(epochs/q)); give this or
      ``steps``.
    steps: T, the number of releases.
    key: root key or int seed (recorded as seeded); ``None`` draws the root
      once from OS entropy. Sampler and release use its different streams.
    accountant: ``"rdp"`` (default) or ``"pld"``.
    clipping: a clipping rule with bound C (default flat clipping at C).
    capacity: rows per padded batch (default: see
      :func:`~dpmuon_jax.privacy.sampling.default_capacity`).
    denominator: D; default the expected batch size qN.
    noise_multiplier: σ; ``None`` (default) calibrates it so that ε after T
      releases is at most ``target_epsilon``. A given σ is used as it is and
      the ledger still stops at ``target_epsilon``.
    secure_noise: exact discrete Gaussian noise on an integer grid of the
      clipped sum, from OS entropy (see :func:`~dpmuon_jax.privacy.release.dp_release`);
      the clipping rule then carries the grid, so every ``dp_*`` optimizer
      built from ``release_kwargs`` uses it.
    privacy_unit: ``"example"`` or ``"user"``: user-level DP (default: the clipping
      rule's unit, ``"example"`` for a bare C). Then N is the
      number of USERS, B the expected number of sampled users, the data are grouped one
      row per user (:func:`~dpmuon_jax.data.users.group_by_user`) and the clipping rule
      clips each user's mean query (``Clipping.unit``), so (ε, δ) hold per user.
    noise: ``"iid"`` (default), ``"bandmf"`` (with ``bands``) or ``"blt"`` (with
      ``buffers``): see the module docstring. ``release_kwargs`` then carry the strategy to
      every ``dp_*`` optimizer built from them.
    bands: b of ``"bandmf"``, the bands and the sampler's groups.
    buffers: k of ``"blt"``, in [1, 15].

  Returns:
    A :class:`PrivateSetup`.
  """
  dataset_size = checks.check_positive_int("dataset_size", dataset_size)
  if not 0 < expected_batch_size <= dataset_size:
    raise ValueError(
        f"expected_batch_size must be in (0, dataset_size={dataset_size}], "
        f"got {expected_batch_size}."
    )
  if (epochs is None) == (steps is None):
    raise ValueError("Give exactly one of epochs and steps.")
  sampling_rate = expected_batch_size / dataset_size
  if steps is None:
    epochs = checks.check_positive("epochs", epochs)
    steps = max(1, round(epochs / sampling_rate))
  steps = checks.check_positive_int("steps", steps)
  cycle_length = _cycle_length(noise, bands, buffers, expected_batch_size, dataset_size,
                               secure_noise)
  noise_kwargs = _noise_kwargs(noise, buffers, steps, cycle_length)
  if noise_multiplier is None:
    noise_multiplier = _calibrated_sigma(target_epsilon, target_delta, dataset_size,
                                         sampling_rate, steps, accountant, cycle_length,
                                         noise_kwargs)

  clipping = _clipping(l2_clip_norm, clipping, privacy_unit, secure_noise)
  root = root_key(key)
  sampler = PoissonSampler(dataset_size, sampling_rate * cycle_length, capacity=capacity,
                           key=root, cycle_length=cycle_length)
  if denominator is None:
    denominator = sampler.expected_batch_size
  release_kwargs = {
      "l2_clip_norm": float(l2_clip_norm),
      "noise_multiplier": float(noise_multiplier),
      "denominator": float(denominator),
      "key": root,
      "clipping": clipping,
      **noise_kwargs,
  }
  release = gaussian_release(**release_kwargs)
  ledger = PrivacyLedger(sampler, release, target_delta, target_epsilon, accountant)
  return PrivateSetup(sampler, steps, float(noise_multiplier), release, ledger, release_kwargs)


def _noise_kwargs(noise: str, buffers: int | None, steps: int,
                  cycle_length: int) -> dict[str, Any]:
  """The release's noise settings: none for iid noise, BandMF's name, bands and T, or the
  built k-buffer BLT for T releases ``cycle_length`` apart."""
  if noise == BANDMF:
    return {"noise": noise, "bands": cycle_length, "steps": steps}
  if noise == BLT:
    return {"noise": blt_strategy(steps, cast(int, buffers), cycle_length)}
  return {}


def _calibrated_sigma(target_epsilon: float, target_delta: float, dataset_size: int,
                      sampling_rate: float, steps: int, accountant: str, cycle_length: int,
                      noise_kwargs: dict[str, Any]) -> float:
  """σ for ε after T releases: BLT as ONE Gaussian of σ/Δ_T (no amplification); otherwise
  the ⌈T/b⌉ releases an example takes part in, at the within-group rate b·q."""
  strategy = noise_kwargs.get("noise")
  if isinstance(strategy, BLTStrategy):
    return calibrate_blt_noise_multiplier(target_epsilon, target_delta, strategy, accountant,
                                          dataset_size=dataset_size)
  return calibrate_noise_multiplier(target_epsilon, target_delta, sampling_rate * cycle_length,
                                    participations(steps, cycle_length), accountant)


def _cycle_length(noise: str, bands: int | None, buffers: int | None,
                  expected_batch_size: float, dataset_size: int, secure_noise: bool) -> int:
  """b, the sampler's groups: ``bands`` for BandMF noise, ⌊N/B⌋ for BLT noise, 1 for
  independent noise."""
  if noise not in NOISES:
    raise ValueError(f"noise must be one of {', '.join(NOISES)}, got {noise!r}.")
  if (noise == BANDMF) != (bands is not None):
    raise ValueError("bands goes with noise='bandmf', and noise='bandmf' needs bands.")
  if (noise == BLT) != (buffers is not None):
    raise ValueError("buffers goes with noise='blt', and noise='blt' needs buffers.")
  if noise == IID:
    return 1
  if secure_noise:
    raise ValueError("secure_noise adds exact discrete noise, available with noise='iid' "
                     "only.")
  if noise == BLT:  # buffers are checked by blt_strategy
    return blt_groups(dataset_size, expected_batch_size)
  bands = checks.check_positive_int("bands", bands)
  if bands * expected_batch_size > dataset_size:
    raise ValueError(f"bands × expected_batch_size must not exceed dataset_size: each of "
                     f"the {bands} groups of about {dataset_size / bands:g} examples gives an "
                     f"expected {expected_batch_size:g} per release (got "
                     f"{bands} × {expected_batch_size:g} > {dataset_size}).")
  return bands


def _clipping(l2_clip_norm: float, clipping: Clipping | None, privacy_unit: str | None,
              secure_noise: bool) -> Clipping:
  """The run's clipping rule, with its privacy unit and (secure noise) its grid."""
  clipping = as_clipping(l2_clip_norm if clipping is None else clipping)
  if privacy_unit is not None and privacy_unit != clipping.unit:
    if clipping.unit != EXAMPLE:
      raise ValueError(f"privacy_unit={privacy_unit!r} disagrees with the clipping rule's "
                       f"unit {clipping.unit!r}.")
    clipping = dataclasses.replace(clipping, unit=privacy_unit)
  if secure_noise and clipping.grid_bits is None:
    clipping = dataclasses.replace(clipping, grid_bits=DEFAULT_GRID_BITS)
  return clipping
