"""The Gaussian release as an Optax gradient transformation (docs/design.md, invariants 2–3).

::

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
import functools
import math
import os
import warnings
from typing import Any, Literal, NamedTuple, get_args

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import io_callback

from dpmuon_jax.privacy.clipping import LIMB_BITS, Clipping, GridSum, as_clipping
from dpmuon_jax.privacy.discrete_gaussian import (
  discrete_gaussian_noise_multiplier,
  sample_discrete_gaussian,
)
from dpmuon_jax.privacy.keys import KeyLike, claim_noise_stream
from dpmuon_jax.privacy.query import GRADIENT_QUERY, ClippedSum, QuerySpec, clip_and_sum

PyTree = Any

Neighbouring = Literal["add_remove", "replace_one"]
"""The adjacency a guarantee is stated for: add/remove one example, or replace one."""
ADD_REMOVE, REPLACE_ONE = get_args(Neighbouring)


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
    clipping: the rule that bounds each example's query by C (default flat
      clipping). Every step builder clips with it; asking for another is an error.
    bands: b of a BandMF release (:mod:`~dpmuon_jax.privacy.correlated`): its noise is
      correlated over b releases, which needs cyclic Poisson sampling with at least b
      groups; 1 (default) is independent noise.
    blt_steps, blt_min_sep, blt_buf_decay, blt_output_scale: the strategy C of a BLT
      release (:func:`~dpmuon_jax.privacy.correlated.dp_blt_release`): its T releases, the
      participation separation b it is optimised for (it needs cyclic Poisson sampling
      with at least b groups) and its k buffers' parameters; 0, 1, () and () (default)
      for any other release.
  """

  l2_clip_norm: float
  noise_multiplier: float
  denominator: float
  seeded: bool
  neighbouring: Neighbouring = ADD_REMOVE
  # None becomes as_clipping(l2_clip_norm) on init, so the field is always a Clipping.
  clipping: Clipping = None  # pyright: ignore[reportAssignmentType]
  bands: int = 1
  blt_steps: int = 0
  blt_min_sep: int = 1
  blt_buf_decay: tuple[float, ...] = ()
  blt_output_scale: tuple[float, ...] = ()

  def __post_init__(self):
    if self.clipping is None:
      object.__setattr__(self, "clipping", as_clipping(self.l2_clip_norm))

  @property
  def secure_noise(self) -> bool:
    """Whether the release adds exact discrete Gaussian noise on an integer grid."""
    return self.clipping.grid_bits is not None

  @property
  def buffers(self) -> int:
    """k, the buffers of a BLT release (0 for any other release)."""
    return len(self.blt_buf_decay)

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
  """State of :func:`dp_release`. SECRET: whoever holds it can subtract the noise.

  ``count`` is the index of the next noise key, ``fold_in(noise_key, count)``.
  It only grows: a training loop that resumes after releases it lost skips
  their indices (:func:`with_noise_counter`) rather than reuse a key on a
  different clipped sum.
  """

  count: jax.Array  # index of the next noise key (int32); one per release
  noise_key: jax.Array  # raw uint32 key of the noise stream


class BandMFReleaseState(NamedTuple):
  """State of :func:`~dpmuon_jax.privacy.correlated.dp_bandmf_release` and
  :func:`~dpmuon_jax.privacy.correlated.dp_blt_release`. SECRET: it holds the noise key
  and the past noise.

  ``count`` is the index of the next release (and of its noise key); ``buffers`` the
  streaming state of C⁻¹ (jax_privacy's: for BandMF its own row index and the last b
  solves, for BLT its k buffers).
  """

  count: jax.Array
  noise_key: jax.Array
  buffers: PyTree


def gaussian_noise_like(tree: PyTree, key: jax.Array, std: float | jax.Array) -> PyTree:
  """Independent N(0, std²) noise, float32, one fresh sub-key per leaf.

  Leaf l gets std · normal(k_l, shape_l) with (k_1, …, k_L) = split(key, L).
  The leaves of one shape are drawn by one call vmapped over their keys: the
  same bits as one call per leaf, compiled once per shape rather than once per
  leaf (a deep model has a few shapes and many leaves).
  """
  leaves, treedef = jax.tree.flatten(tree)
  keys = jax.random.split(key, max(len(leaves), 1))
  by_shape: dict[tuple[int, ...], list[int]] = {}
  for index, leaf in enumerate(leaves):
    by_shape.setdefault(tuple(jnp.shape(leaf)), []).append(index)
  noise: list[Any] = [None] * len(leaves)
  for shape, indices in by_shape.items():
    draw_one = functools.partial(jax.random.normal, shape=shape, dtype=jnp.float32)
    draws = std * jax.vmap(draw_one)(keys[np.asarray(indices)])
    for index, draw in zip(indices, draws, strict=True):
      noise[index] = draw
  return jax.tree.unflatten(treedef, noise)


def _leaf_shapes(tree: PyTree) -> list[tuple[str, tuple[int, ...]]]:
  flat, _ = jax.tree_util.tree_flatten_with_path(tree)
  return [(jax.tree_util.keystr(path) or "<root>", tuple(jnp.shape(x))) for path, x in flat]


def _check_structure(tree: PyTree, params: PyTree, what: str) -> None:
  if jax.tree.structure(tree) != jax.tree.structure(params):
    raise ValueError(
        f"The release got {what} with tree structure {jax.tree.structure(tree)}, "
        f"but the parameters have {jax.tree.structure(params)}."
    )


def check_per_example_shapes(per_example: PyTree, params: PyTree) -> int:
  """Checks that every leaf is ``(B,) + p.shape`` with one B; returns B.

  This is what stops a summed gradient (e.g. a square kernel's rows) from
  being clipped row by row as if each row were an example.
  """
  _check_structure(per_example, params, "per-example queries")
  batch_sizes = set()
  for (path, shape), (_, p_shape) in zip(_leaf_shapes(per_example), _leaf_shapes(params)):
    if shape[1:] != p_shape or len(shape) != len(p_shape) + 1:
      accumulated = (" optax.MultiSteps around a release hands it such an average: accumulate "
                     "with dm.clipped_sum(..., microbatch_size=...) instead."
                     if shape == p_shape else "")
      raise ValueError(
          f"The release expects per-example queries of shape (B,) + parameter shape; "
          f"{path} has shape {shape} for a parameter of shape {p_shape}, so (B,) + {p_shape} "
          "was expected (per-example gradients come from vmap(grad); a summed gradient "
          f"cannot be released).{accumulated}"
      )
    batch_sizes.add(shape[0])
  if len(batch_sizes) > 1:
    raise ValueError(
        f"The per-example queries disagree on the batch size B: {sorted(batch_sizes)}."
    )
  return batch_sizes.pop() if batch_sizes else 0


def check_sum_shapes(total: PyTree, params: PyTree) -> None:
  """Checks that a clipped sum has exactly the parameters' shapes."""
  total = jax.tree.map(lambda g: g.hi if _is_grid_sum(g) else g, total, is_leaf=_is_grid_sum)
  _check_structure(total, params, "a clipped sum")
  for (path, shape), (_, p_shape) in zip(_leaf_shapes(total), _leaf_shapes(params)):
    if shape != p_shape:
      raise ValueError(
          f"The clipped sum's leaf {path} has shape {shape}, its parameter {p_shape}."
      )


DEFAULT_GRID_BITS = 16
# The secure release's entropy source (tests substitute a seeded one).
_random_bytes = os.urandom


def _is_grid_sum(x: Any) -> bool:
  return isinstance(x, GridSum)


def secure_noise_variance(noise_multiplier: float, clipping: Clipping, dim: int) -> int:
  """σ_Z², the integer variance of the discrete Gaussian noise per grid coordinate.

  One example's rounded query has L2 norm at most Δ = 2ᵏ + √d/2 grid units
  (:meth:`~dpmuon_jax.privacy.clipping.Clipping.grid_sensitivity`). With
  σ_Z² = ⌈(σΔ)²⌉, the discrete Gaussian satisfies the same concentrated DP as a
  continuous Gaussian of multiplier σ_Z/Δ ≥ σ (Canonne, Kamath and Steinke
  2020, the multivariate discrete Gaussian), so the ledger accounts for σ as in the float mode.
  """
  delta = clipping.grid_sensitivity(dim)
  variance = math.ceil((noise_multiplier * delta) ** 2)
  if variance and discrete_gaussian_noise_multiplier(math.sqrt(variance), delta, dim) < (
      noise_multiplier
  ):
    raise ValueError("The discrete Gaussian noise would be accounted below σ; refusing.")
  return variance


def _secure_release(total: PyTree, params: PyTree, spec: GaussianReleaseSpec) -> PyTree:
  """(Σ_i r_i + Z)·γ/D with Z ~ N_Z(0, σ_Z²) per coordinate, drawn from OS entropy."""
  clipping = spec.clipping
  dim = sum(math.prod(jnp.shape(p)) for p in jax.tree.leaves(params))
  variance = secure_noise_variance(spec.noise_multiplier, clipping, dim)
  unit = clipping.grid_step / spec.denominator

  def noisy_sum(grid: GridSum):
    exact = np.asarray(grid.hi, np.int64) * 2**LIMB_BITS + np.asarray(grid.lo, np.int64)
    if variance:
      exact = exact + sample_discrete_gaussian(exact.shape, variance, _random_bytes)
    return (exact.astype(np.float64) * unit).astype(np.float32)

  def host(total_on_host):
    return jax.tree.map(noisy_sum, total_on_host, is_leaf=_is_grid_sum)

  shapes = jax.tree.map(lambda p: jax.ShapeDtypeStruct(jnp.shape(p), jnp.float32), params)
  released = io_callback(host, shapes, total, ordered=False)
  return jax.tree.map(lambda x, p: x.astype(jnp.result_type(p)), released, params)


def check_public_constants(l2_clip_norm: Any, noise_multiplier: Any, denominator: Any) -> None:
  """Refuses C, σ or D given as a JAX array, e.g. a hyperparameter of ``optax.inject_hyperparams``.

  They are public constants fixed before training, and the accountant reads
  them from the release; held in an optimizer state they could change between
  releases without being accounted. A learning rate or another post-processing
  option can be injected: ``privatize(dp_release(C, σ, D),
  optax.inject_hyperparams(muon)(learning_rate=0.02))``.
  """
  given = {"l2_clip_norm": l2_clip_norm, "noise_multiplier": noise_multiplier,
           "denominator": denominator}
  for name, value in given.items():
    if isinstance(value, jax.Array):
      raise TypeError(
          f"{name} must be a Python number, got a JAX array: the release's l2_clip_norm, "
          "noise_multiplier and denominator are public constants fixed before training, "
          "which the accountant reads. To inject a hyperparameter (optax.inject_hyperparams), "
          "inject the post-processing only: dm.privatize(dm.dp_release(C, sigma, D), "
          "optax.inject_hyperparams(dm.muon)(learning_rate=0.02))."
      )


def _validate(l2_clip_norm: float, noise_multiplier: float, denominator: float) -> None:
  check_public_constants(l2_clip_norm, noise_multiplier, denominator)
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


class NoiseKeyUses:
  """The noise keys one release has used, and on which clipped sum (by fingerprint).

  A state that is not threaded through (``update`` called twice with one
  state, ``init`` called again mid-training, a restored checkpoint continued
  on other data) would add the noise of key index k to a second, different
  sum; their difference would then be released without noise. :meth:`check`
  runs on the host at every release (``io_callback``, also under ``jit``) with
  the sum's seal (its bit-level fingerprint, :func:`~dpmuon_jax.privacy.query.fingerprint`):
  the same key on the same sum (a replay, bit for bit) is allowed, on another
  sum it is refused: the release is replaced by NaN and a warning names the
  key index. It catches reuse within one release object in one process;
  ``docs/sharp-edges.md`` lists what it cannot see.
  """

  def __init__(self):
    self._used: dict[tuple[bytes, int], bytes] = {}

  def _claim(self, noise_key, count, fingerprint) -> np.ndarray:
    use = (np.asarray(noise_key, np.uint32).tobytes(), int(count))
    digest = np.asarray(fingerprint, np.uint32).tobytes()
    fresh = self._used.setdefault(use, digest) == digest
    if not fresh:
      warnings.warn(
          f"dp_release: noise key index {use[1]} was already used on a different clipped sum "
          "(a state used twice, or init called again); this release is NaN. Thread the "
          "optimizer state through every update.",
          RuntimeWarning,
          stacklevel=1,
      )
    return np.asarray(fresh)

  def check(self, noise_key: jax.Array, count: jax.Array, fingerprint: jax.Array) -> jax.Array:
    """True unless this key was used before on a sum with another fingerprint."""
    return io_callback(self._claim, jax.ShapeDtypeStruct((), jnp.bool_), noise_key, count,
                       fingerprint, ordered=False)


def dp_release(
    l2_clip_norm: float,
    noise_multiplier: float,
    denominator: float,
    key: KeyLike = None,
    clipping: Clipping | None = None,
    neighbouring: Neighbouring = ADD_REMOVE,
    secure_noise: bool = False,
) -> PrivateTransformation:
  """The private release G̃ = (Σ_i clip_C(q_i) + N(0, σ²C² I)) / D.

  ``update(updates, state, params, *, mask=None)`` needs ``params`` and accepts either

  * per-example queries (e.g. ``vmap(grad)`` output): every leaf has shape
    ``(B,) + p.shape`` for its parameter ``p``, with one B, and an optional
    boolean ``mask`` of shape ``(B,)``: they are clipped, summed over the real
    rows, noised and divided by D; or
  * a :class:`~dpmuon_jax.privacy.query.ClippedSum` (from
    :func:`~dpmuon_jax.privacy.query.clipped_sum`) with the parameters'
    shapes, whose attached sensitivity must equal ``l2_clip_norm``.

  Anything else (e.g. a summed gradient, whose rows would be clipped as if
  they were examples) is refused with a one-line ``ValueError``. The update
  has exactly the parameters' shapes and dtypes.

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
    secure_noise: resist floating-point attacks on the Gaussian mechanism
      (Mironov 2012; Jin et al. 2022): clip on an integer grid
      (``clipping.grid_bits``, default 16), sum exactly in integers and add
      exact discrete Gaussian noise (Canonne, Kamath and Steinke 2020) drawn
      from OS entropy on the host, scaled so that the accountant's σ is
      unchanged (:func:`secure_noise_variance`). The noise is then about
      1 + √d·2⁻ᵏ⁻¹ times the float mode's, the host draws d integers per
      release, and releases cannot be replayed. A clipping rule with
      ``grid_bits`` set selects this mode too. One device only.

  Returns:
    A :class:`PrivateTransformation`; its ``release`` attribute describes it.
  """
  spec, noise_key = _release_spec(
      l2_clip_norm, noise_multiplier, denominator, key, clipping, neighbouring, secure_noise
  )
  key_uses = NoiseKeyUses()

  def init_fn(params):
    _refuse_masked_params(params)
    return GaussianReleaseState(jnp.zeros((), jnp.int32), noise_key)

  def update_fn(updates, state, params=None, *, mask=None, **extra_args):
    del extra_args
    clipped = _checked_clipped_sum(updates, params, mask, spec)
    if spec.secure_noise:
      released = _secure_release(clipped.total, params, spec)
    else:
      noise = independent_noise(clipped.total, state.noise_key, state.count, spec)
      released = add_noise(clipped, noise, params, state.noise_key, state.count, spec, key_uses)
    return released, GaussianReleaseState(state.count + 1, state.noise_key)

  return PrivateTransformation.wrap(optax.GradientTransformationExtraArgs(init_fn, update_fn), spec)


def independent_noise(total: PyTree, noise_key: jax.Array, count: jax.Array,
                      spec: GaussianReleaseSpec) -> PyTree:
  """z_t ~ N(0, σ²C² I) of release t = ``count``, from the key ``fold_in(noise_key, t)``."""
  step_key = jax.random.fold_in(noise_key, count)
  return gaussian_noise_like(total, step_key, spec.noise_multiplier * spec.l2_clip_norm)


def add_noise(clipped: ClippedSum, noise: PyTree, params: PyTree, noise_key: jax.Array,
              count: jax.Array, spec: GaussianReleaseSpec, key_uses: NoiseKeyUses) -> PyTree:
  """(Σ clip + noise) / D in the parameters' dtypes; NaN if key ``count`` was used before
  on another sum (:class:`NoiseKeyUses`)."""
  released = jax.tree.map(
      lambda s, z, p: ((s + z) / spec.denominator).astype(jnp.result_type(p)),
      clipped.total, noise, params,
  )
  # Without noise there is no key to protect. Several processes: a host callback would
  # run in one of them only; there the trainer's release journal guards the keys.
  if spec.noise_multiplier > 0 and jax.process_count() == 1:
    assert clipped.seal is not None  # the library seals every sum it makes
    fresh = key_uses.check(noise_key, count, clipped.seal)
    released = _nan_unless(fresh, released)
  return released


def _nan_unless(fresh: jax.Array, released: PyTree) -> PyTree:
  """``released``, or NaN where the key check failed.

  Eagerly the check's answer is a host value, so it is read as a bool rather
  than broadcast: a release sharded or replicated over a mesh cannot be mixed
  with the callback's single-device result in one ``jnp.where``.
  """
  try:
    concrete = bool(fresh)
  except jax.errors.ConcretizationTypeError:  # traced under jit
    return jax.tree.map(lambda x: jnp.where(fresh, x, jnp.nan), released)
  return released if concrete else jax.tree.map(lambda x: jnp.full_like(x, jnp.nan), released)


def _release_spec(
    l2_clip_norm, noise_multiplier, denominator, key, clipping, neighbouring, secure_noise
) -> tuple[GaussianReleaseSpec, jax.Array]:
  """Checks the settings of :func:`dp_release`; returns its spec and noise stream."""
  _validate(l2_clip_norm, noise_multiplier, denominator)
  l2_clip_norm = float(l2_clip_norm)  # compared with the clipping rule's float below
  if neighbouring not in (ADD_REMOVE, REPLACE_ONE):
    raise ValueError(f"neighbouring must be {ADD_REMOVE!r} or {REPLACE_ONE!r}.")
  clipping = as_clipping(l2_clip_norm if clipping is None else clipping)
  if secure_noise and clipping.grid_bits is None:
    clipping = dataclasses.replace(clipping, grid_bits=DEFAULT_GRID_BITS)
  if clipping.l2_clip_norm != l2_clip_norm:
    raise ValueError(
        f"clipping bound {clipping.l2_clip_norm} differs from l2_clip_norm {l2_clip_norm}."
    )
  noise_key, seeded = claim_noise_stream(key)
  spec = GaussianReleaseSpec(
      l2_clip_norm, float(noise_multiplier), float(denominator), seeded, neighbouring,
      clipping,
  )
  return spec, noise_key


def _is_masked_node(x: Any) -> bool:
  return isinstance(x, optax.MaskedNode)


def _refuse_masked_params(params: PyTree) -> None:
  """Refuses a release inside ``optax.masked`` or ``optax.partition``.

  Those wrappers hand the release only some leaves (the others become
  ``optax.MaskedNode``) and pass the other leaves' per-example gradients on
  as updates, neither clipped nor noised; two releases on two parts of the
  tree would also be two mechanisms, which the ledger counts as one.
  """
  if any(_is_masked_node(x) for x in jax.tree.leaves(params, is_leaf=_is_masked_node)):
    raise ValueError(
        "The release is inside optax.masked or optax.partition (it sees optax.MaskedNode "
        "parameters): the leaves it does not see would be updated with their raw per-example "
        "gradients. Release the whole tree, then route the post-processing, e.g. "
        "dm.privatize(dm.dp_release(C, sigma, D), optax.partition(transforms, labels)); to "
        "freeze parameters, keep them out of the tree you differentiate."
    )


def _checked_clipped_sum(updates, params, mask, spec: GaussianReleaseSpec) -> ClippedSum:
  """The clipped sum of the release's input, after checking its shapes, rule, seal and bound."""
  if params is None:
    raise ValueError(
        "dp_release needs params (opt.update(per_example_grads, state, params)) to check "
        "that its input has the parameters' shapes."
    )
  _refuse_masked_params(params)
  if not jax.tree.leaves(params):
    raise ValueError("dp_release got a parameter tree without leaves: there is nothing to train.")
  if not isinstance(updates, ClippedSum):
    check_per_example_shapes(updates, params)
    _refuse_grid_overflow(jax.tree.leaves(updates)[0].shape[0], spec.clipping)
    return clip_and_sum(updates, mask, spec.clipping)
  if mask is not None:
    raise ValueError("mask applies to per-example queries, not to a ClippedSum.")
  if updates.l2_sensitivity != spec.l2_clip_norm:
    raise ValueError(
        f"This release is calibrated for sensitivity {spec.l2_clip_norm}, but the "
        f"clipped sum has sensitivity {updates.l2_sensitivity}."
    )
  check_sum_shapes(updates.total, params)
  if updates.grid_bits != spec.clipping.grid_bits:
    raise ValueError(
        f"The clipped sum's grid (grid_bits={updates.grid_bits}) is not the release's "
        f"({spec.clipping.grid_bits}); build both from the optimizer's clipping rule."
    )
  if not updates.clipping.matches(spec.clipping):
    raise ValueError(
        f"The clipped sum was clipped with {updates.clipping.describe()}, the release with "
        f"{spec.clipping.describe()}; build it with the optimizer's rule "
        "(optimizer.release.clipping)."
    )
  return _sealed_and_bounded(updates)


def _warn_refused() -> None:
  warnings.warn(
      "dp_release refused a ClippedSum under jit (its seal or its bound ||total|| <= "
      "num_examples * C failed: it was changed after clipping); its total was replaced by "
      "NaN (by a constant in secure-noise mode), so the update depends on no data.",
      RuntimeWarning, stacklevel=1,
  )


def _refuse_grid_overflow(examples: float, clipping: Clipping) -> None:
  """A grid sum of more examples than its int32 limbs hold exactly could have wrapped."""
  if clipping.grid_bits is not None and examples > clipping.max_grid_examples:
    raise ValueError(
        f"A grid sum of {examples:g} examples is more than the {clipping.max_grid_examples} "
        f"its int32 limbs sum exactly at grid_bits={clipping.grid_bits}: lower grid_bits or "
        "release smaller batches.")


def _sealed_and_bounded(clipped: ClippedSum) -> ClippedSum:
  """``clipped`` if its seal matches its bits and ‖total‖₂ ≤ num_examples·C (privacy invariant 8).

  Concrete values that fail are refused with a ``ValueError``. Under ``jit``
  the check is a traced bool: a failing sum's total becomes NaN (the integer
  limbs of a grid sum a data-independent constant), so nothing that depends on
  it is released, and a host-side ``RuntimeWarning`` says so.
  """
  intact = clipped.seal_holds()
  norm, bound = clipped.norm_and_bound()
  within = norm <= bound
  try:
    concrete = bool(intact), bool(within)
  except jax.errors.ConcretizationTypeError:  # traced under jit
    concrete = None
  if concrete is not None:
    if not concrete[0]:
      raise ValueError(
          "The ClippedSum was changed after clipping (its seal does not match its total, "
          "statistics and clipping rule), or it adds copies of one sum (add_disjoint or psum "
          "over the same examples): jax.tree.map or tree.unflatten on it cannot make a "
          "releasable sum; add sums over disjoint examples with a.add_disjoint(b) or "
          "s.psum(axis) over a sharded batch.")
    _refuse_grid_overflow(float(clipped.stats.num_examples), clipped.clipping)
    if not concrete[1]:
      raise ValueError(
          f"The ClippedSum's norm {float(norm):.6g} exceeds num_examples x bound = "
          f"{float(bound):.6g}: it is not a sum of {float(clipped.stats.num_examples):g} "
          "clipped queries.")
    return clipped
  ok = intact & within
  jax.lax.cond(ok, lambda: None, lambda: jax.debug.callback(_warn_refused))

  def poison(x):
    bad = jnp.nan if jnp.issubdtype(x.dtype, jnp.floating) else jnp.iinfo(x.dtype).max
    return jnp.where(ok, x, jnp.asarray(bad, x.dtype))

  (total, stats, seal), aux = clipped.tree_flatten()
  return ClippedSum.tree_unflatten(aux, (jax.tree.map(poison, total), stats, seal))


def optimizer_clipping(
    optimizer: PrivateTransformation, clipping: Clipping | float | None = None
) -> Clipping:
  """The clipping rule a private step must use: the one the optimizer carries.

  ``clipping`` may repeat it (for explicitness); a different rule is refused,
  so the method that runs is always the one that was requested and recorded.
  """
  carried = optimizer.release.clipping
  if clipping is not None and not carried.matches(as_clipping(clipping)):
    raise ValueError(
        f"The optimizer was built with clipping {carried.describe()}; the step was asked for "
        f"{as_clipping(clipping).describe()}. Build the optimizer with the clipping you want "
        "(clipping=... in dp_*/make_private)."
    )
  return carried


def privatize(
    release: PrivateTransformation,
    *post_processing: optax.GradientTransformation,
    query: QuerySpec | None = None,
) -> PrivateTransformation:
  """``optax.chain(release, *post_processing)``, still labelled with the release.

  This is how every ``dp_*`` optimizer is built (privacy invariant 7, docs/design.md): ONE
  release over the whole parameter tree, then post-processing only.
  ``query`` names the per-example query the release is fed with (DiSK and
  inner momentum change it; their inputs come from the post-processing state).
  ``None`` keeps the query ``release`` already has: the gradient for
  :func:`dp_release`, a ``dp_*`` optimizer's own (e.g. inner momentum's) when
  more post-processing is chained after it. A different query for a ``dp_*``
  optimizer whose query is not the gradient is refused.
  """
  if not isinstance(release, PrivateTransformation):
    raise TypeError("privatize needs the transformation returned by dp_release first.")
  if query is None:
    query = release.query
  elif query is not release.query and release.query is not GRADIENT_QUERY:
    raise ValueError(
        "privatize was given a query for an optimizer that already privatises a query of its "
        "own (e.g. DiSK's or inner momentum's); leave query=None to keep it."
    )
  return PrivateTransformation.wrap(
      optax.chain(release, *post_processing), release.release, query
  )


def _is_release_state(x: Any) -> bool:
  return isinstance(x, (GaussianReleaseState, BandMFReleaseState))


def _release_states(opt_state: optax.OptState) -> list[GaussianReleaseState]:
  leaves = jax.tree.leaves(opt_state, is_leaf=_is_release_state)
  states = [x for x in leaves if _is_release_state(x)]
  if len(states) != 1:
    raise ValueError(
        f"Expected the state of exactly one dp_release in the optimizer state, found {len(states)}."
    )
  return states


def noise_counter(opt_state: optax.OptState) -> int:
  """The index of the next noise key of the (one) release in ``opt_state``."""
  return int(_release_states(opt_state)[0].count)


def noise_stream(opt_state: optax.OptState) -> np.ndarray:
  """The noise stream (raw uint32 key) of the (one) release in ``opt_state``. SECRET."""
  key = _release_states(opt_state)[0].noise_key
  if isinstance(key, jax.Array) and not key.is_fully_addressable:
    key = key.addressable_data(0)  # several processes: replicated on every device
  return np.asarray(key, np.uint32)


def with_noise_counter(opt_state: optax.OptState, counter: int) -> optax.OptState:
  """``opt_state`` with the release's next noise-key index set to ``counter``.

  The index may only move forward: a key index, once used, is never used
  again (on any clipped sum).
  """
  current = noise_counter(opt_state)
  if counter < current:
    raise ValueError(f"The noise counter only moves forward ({current} -> {counter} refused).")
  if counter != current and isinstance(_release_states(opt_state)[0], BandMFReleaseState):
    raise ValueError(f"A correlated-noise release follows the rows of its strategy in order: "
                     f"its noise counter cannot skip releases ({current} -> {counter} "
                     "refused).")
  return jax.tree.map(  # placed like the old count: a restored (committed) state stays so
      lambda x: x._replace(count=jnp.full_like(x.count, counter)) if _is_release_state(x)
      else x,
      opt_state,
      is_leaf=_is_release_state,
  )
