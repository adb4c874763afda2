"""Paper 1's spectral diagnostics: noise edge, clean gap, SNR, recovery threshold.

Paper 1 is "Spectral Gradient Orthogonalization Improves Differentially Private
Training at Scale"; its recovery condition is in its "Loss & Training" section
(see also docs/design.md, "Diagnostics"). For a layer viewed as an m × n
matrix, the release's noise N has i.i.d. entries of std s₀ = σC/D, so ::

    ‖N‖₂ ≈ s₀(√m + √n) = σC(√m+√n)/D              (Vershynin 2012, Cor. 5.35)
    SNR  = (σ₁(G) − σ₂(G)) · D / (σC(√m+√n))       (paper 1, Prop. 1)
    recovery threshold:  B > σ(B)·C(√m+√n) / (σ₁(G) − σ₂(G))

where G is the quantity the release averages: the mean CLIPPED per-example
gradient (its gap is far smaller than the unclipped gradient's). Newton–Schulz
acts on a momentum buffer whose per-entry noise std is s₀ times the exact
per-step factor of
:func:`dpmuon_jax.transforms.buffer_noise.buffer_noise_factor`; both levels are reported.

Two kinds of functions live here:

* PUBLIC ones (noise levels, buffer factors, thresholds from σ, C, D, shapes):
  functions of public settings only.
* NON-PRIVATE ones, prefixed ``nonprivate_``: they read a probe batch (training
  data beyond the releases). Their results are not covered by the privacy
  guarantee, are for analysis only and must never feed back into training;
  they take no keys and return fresh values, so training with or without them
  is bit-identical.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from dpmuon_jax.extras import pyplot
from dpmuon_jax.linalg.scaling import (
  DimensionNumbers,
  dimension_numbers_fn,
  matrix_view,
  path_names,
)
from dpmuon_jax.privacy.accounting import RDP, calibrate_noise_multiplier
from dpmuon_jax.privacy.clipping import Clipping
from dpmuon_jax.privacy.query import LossFn, clipped_sum, gradient_query
from dpmuon_jax.transforms.buffer_noise import DP_MUON_BUFFER, BufferSpec
from dpmuon_jax.transforms.routing import Routing, route_fn

PyTree = Any


# ------------------------------------------------------------------ public noise levels


def noise_edge(shape: tuple[int, int], noise_std: float) -> float:
  """s(√m + √n): the typical ‖N‖₂ (and the Marchenko–Pastur bulk edge) for entry std s."""
  m, n = shape
  return noise_std * (math.sqrt(m) + math.sqrt(n))


def noise_operator_norm(
    shape: tuple[int, int], noise_multiplier: float, l2_clip_norm: float, denominator: float,
    noise_factor: float = 1.0,
) -> float:
  """σC(√m+√n)/D, times ``noise_factor`` (e.g. a buffer factor) for a momentum buffer."""
  return noise_edge(shape, noise_factor * noise_multiplier * l2_clip_norm / denominator)


def snr(gap: float, shape: tuple[int, int], noise_multiplier: float, l2_clip_norm: float,
        denominator: float, noise_factor: float = 1.0) -> float:
  """(σ₁ − σ₂)·D/(σC(√m+√n)) (over ``noise_factor`` for a buffer); > 1 ⇔ above threshold."""
  edge = noise_operator_norm(shape, noise_multiplier, l2_clip_norm, denominator, noise_factor)
  return math.inf if edge == 0 else gap / edge


def threshold_batch_size_at_fixed_sigma(
    gap: float, shape: tuple[int, int], noise_multiplier: float, l2_clip_norm: float,
    noise_factor: float = 1.0,
) -> float:
  """σC(√m+√n)/(σ₁−σ₂) (× ``noise_factor``): paper 1's threshold if σ did not depend on B."""
  edge = noise_factor * noise_edge(shape, noise_multiplier * l2_clip_norm)
  return math.inf if gap <= 0 else edge / gap


class PrivacyBudget(NamedTuple):
  """Fixed ε, δ, dataset size N and epochs, for σ as a function of B.

  At batch size B: q = B/N, T = max(1, round(epochs·N/B)) steps, D = B, and
  σ(B) = :func:`dpmuon_jax.calibrate_noise_multiplier` (ε, δ, q, T).
  """

  target_epsilon: float
  target_delta: float
  dataset_size: int
  epochs: float
  accountant: str = RDP

  def steps(self, batch_size: int) -> int:
    return max(1, round(self.epochs * self.dataset_size / batch_size))

  def noise_multiplier(self, batch_size: int) -> float:
    return calibrate_noise_multiplier(
        self.target_epsilon, self.target_delta, batch_size / self.dataset_size,
        self.steps(batch_size), self.accountant,
    )


def recovery_threshold_batch_size(
    gap: float,
    shape: tuple[int, int],
    l2_clip_norm: float,
    budget: PrivacyBudget,
    noise_factor: float = 1.0,
    batch_sizes: Sequence[int] | None = None,
) -> int | None:
  """The smallest B with B > σ(B)·C(√m+√n)·f/(σ₁−σ₂) at fixed ε and epochs.

  σ(B) grows with B (q grows while T shrinks), so the condition is solved
  with the accountant in the loop. ``batch_sizes``: the smallest passing
  entry of this grid (sorted); ``None``: bisection over the integers in
  [1, N], which assumes B/σ(B) is increasing (it is for the subsampled
  Gaussian in practice: σ(B) grows like √B or slower). Returns ``None`` if no
  candidate passes. f = ``noise_factor`` (1 for the release, the buffer factor
  for what Newton–Schulz sees).
  """
  if gap <= 0:
    return None
  edge = noise_factor * noise_edge(shape, l2_clip_norm)
  passes = lambda b: b > budget.noise_multiplier(b) * edge / gap
  if batch_sizes is not None:
    return next((int(b) for b in sorted(batch_sizes) if passes(int(b))), None)
  low, high = 1, int(budget.dataset_size)
  if not passes(high):
    return None
  if passes(low):
    return low
  while high - low > 1:
    mid = (low + high) // 2
    low, high = (low, mid) if passes(mid) else (mid, high)
  return high


# ------------------------------------------------------------------ clean spectra (non-private)


class Spectrum(NamedTuple):
  """Summary of one clean matrix G (from probe data: NON-PRIVATE)."""

  sigma1: float
  sigma2: float
  gap: float  # σ₁ − σ₂
  effective_rank: float  # exp(entropy of σ_k/Σσ_j)  (Roy & Vetterli 2007)
  stable_rank: float  # ‖G‖_F² / σ₁²
  signal_energy: float  # ‖G‖_F²
  top_energy_fraction: float  # σ₁²/‖G‖_F²


def spectrum_summary(singular_values: np.ndarray) -> Spectrum:
  """:class:`Spectrum` of a matrix from its singular values (descending)."""
  s = np.sort(np.asarray(singular_values, np.float64))[::-1]
  s2 = s[1] if s.size > 1 else 0.0
  energy = float(np.sum(s**2))
  if energy == 0:
    return Spectrum(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
  p = s / s.sum()
  p = p[p > 0]
  return Spectrum(
      sigma1=float(s[0]), sigma2=float(s2), gap=float(s[0] - s2),
      effective_rank=float(np.exp(-np.sum(p * np.log(p)))),
      stable_rank=energy / float(s[0]) ** 2, signal_energy=energy,
      top_energy_fraction=float(s[0]) ** 2 / energy,
  )


def nonprivate_mean_clipped_gradient(
    loss_fn: LossFn, params: PyTree, probe_batch: PyTree, clipping: Clipping | float,
    microbatch_size: int | None = None,
) -> PyTree:
  """NON-PRIVATE: (1/B_probe) Σ_i clip_C(∇ℓ(θ; x_i)) over a probe batch.

  The quantity the release averages (its expectation under Poisson sampling
  with D = qN), computed with the library's clipping code. Reads data beyond
  the releases: for analysis only, never for training.
  """
  total = clipped_sum(gradient_query(loss_fn), params, probe_batch, None, clipping,
                      microbatch_size)
  size = jax.tree.leaves(probe_batch)[0].shape[0]
  return jax.tree.map(lambda x: np.asarray(x, np.float64) / size, total.total)


class LayerDiagnostics(NamedTuple):
  """One row of :func:`nonprivate_layer_report` (one matrix of one layer)."""

  path: str
  shape: tuple[int, int]  # (fan_in, fan_out)
  spectrum: Spectrum  # of the mean clipped probe gradient (NON-PRIVATE)
  noise_norm: float  # σC(√m+√n)/D of the release
  buffer_noise_norm: float  # the same for the buffer NS sees, at ``step``
  snr: float  # gap / noise_norm
  buffer_snr: float  # gap / buffer_noise_norm
  threshold_batch_size: float  # σC(√m+√n)/gap at this σ (release)
  above_threshold: bool  # snr > 1: D > threshold_batch_size
  buffer_above_threshold: bool  # buffer_snr > 1
  recovery_batch_size: int | None  # solved with σ(B) at fixed ε, epochs (if a budget is given)


def _matrices(tree: PyTree, routing: Routing, dimension_numbers: DimensionNumbers):
  """(path string, index, matrix) for every matrix of every routed rank ≥ 2 leaf."""
  route, spec_fn = route_fn(routing), dimension_numbers_fn(dimension_numbers)
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    names = path_names(path)
    if np.ndim(leaf) < 2 or not route(names, leaf):
      continue
    view = matrix_view(np.shape(leaf), spec_fn(names, leaf))
    mats = np.asarray(view.to_matrices(np.asarray(leaf)))
    for k, mat in enumerate(mats):
      yield "/".join(names) + (f"[{k}]" if view.batch > 1 else ""), mat


def nonprivate_layer_report(
    loss_fn: LossFn,
    params: PyTree,
    probe_batch: PyTree,
    clipping: Clipping | float,
    noise_multiplier: float,
    denominator: float,
    buffer: BufferSpec = DP_MUON_BUFFER,
    step: float = math.inf,
    budget: PrivacyBudget | None = None,
    routing: Routing = "paper1",
    dimension_numbers: DimensionNumbers = None,
    microbatch_size: int | None = None,
) -> list[LayerDiagnostics]:
  """NON-PRIVATE: "which layers are above threshold at this batch size".

  Per matrix of every routed layer: the spectrum of the mean clipped probe
  gradient G, the release noise norm σC(√m+√n)/D, the buffer's (factor at
  release ``step``; default the steady state), both SNRs, and, given a
  ``budget``, the recovery-threshold batch size with σ(B) (for the buffer NS
  sees). Reads a probe batch: analysis only. Format with :func:`format_report`.
  """
  clipping_norm = clipping.l2_clip_norm if isinstance(clipping, Clipping) else float(clipping)
  mean = nonprivate_mean_clipped_gradient(loss_fn, params, probe_batch, clipping, microbatch_size)
  factor = float(buffer.factor(step)) if not math.isinf(step) else buffer.steady_state_factor()
  rows = []
  for name, mat in _matrices(mean, routing, dimension_numbers):
    spec = spectrum_summary(np.linalg.svd(mat, compute_uv=False))
    shape = tuple(mat.shape)
    release = noise_operator_norm(shape, noise_multiplier, clipping_norm, denominator)
    buffered = factor * release
    recovery = None
    if budget is not None:
      recovery = recovery_threshold_batch_size(spec.gap, shape, clipping_norm, budget, factor)
    rows.append(LayerDiagnostics(
        path=name, shape=shape, spectrum=spec, noise_norm=release, buffer_noise_norm=buffered,
        snr=spec.gap / release if release else math.inf,
        buffer_snr=spec.gap / buffered if buffered else math.inf,
        threshold_batch_size=threshold_batch_size_at_fixed_sigma(
            spec.gap, shape, noise_multiplier, clipping_norm),
        above_threshold=spec.gap > release, buffer_above_threshold=spec.gap > buffered,
        recovery_batch_size=recovery,
    ))
  return rows


def format_report(rows: Sequence[LayerDiagnostics]) -> str:
  """A fixed-width text table of :func:`nonprivate_layer_report` rows."""
  header = ("layer", "m×n", "σ₁−σ₂", "eff.rank", "‖G‖_F²", "‖N‖₂", "‖N_buf‖₂", "SNR",
            "SNR_buf", "B*(σ)", "B*(σ(B))", "above")
  body = []
  for r in rows:
    body.append((
        r.path, f"{r.shape[0]}×{r.shape[1]}", f"{r.spectrum.gap:.3g}",
        f"{r.spectrum.effective_rank:.1f}", f"{r.spectrum.signal_energy:.3g}",
        f"{r.noise_norm:.3g}", f"{r.buffer_noise_norm:.3g}", f"{r.snr:.3g}", f"{r.buffer_snr:.3g}",
        f"{r.threshold_batch_size:.4g}", "-" if r.recovery_batch_size is None
        else str(r.recovery_batch_size),
        ("yes" if r.above_threshold else "no") + ("/yes" if r.buffer_above_threshold else "/no"),
    ))
  widths = [max(len(str(c)) for c in col) for col in zip(header, *body)]
  line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()
  above = sum(r.above_threshold for r in rows)
  foot = f"{above}/{len(rows)} matrices above threshold (release); " \
         f"{sum(r.buffer_above_threshold for r in rows)}/{len(rows)} for the buffer NS sees."
  return "\n".join([line(header), line(["-" * w for w in widths])] + [line(b) for b in body]
                   + [foot])


def plot_spectrum(
    matrix: np.ndarray,
    noise_std: float,
    path: str,
    clean_singular_values: np.ndarray | None = None,
    title: str | None = None,
    bins: int = 60,
) -> str:
  """Saves a PNG: eigenvalues of X Xᵀ/(n s²) for ``matrix`` X (m ≤ n after transposing)
  against the Marchenko–Pastur density of ratio β = m/n, with the bulk edge
  (1+√β)² and, if given, the clean singular values on the same scale.

  Needs matplotlib (the ``train`` extra). Returns ``path``.
  """
  plt = pyplot("plot_spectrum")
  from dpmuon_jax.transforms.shrinkage import marchenko_pastur_density

  x = np.asarray(matrix, np.float64)
  m, n = sorted(x.shape)
  beta = m / n
  eig = np.linalg.svd(x, compute_uv=False) ** 2 / (n * noise_std**2)
  grid = np.linspace(max((1 - math.sqrt(beta)) ** 2, 1e-6), (1 + math.sqrt(beta)) ** 2, 400)
  fig, ax = plt.subplots(figsize=(6, 4))
  ax.hist(eig, bins=bins, density=True, alpha=0.5, label="release / buffer")
  ax.plot(grid, marchenko_pastur_density(grid, beta), "k-", label=f"Marchenko–Pastur β={beta:.2g}")
  ax.axvline((1 + math.sqrt(beta)) ** 2, color="k", ls="--", lw=0.8, label="bulk edge")
  if clean_singular_values is not None:
    for k, s in enumerate(np.asarray(clean_singular_values, np.float64)[:10]):
      ax.axvline(s**2 / (n * noise_std**2), color="r", lw=0.8,
                 label="clean σ_k²/(n s²)" if k == 0 else None)
  ax.set_xlabel("eigenvalue of X Xᵀ / (n s²)")
  ax.set_ylabel("density")
  ax.set_title(title or f"{x.shape[0]}×{x.shape[1]}")
  ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path
