"""Paper 2's geometric metrics and its probe protocol (paper 2 §2.4, §3.1, §4.2, §5.3, App. D, F).

Definitions (paper 2's exact normalisations were not found; these are the
natural candidates, stated here once):

* polar factor: polar(A) = U_r V_rᵀ over the r nonzero singular values of A
  (singular values ≤ max(m, n)·eps·σ₁ count as zero, eps of A's dtype), so
  ‖polar(A)‖_F = √rank(A);
* polar error:  ‖polar(A) − polar(B)‖_F / ‖polar(B)‖_F, B the reference;
* cosine error: 1 − ⟨A, B⟩_F / (‖A‖_F ‖B‖_F);
* clipping residual: with λ_i the per-example clip factors, λ̄ = mean λ_i,
  ḡ = mean g_i::

      (1/B) Σ_i λ_i g_i = λ̄ ḡ + R,     R = (1/B) Σ_i (λ_i − λ̄)(g_i − ḡ)
      ‖R‖_F ≤ σ_λ σ_G,  σ_λ² = (1/B) Σ (λ_i − λ̄)²,  σ_G² = (1/B) Σ ‖g_i − ḡ‖_F²

  and the normalised residual is ‖R‖_F / ‖λ̄ḡ‖_F. Since polar(λ̄ḡ) = polar(ḡ),
  the clipping distortion of the Muon direction comes from R only.
* envelope factor of inner momentum (paper 2 §4.2, App. F): averaging K+1
  states with weights w_k scales the expected empirical variance of the query
  by ρ + (1 − ρ) S_K, S_K = Σ_k w_k² (the variance ratio of the weighted
  average of K+1 i.i.d. terms), where ρ ∈ [0, 1] is the fraction of the
  per-example fluctuation shared by all states (ρ = 0: independent
  fluctuations; ρ = 1: no reduction). With equal weights S_K = 1/(K+1).

Everything here is a NON-PRIVATE diagnostic: it reads per-example gradients of
probe data before any noise. The protocol runner :func:`nonprivate_im_protocol`
follows paper 2 §5.3: at each checkpoint, the inner-momentum (IM) query and the
current-only query are computed at the SAME model state on the same probe batch
and compared against the SAME reference, the raw (unclipped) mean current
gradient, before noise and outer momentum; reductions are paired per
checkpoint.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from dpmuon_jax.linalg.scaling import (
  DimensionNumbers,
  dimension_numbers_fn,
  matrix_view,
  path_names,
)
from dpmuon_jax.privacy.clipping import Clipping, as_clipping
from dpmuon_jax.privacy.query import LossFn, add_batch_axis, clip_and_sum
from dpmuon_jax.transforms.routing import Routing, route_fn

PyTree = Any


# ------------------------------------------------------------------ matrix metrics


def polar(a: np.ndarray) -> np.ndarray:
  """polar(A) = U_r V_rᵀ over A's nonzero singular values (exact, by SVD, in float64).

  A singular value counts as zero when ≤ max(m, n)·eps·σ₁, eps that of A's own
  float dtype (so a float32 matrix's rounding noise does not count as rank).
  """
  dtype = np.asarray(a).dtype
  eps = np.finfo(dtype if np.issubdtype(dtype, np.floating) else np.float64).eps
  a = np.asarray(a, np.float64)
  u, s, vt = np.linalg.svd(a, full_matrices=False)
  keep = s > (max(a.shape) * eps * (s[0] if s.size else 0.0))
  return (u[:, keep]) @ vt[keep]


def polar_error(a: np.ndarray, reference: np.ndarray) -> float:
  """‖polar(A) − polar(B)‖_F / ‖polar(B)‖_F with B = ``reference`` (module docstring)."""
  pb = polar(reference)
  denom = np.linalg.norm(pb)
  return float(np.linalg.norm(polar(a) - pb) / denom) if denom > 0 else math.nan


def cosine_error(a: np.ndarray, reference: np.ndarray) -> float:
  """1 − ⟨A, B⟩_F / (‖A‖_F ‖B‖_F) (module docstring)."""
  a, b = np.asarray(a, np.float64).ravel(), np.asarray(reference, np.float64).ravel()
  denom = np.linalg.norm(a) * np.linalg.norm(b)
  return float(1.0 - a @ b / denom) if denom > 0 else math.nan


# ------------------------------------------------------------------ clipping residual


class ClippingResidual(NamedTuple):
  """The decomposition (1/B) Σ λ_i g_i = λ̄ ḡ + R of one batch (float64)."""

  clipped_mean: PyTree  # (1/B) Σ λ_i g_i, computed with the library's clipping code
  common: PyTree  # λ̄ ḡ
  residual: PyTree  # R = (1/B) Σ (λ_i − λ̄)(g_i − ḡ)
  factors: np.ndarray  # λ_i, shape (B,)
  sigma_lambda: float
  sigma_g: float
  residual_norm: float  # ‖R‖_F (all leaves)
  bound: float  # σ_λ σ_G ≥ ‖R‖_F

  @property
  def normalized(self) -> float:
    """‖R‖_F / ‖λ̄ ḡ‖_F."""
    common = _tree_norm(self.common)
    return self.residual_norm / common if common > 0 else math.inf


def _tree_norm(tree: PyTree) -> float:
  return math.sqrt(sum(float(np.sum(np.square(x))) for x in jax.tree.leaves(tree)))


def _clip_all(per_example: PyTree, clipping: Clipping | float) -> PyTree:
  clipping = as_clipping(clipping)
  if clipping.per_layer:
    raise ValueError("Per-layer clipping has one factor per layer; pass one leaf at a time.")
  return jax.jit(jax.vmap(clipping.clip))(per_example).clipped


def _factors(per_example: PyTree, clipped: PyTree) -> np.ndarray:
  flat = lambda t: np.concatenate(
      [np.asarray(x, np.float64).reshape(x.shape[0], -1) for x in jax.tree.leaves(t)], axis=1)
  g, c = flat(per_example), flat(clipped)
  sq = np.sum(g * g, axis=1)
  return np.where(sq > 0, np.sum(c * g, axis=1) / np.where(sq > 0, sq, 1.0), 1.0)


def clipping_factors(per_example: PyTree, clipping: Clipping | float) -> np.ndarray:
  """λ_i with clip_C(g_i) = λ_i g_i (flat or automatic clipping, not per-layer), float64.

  Read off the library's own clipping as λ_i = ⟨clip(g_i), g_i⟩/‖g_i‖² (λ_i = 1
  when g_i = 0).
  """
  return _factors(per_example, _clip_all(per_example, clipping))


def clipping_residual(per_example: PyTree, clipping: Clipping | float) -> ClippingResidual:
  """The clipping-residual identity of paper 2 §3.1 on per-example queries ``per_example``
  (a pytree with a leading batch axis B): NON-PRIVATE (no noise, data beyond the releases).
  """
  clipped = _clip_all(per_example, clipping)
  lam = _factors(per_example, clipped)
  size = lam.shape[0]
  g = jax.tree.map(lambda x: np.asarray(x, np.float64), per_example)
  clipped_mean = jax.tree.map(lambda x: np.asarray(x, np.float64).sum(0) / size, clipped)
  lam_bar = lam.mean()
  g_bar = jax.tree.map(lambda x: x.mean(0), g)
  centred_lam = lam - lam_bar
  residual = jax.tree.map(
      lambda x, m: np.tensordot(centred_lam, x - m, axes=1) / size, g, g_bar)
  sigma_lambda = math.sqrt(float(np.mean(centred_lam**2)))
  sigma_g = math.sqrt(sum(float(np.sum((x - m) ** 2)) for x, m in
                          zip(jax.tree.leaves(g), jax.tree.leaves(g_bar))) / size)
  return ClippingResidual(
      clipped_mean=clipped_mean, common=jax.tree.map(lambda m: lam_bar * m, g_bar),
      residual=residual, factors=lam, sigma_lambda=sigma_lambda, sigma_g=sigma_g,
      residual_norm=_tree_norm(residual), bound=sigma_lambda * sigma_g,
  )


# ------------------------------------------------------------------ inner-momentum weights


def history_weights(gamma: float, num_states: int) -> np.ndarray:
  """w_k = γ^k / Σ_j γ^j for k = 0..K_t (the current state first, weighted most for γ < 1)."""
  if num_states < 1:
    raise ValueError(f"num_states must be >= 1, got {num_states}.")
  w = float(gamma) ** np.arange(num_states, dtype=np.float64)
  return w / w.sum()


def variance_ratio(weights: Sequence[float] | np.ndarray) -> float:
  """S_K = Σ_k w_k² for weights summing to one: Var of Σ w_k ξ_k over Var ξ for i.i.d. ξ_k."""
  w = np.asarray(weights, np.float64)
  return float(np.sum(w**2) / np.sum(w) ** 2)


def envelope_factor(rho: float, gamma: float, num_history: int) -> float:
  """ρ + (1 − ρ) S_K with S_K = Σ w_k², w = :func:`history_weights` (γ, K + 1).

  ``num_history`` is K, the number of past states (K = 0: factor 1).
  """
  if not 0.0 <= rho <= 1.0:
    raise ValueError(f"rho must lie in [0, 1], got {rho}.")
  return rho + (1.0 - rho) * variance_ratio(history_weights(gamma, num_history + 1))


# ------------------------------------------------------------------ the protocol runner


class ProtocolCheckpoint(NamedTuple):
  """One model state of the protocol.

  Attributes:
    params: θ_t.
    history: past states [θ_{t−1}, θ_{t−2}, …] (most recent first; may be empty).
    seed, step: labels (the run's seed and the update index).
    probe_batch: this checkpoint's probe batch; ``None``: the runner's shared one.
  """

  params: PyTree
  history: Sequence[PyTree] = ()
  seed: int = 0
  step: int = 0
  probe_batch: PyTree | None = None


Combine = Callable[[Sequence[PyTree]], PyTree]


def weighted_combination(gamma: float, num_history: int) -> Combine:
  """Σ_{k≤K_t} w_k q_k over per-state queries [q_0 (current), q_1, …], K_t = min(K, available)."""

  def combine(per_state: Sequence[PyTree]) -> PyTree:
    states = per_state[: num_history + 1]
    w = history_weights(gamma, len(states))
    return jax.tree.map(lambda *qs: sum(float(wk) * q for wk, q in zip(w, qs)), *states)

  return combine


def _per_state_query(loss_fn: LossFn, combine: Combine):
  grad = jax.grad(loss_fn)

  def query(states: Sequence[PyTree], example: PyTree) -> PyTree:
    one = add_batch_axis(example)
    return combine([grad(s, one) for s in states])

  return query


class ProtocolRow(NamedTuple):
  """One (checkpoint, matrix) comparison; errors against the raw mean current gradient."""

  seed: int
  step: int
  path: str
  polar_error_current: float
  polar_error_im: float
  cosine_error_current: float
  cosine_error_im: float
  residual_current: float  # normalised clipping residual ‖R‖/‖λ̄ḡ‖ of the current-only query
  residual_im: float  # the same for the IM query vectors


class PairedReduction(NamedTuple):
  """Summary of paired relative reductions (current − IM)/current over rows."""

  mean: float
  std: float
  min: float
  max: float
  fraction_improved: float  # share of rows where IM < current
  count: int


def _paired(current: np.ndarray, im: np.ndarray) -> PairedReduction:
  rel = (current - im) / np.where(current != 0, current, np.nan)
  return PairedReduction(
      float(np.nanmean(rel)), float(np.nanstd(rel)), float(np.nanmin(rel)), float(np.nanmax(rel)),
      float(np.mean(im < current)), int(rel.size))


class ProtocolResult(NamedTuple):
  rows: list[ProtocolRow]
  polar_error: PairedReduction
  cosine_error: PairedReduction
  clipping_residual: PairedReduction

  def table(self) -> str:
    """Text summary (relative reductions in %)."""
    lines = [f"{'metric':<18}{'mean':>9}{'std':>9}{'min':>9}{'max':>9}{'improved':>10}{'n':>5}"]
    for name in ("polar_error", "cosine_error", "clipping_residual"):
      r = getattr(self, name)
      lines.append(f"{name:<18}{100 * r.mean:>8.2f}%{100 * r.std:>8.2f}%{100 * r.min:>8.2f}%"
                   f"{100 * r.max:>8.2f}%{100 * r.fraction_improved:>9.0f}%{r.count:>5}")
    return "\n".join(lines)


def _mean_clipped(total: PyTree, size: int) -> PyTree:
  return jax.tree.map(lambda x: np.asarray(x, np.float64) / size, total)


def nonprivate_im_protocol(
    loss_fn: LossFn,
    checkpoints: Sequence[ProtocolCheckpoint],
    clipping: Clipping | float,
    gamma: float = 0.9,
    num_history: int = 4,
    probe_batch: PyTree | None = None,
    combine: Combine | None = None,
    routing: Routing = "muon",
    dimension_numbers: DimensionNumbers = None,
) -> ProtocolResult:
  """NON-PRIVATE: paper 2 §5.3's comparison of the IM and current-only queries.

  For each checkpoint (θ_t, [θ_{t−1}, …]) and each routed (Muon) matrix:

  * reference  Ḡ = (1/B) Σ_i ∇ℓ(θ_t; x_i)                 (raw, unclipped, current)
  * current    (1/B) Σ_i clip_C(∇ℓ(θ_t; x_i))
  * IM         (1/B) Σ_i clip_C(Σ_{k≤K_t} w_k ∇ℓ(θ_{t−k}; x_i)),  K_t = min(K, len(history))

  all on the same probe batch, before noise and outer momentum; clipping is
  over the whole query (flat), as in training. Reports polar and cosine
  errors of both against Ḡ and the normalised clipping residual of each
  query, per row, and their paired relative reductions.

  Args:
    loss_fn: ``loss_fn(params, batch) -> scalar``.
    checkpoints: :class:`ProtocolCheckpoint` s (several seeds and steps).
    clipping: C or a :class:`Clipping` (flat or automatic).
    gamma, num_history: γ and K of the weights w_k = γ^k/Σγ^j (paper 2: 0.9, 4).
    probe_batch: the shared probe batch (a checkpoint's own takes precedence).
    combine: replaces the γ-weighted average: ``combine([q_0, q_1, …])`` gets
      the per-state gradients of one example (current first).
    routing: which leaves are Muon matrices (default ``"muon"``, paper 2's split).
    dimension_numbers: matrix views.
  """
  combine = combine or weighted_combination(gamma, num_history)
  per_example = lambda q: jax.jit(jax.vmap(q, in_axes=(None, 0)))
  current_vectors = per_example(_per_state_query(loss_fn, lambda qs: qs[0]))
  im_vectors_fn = per_example(_per_state_query(loss_fn, combine))
  clip_sum = jax.jit(lambda vectors: clip_and_sum(vectors, None, clipping).total)
  route, spec_fn = route_fn(routing), dimension_numbers_fn(dimension_numbers)
  rows = []
  for ckpt in checkpoints:
    batch = ckpt.probe_batch if ckpt.probe_batch is not None else probe_batch
    if batch is None:
      raise ValueError("Give a probe_batch, shared or per checkpoint.")
    states = [ckpt.params, *ckpt.history]
    raw = current_vectors(states[:1], batch)
    im_vectors = im_vectors_fn(states, batch)
    size = jax.tree.leaves(batch)[0].shape[0]
    reference = jax.tree.map(lambda x: np.asarray(x, np.float64).mean(0), raw)
    current = _mean_clipped(clip_sum(raw), size)
    im = _mean_clipped(clip_sum(im_vectors), size)
    res_current = clipping_residual(raw, clipping)
    res_im = clipping_residual(im_vectors, clipping)
    for (path, leaf), cur, imm, rc, ri, rcc, ric in zip(
        jax.tree_util.tree_flatten_with_path(reference)[0], jax.tree.leaves(current),
        jax.tree.leaves(im), jax.tree.leaves(res_current.residual),
        jax.tree.leaves(res_im.residual), jax.tree.leaves(res_current.common),
        jax.tree.leaves(res_im.common)):
      names = path_names(path)
      if leaf.ndim < 2 or not route(names, leaf):
        continue
      view = matrix_view(leaf.shape, spec_fn(names, leaf))
      mats = [view.to_matrices(np.asarray(x, np.float32)) for x in (leaf, cur, imm)]
      rows.append(ProtocolRow(
          seed=ckpt.seed, step=ckpt.step, path="/".join(names),
          polar_error_current=float(np.mean([polar_error(c, r) for r, c in zip(mats[0], mats[1])])),
          polar_error_im=float(np.mean([polar_error(c, r) for r, c in zip(mats[0], mats[2])])),
          cosine_error_current=cosine_error(cur, leaf),
          cosine_error_im=cosine_error(imm, leaf),
          residual_current=float(np.linalg.norm(rc) / np.linalg.norm(rcc)),
          residual_im=float(np.linalg.norm(ri) / np.linalg.norm(ric)),
      ))
  return summarise_protocol(rows)


def summarise_protocol(rows: Sequence[ProtocolRow]) -> ProtocolResult:
  """Paired relative reductions over protocol rows (e.g. rows gathered across runs)."""
  rows = list(rows)
  col = lambda name: np.asarray([getattr(r, name) for r in rows], np.float64)
  return ProtocolResult(
      rows,
      _paired(col("polar_error_current"), col("polar_error_im")),
      _paired(col("cosine_error_current"), col("cosine_error_im")),
      _paired(col("residual_current"), col("residual_im")),
  )


_SUMMARY_FIELDS = ("polar_error", "cosine_error", "clipping_residual")


class InnerMomentumProbe(NamedTuple):
  """NON-PRIVATE: :func:`nonprivate_im_protocol` as the diagnostic probe of a GPT-2 run.

  Pass it to :func:`dpmuon_jax.text.train.train_lm` (``probe=``) with
  ``diagnostic_steps``: before the update at each of those steps, the run's own
  θ_t and stored states are compared on the probe batch (paper 2, §5.3 and
  figures 3–4), with the run's C, γ (``decay``, default 0.5) and K
  (``history``, default 1).

  Attributes:
    routing: which leaves are Muon matrices (paper 2's GPT-2 split, ``"paper2"``).
  """

  routing: Routing = "paper2"

  def rows(self, loss_fn: LossFn, params: PyTree, past_states: Sequence[PyTree], step: int,
           config: Any, probe_batch: PyTree) -> list[ProtocolRow]:
    """The protocol's rows at one checkpoint (``config``: the run's ``LMTrainConfig``)."""
    settings = config.optimizer_kwargs
    # Rows are labelled seed 0: a seeded run's seed is its root key (SECRET), and these
    # rows are written to the run's public diagnostics.csv.
    checkpoint = ProtocolCheckpoint(params, past_states, 0, step)
    return nonprivate_im_protocol(
        loss_fn, [checkpoint], config.clip, settings.get("decay", 0.5),
        settings.get("history", 1), probe_batch, routing=self.routing).rows

  def summary(self, rows: Sequence[ProtocolRow]) -> dict:
    """Paired reductions (:func:`summarise_protocol`) of polar/cosine error and residual."""
    result = summarise_protocol(rows)
    return {name: getattr(result, name)._asdict() for name in _SUMMARY_FIELDS}
