"""Muon post-processing of the release (paper 1, §Method; docs/design.md "The optimizers").

Paper 1 is "Spectral Gradient Orthogonalization Improves Differentially Private
Training at Scale".

No privacy cost: these transforms only read the release G̃_t. They carry no
``dp_`` prefix; chain them after a release (:func:`dpmuon_jax.dp_release`) or
use the complete private optimizers :func:`dpmuon_jax.dp_muon` /
:func:`dpmuon_jax.dp_muon_s`.

DP-Muon (``scale_by_muon``)::

    M_t = β M_{t−1} + (1−β) G̃_t,   M̂_t = (1−β) G̃_t + β M_t        (Nesterov)
    Ĝ_t = sqrt(min(4, max(1, fan_out/fan_in))) · NS_K(M̂_t)

DP-Muon-S (``scale_by_muon_s``, paper 1 design 4, by default with design 1's M_t)::

    M_t = β M_{t−1} + (1−β) G̃_t        (or the un-normalised β M_{t−1} + G̃_t)
    Ĝ_t = σ₁(M_t) · sqrt(max(1, fan_out/fan_in)) · NS_K(M_t)

with σ₁ from power iteration warm-started at the previous step's vector. Every
leaf these transforms see must have rank ≥ 2 (route the others elsewhere, see
:mod:`dpmuon_jax.transforms.routing`); each is viewed as fan_in × fan_out
matrices (:mod:`dpmuon_jax.linalg.scaling`).

Attention blocks (``attention_blocks`` of :func:`scale_by_orthogonalization`
and :func:`scale_by_muon`, :func:`matrix_blocks`). Paper 2 ("Inner Momentum
for DP-Muon", §5 and appendix C) trains Hugging Face GPT-2, which stores an
attention's q, k, v projections as ONE fused d × 3d matrix ``c_attn``, and does
not say whether Muon orthogonalised that matrix, each projection, or each
head. Our attentions keep them apart (leaves ``.../{query,key,value}/kernel``,
d × d each, in GPT-2 and ViT), so the choice can be made; with A ∈ {Q, K, V}
the d × d updates and H heads of width d_h = d/H::

    "split" (default):  Ĝ_A = NS_K(A)                                each d × d
    "fused":            [Ĝ_Q | Ĝ_K | Ĝ_V] = √3 · NS_K([Q | K | V])    one d × 3d
    "heads":            Ĝ_A[:, h·d_h:(h+1)·d_h] = NS_K(A[:, h·d_h:(h+1)·d_h])

each with the aspect factor of its own block (√3 = sqrt(min(4, 3d/d)) for the
fused one under DP-Muon's cap, 1 for the others). The momentum buffers stay per
leaf; only the orthogonalisation is blocked. It is post-processing: the
release, the clipping and the accounting are the same for every choice.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any, Literal, NamedTuple, cast, get_args

import jax
import jax.numpy as jnp
import optax

from dpmuon_jax import checks
from dpmuon_jax.linalg.newton_schulz import NewtonSchulz
from dpmuon_jax.linalg.power_iteration import exact_top_singular, power_iteration
from dpmuon_jax.linalg.scaling import (
    DP_MUON_MAX_ASPECT_RATIO,
    DimensionNumbers,
    Path,
    aspect_factor,
    dimension_numbers_fn,
    matrix_view,
    path_names,
)
from dpmuon_jax.transforms.momentum import EMA, HEAVY_BALL, Buffer, muon_momentum

PyTree = Any

AttentionBlocks = Literal["split", "fused", "heads"]
"""How an attention's q, k, v updates are blocked for orthogonalisation (module docstring)."""
SPLIT, FUSED, HEADS = get_args(AttentionBlocks)
ATTENTION_BLOCKS: tuple[str, ...] = get_args(AttentionBlocks)
QKV = ("query", "key", "value")
"""The path entries of an attention's projections, ``.../<entry>/kernel``, in ``c_attn``'s order."""


def _view(path, leaf, spec_fn):
  if jnp.ndim(leaf) < 2:
    raise ValueError(
        f"Leaf {'/'.join(path_names(path))} of shape {jnp.shape(leaf)} reached a Muon transform; "
        "Muon needs rank >= 2. Route it to the fallback optimizer."
    )
  return matrix_view(jnp.shape(leaf), spec_fn(path_names(path), leaf))


def check_attention_blocks(attention_blocks: str, attention_heads: int | None) -> None:
  """Refuses, with a one-line ``ValueError``, an unknown ``attention_blocks``, ``"heads"``
  without an int ``attention_heads`` >= 1, and ``attention_heads`` with another choice."""
  if attention_blocks not in ATTENTION_BLOCKS:
    raise ValueError(
        f"attention_blocks must be one of {ATTENTION_BLOCKS}, got {attention_blocks!r}."
    )
  if attention_blocks == HEADS:
    checks.check_positive_int("attention_heads", attention_heads)
  elif attention_heads is not None:
    raise ValueError(
        f"attention_heads is used by attention_blocks={HEADS!r} only, got "
        f"attention_blocks={attention_blocks!r} with attention_heads={attention_heads!r}."
    )


class MatrixBlocks(NamedTuple):
  """The matrices one orthogonalisation step sees, and the way back to the update tree.

  ``matrices[j]`` is a (batch, fan_in, fan_out) stack whose matrices are each
  orthogonalised and aspect-scaled as one; ``unblock(outs)`` maps a list of
  arrays shaped like ``matrices`` to a tree like the updates (each leaf in its
  own dtype).
  """

  matrices: list[jax.Array]
  unblock: Callable[[list[jax.Array]], PyTree]


class _Block(NamedTuple):
  members: tuple[int, ...]  # leaf indices, in flattening order (q, k, v for a fused block)
  join: Callable[[list[jax.Array]], jax.Array]
  split: Callable[[jax.Array], list[jax.Array]]


def _single(i: int) -> _Block:
  return _Block((i,), lambda ms: ms[0], lambda x: [x])


def _fused(module: Path, members: tuple[int, ...], mats: list[jax.Array]) -> _Block:
  """[Q | K | V] along fan_out: (b, n, m_Q + m_K + m_V), split back at the same columns."""
  shapes = [mats[i].shape for i in members]
  if len({s[:2] for s in shapes}) != 1:
    raise ValueError(
        f"attention_blocks='fused' needs query, key and value of {'/'.join(module)} with the same "
        f"(batch, fan_in); got matrix stacks {shapes}."
    )
  cuts = list(itertools.accumulate(s[2] for s in shapes))[:-1]
  return _Block(members, lambda ms: jnp.concatenate(ms, axis=-1),
                lambda x: jnp.split(x, cuts, axis=-1))


def _per_head(name: Path, i: int, shape: tuple[int, ...], heads: int) -> _Block:
  """(b, n, m) → (b·H, n, m/H): head h is columns [h·m/H, (h+1)·m/H), as the model splits them."""
  b, n, m = shape
  if m % heads:
    raise ValueError(
        f"attention_blocks='heads': fan_out {m} of {'/'.join(name)} is not divisible by "
        f"attention_heads={heads}."
    )
  dh = m // heads
  join = lambda ms: ms[0].reshape(b, n, heads, dh).transpose(0, 2, 1, 3).reshape(b * heads, n, dh)
  split = lambda x: [x.reshape(b, heads, n, dh).transpose(0, 2, 1, 3).reshape(b, n, m)]
  return _Block((i,), join, split)


def _qkv_role(name: Path) -> tuple[Path, int] | None:
  """(attention path, 0 / 1 / 2) of a q / k / v ``kernel`` leaf, else ``None``."""
  if len(name) >= 2 and name[-1] == "kernel" and name[-2] in QKV:
    return name[:-2], QKV.index(name[-2])
  return None


def _blocks(names: list[Path], mats: list[jax.Array], attention_blocks: str,
            attention_heads: int | None) -> list[_Block]:
  """Each leaf alone, except q, k, v under ``"fused"`` (one block) or ``"heads"`` (per head)."""
  blocks, modules = [], {}
  for i, name in enumerate(names):
    role = _qkv_role(name)
    if role is None or attention_blocks == SPLIT:
      blocks.append(_single(i))
    elif attention_blocks == HEADS:
      blocks.append(_per_head(name, i, mats[i].shape, cast(int, attention_heads)))
    else:
      modules.setdefault(role[0], {})[role[1]] = i
  for module, roles in modules.items():
    if len(roles) != len(QKV):
      raise ValueError(
          f"attention_blocks='fused' needs query, key and value of {'/'.join(module)} on Muon; "
          f"only {[QKV[r] for r in sorted(roles)]} are (check the routing)."
      )
    blocks.append(_fused(module, tuple(roles[r] for r in range(len(QKV))), mats))
  return blocks


def matrix_blocks(
    updates: PyTree,
    dimension_numbers: DimensionNumbers = None,
    attention_blocks: AttentionBlocks = SPLIT,
    attention_heads: int | None = None,
) -> MatrixBlocks:
  """The (batch, fan_in, fan_out) stacks to orthogonalise for ``updates``, and back.

  Every (rank ≥ 2) leaf is first seen through its matrix view
  (``dimension_numbers``, :mod:`dpmuon_jax.linalg.scaling`). Then, for the
  leaves ``.../{query,key,value}/kernel`` of one attention (module docstring):
  ``"split"`` keeps each view; ``"fused"`` concatenates the three along
  fan_out (Hugging Face's ``c_attn`` layout, d × 3d); ``"heads"`` makes each
  head's fan_in × fan_out/H column block (``attention_heads`` = H) a matrix of
  its own. Other leaves are always their own view. Pure and static in shapes:
  ``unblock`` is exact (a permutation of entries) and undoes the blocking.
  """
  check_attention_blocks(attention_blocks, attention_heads)
  spec_fn = dimension_numbers_fn(dimension_numbers)
  leaves, treedef = jax.tree_util.tree_flatten_with_path(updates)
  views = [_view(p, g, spec_fn) for p, g in leaves]
  mats = [view.to_matrices(g) for view, (_, g) in zip(views, leaves, strict=True)]
  blocks = _blocks([path_names(p) for p, _ in leaves], mats, attention_blocks, attention_heads)

  def unblock(outs: list[jax.Array]) -> PyTree:
    flat: list[Any] = [None] * len(leaves)
    for block, out in zip(blocks, outs, strict=True):
      for i, m in zip(block.members, block.split(out), strict=True):
        flat[i] = views[i].from_matrices(m).astype(leaves[i][1].dtype)
    return treedef.unflatten(flat)

  return MatrixBlocks([block.join([mats[i] for i in block.members]) for block in blocks], unblock)


def _check_aspect_cap(max_aspect_ratio: float | None) -> None:
  """``max_aspect_ratio`` is ``None`` (no cap) or > 0, else a one-line ``ValueError``."""
  if max_aspect_ratio is not None:
    checks.check_positive("max_aspect_ratio", max_aspect_ratio)


def scale_by_orthogonalization(
    ns: NewtonSchulz = NewtonSchulz(),
    max_aspect_ratio: float | None = DP_MUON_MAX_ASPECT_RATIO,
    attention_blocks: AttentionBlocks = SPLIT,
    attention_heads: int | None = None,
) -> optax.GradientTransformation:
  """Ĝ = sqrt(min(r_max, max(1, fan_out/fan_in))) · NS_K(U) for every block U of the update.

  A block is a (rank ≥ 2) leaf's matrix view, except for attention under
  ``attention_blocks`` (:func:`matrix_blocks`); fan_in × fan_out is the
  block's own shape (d × 3d for a fused q, k, v). Stateless.

  Args:
    ns: the Newton–Schulz settings (:class:`~dpmuon_jax.linalg.newton_schulz.NewtonSchulz`:
      steps, coefficients, ε, dtype, precision and the per-leaf matrix views).
    max_aspect_ratio: r_max (4 for DP-Muon); ``None``: no cap.
    attention_blocks: ``"split"`` (default: each of q, k, v on its own),
      ``"fused"`` (one d × 3d matrix, as Hugging Face's ``c_attn``) or
      ``"heads"`` (each head's d × d_h block); the choice paper 2 ("Inner
      Momentum for DP-Muon", §5) leaves open, see the module docstring.
      Post-processing only: the release, clipping and accounting are unchanged.
    attention_heads: H, the number of heads; required by ``"heads"`` only.
  """
  _check_aspect_cap(max_aspect_ratio)
  check_attention_blocks(attention_blocks, attention_heads)
  spec_fn = dimension_numbers_fn(ns.dimension_numbers)

  def block_update(m):
    x = ns.orthogonalize(m)
    return aspect_factor(m.shape[-2], m.shape[-1], max_aspect_ratio) * x

  def update_fn(updates, state, params=None):
    del params
    blocks = matrix_blocks(updates, spec_fn, attention_blocks, attention_heads)
    return blocks.unblock([block_update(m) for m in blocks.matrices]), state

  return optax.GradientTransformation(optax.init_empty_state, update_fn)


class SpectralScaleState(NamedTuple):
  """Per leaf, the power-iteration vectors, shape (batch, min(fan_in, fan_out)), float32."""

  vectors: PyTree


def scale_by_spectral_orthogonalization(
    power_iterations: int = 3,
    exact_svd: bool = False,
    ns: NewtonSchulz = NewtonSchulz(),
    max_aspect_ratio: float | None = None,
) -> optax.GradientTransformation:
  """Ĝ = σ₁(U) · sqrt(max(1, fan_out/fan_in)) · NS_K(U) for every (rank ≥ 2) leaf U.

  σ₁ of each matrix comes from ``power_iterations`` steps of power iteration
  warm-started at the previous call's vector (kept in the state), or from an
  exact SVD if ``exact_svd``. The aspect factor is uncapped by default, as
  paper 1 (design 4) states DP-Muon-S.
  """
  checks.check_positive_int("power_iterations", power_iterations)
  _check_aspect_cap(max_aspect_ratio)
  spec_fn = dimension_numbers_fn(ns.dimension_numbers)

  def init_leaf(path, p):
    view = _view(path, p, spec_fn)
    return jnp.zeros((view.batch, min(view.fan_in, view.fan_out)), jnp.float32)

  def init_fn(params):
    return SpectralScaleState(jax.tree_util.tree_map_with_path(init_leaf, params))

  def top_singular(m, u):
    if exact_svd:
      return exact_top_singular(m)
    return power_iteration(m, u, power_iterations)

  def leaf_update(path, g, u):
    view = _view(path, g, spec_fn)
    m = view.to_matrices(g)
    sigma, u = jax.vmap(top_singular)(m.astype(jnp.promote_types(m.dtype, jnp.float32)), u)
    x = ns.orthogonalize(m)
    scale = aspect_factor(view.fan_in, view.fan_out, max_aspect_ratio)
    out = view.from_matrices((scale * sigma[:, None, None]) * x).astype(g.dtype)
    return out, u.astype(jnp.float32)

  def update_fn(updates, state, params=None):
    del params
    leaves, treedef = jax.tree_util.tree_flatten_with_path(updates)
    vectors = treedef.flatten_up_to(state.vectors)
    results = [leaf_update(p, g, u) for (p, g), u in zip(leaves, vectors, strict=True)]
    out = treedef.unflatten([r[0] for r in results])
    return out, SpectralScaleState(treedef.unflatten([r[1] for r in results]))

  return optax.GradientTransformation(init_fn, update_fn)


def scale_by_muon(
    beta: float = 0.95,
    *,
    nesterov: bool = True,
    ns: NewtonSchulz = NewtonSchulz(),
    mu_dtype: jnp.dtype | None = None,
    attention_blocks: AttentionBlocks = SPLIT,
    attention_heads: int | None = None,
) -> optax.GradientTransformation:
  """DP-Muon's post-processing: EMA momentum (Nesterov), NS_K, capped aspect factor.

  Defaults are paper 1's (β = 0.95, Nesterov, K = 5, Keller Jordan's
  coefficients, ε = 1e-7). Learning rate and weight decay are not included:
  chain ``optax.add_decayed_weights`` and ``optax.scale_by_learning_rate``.
  The options after ``beta`` are keyword-only: ``optax.contrib.scale_by_muon``
  orders its positional arguments differently (``ns_coeffs`` first); its
  ``ns_steps``, ``ns_coeffs`` and ``eps`` are ``ns=NewtonSchulz(steps, coeffs,
  eps)`` here.
  ``attention_blocks``, ``attention_heads``: see
  :func:`scale_by_orthogonalization`; the momentum stays per leaf.
  """
  return optax.chain(
      muon_momentum(beta, nesterov, EMA, mu_dtype),
      scale_by_orthogonalization(ns, DP_MUON_MAX_ASPECT_RATIO, attention_blocks,
                                 attention_heads),
  )


def scale_by_muon_s(
    beta: float = 0.9,
    *,
    buffer: Buffer = HEAVY_BALL,
    power_iterations: int = 3,
    exact_svd: bool = False,
    ns: NewtonSchulz = NewtonSchulz(),
    mu_dtype: jnp.dtype | None = None,
) -> optax.GradientTransformation:
  """DP-Muon-S's post-processing: Ĝ = σ₁(M_t)·sqrt(max(1, fan_out/fan_in))·NS_K(M_t).

  Args:
    beta: β (paper 1's preset: 0.9).
    buffer: ``"heavy_ball"`` (default: paper 1 design 4 defines σ₁ on "the
      heavy-ball momentum matrix" M_t = βM_{t−1} + G̃_t) or ``"ema"``
      (M_t = βM_{t−1} + (1−β)G̃_t, the buffer of paper 1's DP-Muon). No
      look-ahead either way. Because σ₁ carries the buffer's scale,
      ``"heavy_ball"`` steps are ≈ 1/(1−β) times larger (10× at β = 0.9), so
      learning rates do not transfer between the two.
    power_iterations: warm-started iterations per step for σ₁.
    exact_svd: compute σ₁ by SVD instead (for checks; slow on large layers).
    ns, mu_dtype: as in :func:`scale_by_muon`.
  """
  return optax.chain(
      muon_momentum(beta, False, buffer, mu_dtype),
      scale_by_spectral_orthogonalization(power_iterations, exact_svd, ns, None),
  )
