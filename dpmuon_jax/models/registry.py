"""Models by name: ``create_model`` and ``model_and_loss``.

* ``cnn``: :class:`~dpmuon_jax.models.cnn.SmallCNN` (~156k parameters on CIFAR-10);
* ``mlp``: :class:`~dpmuon_jax.models.mlp.MLP`, one hidden layer of 128 (9.6k parameters
  on 8×8 digits; the quickest to compile);
* ``wrn16_4``, ``wrn28_10``: :class:`~dpmuon_jax.models.wrn.WideResNet` (2.75M, 36.5M);
* ``resnet18``: :class:`~dpmuon_jax.models.resnet.ResNet` (11.2M);
* ``vit_small``: :class:`~dpmuon_jax.models.vit.VisionTransformer` (21.3M).

All use GroupNorm / LayerNorm (never BatchNorm) and the parameter-path
convention of ``models/common.py``. The initialisation seed is public: it is
not a privacy key (DP-SGD's guarantee holds for any data-independent θ₀).
It has no default, so the caller (the trainer's ``--seed`` or its own draw)
always decides it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from flax import nnx

from dpmuon_jax.models import taps
from dpmuon_jax.models.cnn import SmallCNN
from dpmuon_jax.models.common import PureModel, classification_loss, pure_model
from dpmuon_jax.models.mlp import MLP, in_features
from dpmuon_jax.models.resnet import ResNet
from dpmuon_jax.models.vit import VisionTransformer
from dpmuon_jax.models.wrn import WideResNet

Builder = Callable[..., nnx.Module]


def _mlp(num_classes: int, shape: tuple[int, int, int], rngs: nnx.Rngs, **kw: Any) -> nnx.Module:
  return MLP(num_classes, in_features(shape), rngs=rngs, **kw)


def _cnn(num_classes: int, shape: tuple[int, int, int], rngs: nnx.Rngs, **kw: Any) -> nnx.Module:
  return SmallCNN(num_classes, shape[2], image_shape=shape[:2], rngs=rngs, **kw)


def _wrn(depth: int, width: int) -> Builder:
  """WRN-``depth``-``width``; ``depth``/``width`` overrides give a scaled-down WRN."""

  def build(num_classes: int, shape: tuple[int, int, int], rngs: nnx.Rngs, **kw: Any):
    kw = {"depth": depth, "width": width, **kw}
    return WideResNet(num_classes=num_classes, in_channels=shape[2], rngs=rngs, **kw)

  return build


def _resnet18(num_classes: int, shape: tuple[int, int, int], rngs: nnx.Rngs, **kw: Any):
  return ResNet(num_classes, in_channels=shape[2], rngs=rngs, **kw)


def _vit_small(num_classes: int, shape: tuple[int, int, int], rngs: nnx.Rngs, **kw: Any):
  # 4×4 patches (64 tokens at 32×32, 49 at 28×28); 2×2 below 16 pixels (8×8 digits).
  kw.setdefault("patch_size", 4 if min(shape[:2]) >= 16 else 2)
  return VisionTransformer(num_classes, image_shape=shape, rngs=rngs, **kw)


_BUILDERS: dict[str, Builder] = {
    "cnn": _cnn,
    "mlp": _mlp,
    "wrn16_4": _wrn(16, 4),
    "wrn28_10": _wrn(28, 10),
    "resnet18": _resnet18,
    "vit_small": _vit_small,
}
MODEL_NAMES: tuple[str, ...] = tuple(_BUILDERS)


def create_model(
    name: str,
    num_classes: int,
    image_shape: Sequence[int],
    *,
    seed: int,
    **overrides: Any,
) -> nnx.Module:
  """Builds the named model for (H, W, C) images.

  Args:
    name: one of :data:`MODEL_NAMES`.
    num_classes: number of classes (outputs of ``head``).
    image_shape: (H, W, C) of one input image.
    seed: public initialisation seed.
    **overrides: constructor arguments of the model class, e.g. ``groups``;
      ``hidden`` (widths) for ``mlp``; ``conv_impl="patches"`` for the
      convolutional models (fast per-example gradients on CPU);
      ``depth``/``width`` for the WRNs and ``width``/``stage_sizes`` for
      ``resnet18`` (scaled-down variants); for
      ``vit_small``, ``dim``/``depth``/``num_heads``/``patch_size``.
  """
  if name not in _BUILDERS:
    raise ValueError(f"Unknown model {name!r}; valid names: {', '.join(MODEL_NAMES)}.")
  shape = tuple(int(s) for s in image_shape)
  if len(shape) != 3:
    raise ValueError(f"image_shape must be (H, W, C), got {tuple(image_shape)}.")
  return _BUILDERS[name](num_classes, shape, nnx.Rngs(seed), **overrides)


def model_and_loss(
    name: str,
    num_classes: int,
    image_shape: Sequence[int],
    *,
    seed: int,
    tapped: bool = False,
    **overrides: Any,
) -> tuple[PureModel, Callable[[Any, Any], Any]]:
  """``(PureModel(apply, params), loss_fn)`` of the named model (mean cross-entropy).

  ``tapped=True`` builds it with :func:`dpmuon_jax.models.taps.tapped`, so that
  ghost clipping gets the norms of its dense, convolution and embedding
  weights (the same function and parameters).
  """
  module = create_model(name, num_classes, image_shape, seed=seed, **overrides)
  model = pure_model(taps.tapped(module) if tapped else module)
  return model, classification_loss(model.apply)
