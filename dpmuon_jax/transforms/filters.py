"""Temporal filters on the release: DiSK's Kalman filter and DOPPLER's IIR low-pass.

Both are post-processing of the releases G̃_0, G̃_1, … (no privacy cost) and
act elementwise on the whole parameter tree. Chain them right after the
release (:func:`dpmuon_jax.privatize`) and before the optimizer they feed.

DiSK (Zhang et al., ICLR 2025, arXiv 2410.03883, §3)::

    g_t = (1−κ) g_{t−1} + κ G̃_t,        g_0 = G̃_0            (:func:`kalman_filter`)

Any κ in (0, 2] (the DiSK authors' code default κ = 1.5 extrapolates); outside
it abs(1−κ) > 1 and g_t grows geometrically. DiSK also
changes the per-example query: it needs the update d_t applied at the previous
step, which :func:`record_applied_update`, the LAST transform of the chain,
keeps (see :mod:`dpmuon_jax.privacy.disk_query`).

DOPPLER (Zhang et al., NeurIPS 2024, arXiv 2408.13460, §3),
``scipy.signal.lfilter``'s sign convention, with the initialisation-bias
correction c_t of the authors' code, which sums b_j only over the inputs that
exist (j ≤ t): the exact normaliser when G̃_{<0} = 0::

    m_t = −Σ_{i≥1} a_i m_{t−i} + Σ_{j≥0} b_j G̃_{t−j}           (m_{<0} = G̃_{<0} = 0)
    c_t = −Σ_{i≥1} a_i c_{t−i} + Σ_{0≤j≤min(t, n_b)} b_j          (c_{<0} = 0)
    m̂_t = m_t / c_t                                              (:func:`low_pass_filter`)

The state keeps the un-normalised m (as the code does), not m̂. With
a = [1, −β], b = [1−β] this is the EMA with Adam's bias correction 1 − β^{t+1}.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dpmuon_jax import checks

PyTree = Any


class LowPassCoefficients(NamedTuple):
  """Filter coefficients (a, b) in ``scipy.signal.lfilter``'s convention."""

  a: tuple[float, ...]
  b: tuple[float, ...]


DOPPLER_PRESETS: dict[str, LowPassCoefficients] = {
    # Paper 1's DOPPLER-SGD / DOPPLER-Muon "EMA β = 0.9"; DP-PMLF's default (a9b1.csv).
    "ema0.9": LowPassCoefficients((1.0, -0.9), (0.1,)),
    # The published coefficient files of DP-PMLF (github.com/Philosophy3290/DP-PMLF
    # @8329d3b, coefs/*.csv).
    "a9b0505": LowPassCoefficients((1.0, -0.9), (0.05, 0.05)),
    "a9b1505": LowPassCoefficients((1.0, -0.9), (0.15, -0.05)),
    "ema0.6": LowPassCoefficients((1.0, -0.6), (0.4,)),  # a6b4.csv
    "a6b0202": LowPassCoefficients((1.0, -0.6), (0.2, 0.2)),
    "a6b0501": LowPassCoefficients((1.0, -0.6), (0.5, -0.1)),
    "a72b0505": LowPassCoefficients((1.0, -0.7, -0.2), (0.05, 0.05)),
    # The DOPPLER author's LPSGD.py default (KalmanDP): 2nd-order IIR, DC gain 0.316.
    "lpsgd": LowPassCoefficients(
        (1.0, -1.98342955, 0.98549544), (0.00016332, 0.00032665, 0.00016332)
    ),
}
"""DOPPLER coefficient sets. The DOPPLER paper's own tables were not found."""


# ------------------------------------------------------------------------------------ DiSK filter


class KalmanFilterState(NamedTuple):
  """DiSK's filtered gradient g_{t−1} (tree like the parameters) and the step count."""

  count: jax.Array  # int32
  filtered: PyTree


def kalman_filter(kappa: float) -> optax.GradientTransformation:
  """DiSK's fixed-gain Kalman correction g_t = (1−κ) g_{t−1} + κ G̃_t, g_0 = G̃_0.

  Args:
    kappa: the gain κ in (0, 2] (DiSK paper: 0.7; the DiSK authors' code
      default 1.5 gives g_t = 1.5 G̃_t − 0.5 g_{t−1}). Outside it the pole
      1 − κ lies outside the unit circle and g_t diverges.

  Returns:
    An ``optax.GradientTransformation``; outputs have the updates' dtypes.

  Its gain at frequency ω is κ / abs(1 − (1−κ)e^{−iω}): 1 at ω = 0, so a constant
  input passes unchanged and a learning rate after it is on plain SGD's
  scale; κ/(2−κ) at ω = π. White release noise leaves with its variance
  multiplied by κ/(2−κ): 0.54 at κ = 0.7 (a low-pass), 3 at κ = 1.5, where
  1 − κ < 0 makes the filter alternate in sign and amplify the noise.
  """
  kappa = checks.check_in_range("kappa", kappa, 0.0, 2.0, low_inclusive=False)

  def init_fn(params):
    return KalmanFilterState(jnp.zeros((), jnp.int32), optax.tree.zeros_like(params))

  def update_fn(updates, state, params=None):
    del params
    first = state.count == 0

    def leaf(g_prev, g_new):
      g = (1.0 - kappa) * g_prev.astype(jnp.float32) + kappa * g_new.astype(jnp.float32)
      return jnp.where(first, g_new.astype(jnp.float32), g).astype(g_new.dtype)

    filtered = jax.tree.map(leaf, state.filtered, updates)
    new_state = KalmanFilterState(
        optax.safe_increment(state.count),  # pyright: ignore[reportArgumentType]
        jax.tree.map(lambda f, s: f.astype(s.dtype), filtered, state.filtered),
    )
    return filtered, new_state

  return optax.GradientTransformation(init_fn, update_fn)


class AppliedUpdateState(NamedTuple):
  """The update d_t output by the previous step (DiSK's ``kf_d_t``); zeros before step 1.

  :func:`applied_update` finds this state by its type inside the optimizer
  state, so a DiSK optimizer must hold exactly one.
  """

  applied_update: PyTree


def record_applied_update() -> optax.GradientTransformation:
  """Passes the updates through and keeps them as d_{t+1} for DiSK's next query.

  Put it LAST in the chain (after the learning rate and weight decay), so it
  records the update ``optax.apply_updates`` then applies: θ_{t+1} = θ_t + d_{t+1}.
  """

  def init_fn(params):
    return AppliedUpdateState(optax.tree.zeros_like(params))

  def update_fn(updates, state, params=None):
    del params
    recorded = jax.tree.map(lambda u, d: u.astype(d.dtype), updates, state.applied_update)
    return updates, AppliedUpdateState(recorded)

  return optax.GradientTransformation(init_fn, update_fn)


def applied_update(opt_state: Any) -> PyTree:
  """d_t: the tree of the (unique) :class:`AppliedUpdateState` inside ``opt_state``.

  DiSK's query (:mod:`dpmuon_jax.privacy.disk_query`) evaluates the gradient at
  θ_t + γ d_t; this reads d_t from the optimizer's post-processing state.
  """
  found = [
      node
      for node in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, AppliedUpdateState))
      if isinstance(node, AppliedUpdateState)
  ]
  if len(found) != 1:
    raise ValueError(
        f"DiSK's query needs exactly one AppliedUpdateState in the optimizer state, found "
        f"{len(found)}; put record_applied_update() last in the post-processing chain."
    )
  return found[0].applied_update


# ---------------------------------------------------------------------------------- DOPPLER filter


class LowPassFilterState(NamedTuple):
  """DOPPLER's filter memory, most recent first.

  Attributes:
    count: number of inputs seen (int32).
    outputs: (m_{t−1}, …, m_{t−n_a}), the UN-normalised outputs.
    inputs: (G̃_{t−1}, …, G̃_{t−n_b}).
    normalisers: (c_{t−1}, …, c_{t−n_a}), float32 of shape (n_a,).
  """

  count: jax.Array
  outputs: tuple[PyTree, ...]
  inputs: tuple[PyTree, ...]
  normalisers: jax.Array


def _normalised_coefficients(
    a: Sequence[float] | np.ndarray, b: Sequence[float] | np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
  a = np.asarray(a, np.float64).reshape(-1)
  b = np.asarray(b, np.float64).reshape(-1)
  if a.size == 0 or b.size == 0:
    raise ValueError("a and b need at least one coefficient each.")
  if not (np.all(np.isfinite(a)) and np.all(np.isfinite(b))):
    raise ValueError(f"Coefficients must be finite, got a={a.tolist()}, b={b.tolist()}.")
  if a[0] == 0:
    raise ValueError("a[0] must be non-zero (lfilter divides a and b by it).")
  poles = np.abs(np.roots(a)) if a.size > 1 else np.zeros(0)
  if np.any(poles > 1.0 + 1e-9):
    raise ValueError(
        f"a must give poles in the closed unit disk (a stable filter), got a={a.tolist()} "
        f"with a pole of modulus {poles.max():.6g}."
    )
  return a / a[0], b / a[0]


def _push(tree: PyTree, history: tuple[PyTree, ...]) -> tuple[PyTree, ...]:
  """(tree, h_0, …, h_{n−2}): the newest entry first, cast to the history's dtypes."""
  if not history:
    return ()
  newest = jax.tree.map(lambda x, h: x.astype(h.dtype), tree, history[0])
  return ((newest,) + history)[: len(history)]


def low_pass_filter(
    a: Sequence[float] | np.ndarray = DOPPLER_PRESETS["ema0.9"].a,
    b: Sequence[float] | np.ndarray = DOPPLER_PRESETS["ema0.9"].b,
    bias_correction: bool = True,
) -> optax.GradientTransformation:
  """DOPPLER's IIR low-pass filter m_t (output m̂_t = m_t / c_t with bias correction).

  Args:
    a: feedback coefficients [a_0, a_1, …, a_{n_a}] in ``scipy.signal.lfilter``'s
      convention (m_t = −Σ_{i≥1} a_i m_{t−i} + …); like lfilter, a and b are
      divided by a_0. Default: paper 1's EMA(0.9), a = [1, −0.9]. The poles
      (roots of a) must lie in the closed unit disk: otherwise m_t diverges.
    b: feedforward coefficients [b_0, …, b_{n_b}]. Default [0.1].
    bias_correction: divide by c_t, the filter's response to a constant 1
      since step 0 (so a constant input is returned unchanged from the first
      step on). Needs b_0 ≠ 0 (c_0 = b_0).

  Returns:
    An ``optax.GradientTransformation``; memory n_a + n_b trees like the
    parameters. See :data:`DOPPLER_PRESETS` for published (a, b).
  """
  a, b = _normalised_coefficients(a, b)
  if bias_correction and b[0] == 0:
    raise ValueError("bias_correction needs b[0] != 0, since c_0 = b_0.")
  feedback = [float(x) for x in a[1:]]
  feedforward = [float(x) for x in b]
  cumulative_b = jnp.asarray(np.cumsum(b), jnp.float32)  # Σ_{j≤k} b_j for k = 0..n_b
  num_out, num_in = len(feedback), len(feedforward) - 1

  def init_fn(params):
    zeros = optax.tree.zeros_like(params)
    return LowPassFilterState(
        jnp.zeros((), jnp.int32),
        (zeros,) * num_out,
        (zeros,) * num_in,
        jnp.zeros((num_out,), jnp.float32),
    )

  def update_fn(updates, state, params=None):
    del params

    def leaf(g, *history):
      past_m, past_g = history[:num_out], history[num_out:]
      m = feedforward[0] * g.astype(jnp.float32)
      for coeff, x in zip(feedforward[1:], past_g, strict=True):
        m = m + coeff * x.astype(jnp.float32)
      for coeff, x in zip(feedback, past_m, strict=True):
        m = m - coeff * x.astype(jnp.float32)
      return m

    m = jax.tree.map(leaf, updates, *state.outputs, *state.inputs)
    c = cumulative_b[jnp.minimum(state.count, num_in)]
    for i, coeff in enumerate(feedback):
      c = c - coeff * state.normalisers[i]
    scale = 1.0 / c if bias_correction else 1.0
    out = jax.tree.map(lambda x, g: (scale * x).astype(g.dtype), m, updates)
    new_state = LowPassFilterState(
        optax.safe_increment(state.count),  # pyright: ignore[reportArgumentType]
        _push(m, state.outputs),
        _push(updates, state.inputs),
        jnp.concatenate([c[None], state.normalisers])[:num_out],
    )
    return out, new_state

  return optax.GradientTransformation(init_fn, update_fn)
