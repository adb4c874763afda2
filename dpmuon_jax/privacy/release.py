"""The Gaussian release as an Optax gradient transformation (DESIGN.md, invariants 2–3).

    G̃_t = ( Σ_i clip_C(q_i) + N(0, σ²C² I) ) / D

* The noise has standard deviation σ·C on the SUM, independently per
  coordinate, fresh at every release: the key of release t is
  ``fold_in(noise_stream, t)``, where the noise stream comes from the run's
  root key split once into named streams (:mod:`dpmuon_jax.privacy.keys`).
* D is a public float fixed before training (default in
  :func:`dpmuon_jax.make_private`: the expected batch size qN), never the
  realised batch size.

Every optimizer of this library is post-processing of G̃_t.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from dpmuon_jax.privacy.clipping import Clipping, as_clipping
from dpmuon_jax.privacy.keys import KeyLike, stream_key
from dpmuon_jax.privacy.query import GRADIENT_QUERY, ClippedSum, QuerySpec, clip_and_sum

PyTree = Any

ADD_REMOVE = "add_remove"
REPLACE_ONE = "replace_one"


@dataclasses.dataclass(frozen=True)
class GaussianReleaseSpec:
  """The public settings of one release, read by the privacy ledger.

  Attributes:
    l2_clip_norm: C, the L2 bound of one example's clipped query.
    noise_multiplier: σ; the noise on the sum has standard deviation σ·C.
    denominator: D, the public constant the noisy sum is divided by.
    seeded: whether the noise key came from a user seed (reproducible)
      rather than OS entropy.
    neighbouring: the adjacency the guarantee is stated for: ``"add_remove"``
      (default; sensitivity C) or ``"replace_one"`` (sensitivity 2C: the
      accountant must then see σ/2).
  """

  l2_clip_norm: float
  noise_multiplier: float
  denominator: float
  seeded: bool
  neighbouring: str = ADD_REMOVE

  @property
  def noise_std(self) -> float:
    """Standard deviation of each coordinate of the release: σC/D."""
    return self.noise_multiplier * self.l2_clip_norm / self.denominator

  @property
  def accounting_noise_multiplier(self) -> float:
    """σ as the accountant must see it: noise std over the L2 sensitivity."""
    factor = 2.0 if self.neighbouring == REPLACE_ONE else 1.0
    return self.noise_multiplier / factor


class PrivateTransformation(optax.GradientTransformationExtraArgs):
  """A ``GradientTransformationExtraArgs`` that contains the Gaussian release.

  Its ``release`` attribute holds the :class:`GaussianReleaseSpec` so the
  ledger reads σ, C and D from the object that actually adds the noise; its
  ``query`` attribute (a :class:`~dpmuon_jax.privacy.query.QuerySpec`) says
  which per-example query the release privatises (default: the gradient).
  """

  release: GaussianReleaseSpec
  query: QuerySpec

  @classmethod
  def wrap(
      cls,
      transform: optax.GradientTransformation,
      release: GaussianReleaseSpec,
      query: QuerySpec = GRADIENT_QUERY,
  ) -> PrivateTransformation:
    out = cls(transform.init, transform.update)
    out.release = release
    out.query = query
    return out


class GaussianReleaseState(NamedTuple):
  """State of :func:`dp_release`. SECRET: whoever holds it can subtract the noise."""

  count: jax.Array  # number of releases made so far (int32)
  noise_key: jax.Array  # raw uint32 key of the noise stream


def gaussian_noise_like(tree: PyTree, key: jax.Array, std: float | jax.Array) -> PyTree:
  """Independent N(0, std²) noise, float32, one fresh sub-key per leaf."""
  leaves, treedef = jax.tree.flatten(tree)
  keys = jax.random.split(key, max(len(leaves), 1))
  noise = [std * jax.random.normal(k, jnp.shape(x), jnp.float32) for k, x in zip(keys, leaves)]
  return jax.tree.unflatten(treedef, noise)


def _validate(l2_clip_norm: float, noise_multiplier: float, denominator: float) -> None:
  if not (math.isfinite(l2_clip_norm) and l2_clip_norm > 0):
    raise ValueError(f"l2_clip_norm must be positive and finite, got {l2_clip_norm}.")
  if not (math.isfinite(noise_multiplier) and noise_multiplier >= 0):
    raise ValueError(f"noise_multiplier must be >= 0 and finite, got {noise_multiplier}.")
  if not (math.isfinite(denominator) and denominator > 0):
    raise ValueError(
        f"denominator must be a positive public constant (e.g. the expected batch size qN), "
        f"got {denominator}."
    )
  if noise_multiplier == 0:
    warnings.warn(
        "noise_multiplier=0: the release adds no noise and gives NO differential privacy.",
        stacklevel=3,
    )


def dp_release(
    l2_clip_norm: float,
    noise_multiplier: float,
    denominator: float,
    key: KeyLike = None,
    clipping: Clipping | None = None,
    neighbouring: str = ADD_REMOVE,
) -> PrivateTransformation:
  """The private release G̃ = (Σ_i clip_C(q_i) + N(0, σ²C² I)) / D.

  ``update(updates, state, params=None, *, mask=None)`` accepts either

  * per-example queries (e.g. ``vmap(grad)`` output) on a leading batch axis,
    with an optional boolean ``mask`` over that axis: they are clipped,
    summed over the real rows, noised and divided by D; or
  * a :class:`~dpmuon_jax.privacy.query.ClippedSum` (from
    :func:`~dpmuon_jax.privacy.query.clipped_sum`), whose attached
    sensitivity must equal ``l2_clip_norm``.

  Args:
    l2_clip_norm: C.
    noise_multiplier: σ (0 is allowed, with a warning: no privacy).
    denominator: D, a public float fixed before training; never the realised
      batch size.
    key: root key or int seed of the run. ``None`` draws it from OS entropy.
      Only the root's ``noise`` stream is used here.
    clipping: how per-example queries are clipped (default flat clipping at C);
      its bound must equal ``l2_clip_norm``.
    neighbouring: ``"add_remove"`` (default) or ``"replace_one"``; recorded
      for the accountant.

  Returns:
    A :class:`PrivateTransformation`; its ``release`` attribute describes it.
  """
  _validate(l2_clip_norm, noise_multiplier, denominator)
  if neighbouring not in (ADD_REMOVE, REPLACE_ONE):
    raise ValueError(f"neighbouring must be {ADD_REMOVE!r} or {REPLACE_ONE!r}.")
  clipping = as_clipping(l2_clip_norm if clipping is None else clipping)
  if clipping.l2_clip_norm != l2_clip_norm:
    raise ValueError(
        f"clipping bound {clipping.l2_clip_norm} differs from l2_clip_norm {l2_clip_norm}."
    )
  noise_key, seeded = stream_key(key, "noise")
  spec = GaussianReleaseSpec(
      float(l2_clip_norm), float(noise_multiplier), float(denominator), seeded, neighbouring
  )
  noise_std_on_sum = spec.noise_multiplier * spec.l2_clip_norm

  def init_fn(params):
    del params
    return GaussianReleaseState(jnp.zeros((), jnp.int32), noise_key)

  def update_fn(updates, state, params=None, *, mask=None, **extra_args):
    del extra_args
    if isinstance(updates, ClippedSum):
      if mask is not None:
        raise ValueError("mask applies to per-example queries, not to a ClippedSum.")
      if updates.l2_sensitivity != spec.l2_clip_norm:
        raise ValueError(
            f"This release is calibrated for sensitivity {spec.l2_clip_norm}, but the "
            f"clipped sum has sensitivity {updates.l2_sensitivity}."
        )
      clipped = updates
    else:
      clipped = clip_and_sum(updates, mask, clipping)
    step_key = jax.random.fold_in(state.noise_key, state.count)
    noise = gaussian_noise_like(clipped.total, step_key, noise_std_on_sum)
    like = params if params is not None else clipped.total
    released = jax.tree.map(
        lambda s, z, p: ((s + z) / spec.denominator).astype(jnp.result_type(p)),
        clipped.total,
        noise,
        like,
    )
    return released, GaussianReleaseState(state.count + 1, state.noise_key)

  return PrivateTransformation.wrap(optax.GradientTransformationExtraArgs(init_fn, update_fn), spec)


def privatize(
    release: PrivateTransformation,
    *post_processing: optax.GradientTransformation,
    query: QuerySpec = GRADIENT_QUERY,
) -> PrivateTransformation:
  """``optax.chain(release, *post_processing)``, still labelled with the release.

  This is how every ``dp_*`` optimizer is built (DESIGN.md, invariant 7): ONE
  release over the whole parameter tree, then post-processing only.
  ``query`` names the per-example query the release is fed with (DiSK and
  inner momentum change it; their inputs come from the post-processing state).
  """
  if not isinstance(release, PrivateTransformation):
    raise TypeError("privatize needs the transformation returned by dp_release first.")
  return PrivateTransformation.wrap(
      optax.chain(release, *post_processing), release.release, query
  )
