"""DP-SGD, DP-Adam and DP-AdamW: the Gaussian release, then an Optax optimizer.

Every name here that starts with ``dp_`` contains the release (privacy
invariant 7, docs/design.md): ``update`` takes per-example gradients on a leading batch axis
(with ``mask=``) or a :class:`~dpmuon_jax.privacy.query.ClippedSum`, privatises
them once, and hands G̃_t to the post-processing. The post-processing alone is
plain Optax (``optax.sgd``, ``optax.adam``, ...) or one of this library's
``scale_by_*`` transforms; chain it after your own release with
:func:`~dpmuon_jax.optimizers.private.private`.
"""

from __future__ import annotations

import optax

from dpmuon_jax import checks
from dpmuon_jax.optimizers.private import ReleaseSettings, private
from dpmuon_jax.privacy.clipping import Clipping
from dpmuon_jax.privacy.correlated import IID, Noise
from dpmuon_jax.privacy.keys import KeyLike
from dpmuon_jax.privacy.release import ADD_REMOVE, Neighbouring, PrivateTransformation


def _check_adam(b1: float, b2: float, eps: float, eps_root: float = 0.0) -> None:
  """Adam's decays in [0, 1) and its epsilons >= 0."""
  checks.check_in_range("b1", b1, 0.0, 1.0, high_inclusive=False)
  checks.check_in_range("b2", b2, 0.0, 1.0, high_inclusive=False)
  checks.check_nonnegative("eps", eps)
  checks.check_nonnegative("eps_root", eps_root)


def dp_sgd(
    learning_rate: optax.ScalarOrSchedule, l2_clip_norm: float, noise_multiplier: float,
    denominator: float, key: KeyLike = None, *, momentum: float | None = None,
    nesterov: bool = False, clipping: Clipping | None = None,
    neighbouring: Neighbouring = ADD_REMOVE, noise: Noise = IID, bands: int | None = None,
    steps: int | None = None,
) -> PrivateTransformation:
  """DP-SGD (Abadi et al. 2016): θ ← θ − η·m_t with m_t = μ m_{t−1} + G̃_t.

  ``momentum=None`` is plain DP-SGD (m_t = G̃_t); ``nesterov=True`` uses
  Nesterov's look-ahead G̃_t + μ m_t. Preset of paper 1 ("Spectral Gradient
  Orthogonalization Improves Differentially Private Training at Scale", its
  reported hyperparameters): lr 0.3, momentum 0.9.
  """
  checks.check_learning_rate("learning_rate", learning_rate)
  if momentum is not None:
    checks.check_in_range("momentum", momentum, 0.0, 1.0, high_inclusive=False)
  release = ReleaseSettings(l2_clip_norm, noise_multiplier, denominator, key, clipping,
                            neighbouring, noise, bands, steps)
  return private(release, optax.sgd(learning_rate, momentum=momentum, nesterov=nesterov))


def dp_adam(
    learning_rate: optax.ScalarOrSchedule, l2_clip_norm: float, noise_multiplier: float,
    denominator: float, key: KeyLike = None, *, b1: float = 0.9, b2: float = 0.999,
    eps: float = 1e-8, eps_root: float = 0.0, clipping: Clipping | None = None,
    neighbouring: Neighbouring = ADD_REMOVE, noise: Noise = IID, bands: int | None = None,
    steps: int | None = None,
) -> PrivateTransformation:
  """DP-Adam: Adam (Kingma & Ba 2015) on the release G̃_t.

  m_t = b1 m + (1−b1) G̃_t,  v_t = b2 v + (1−b2) G̃_t²,
  θ ← θ − η m̂_t / (√v̂_t + eps). Paper 1's preset: lr 1e-3, (0.9, 0.999).
  """
  checks.check_learning_rate("learning_rate", learning_rate)
  _check_adam(b1, b2, eps, eps_root)
  release = ReleaseSettings(l2_clip_norm, noise_multiplier, denominator, key, clipping,
                            neighbouring, noise, bands, steps)
  return private(release, optax.adam(learning_rate, b1=b1, b2=b2, eps=eps, eps_root=eps_root))


def dp_adamw(
    learning_rate: optax.ScalarOrSchedule, l2_clip_norm: float, noise_multiplier: float,
    denominator: float, key: KeyLike = None, *, b1: float = 0.9, b2: float = 0.999,
    eps: float = 1e-8, weight_decay: float = 1e-4, clipping: Clipping | None = None,
    neighbouring: Neighbouring = ADD_REMOVE, noise: Noise = IID, bands: int | None = None,
    steps: int | None = None,
) -> PrivateTransformation:
  """DP-AdamW: Adam on G̃_t with decoupled weight decay θ ← θ − η(û_t + λθ)."""
  checks.check_learning_rate("learning_rate", learning_rate)
  _check_adam(b1, b2, eps)
  checks.check_nonnegative("weight_decay", weight_decay)
  release = ReleaseSettings(l2_clip_norm, noise_multiplier, denominator, key, clipping,
                            neighbouring, noise, bands, steps)
  return private(
      release, optax.adamw(learning_rate, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay)
  )
