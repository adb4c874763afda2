"""ResNet-18, CIFAR variant, with GroupNorm instead of BatchNorm.

He et al., "Deep Residual Learning for Image Recognition" (2016), with the
CIFAR stem (one 3×3 convolution, stride 1, no max-pool) and GroupNorm (Wu &
He, 2018) in place of BatchNorm, as in DP training (e.g. De et al., 2022)::

    x → conv3×3(w) → norm → relu → [BasicBlock]×2 per stage, widths
    w, 2w, 4w, 8w, strides 1, 2, 2, 2 → global average pool → head

    BasicBlock(x) = relu(norm2(conv2(relu(norm1(conv1(x))))) + shortcut(x))

where ``shortcut`` is a 1×1 convolution + norm when the shape changes and the
identity otherwise. Batch statistics would mix the examples of a batch and
break per-example privacy; GroupNorm normalises each example on its own.

Parameter paths (``models/common.py``): ``stem``, ``stem_norm``,
``stages/<s>/<b>/{conv1,norm1,conv2,norm2,shortcut,shortcut_norm}``,
``head``. Convolution kernels are (kh, kw, c_in, c_out).

``conv_impl="patches"`` computes every convolution as image patches times
the kernel (:func:`~dpmuon_jax.models.cnn.patch_conv`): the same function,
but the per-example kernel gradient is a matmul, which XLA:CPU runs fast
inside the rolled microbatch ``lax.scan`` (CPU-scale experiments). The
default ``"lax"`` (``lax.conv_general_dilated``) is the one to use on GPU/TPU.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from dpmuon_jax.models.cnn import patch_conv

CONV_IMPLS = {"lax": lax.conv_general_dilated, "patches": patch_conv}

# Kaiming normal, fan_out, for ReLU networks (He et al., 2015), as in the
# reference ResNet and WRN implementations.
conv_init = nnx.initializers.variance_scaling(2.0, "fan_out", "normal")


def group_norm(channels: int, groups: int, rngs: nnx.Rngs) -> nnx.GroupNorm:
  """GroupNorm over ``gcd(channels, groups)`` groups, so any width is valid."""
  return nnx.GroupNorm(channels, num_groups=math.gcd(channels, groups), rngs=rngs)


def conv_fn(conv_impl: str):
  """``lax.conv_general_dilated`` (``"lax"``) or :func:`patch_conv` (``"patches"``)."""
  if conv_impl not in CONV_IMPLS:
    raise ValueError(f"conv_impl must be one of {sorted(CONV_IMPLS)}, got {conv_impl!r}.")
  return CONV_IMPLS[conv_impl]


def conv(
    c_in: int, c_out: int, kernel: int, stride: int, rngs: nnx.Rngs, conv_impl: str = "lax"
) -> nnx.Conv:
  """Bias-free k×k convolution with symmetric padding k // 2 (PyTorch layout)."""
  pad = kernel // 2
  return nnx.Conv(
      c_in, c_out, (kernel, kernel), strides=stride, padding=((pad, pad), (pad, pad)),
      use_bias=False, kernel_init=conv_init, conv_general_dilated=conv_fn(conv_impl), rngs=rngs,
  )


class BasicBlock(nnx.Module):
  """Post-activation residual block of two 3×3 convolutions."""

  def __init__(self, c_in: int, c_out: int, stride: int, groups: int, *, rngs: nnx.Rngs,
               conv_impl: str = "lax"):
    self.conv1 = conv(c_in, c_out, 3, stride, rngs, conv_impl)
    self.norm1 = group_norm(c_out, groups, rngs)
    self.conv2 = conv(c_out, c_out, 3, 1, rngs, conv_impl)
    self.norm2 = group_norm(c_out, groups, rngs)
    if stride != 1 or c_in != c_out:
      self.shortcut = conv(c_in, c_out, 1, stride, rngs, conv_impl)
      self.shortcut_norm = group_norm(c_out, groups, rngs)
    else:
      self.shortcut = None
      self.shortcut_norm = None

  def __call__(self, x: jax.Array) -> jax.Array:
    y = jax.nn.relu(self.norm1(self.conv1(x)))
    y = self.norm2(self.conv2(y))
    skip = x if self.shortcut is None else (  # shortcut_norm is set with shortcut
        self.shortcut_norm(self.shortcut(x)))  # pyright: ignore[reportOptionalCall]
    return jax.nn.relu(y + skip)


class ResNet(nnx.Module):
  """CIFAR ResNet of basic blocks; the default configuration is ResNet-18.

  Args:
    num_classes: outputs of ``head``.
    in_channels: image channels (3 for CIFAR/SVHN, 1 for MNIST).
    stage_sizes: blocks per stage; (2, 2, 2, 2) is ResNet-18.
    width: channels of the stem and first stage; stage s has width·2^s.
    groups: GroupNorm groups (reduced to gcd(channels, groups) per layer).
    conv_impl: ``"lax"`` (default) or ``"patches"`` (fast per-example
      gradients on CPU); the same function.
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
      conv_impl: str = "lax",
      rngs: nnx.Rngs,
  ):
    self.stem = conv(in_channels, width, 3, 1, rngs, conv_impl)
    self.stem_norm = group_norm(width, groups, rngs)
    stages = []
    c_in = width
    for s, size in enumerate(stage_sizes):
      c_out = width * 2**s
      blocks = []
      for b in range(size):
        stride = 2 if (s > 0 and b == 0) else 1
        blocks.append(BasicBlock(c_in, c_out, stride, groups, rngs=rngs, conv_impl=conv_impl))
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

