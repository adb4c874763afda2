"""The small benchmark CNN: 3 conv blocks 16/32/64 → dense 128 → ``head``.

::

    x → [conv3×3 → GroupNorm? → act → maxpool2×2] × 3 → flatten → dense 128 → act → head

About 156k parameters for 32×32×3 inputs (CIFAR-10), 98k for 28×28×1
(MNIST). No BatchNorm: batch statistics mix examples (privacy invariant 1,
docs/design.md).

Convolutions are computed as image patches times the kernel
(:func:`patch_conv`): the same function as ``lax.conv_general_dilated``, but
its kernel gradient is a matmul. JAX differentiates a convolution w.r.t. its
kernel into another convolution with non-canonical dimension labels; XLA:CPU
rewrites that into its fast (Eigen) form in straight-line code but not inside
a rolled ``lax.scan``, where it falls back to a generic loop (about 10–30×
slower). The microbatched clipped sum is such a loop, so with ``patch_conv``
it is both fast and flat in memory (``benchmarks/bench_release.py``).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from dpmuon_jax.models.common import PureModel, pure_model

PaddingLike = str | Sequence[tuple[int, int]]

_ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "relu": jax.nn.relu,
    "tanh": jnp.tanh,
}


def _channels_last(ndim: int) -> lax.ConvDimensionNumbers:
  spatial = tuple(range(1, ndim - 1))
  return lax.ConvDimensionNumbers(
      lhs_spec=(0, ndim - 1, *spatial),
      rhs_spec=(ndim - 1, ndim - 2, *range(ndim - 2)),
      out_spec=(0, ndim - 1, *spatial),
  )


def image_patches(
    x: jax.Array, window: Sequence[int], strides: Sequence[int], padding: PaddingLike
) -> jax.Array:
  """``(N, *spatial, C)`` → ``(N, *out_spatial, prod(window)·C)``, features ordered (window…, C).

  Built from strided slices of the padded input (pure data movement, so its
  gradient is a pad-and-add, never a convolution).
  """
  spatial = x.shape[1:-1]
  pads = lax.padtype_to_pads(spatial, window, strides, padding) if isinstance(
      padding, str) else tuple(padding)
  x = jnp.pad(x, ((0, 0), *pads, (0, 0)))
  out = [(n - k) // s + 1 for n, k, s in zip(x.shape[1:-1], window, strides, strict=True)]
  taps = []
  for offset in itertools.product(*(range(k) for k in window)):
    limit = [o + (m - 1) * s + 1 for o, m, s in zip(offset, out, strides, strict=True)]
    taps.append(lax.slice(
        x, (0, *offset, 0), (x.shape[0], *limit, x.shape[-1]), (1, *strides, 1)))
  return jnp.concatenate(taps, axis=-1)


def patch_conv(
    lhs: jax.Array,
    rhs: jax.Array,
    window_strides: Sequence[int],
    padding: PaddingLike,
    lhs_dilation: Sequence[int] | None = None,
    rhs_dilation: Sequence[int] | None = None,
    dimension_numbers: Any = None,
    feature_group_count: int = 1,
    precision: Any = None,
    preferred_element_type: Any = None,
    **unused_kwargs: Any,
) -> jax.Array:
  """Drop-in ``lax.conv_general_dilated`` (channels-last) as patches @ kernel.

  ::

      y[n, p, o] = Σ_{t, c} x[n, s·p + t, c] · k[t, c, o]
                 = (patches(x) @ reshape(k, (|t|·C_in, C_out)))[n, p, o]

  Pass it to ``nnx.Conv(..., conv_general_dilated=patch_conv)``. Under
  ``vmap(grad)`` each example's kernel gradient is patchesᵀ @ ∂y, a batched
  matmul. ``lax.conv_general_dilated``'s kernel gradient is a convolution with
  non-canonical dimension labels that XLA:CPU runs through a slow generic loop
  inside a rolled ``lax.scan`` (the microbatched clipped sum). Supports stride, padding and
  the layout ``nnx.Conv`` uses; no dilation or feature groups.
  """
  ndim = lhs.ndim
  if feature_group_count != 1:
    raise ValueError("patch_conv supports feature_group_count=1 only.")
  if any(d != 1 for d in (lhs_dilation or ())) or any(d != 1 for d in (rhs_dilation or ())):
    raise ValueError("patch_conv does not support dilation.")
  if dimension_numbers is not None and (
      lax.conv_dimension_numbers(lhs.shape, rhs.shape, dimension_numbers)
      != _channels_last(ndim)):
    raise ValueError("patch_conv needs channels-last inputs and (*window, in, out) kernels.")
  *window, cin, cout = rhs.shape
  patches = image_patches(lhs, window, tuple(window_strides), padding)
  return jnp.einsum(
      "...k,ko->...o", patches, rhs.reshape(-1, cout), precision=precision,
      preferred_element_type=preferred_element_type,
  )


class SmallCNN(nnx.Module):
  """3 conv layers (16/32/64 channels, 3×3 SAME, 2×2 max-pool), dense 128, ``head``.

  Args:
    num_classes: outputs of ``head``.
    in_channels: input channels (3 for CIFAR-10, 1 for MNIST).
    image_shape: spatial size (H, W) of the inputs; fixes the flattened size.
    activation: ``"relu"`` or ``"tanh"``.
    groups: if set, a GroupNorm with this many groups after every
      convolution (per example, so private).
    conv_impl: ``"patches"`` (default, :func:`patch_conv`) or ``"lax"``
      (``lax.conv_general_dilated``); same function, different per-example
      gradient computation.
    rngs: NNX random streams for initialisation.
  """

  def __init__(
      self,
      num_classes: int = 10,
      in_channels: int = 3,
      *,
      image_shape: Sequence[int] = (32, 32),
      activation: str = "relu",
      groups: int | None = None,
      conv_impl: str = "patches",
      rngs: nnx.Rngs,
  ):
    if activation not in _ACTIVATIONS:
      raise ValueError(f"activation must be one of {sorted(_ACTIVATIONS)}, got {activation!r}.")
    if conv_impl not in ("patches", "lax"):
      raise ValueError(f"conv_impl must be 'patches' or 'lax', got {conv_impl!r}.")
    conv_fn = patch_conv if conv_impl == "patches" else lax.conv_general_dilated
    self.activation = activation
    channels = (16, 32, 64)
    for i, (cin, cout) in enumerate(zip((in_channels, *channels[:-1]), channels, strict=True)):
      setattr(self, f"conv{i}", nnx.Conv(
          cin, cout, (3, 3), padding="SAME", conv_general_dilated=conv_fn, rngs=rngs))
      if groups:
        setattr(self, f"norm{i}", nnx.GroupNorm(cout, num_groups=groups, rngs=rngs))
    self.num_blocks = len(channels)
    self.use_norm = bool(groups)
    height, width = image_shape
    for _ in channels:
      height, width = height // 2, width // 2
    if not (height and width):
      raise ValueError(f"image_shape {tuple(image_shape)} is too small for 3 2×2 poolings (≥ 8×8).")
    self.dense = nnx.Linear(height * width * channels[-1], 128, rngs=rngs)
    self.head = nnx.Linear(128, num_classes, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    act = _ACTIVATIONS[self.activation]
    for i in range(self.num_blocks):
      x = getattr(self, f"conv{i}")(x)
      if self.use_norm:
        x = getattr(self, f"norm{i}")(x)
      x = nnx.max_pool(act(x), window_shape=(2, 2), strides=(2, 2))
    x = x.reshape(x.shape[:-3] + (-1,))
    return self.head(act(self.dense(x)))


def small_cnn(
    num_classes: int = 10,
    in_channels: int = 3,
    *,
    key: jax.Array,
    **kwargs,
) -> PureModel:
  """:class:`SmallCNN` as ``pure_model``: ``apply(params, images)`` and ``params``.

  ``key`` initialises the weights (weights are public; this is not a noise key).
  """
  return pure_model(SmallCNN(num_classes, in_channels, rngs=nnx.Rngs(key), **kwargs))
