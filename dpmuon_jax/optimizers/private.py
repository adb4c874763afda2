"""A private optimizer: ONE Gaussian release, then post-processing.

::

    G̃_t = (Σ_i clip_C(q_i) + N(0, σ²C² I)) / D        the release, whole parameter tree
    u_t = post(G̃_t, state)                             post-processing, no privacy cost

:class:`ReleaseSettings` are the release's public settings; :func:`private`
builds the release (:func:`~dpmuon_jax.privacy.release.dp_release`) and
chains the post-processing after it (privacy invariant 7, docs/design.md).
``noise="bandmf", bands=b, steps=T`` makes that release the banded
matrix-factorization one (:mod:`~dpmuon_jax.privacy.correlated`) for every
``dp_*`` optimizer alike: momentum and Newton–Schulz are post-processing of
whatever release precedes them.
Every ``dp_*`` optimizer of this package is::

    private(ReleaseSettings(l2_clip_norm, noise_multiplier, denominator, key, clipping,
                            neighbouring, noise, bands, steps),
            post_processing(learning_rate, **options),
            query=...)  # only where the per-example query is not the gradient

The post-processing factories (:func:`~dpmuon_jax.optimizers.muon.muon`,
:func:`~dpmuon_jax.optimizers.filters.disk_muon`, ...) are plain Optax and
usable without privacy.
"""

from __future__ import annotations

import dataclasses

import optax

from dpmuon_jax.privacy.clipping import Clipping
from dpmuon_jax.privacy.correlated import IID, Noise, gaussian_release, noise_strategy
from dpmuon_jax.privacy.keys import KeyLike
from dpmuon_jax.privacy.query import QuerySpec
from dpmuon_jax.privacy.release import (
    ADD_REMOVE,
    Neighbouring,
    PrivateTransformation,
    check_public_constants,
    privatize,
)


@dataclasses.dataclass(frozen=True)
class ReleaseSettings:
  """The public settings of a ``dp_*`` optimizer's release.

  The same names as the ``release_kwargs`` of
  :func:`~dpmuon_jax.privacy.setup.make_private`, so
  ``ReleaseSettings(**setup.release_kwargs)`` is the run's release.

  Attributes:
    l2_clip_norm: C, the L2 bound of one example's clipped query.
    noise_multiplier: σ; the noise on the sum has standard deviation σC.
    denominator: D, a public constant fixed before training (never the
      realised batch size).
    key: the run's root key or an int seed; ``None``: OS entropy.
    clipping: the clipping rule (default flat clipping at C).
    neighbouring: ``"add_remove"`` or ``"replace_one"``, recorded for the accountant.
    noise: ``"iid"`` (default: fresh Gaussian noise per release, :func:`~dpmuon_jax.dp_release`)
      or ``"bandmf"`` (banded matrix-factorization noise correlated over ``bands``
      releases, :func:`~dpmuon_jax.privacy.correlated.dp_bandmf_release`), or a
      strategy already built: a :class:`~dpmuon_jax.privacy.correlated.BandMFStrategy`,
      or a :class:`~dpmuon_jax.privacy.correlated.BLTStrategy` (buffered-linear-Toeplitz
      noise, accounted as one Gaussian mechanism without amplification).
    bands: b of ``"bandmf"``; private only under cyclic Poisson sampling with b groups
      (``PoissonSampler(..., cycle_length=b)``, which ``make_private(noise="bandmf")`` builds).
    steps: T, the releases the ``"bandmf"`` strategy is optimised for (it releases no more).
  """

  l2_clip_norm: float
  noise_multiplier: float
  denominator: float
  key: KeyLike = None
  clipping: Clipping | None = None
  neighbouring: Neighbouring = ADD_REMOVE
  noise: Noise = IID
  bands: int | None = None
  steps: int | None = None

  def __post_init__(self):
    # Before any post-processing factory runs, so optax.inject_hyperparams on a dp_* name
    # meets these refusals first.
    check_public_constants(self.l2_clip_norm, self.noise_multiplier, self.denominator)
    noise_strategy(self.noise, self.bands, self.steps)

  def build(self) -> PrivateTransformation:
    """The release with these settings (checked there), see :func:`dpmuon_jax.dp_release`."""
    return gaussian_release(
        self.l2_clip_norm, self.noise_multiplier, self.denominator, self.key, self.clipping,
        self.neighbouring, self.noise, self.bands, self.steps,
    )

def private(
    release: ReleaseSettings | PrivateTransformation,
    *post_processing: optax.GradientTransformation,
    query: QuerySpec | None = None,
) -> PrivateTransformation:
  """``optax.chain(release, *post_processing)``, labelled with the release and its query.

  Args:
    release: the settings of the release, or a release already built from
      them (for post-processing that reads it, e.g. the noise std σC/D of
      the bias-corrected optimizers).
    *post_processing: Optax transformations applied to G̃_t in order.
    query: the per-example query the release privatises (default: the
      release's, the gradient for settings; DiSK and inner momentum change
      it, their inputs read from the post-processing state).

  Returns:
    A :class:`~dpmuon_jax.privacy.release.PrivateTransformation`.
  """
  if isinstance(release, ReleaseSettings):
    release = release.build()
  return privatize(release, *post_processing, query=query)
