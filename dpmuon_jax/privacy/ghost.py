"""Ghost clipping: the clipped sum of per-example gradients without per-example gradients.

The same sum S = Σ_i mask_i · clip_C(∇ℓ_i(θ)) as :func:`~dpmuon_jax.privacy.query.clipped_sum`
with :func:`~dpmuon_jax.privacy.query.gradient_query`, from ONE forward and ONE
backward pass of the batch (Li et al. 2021, "Large Language Models Can Be
Strong Differentially Private Learners", §4, ghost clipping; Bu et al. 2023,
"Differentially Private Optimization on Large Model at Small Cost", §3,
book-keeping).

Layers that use a parameter as ``y = a · W`` (dense, patch convolution,
embedding lookup, tied head) report each use to the active *tape* with
:func:`tap`: the tape records the input a and adds a zero perturbation z to the
output y. The gradient of Σ_i ℓ_i w.r.t. z is every example's output gradient
g = ∂ℓ_i/∂y (examples are independent). One use contributes the per-example
gradient G = Σ_t a_t g_tᵀ = Aᵀ G_out (rows t = positions), and ::

    ‖Aᵀ G_out‖_F² = Σ_{t,s} (a_t·a_s)(g_t·g_s)                  (the T×T Gram trick)

computed from the Grams when T² ≤ d_in·d_out, else from AᵀG_out directly (Li
et al., §4). Either way the norm each example is clipped by is an upper bound
that float32 rounding cannot push below the norm of the vector summed
(:func:`factor_sq_norm`): the Gram's N² terms can cancel, and an example built
to make them cancel must not be clipped too little. A bias is the use with
a_t = 1; an embedding lookup has a_t = onehot(x_t), so a_t·a_s = [x_t = x_s];
the tied head ``h · Eᵀ`` contributes Zᵀ H to the table E (Z: the logit
gradients). A parameter with
several uses has G = Σ_u G_u and ‖G‖² = Σ_{u,v} ⟨G_u, G_v⟩, each a sum of
products of cross Grams (for the tied embedding, ⟨onehot(x)ᵀE_out, ZᵀH⟩ =
Σ_{t,s} Z[s, x_t] (e_t·h_s)). Every parameter no tap reports (norm scales and
biases, anything in an untapped layer) gets its exact per-example gradient,
through a zero per-example copy of that parameter only.

The clip factors f_i come from :meth:`~dpmuon_jax.privacy.clipping.Clipping.factors`
(flat, per-layer or automatic clipping; the secure-noise grid is refused), and
S is assembled by book-keeping from the SAME factors whose norms were taken:
Σ_i f_i G_{i,u} = (f ⊙ A)ᵀ G_out per use. Each example's contribution is
therefore f_i · (the vector whose norm was computed), of norm ≤ C, whatever the
taps saw: a use of a parameter that no tap reports would make the sum differ
from the gradient, never exceed the sensitivity (the tests check both).

A query of several gradient terms, q_i = Σ_k w_k ∇ℓ(θ_k; x_i) (DiSK's two
points, inner momentum's K + 1 states), is clipped as one vector. Its terms
run one after the other in a ``lax.scan``; per parameter, either every term's
factors are kept and the norm takes the cross terms between states from the
Gram of all their rows, or the per-example gradient Σ_k w_k G_{i,k} is summed
term by term (its memory does not grow with the number of terms), whichever
takes less memory (:func:`accumulates_per_example`). The sum is then
Σ_i f_i q_{i,l} from the same factors or the same accumulated gradients.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from dpmuon_jax.privacy.clipping import Clipping, as_clipping
from dpmuon_jax.privacy.query import (
    GRADIENT_QUERY,
    ClippedSum,
    GradientTerm,
    LossFn,
    _sum_over_chunks,
    add_batch_axis,
    clipped_sum_from_norms,
    pad_to_multiple,
    stack_terms,
)

PyTree = Any
Path = tuple[Any, ...]
KINDS = ("dense", "embed", "attend")


class Site(NamedTuple):
  """One tapped use: ``kind`` and the paths of the parameters it uses.

  ``dense``: y = a · K (+ b), params (kernel path, bias path or None), a the
  (…, d_in) input, K reshaped to (d_in, d_out) (a patch convolution's kernel
  ``(*window, C_in, C_out)`` with a its image patches). ``embed``: y = E[x],
  params (table path,), a the integer ids. ``attend``: y = h · Eᵀ, params
  (table path,), a = h.
  """

  kind: str
  params: tuple[Path | None, ...]


class _Tape:
  """Records the tapped uses of one trace; ``taps is None`` only discovers them."""

  def __init__(self, taps: dict[str, jax.Array] | None):
    self.taps = taps
    self.sites: dict[str, Site] = {}
    self.inputs: dict[str, jax.Array] = {}
    self.outputs: dict[str, jax.ShapeDtypeStruct] = {}

  def record(self, site: Site, inputs: jax.Array, output: jax.Array) -> jax.Array:
    stem = f"{site.kind}:{'/'.join(map(str, site.params[0] or ()))}"
    name = f"{stem}#{sum(key.startswith(stem + '#') for key in self.sites)}"
    self.sites[name] = site
    self.inputs[name] = inputs
    if self.taps is None:
      self.outputs[name] = jax.ShapeDtypeStruct(jnp.shape(output), jnp.result_type(output))
      return output
    return output + self.taps[name]


_ACTIVE: list[_Tape] = []


@contextlib.contextmanager
def _recording(tape: _Tape) -> Iterator[_Tape]:
  _ACTIVE.append(tape)
  try:
    yield tape
  finally:
    _ACTIVE.pop()


def tap(kind: str, params: tuple[Path | None, ...], inputs: jax.Array, output: jax.Array
        ) -> jax.Array:
  """Reports one use of ``params`` (see :class:`Site`) and returns its output.

  Outside a ghost computation this is the identity on ``output``; inside, it
  records ``inputs`` and adds the zero perturbation whose gradient is ∂ℓ_i/∂y.
  Tapped layers call it at trace time (:mod:`dpmuon_jax.models.taps`).
  """
  if kind not in KINDS:
    raise ValueError(f"tap kind must be one of {KINDS}, got {kind!r}.")
  if not _ACTIVE:
    return output
  return _ACTIVE[-1].record(Site(kind, tuple(params)), inputs, output)


# ------------------------------------------------------------------ parameters by path


def _key(entry: Any) -> Any:
  for attr in ("key", "idx", "name"):
    if hasattr(entry, attr):
      return getattr(entry, attr)
  raise TypeError(f"Unsupported pytree path entry {entry!r}.")


def _flat_params(params: PyTree) -> tuple[dict[Path, jax.Array], Any]:
  leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
  return {tuple(_key(e) for e in path): leaf for path, leaf in leaves}, treedef


def _name(path: Path) -> str:
  return "/".join(map(str, path))


class GhostCoverage(NamedTuple):
  """Which parameters get ghost norms and which exact per-example gradients.

  ``accumulated``: the covered parameters for which a query of several terms
  keeps the per-example gradient summed over its terms instead of every term's
  factors (:func:`accumulates_per_example`); empty for one term.
  """

  ghost: tuple[Path, ...]
  exact: tuple[Path, ...]
  accumulated: tuple[Path, ...] = ()


def _per_example_loss(loss_fn: LossFn, flat: dict[Path, jax.Array], treedef: Any):
  """(taps, deltas, example) -> (ℓ(θ + δ; x), recorded inputs), one example, under a tape."""
  paths = list(flat)

  def run(taps, deltas, example, tape: _Tape | None = None):
    tape = _Tape(taps) if tape is None else tape
    leaves = [flat[p] + deltas[_name(p)] if _name(p) in deltas else flat[p] for p in paths]
    with _recording(tape):
      loss = loss_fn(jax.tree_util.tree_unflatten(treedef, leaves), add_batch_axis(example))
    return jnp.asarray(loss, jnp.float32), tape.inputs

  return run


def _discover(loss_fn: LossFn, params: PyTree, example: PyTree) -> _Tape:
  flat, treedef = _flat_params(params)
  tape = _Tape(None)
  jax.eval_shape(lambda p, ex: _per_example_loss(loss_fn, flat, treedef)({}, {}, ex, tape)[0],
                 params, example)
  tape.inputs = {}
  unknown = {p for s in tape.sites.values() for p in s.params if p is not None} - set(flat)
  if unknown:
    raise ValueError(f"Tapped layers name parameters missing from params: {sorted(unknown)}.")
  return tape


def ghost_coverage(loss_fn: LossFn, params: PyTree, example: PyTree, num_terms: int = 1
                   ) -> GhostCoverage:
  """The parameters that tapped layers cover, and the others (exact per-example gradients).

  ``example`` is one example (no batch axis); ``num_terms`` the number of
  gradient terms of the query (1 for the gradient, 2 for DiSK's, K + 1 for
  inner momentum's), which decides :attr:`GhostCoverage.accumulated`.
  """
  flat, _ = _flat_params(params)
  tape = _discover(loss_fn, params, example)
  covered = {p for s in tape.sites.values() for p in s.params}
  accumulated: set[Path] = set()
  if num_terms > 1:
    factors = _factor_shapes(loss_fn, params, add_batch_axis(example), tape)
    accumulated = {p for p, fs in factors.items() if accumulates_per_example(fs, num_terms)}
  return GhostCoverage(tuple(p for p in flat if p in covered),
                       tuple(p for p in flat if p not in covered),
                       tuple(p for p in flat if p in accumulated))


# ------------------------------------------------------------------ factors and their norms


class Factor(NamedTuple):
  """One use's per-example gradient G_i = reshape(L_iᵀ R_i), batched over examples.

  ``left`` (B, N, p) floats, or (B, N) ints standing for onehot rows of width
  ``width`` (an embedding lookup); ``right`` (B, N, q).
  """

  left: jax.Array
  right: jax.Array
  width: int


def _rows(x: jax.Array, batch: int, features: bool = True) -> jax.Array:
  return x.reshape((batch, -1, x.shape[-1]) if features else (batch, -1))


def _path(path: Path | None) -> Path:
  if path is None:
    raise ValueError("A tapped use needs the path of its weight.")
  return path


def _site_factors(site: Site, inputs: jax.Array, grad: jax.Array, shapes: dict[Path, tuple]
                  ) -> list[tuple[Path, Factor]]:
  """The (parameter, factor) pairs of one tapped use, from its input and output gradient."""
  b = grad.shape[0]
  g = _rows(grad.astype(jnp.float32), b)
  weight = _path(site.params[0])
  if site.kind == "embed":  # ids as the lookup reads them: -1 is row V - 1
    vocab = shapes[weight][0]
    ids = _rows(inputs, b, features=False)
    return [(weight, Factor(jnp.where(ids < 0, ids + vocab, ids), g, vocab))]
  a = _rows(inputs.astype(jnp.float32), b)
  if site.kind == "attend":
    return [(weight, Factor(g, a, g.shape[-1]))]
  out = [(weight, Factor(a, g, a.shape[-1]))]
  if len(site.params) > 1 and site.params[1] is not None:
    out.append((site.params[1], Factor(jnp.ones(g.shape[:2] + (1,), jnp.float32), g, 1)))
  return out


def _is_ids(f: Factor) -> bool:
  return f.left.ndim == 2


_HIGHEST = jax.lax.Precision.HIGHEST  # float32 products on GPU (not TF32) and TPU (not bf16)
_BLOCK = 256  # features per partial Gram
_ROUNDOFF = 2.0 ** -24  # float32's unit roundoff u


def _gram(x: jax.Array, y: jax.Array) -> jax.Array:
  """(B, N, p), (B, M, p) → (B, N, M) inner products x_t·y_s, from partial Grams of at most
  ``_BLOCK`` features added in order (a ``lax.scan``), so each entry errs by at most
  (``_dot_error(p)``)·u·Σ_k abs(x_tk y_sk), whatever order the backend sums a dot in."""
  dot = lambda a, b: jnp.einsum("bnp,bmp->bnm", a, b, precision=_HIGHEST)
  p = x.shape[-1]
  if p <= _BLOCK:
    return dot(x, y)
  blocks = -(-p // _BLOCK)
  padded = lambda a: jnp.pad(a, [(0, 0), (0, 0), (0, blocks * _BLOCK - p)])
  split = lambda a: jnp.moveaxis(padded(a).reshape(a.shape[:2] + (blocks, _BLOCK)), 2, 0)
  zeros = jnp.zeros(x.shape[:2] + y.shape[1:2], jnp.float32)
  return jax.lax.scan(lambda acc, xy: (acc + dot(*xy), None), zeros, (split(x), split(y)))[0]


def _dot_error(width: int) -> int:
  """The roundings one entry of :func:`_gram` of ``width`` features can accumulate: a dot of
  at most ``_BLOCK`` products, then one addition per further block."""
  return min(width, _BLOCK) + -(-width // _BLOCK)


_LEAF = 16  # terms summed in any order before the pairwise additions


def _pairwise_sum(x: jax.Array) -> jax.Array:
  """Σ over every axis but the first: sums of ``_LEAF`` terms, then halving, so each
  total errs by at most ``_sum_error(n)``·u·Σ abs(x) (slices and additions XLA keeps as
  written)."""
  x = x.reshape(x.shape[0], -1)
  size = _LEAF << max(0, (-(-x.shape[1] // _LEAF) - 1).bit_length())
  x = jnp.sum(jnp.pad(x, [(0, 0), (0, size - x.shape[1])]).reshape(x.shape[0], -1, _LEAF),
              axis=-1)
  while x.shape[1] > 1:
    x = x[:, : x.shape[1] // 2] + x[:, x.shape[1] // 2:]
  return x[:, 0]


def _sum_error(n: int) -> int:
  """The roundings one total of :func:`_pairwise_sum` over ``n`` terms can accumulate."""
  return _LEAF + max(0, (-(-n // _LEAF) - 1).bit_length())


def _left_gram(u: Factor, v: Factor) -> jax.Array:
  """(B, N_u, N_v) inner products of the left rows (onehot rows stay implicit; exact)."""
  if _is_ids(u) and _is_ids(v):
    return (u.left[:, :, None] == v.left[:, None, :]).astype(jnp.float32)
  if _is_ids(u):  # onehot(x_t) · l_s = l_s[x_t]
    return jax.vmap(lambda ids, dense: jnp.take(dense, ids, axis=1).T)(u.left, v.left)
  if _is_ids(v):
    return jnp.swapaxes(_left_gram(v, u), 1, 2)
  return _gram(u.left, v.left)


def _pair(u: Factor, v: Factor) -> jax.Array:
  """⟨G_u, G_v⟩ per example = Σ_{t,s} (l_t·l_s)(r_t·r_s)."""
  return _pairwise_sum(_left_gram(u, v) * _gram(u.right, v.right))


def _self_pair(f: Factor) -> tuple[jax.Array, jax.Array]:
  """‖G_f‖² per example by the Gram form, and Σ_t ‖l_t‖‖r_t‖ from the Grams' diagonals
  (sums of squares: no cancellation)."""
  left, right = _left_gram(f, f), _gram(f.right, f.right)
  rows = jnp.sqrt(jnp.maximum(jnp.diagonal(left, axis1=1, axis2=2), 0.0)
                  * jnp.maximum(jnp.diagonal(right, axis1=1, axis2=2), 0.0))
  return _pairwise_sum(left * right), jnp.sum(rows, axis=1)


def _dense_grad(f: Factor) -> jax.Array:
  return jnp.einsum("bnp,bnq->bpq", f.left, f.right, precision=_HIGHEST)


def _stacked(uses: list[Factor]) -> list[Factor]:
  """The uses of one parameter with rows stacked, Σ_u L_uᵀR_u = [L_1; L_2; …]ᵀ[R_1; R_2; …]:
  one factor of dense rows and one of onehot rows (at most two)."""
  if len({(f.width, f.right.shape[-1]) for f in uses}) != 1:
    raise ValueError("All uses of one parameter must have the same (d_in, d_out) layout.")
  out = []
  for group in ([f for f in uses if not _is_ids(f)], [f for f in uses if _is_ids(f)]):
    if group:
      out.append(Factor(jnp.concatenate([f.left for f in group], axis=1),
                        jnp.concatenate([f.right for f in group], axis=1), group[0].width))
  return out


def factor_sq_norm(uses: list[Factor]) -> jax.Array:
  """An upper bound on ‖Σ_u G_u‖_F² per example, (B,), that float32 rounding cannot
  push below the norm of the vector summed.

  The Gram form Σ_{t,s} (l_t·l_s)(r_t·r_s) (Li et al., §4) adds N² signed terms that
  can be far larger than their sum: an example built to make them cancel gets a
  float32 Gram far below its norm and would be clipped too little. A sum of n
  products errs by at most n·u·Σ abs(products) (to first order; Higham, "Accuracy and
  Stability of Numerical Algorithms", §3.1), and Σ_{t,s} Σ_k abs(l_tk l_sk) Σ_j abs(r_tj r_sj)
  ≤ W = (Σ_t ‖l_t‖‖r_t‖)² (Cauchy–Schwarz), so ::

      ‖G‖² ≤ Gram + 2(e_l + e_r + e_Σ + 4)·u·W   and   ‖G‖² ≤ W (triangle inequality),

  e_l, e_r the roundings of one left / right inner product (:func:`_dot_error`;
  0 for onehot rows), e_Σ those of the sum over the N² pairs (:func:`_sum_error`),
  u = 2⁻²⁴, the factor 2 covering second-order terms; W comes from the Grams'
  diagonals. The smaller bound is returned. The direct form ‖LᵀR‖_F (dense rows,
  N² > p·q) errs by at most N·u·√W in the norm. On natural data both add well
  under 1 % to the norm (``python benchmarks/bench_ghost_bound.py``).
  """
  stacked = _stacked(uses)
  rows = sum(f.right.shape[1] for f in stacked)
  if len(stacked) == 1 and not _is_ids(stacked[0]):
    (f,) = stacked
    if f.left.shape[1] ** 2 > f.left.shape[2] * f.right.shape[2]:
      bound = jnp.sum(jnp.linalg.norm(f.left, axis=-1) * jnp.linalg.norm(f.right, axis=-1), 1)
      direct = jnp.sqrt(jnp.sum(jnp.square(_dense_grad(f)), axis=(1, 2)))
      return jnp.square(direct + 2.0 * rows * _ROUNDOFF * bound)
  pairs = [_self_pair(f) for f in stacked]
  total = sum(gram for gram, _ in pairs)
  if len(stacked) == 2:
    total = total + 2.0 * _pair(*stacked)
  w = jnp.square(sum(row_norms for _, row_norms in pairs))
  dots = (max((_dot_error(f.left.shape[-1]) for f in stacked if not _is_ids(f)), default=0)
          + _dot_error(stacked[0].right.shape[-1]))
  slack = 2.0 * (dots + _sum_error(rows * rows) + 4) * _ROUNDOFF
  cap = 1.0 + 2.0 * (dots + _sum_error(rows) + 4) * _ROUNDOFF  # W's own rounding
  return jnp.minimum(jnp.maximum(jnp.asarray(total), 0.0) + slack * w, cap * w)


def _keep_rows(x: jax.Array, keep: jax.Array) -> jax.Array:
  return jnp.where(keep.reshape(keep.shape + (1,) * (x.ndim - 1)), x, jnp.zeros_like(x))


def factor_weighted_sum(uses: list[Factor], weights: jax.Array, keep: jax.Array,
                        shape: tuple[int, ...]) -> jax.Array:
  """Σ_i w_i Σ_u G_{i,u} over rows with ``keep``, reshaped to the parameter's ``shape``."""
  total = jnp.zeros((uses[0].width, uses[0].right.shape[-1]), jnp.float32)
  w = weights[:, None, None]
  for f in _stacked(uses):
    q = f.right.shape[-1]
    if _is_ids(f):
      right = (_keep_rows(f.right, keep) * w).reshape(-1, q)
      total = total.at[f.left.reshape(-1)].add(right, mode="drop")
    else:  # weight the narrower factor; one (B·N, p)ᵀ(B·N, q) matmul
      left, right = _keep_rows(f.left, keep), _keep_rows(f.right, keep)
      left, right = (left * w, right) if left.shape[-1] <= q else (left, right * w)
      total = total + jnp.matmul(left.reshape(-1, left.shape[-1]).T, right.reshape(-1, q),
                                 precision=_HIGHEST)
  return total.reshape(shape)


# ------------------------------------------------------------------ the clipped sum


def _pass(loss_fn: LossFn, params: PyTree, batch: PyTree, tape: _Tape):
  """One forward and one backward: (per-use factors by parameter, exact per-example grads)."""
  flat, treedef = _flat_params(params)
  covered = {p for s in tape.sites.values() for p in s.params if p is not None}
  b = jax.tree.leaves(batch)[0].shape[0]
  taps = {k: jnp.zeros((b,) + o.shape, o.dtype) for k, o in tape.outputs.items()}
  deltas = {_name(p): jnp.zeros((b,) + v.shape, v.dtype) for p, v in flat.items()
            if p not in covered}
  run = _per_example_loss(loss_fn, flat, treedef)

  def total(taps, deltas):
    losses, inputs = jax.vmap(run)(taps, deltas, batch)
    return jnp.sum(losses), inputs

  (g_taps, g_deltas), inputs = jax.grad(total, argnums=(0, 1), has_aux=True)(taps, deltas)
  shapes = {p: jnp.shape(v) for p, v in flat.items()}
  uses: dict[Path, list[Factor]] = {}
  for name, site in tape.sites.items():
    for path, factor in _site_factors(site, inputs[name], g_taps[name], shapes):
      uses.setdefault(path, []).append(factor)
  exact = {p: g_deltas[_name(p)].astype(jnp.float32) for p in flat if p not in uses}
  return flat, treedef, uses, exact


def _scaled(x: jax.Array, w: Any) -> jax.Array:
  if isinstance(w, (int, float)) and w == 1:
    return x
  # jnp.where, not a product: a zero-weight term must not turn NaN into the sum.
  return jnp.where(w != 0, w * x, jnp.zeros_like(x))


def _leaf_weights(weight: Any, flat: dict[Path, jax.Array]) -> dict[Path, Any]:
  """A term's weight per parameter: one scalar for all, or a pytree like the state."""
  if jax.tree_util.treedef_is_leaf(jax.tree.structure(weight)):
    return dict.fromkeys(flat, weight)
  return _flat_params(weight)[0]


class _Terms(NamedTuple):
  """q_i = Σ_k w_k ∇ℓ(θ_k; x_i): every term's factors (Gram-form leaves), per-example
  gradients accumulated over the terms (``direct``, (B, width, q) each) and exact
  per-example gradients (leaves no tap covers)."""

  flat: dict[Path, jax.Array]
  treedef: Any
  uses: dict[Path, list[Factor]]
  direct: dict[Path, jax.Array]
  exact: dict[Path, jax.Array]


def _weighted_factors(uses: dict[Path, list[Factor]], w: dict[Path, Any]
                      ) -> dict[Path, list[Factor]]:
  return {p: [Factor(f.left, _scaled(f.right, w[p]), f.width) for f in fs]
          for p, fs in uses.items()}


def _per_example_grad(uses: list[Factor]) -> jax.Array:
  """Σ_u L_uᵀ R_u per example, (B, width, q): one parameter's per-example gradient."""
  total = jnp.zeros((uses[0].right.shape[0], uses[0].width, uses[0].right.shape[-1]),
                    jnp.float32)
  for f in uses:
    if _is_ids(f):
      lookup = lambda ids, rows, w=f.width: jnp.zeros((w, rows.shape[-1]), jnp.float32).at[
          ids].add(rows, mode="drop")
      total = total + jax.vmap(lookup)(f.left, f.right)
    else:
      total = total + _dense_grad(f)
  return total


def accumulates_per_example(uses: list[Factor], num_terms: int) -> bool:
  """Whether a parameter of a ``num_terms``-term query keeps its per-example gradient
  rather than every term's factors.

  The Gram form of ‖Σ_k w_k G_k‖² needs the factors of all terms at once
  (n·Σ_u N_u(p_u + q) floats per example, n = ``num_terms``, N_u rows and
  p_u left features of use u, an id counting as one) and a Gram of the
  stacked rows ((n·Σ_u N_u)²); the per-example gradient Σ_k w_k G_k, summed
  term by term, takes width·q floats whatever n is. The smaller one is kept
  (Bu et al. 2023, §3.2 make the same per-layer choice for one term).
  """
  rows = sum(f.right.shape[1] for f in uses)
  factors = sum(f.right.shape[1] * ((1 if _is_ids(f) else f.left.shape[-1]) + f.right.shape[-1])
                for f in uses)
  return uses[0].width * uses[0].right.shape[-1] <= num_terms * factors + (num_terms * rows) ** 2


def _factor_shapes(loss_fn: LossFn, params: PyTree, batch: PyTree, tape: _Tape
                   ) -> dict[Path, list[Factor]]:
  """The factors of one pass by parameter, ShapeDtypeStructs in place of arrays (traced,
  never computed)."""
  found: dict[Path, list[Factor]] = {}

  def trace(p: PyTree, b: PyTree) -> jax.Array:
    for path, fs in _pass(loss_fn, p, b, tape)[2].items():
      shape = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)
      found[path] = [Factor(shape(f.left), shape(f.right), f.width)  # pyright: ignore[reportArgumentType]
                     for f in fs]
    return jnp.zeros(())

  jax.eval_shape(trace, params, batch)
  return found


def _one_term(loss_fn: LossFn, term: GradientTerm, batch: PyTree, tape: _Tape) -> _Terms:
  """One forward and one backward; every covered leaf in the Gram form."""
  flat, treedef, uses, exact = _pass(loss_fn, term.state, batch, tape)
  w = _leaf_weights(term.weight, flat)
  return _Terms(flat, treedef, _weighted_factors(uses, w), {},
                {p: _scaled(g, w[p]) for p, g in exact.items()})


def _collect(loss_fn: LossFn, terms: tuple[GradientTerm, ...], batch: PyTree, tape: _Tape
             ) -> _Terms:
  """One forward and one backward per term (θ_k, w_k); several terms in a ``lax.scan``.

  Over the scan, a leaf that :func:`accumulates_per_example` adds up its
  per-example gradient, so only one term's factors are live at a time; the
  other covered leaves keep every term's factors for the Gram form.
  """
  if len(terms) == 1:
    return _one_term(loss_fn, terms[0], batch, tape)
  like = terms[0].state
  first = _factor_shapes(loss_fn, like, batch, tape)
  direct = {p for p, fs in first.items() if accumulates_per_example(fs, len(terms))}
  stacked, weights = stack_terms(terms)
  flat_like, treedef = _flat_params(like)

  def add_term(acc, term):
    state, weight = term
    _, _, uses, exact = _pass(loss_fn, state, batch, tape)
    w = _flat_params(weight)[0]
    acc_direct, acc_exact = acc
    acc_direct = {p: a + _scaled(_per_example_grad(uses[p]), w[p]) for p, a in acc_direct.items()}
    acc_exact = {p: a + _scaled(exact[p], w[p]) for p, a in acc_exact.items()}
    kept = _weighted_factors({p: fs for p, fs in uses.items() if p not in direct}, w)
    return (acc_direct, acc_exact), {p: [(f.left, f.right) for f in fs] for p, fs in kept.items()}

  b = jax.tree.leaves(batch)[0].shape[0]
  init = ({p: jnp.zeros((b, first[p][0].width, first[p][0].right.shape[-1]), jnp.float32)
           for p in direct},
          {p: jnp.zeros((b,) + jnp.shape(v), jnp.float32)
           for p, v in flat_like.items() if p not in first})
  (acc_direct, acc_exact), kept = jax.lax.scan(add_term, init, (stacked, weights))
  uses = {p: [Factor(left[k], right[k], f.width) for k in range(len(terms))
              for f, (left, right) in zip(first[p], pairs, strict=True)]
          for p, pairs in kept.items()}
  return _Terms(flat_like, treedef, uses, acc_direct, acc_exact)


def _leaf_sq_norms(t: _Terms) -> dict[Path, jax.Array]:
  """Per-parameter ‖q_{i,l}‖², (B,) each."""
  grads = {**t.direct, **t.exact}
  return {p: (factor_sq_norm(t.uses[p]) if p in t.uses
              else jnp.sum(jnp.square(grads[p]), axis=tuple(range(1, grads[p].ndim))))
          for p in t.flat}


def ghost_norms(loss_fn: LossFn, params: PyTree, batch: PyTree) -> jax.Array:
  """‖∇ℓ(θ; x_i)‖₂ per example, (B,), from ghost norms (no per-example gradient)."""
  tape = _discover(loss_fn, params, jax.tree.map(lambda x: x[0], batch))
  terms = (GradientTerm(params),)
  return jnp.sqrt(sum(_leaf_sq_norms(_collect(loss_fn, terms, batch, tape)).values()))


def _terms_clipped_sum(t: _Terms, mask: jax.Array | None, clipping: Clipping | float
                       ) -> ClippedSum:
  as_tree = lambda d: jax.tree_util.tree_unflatten(t.treedef, [d[p] for p in t.flat])

  def weighted_sum(factors: PyTree, keep: jax.Array) -> PyTree:
    w, _ = _flat_params(factors)
    grads = {**t.direct, **t.exact}
    out = {p: (factor_weighted_sum(t.uses[p], w[p], keep, jnp.shape(v)) if p in t.uses
               else jnp.tensordot(w[p], _keep_rows(grads[p], keep), axes=1).reshape(jnp.shape(v)))
           for p, v in t.flat.items()}
    return as_tree(out)

  return clipped_sum_from_norms(as_tree(_leaf_sq_norms(t)), mask, clipping, weighted_sum)


def _chunked(chunk: Callable[[PyTree, jax.Array | None], ClippedSum], like: PyTree,
             batch: PyTree, mask: jax.Array | None, clipping: Clipping | float,
             microbatch_size: int | None) -> ClippedSum:
  """``chunk`` on the whole batch, or summed over microbatches in a rolled scan."""
  if as_clipping(clipping).grid_bits is not None:
    raise ValueError("Ghost clipping never forms the clipped queries, so it cannot round them "
                     "to the secure-noise grid (grid_bits); use the vmap path.")
  batch_size = jax.tree.leaves(batch)[0].shape[0]
  if microbatch_size is not None and (
      isinstance(microbatch_size, bool) or operator.index(microbatch_size) <= 0):
    raise ValueError(f"microbatch_size must be a positive int or None, got {microbatch_size!r}.")
  if microbatch_size is None or microbatch_size >= batch_size:
    return chunk(batch, mask)
  if mask is None:
    mask = jnp.ones((batch_size,), jnp.bool_)
  batch, mask = pad_to_multiple(batch, mask, microbatch_size)
  n = mask.shape[0] // microbatch_size
  chunked = jax.tree.map(lambda x: x.reshape((n, microbatch_size) + x.shape[1:]), (batch, mask))
  return _sum_over_chunks(lambda c: chunk(*c), chunked, like, as_clipping(clipping))


QueryTerms = Callable[[PyTree], tuple[GradientTerm, ...]]
"""``inputs -> (GradientTerm, ...)``: a query as a weighted sum of gradients
(:attr:`~dpmuon_jax.privacy.query.QuerySpec.terms`)."""


def ghost_query_sum(loss_fn: LossFn, terms: QueryTerms) -> Callable[..., ClippedSum]:
  """Ghost clipping of the query q_i = Σ_k w_k ∇ℓ(θ_k; x_i) that ``terms`` describes.

  Returns ``sum_fn(inputs, batch, mask, clipping, microbatch_size=None)``, the
  same sum and sensitivity as ``clipped_sum(query, inputs, batch, mask,
  clipping, microbatch_size)`` for the query with these terms. q_i is
  clipped as ONE vector; for a dense use its norm has the cross terms
  between states, ::

      ‖Σ_k w_k Σ_t a_{k,t} g_{k,t}ᵀ‖² = Σ_{k,l} w_k w_l Σ_{t,s} (a_{k,t}·a_{l,s})(g_{k,t}·g_{l,s}),

  the Gram of the rows of all states stacked (w_k folded into g_k), and the
  book-keeping sum weights every state's factors by the same clip factor;
  a parameter whose per-example gradient is smaller than all states' factors
  sums that gradient over the states instead (:func:`accumulates_per_example`,
  listed by :func:`ghost_coverage` with ``num_terms``). One forward and one
  backward per term, in a ``lax.scan``, as the vmap query's gradients.
  This covers the gradient query (one term), DiSK's two-point query
  (Zhang et al., ICLR 2025, §3: c at θ_t + γd_t, 1 − c at θ_t) and inner
  momentum's combination over K past states ("Inner Momentum for DP-Muon", §3).
  """

  def sum_fn(inputs: PyTree, batch: PyTree, mask: jax.Array | None,
             clipping: Clipping | float, microbatch_size: int | None = None) -> ClippedSum:
    like = terms(inputs)[0].state
    tape = _discover(loss_fn, like, jax.tree.map(lambda x: x[0], batch))
    chunk = lambda b, m: _terms_clipped_sum(_collect(loss_fn, terms(inputs), b, tape), m,
                                            clipping)
    return _chunked(chunk, like, batch, mask, clipping, microbatch_size)

  return sum_fn


def ghost_clipped_sum(
    loss_fn: LossFn,
    params: PyTree,
    batch: PyTree,
    mask: jax.Array | None,
    clipping: Clipping | float,
    microbatch_size: int | None = None,
) -> ClippedSum:
  """Σ_i mask_i · clip_C(∇ℓ(θ; x_i)) by ghost norms and book-keeping (see the module doc).

  The same result (up to float rounding) and the same sensitivity C as
  ``clipped_sum(gradient_query(loss_fn), params, batch, mask, clipping,
  microbatch_size)``, with the same :class:`~dpmuon_jax.privacy.query.ClipStats`.

  Args:
    loss_fn: ``loss_fn(params, batch) -> scalar``, called (under ``vmap``) on
      batches of one example, as by ``gradient_query``. Layers built with
      :func:`dpmuon_jax.models.taps.tapped` get ghost norms; every other
      parameter gets exact per-example gradients (see :func:`ghost_coverage`).
    params, batch, mask, clipping, microbatch_size: as for ``clipped_sum``;
      ``clipping`` must not use the secure-noise grid.
  """
  sum_fn = ghost_query_sum(loss_fn, GRADIENT_QUERY.terms)  # pyright: ignore[reportArgumentType]
  return sum_fn(params, batch, mask, clipping, microbatch_size)


CLIPPED_SUM_METHODS = ("vmap", "ghost", "automatic")
"""How a private step computes its clipped sum of per-example gradients."""


def resolve_method(method: str, loss_fn: LossFn, params: PyTree, example: PyTree) -> str:
  """``"vmap"`` or ``"ghost"``; ``"automatic"`` picks ghost when every parameter of
  two or more dimensions (every matrix, kernel and table) is covered by a tap."""
  if method not in CLIPPED_SUM_METHODS:
    raise ValueError(f"clipped_sum_method must be one of {CLIPPED_SUM_METHODS}, got {method!r}.")
  if method != "automatic":
    return method
  flat, _ = _flat_params(params)
  exact = ghost_coverage(loss_fn, params, example).exact
  return "vmap" if any(jnp.ndim(flat[p]) >= 2 for p in exact) else "ghost"


def select_clipped_sum(
    method: str,
    vmap_sum: Callable[[PyTree, PyTree, jax.Array], ClippedSum],
    loss_fn: LossFn | None,
    terms: QueryTerms | None,
    clipping: Clipping | float,
    microbatch_size: int | None = None,
) -> Callable[[PyTree, PyTree, jax.Array], ClippedSum]:
  """``(inputs, batch, mask) -> ClippedSum`` by ``method`` (:data:`CLIPPED_SUM_METHODS`).

  ``vmap_sum`` is the ``vmap(grad)`` path. Ghost clipping computes a query
  given as ``terms`` (:attr:`~dpmuon_jax.privacy.query.QuerySpec.terms`: the
  gradient, DiSK's and inner momentum's queries) of ``loss_fn``; a custom
  query without terms is refused.
  """
  if method not in CLIPPED_SUM_METHODS:
    raise ValueError(f"clipped_sum_method must be one of {CLIPPED_SUM_METHODS}, got {method!r}.")
  if method == "vmap":
    return vmap_sum
  if loss_fn is None or terms is None:
    raise ValueError(f"clipped_sum_method={method!r} computes a query given as a weighted sum "
                     "of gradients of a loss_fn (QuerySpec.terms); a custom query needs 'vmap'.")
  ghost_sum = ghost_query_sum(loss_fn, terms)

  def local_sum(inputs: PyTree, batch: PyTree, mask: jax.Array) -> ClippedSum:
    example = jax.tree.map(lambda x: x[0], batch)
    if resolve_method(method, loss_fn, terms(inputs)[0].state, example) == "vmap":
      return vmap_sum(inputs, batch, mask)
    return ghost_sum(inputs, batch, mask, clipping, microbatch_size)

  return local_sum
