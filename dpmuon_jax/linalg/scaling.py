"""The matrix view of a parameter and its aspect-ratio factor (paper 1, design 3).

A leaf is seen as a batch of fan_in × fan_out matrices, fan_in being the
input (reduction) dimension and fan_out the output dimension of the layer,
whatever the storage layout (docs/design.md, "The optimizers"):

* Flax Dense kernel (in, out): fan_in = in, fan_out = out;
* Flax Conv kernel (kh, kw, c_in, c_out): fan_in = kh·kw·c_in, fan_out = c_out.

By default every axis but the last is a reduction axis and the last is the
output axis. Other layouts (e.g. attention kernels (d, heads, head_dim), or
stacked layers with a leading batch axis) are described per leaf with Optax's
:class:`optax.contrib.MuonDimensionNumbers`; axes named in neither field are
batch axes, each batch entry being its own matrix.

After Newton–Schulz the update is scaled by ::

    sqrt(min(r_max, max(1, fan_out / fan_in)))

with r_max = 4 for DP-Muon (the factor is at most 2) and no cap for
DP-Muon-S. PyTorch-layout code writes the same physical factor as
sqrt(max(1, rows/cols)) because its weights are (out, in).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, cast

import jax
from optax.contrib import MuonDimensionNumbers

PyTree = Any
Path = tuple[str, ...]
# A single spec for every leaf, a pytree of specs shaped like the parameters
# (``None`` leaves take the default view), or a function of (path, leaf).
DimensionNumbers = (
    MuonDimensionNumbers | PyTree | Callable[[Path, jax.Array], MuonDimensionNumbers | None] | None
)

DP_MUON_MAX_ASPECT_RATIO = 4.0


class MatrixView(NamedTuple):
  """How a leaf maps to a (batch, fan_in, fan_out) stack of matrices and back."""

  # jax.Array -> jax.Array; NumPy arrays work too (the non-private diagnostics use them).
  to_matrices: Callable[[Any], Any]
  from_matrices: Callable[[Any], Any]
  batch: int
  fan_in: int
  fan_out: int


def default_dimension_numbers(ndim: int) -> MuonDimensionNumbers:
  """Reduction over every axis but the last; output along the last; no batch axes."""
  if ndim < 2:
    raise ValueError(f"A matrix view needs rank >= 2, got rank {ndim}.")
  return MuonDimensionNumbers(reduction_axis=tuple(range(ndim - 1)), output_axis=ndim - 1)


def _axes(spec: int | Sequence[int], ndim: int) -> tuple[int, ...]:
  spec = (spec,) if isinstance(spec, int) else tuple(spec)
  return tuple(ax % ndim for ax in spec)


def matrix_view(shape: tuple[int, ...], dim_nums: MuonDimensionNumbers | None = None) -> MatrixView:
  """The (batch, fan_in, fan_out) view of an array of ``shape`` (static)."""
  ndim = len(shape)
  dim_nums = default_dimension_numbers(ndim) if dim_nums is None else dim_nums
  reduction = _axes(dim_nums.reduction_axis, ndim)
  output = _axes(dim_nums.output_axis, ndim)
  if not reduction or not output or set(reduction) & set(output):
    raise ValueError(
        f"Reduction axes {reduction} and output axes {output} must be non-empty and "
        f"disjoint (shape {shape})."
    )
  batch = tuple(ax for ax in range(ndim) if ax not in reduction + output)
  perm = batch + reduction + output
  inverse = tuple(sorted(range(ndim), key=perm.__getitem__))
  size = lambda axes: math.prod(shape[ax] for ax in axes)
  flat = (size(batch), size(reduction), size(output))
  permuted = tuple(shape[ax] for ax in perm)
  return MatrixView(
      to_matrices=lambda x: x.transpose(perm).reshape(flat),
      from_matrices=lambda m: m.reshape(permuted).transpose(inverse),
      batch=flat[0],
      fan_in=flat[1],
      fan_out=flat[2],
  )


def aspect_factor(fan_in: int, fan_out: int, max_ratio: float | None = DP_MUON_MAX_ASPECT_RATIO
                  ) -> float:
  """sqrt(min(max_ratio, max(1, fan_out / fan_in))); ``max_ratio=None``: no cap.

  Dense(64, 1024) → 2.0 (ratio 16, capped at 4); Dense(1024, 64) → 1.0;
  Conv (3, 3, 16, 64) → 1.0 (144 × 64); Dense(64, 128) → √2.
  """
  ratio = max(1.0, fan_out / fan_in)
  if max_ratio is not None:
    ratio = min(float(max_ratio), ratio)
  return math.sqrt(ratio)


def path_names(path: tuple[Any, ...]) -> Path:
  """A JAX key path as a tuple of plain strings (dict keys, attributes, indices)."""
  names = []
  for entry in path:
    for attr in ("key", "name", "idx"):
      if hasattr(entry, attr):
        names.append(str(getattr(entry, attr)))
        break
    else:
      names.append(str(entry))
  return tuple(names)


def _is_spec(x: Any) -> bool:
  return isinstance(x, MuonDimensionNumbers)


def dimension_numbers_fn(dimension_numbers: DimensionNumbers
                         ) -> Callable[[Path, jax.Array], MuonDimensionNumbers | None]:
  """``dimension_numbers`` as a function of (path, leaf); ``None`` means the default view.

  A pytree of specs is matched to leaves by key path, so it may be given for
  the full parameter tree and still apply to a masked one (``optax.partition``).
  """
  if dimension_numbers is None or _is_spec(dimension_numbers):
    spec = cast("MuonDimensionNumbers | None", dimension_numbers)
    return lambda path, leaf: spec
  if callable(dimension_numbers):
    return cast("Callable[[Path, jax.Array], MuonDimensionNumbers | None]", dimension_numbers)
  by_path = {
      path_names(p): spec
      for p, spec in jax.tree_util.tree_flatten_with_path(dimension_numbers, is_leaf=_is_spec)[0]
  }
  return lambda path, leaf: by_path.get(path)
