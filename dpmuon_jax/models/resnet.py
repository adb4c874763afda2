"""ResNet-18, CIFAR variant, with GroupNorm instead of BatchNorm.

He et al., "Deep Residual Learning for Image Recognition" (2016), with the
CIFAR stem (one 3×3 convolution, stride 1, no max-pool) and GroupNorm (Wu &
He, 2018) in place of BatchNorm, as in DP training (e.g. De et al., 2022):

    x → conv3×3(w) → norm → relu → [BasicBlock]×2 per stage, widths
    w, 2w, 4w, 8w, strides 1, 2, 2, 2 → global average pool → head

    BasicBlock(x) = relu(norm2(conv2(relu(norm1(conv1(x))))) + shortcut(x))

where ``shortcut`` is a 1×1 convolution + norm when the shape changes and the
identity otherwise. Batch statistics would mix the examples of a batch and
break per-example privacy; GroupNorm normalises each example on its own.

Parameter paths (``models/common.py``): ``stem``, ``stem_norm``,
``stages/<s>/<b>/{conv1,norm1,conv2,norm2,shortcut,shortcut_norm}``,
``head``. Convolution kernels are (kh, kw, c_in, c_out).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

# Kaiming normal, fan_out, for ReLU networks (He et al., 2015), as in the
# reference ResNet and WRN implementations.
conv_init = nnx.initializers.variance_scaling(2.0, "fan_out", "normal")


def group_norm(channels: int, groups: int, rngs: nnx.Rngs) -> nnx.GroupNorm:
  """GroupNorm over ``gcd(channels, groups)`` groups, so any width is valid."""
  return nnx.GroupNorm(channels, num_groups=math.gcd(channels, groups), rngs=rngs)


def conv(
    c_in: int, c_out: int, kernel: int, stride: int, rngs: nnx.Rngs
) -> nnx.Conv:
  """Bias-free k×k convolution with symmetric padding k // 2 (PyTorch layout)."""
  pad = kernel // 2
  return nnx.Conv(
      c_in, c_out, (kernel, kernel), strides=stride, padding=((pad, pad), (pad, pad)),
      use_bias=False, kernel_init=conv_init, rngs=rngs,
  )


class BasicBlock(nnx.Module):
  """Post-activation residual block of two 3×3 convolutions."""

  def __init__(self, c_in: int, c_out: int, stride: int, groups: int, *, rngs: nnx.Rngs):
    self.conv1 = conv(c_in, c_out, 3, stride, rngs)
    self.norm1 = group_norm(c_out, groups, rngs)
    self.conv2 = conv(c_out, c_out, 3, 1, rngs)
    self.norm2 = group_norm(c_out, groups, rngs)
    if stride != 1 or c_in != c_out:
      self.shortcut = conv(c_in, c_out, 1, stride, rngs)
      self.shortcut_norm = group_norm(c_out, groups, rngs)
    else:
      self.shortcut = None
      self.shortcut_norm = None

  def __call__(self, x: jax.Array) -> jax.Array:
    y = jax.nn.relu(self.norm1(self.conv1(x)))
    y = self.norm2(self.conv2(y))
    skip = x if self.shortcut is None else self.shortcut_norm(self.shortcut(x))
    return jax.nn.relu(y + skip)


class ResNet(nnx.Module):
  """CIFAR ResNet of basic blocks; the default configuration is ResNet-18.

  Args:
    num_classes: outputs of ``head``.
    in_channels: image channels (3 for CIFAR/SVHN, 1 for MNIST).
    stage_sizes: blocks per stage; (2, 2, 2, 2) is ResNet-18.
    width: channels of the stem and first stage; stage s has width·2^s.
    groups: GroupNorm groups (reduced to gcd(channels, groups) per layer).
    rngs: initialisation randomness (public; not a privacy key).
  """

  def __init__(
      self,
      num_classes: int,
      *,
      in_channels: int = 3,
      stage_sizes: Sequence[int] = (2, 2, 2, 2),
      width: int = 64,
      groups: int = 32,
      rngs: nnx.Rngs,
  ):
    self.stem = conv(in_channels, width, 3, 1, rngs)
    self.stem_norm = group_norm(width, groups, rngs)
    stages = []
    c_in = width
    for s, size in enumerate(stage_sizes):
      c_out = width * 2**s
      blocks = []
      for b in range(size):
        stride = 2 if (s > 0 and b == 0) else 1
        blocks.append(BasicBlock(c_in, c_out, stride, groups, rngs=rngs))
        c_in = c_out
      stages.append(nnx.List(blocks))
    self.stages = nnx.List(stages)
    self.head = nnx.Linear(c_in, num_classes, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    x = jax.nn.relu(self.stem_norm(self.stem(x)))
    for stage in self.stages:
      for block in stage:
        x = block(x)
    return self.head(jnp.mean(x, axis=(-3, -2)))

