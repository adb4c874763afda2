"""Tapped copies of Flax NNX models, for ghost clipping (:mod:`dpmuon_jax.privacy.ghost`).

:func:`tapped` returns a copy of a module in which every use of a weight of the
form y = a · W reports itself to the ghost tape with
:func:`~dpmuon_jax.privacy.ghost.tap`:

* ``nnx.Linear``: its ``dot_general`` is wrapped (kernel and bias);
* ``nnx.Conv`` built with :func:`~dpmuon_jax.models.cnn.patch_conv`: its
  convolution is wrapped and reports the image patches (kernel and bias);
* ``nnx.Embed``: the lookup ``E[x]`` and ``attend`` (h · Eᵀ, the tied head of
  GPT-2), both uses of the same table.

Parameter paths, shapes and the function computed are unchanged: outside a
ghost computation every tap is the identity, so the copy can replace the
model everywhere. Other layers (LayerNorm, GroupNorm, convolutions through
``lax``) are left as they are; the ghost clipped sum gives their parameters
exact per-example gradients.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar, cast

import jax
from flax import nnx
from jax import lax

from dpmuon_jax.models.cnn import image_patches, patch_conv
from dpmuon_jax.models.common import PureModel, pure_model
from dpmuon_jax.privacy.ghost import Path, tap


@dataclasses.dataclass(frozen=True)
class _DenseTap:
  """``lax.dot_general`` that taps y = a · K for ``nnx.Linear``."""

  kernel: Path
  bias: Path | None

  def __call__(self, lhs: jax.Array, rhs: jax.Array, dimension_numbers: Any, **kwargs: Any
               ) -> jax.Array:
    y = lax.dot_general(lhs, rhs, dimension_numbers, **kwargs)
    return tap("dense", (self.kernel, self.bias), lhs, y)


@dataclasses.dataclass(frozen=True)
class _PatchConvTap:
  """:func:`patch_conv` that taps y = patches(x) · reshape(K) for ``nnx.Conv``."""

  kernel: Path
  bias: Path | None

  def __call__(self, lhs: jax.Array, rhs: jax.Array, window_strides: Any, padding: Any,
               **kwargs: Any) -> jax.Array:
    y = patch_conv(lhs, rhs, window_strides, padding, **kwargs)
    patches = image_patches(lhs, rhs.shape[:-2], tuple(window_strides), padding)
    return tap("dense", (self.kernel, self.bias), patches, y)


class TappedEmbed(nnx.Embed):
  """``nnx.Embed`` whose lookup and ``attend`` report their use of the table."""

  ghost_table: Path

  def __call__(self, inputs: jax.Array, out_sharding=None) -> jax.Array:
    return tap("embed", (self.ghost_table,), inputs, super().__call__(inputs, out_sharding))

  def attend(self, query: jax.Array, out_sharding=None) -> jax.Array:
    return tap("attend", (self.ghost_table,), query, super().attend(query, out_sharding))


def _tap_one(path: Path, node: Any) -> bool:
  """Makes ``node`` report its uses; False when it is not a layer with a tap."""
  bias = path + ("bias",) if getattr(node, "bias", None) is not None else None
  if type(node) is nnx.Linear:
    node.dot_general = _DenseTap(path + ("kernel",), bias)
  elif type(node) is nnx.Conv and node.conv_general_dilated is patch_conv and node.mask is None:
    node.conv_general_dilated = _PatchConvTap(path + ("kernel",), bias)
  elif type(node) is nnx.Embed and node.num_embeddings > 1:
    node.__class__ = TappedEmbed
    cast(TappedEmbed, node).ghost_table = path + ("embedding",)
  else:
    return False
  return True


ModuleT = TypeVar("ModuleT", bound=nnx.Module)


def tapped(module: ModuleT) -> ModuleT:
  """A copy of ``module`` whose dense, patch-conv and embedding layers are tapped.

  The original module is not modified.
  """
  copy = nnx.clone(module)
  for path, node in list(nnx.iter_graph(copy)):
    if isinstance(node, nnx.Module):
      _tap_one(tuple(path), node)
  return copy


def tapped_model(module: nnx.Module) -> PureModel:
  """:func:`~dpmuon_jax.models.common.pure_model` of :func:`tapped` ``(module)``."""
  return pure_model(tapped(module))
