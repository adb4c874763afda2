"""Wide ResNets (WRN-16-4, WRN-28-10) with GroupNorm instead of BatchNorm.

Zagoruyko & Komodakis, "Wide Residual Networks" (2016), as used for DP
training by De et al. (2022, "Unlocking High-Accuracy Differentially Private
Image Classification through Scale"), with GroupNorm (16 groups) replacing
BatchNorm. WRN-d-k has n = (d − 4) / 6 pre-activation blocks per stage::

    x → conv3×3(16) → [Block]×n at widths 16k, 32k, 64k, strides 1, 2, 2
      → norm → relu → global average pool → head

    Block(x) = conv2(relu(norm2(conv1(a)))) + shortcut,  a = relu(norm1(x)),

with shortcut = x when the shape is kept and a 1×1 convolution of a otherwise.
Batch statistics would mix the examples of a batch and break per-example
privacy; GroupNorm normalises each example on its own.

Parameter paths (``models/common.py``): ``stem``,
``stages/<s>/<b>/{norm1,conv1,norm2,conv2,shortcut}``, ``norm``, ``head``.
Convolution kernels are (kh, kw, c_in, c_out). ``conv_impl`` as in
:mod:`~dpmuon_jax.models.resnet` (``"patches"`` for CPU-scale runs).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dpmuon_jax.models.resnet import conv, group_norm


class WideBlock(nnx.Module):
  """Pre-activation residual block of two 3×3 convolutions."""

  def __init__(self, c_in: int, c_out: int, stride: int, groups: int, *, rngs: nnx.Rngs,
               conv_impl: str = "lax"):
    self.norm1 = group_norm(c_in, groups, rngs)
    self.conv1 = conv(c_in, c_out, 3, stride, rngs, conv_impl)
    self.norm2 = group_norm(c_out, groups, rngs)
    self.conv2 = conv(c_out, c_out, 3, 1, rngs, conv_impl)
    keeps_shape = stride == 1 and c_in == c_out
    self.shortcut = None if keeps_shape else conv(c_in, c_out, 1, stride, rngs, conv_impl)

  def __call__(self, x: jax.Array) -> jax.Array:
    a = jax.nn.relu(self.norm1(x))
    y = self.conv2(jax.nn.relu(self.norm2(self.conv1(a))))
    return y + (x if self.shortcut is None else self.shortcut(a))


class WideResNet(nnx.Module):
  """WRN-``depth``-``width`` for image classification.

  Args:
    depth: total depth d; (d − 4) must be divisible by 6 (16, 28, 40, …).
    width: widening factor k.
    num_classes: outputs of ``head``.
    in_channels: image channels (3 for CIFAR/SVHN, 1 for MNIST).
    groups: GroupNorm groups (reduced to gcd(channels, groups) per layer).
    conv_impl: ``"lax"`` (default) or ``"patches"`` (fast per-example
      gradients on CPU); the same function.
    rngs: initialisation randomness (public; not a privacy key).
  """

  def __init__(
      self,
      depth: int,
      width: int,
      num_classes: int,
      *,
      in_channels: int = 3,
      groups: int = 16,
      conv_impl: str = "lax",
      rngs: nnx.Rngs,
  ):
    if depth < 10 or (depth - 4) % 6:
      raise ValueError(f"WRN depth must be 6n + 4 with n >= 1, got {depth}.")
    if width < 1:
      raise ValueError(f"WRN width must be >= 1, got {width}.")
    blocks_per_stage = (depth - 4) // 6
    self.stem = conv(in_channels, 16, 3, 1, rngs, conv_impl)
    stages = []
    c_in = 16
    for s, stride in enumerate((1, 2, 2)):
      c_out = 16 * width * 2**s
      blocks = []
      for b in range(blocks_per_stage):
        blocks.append(WideBlock(c_in, c_out, stride if b == 0 else 1, groups, rngs=rngs,
                                conv_impl=conv_impl))
        c_in = c_out
      stages.append(nnx.List(blocks))
    self.stages = nnx.List(stages)
    self.norm = group_norm(c_in, groups, rngs)
    self.head = nnx.Linear(c_in, num_classes, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    x = self.stem(x)
    for stage in self.stages:
      for block in stage:
        x = block(x)
    x = jax.nn.relu(self.norm(x))
    return self.head(jnp.mean(x, axis=(-3, -2)))
