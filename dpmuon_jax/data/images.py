"""In-memory image-classification datasets and their public constants.

A dataset is four numpy arrays: uint8 images in NHWC layout and integer
labels, for a train and a test split. Everything fits in host memory for the
supported datasets (CIFAR-10/100, SVHN, MNIST, Fashion-MNIST, digits); the
Poisson sampler gathers its batch by index, which is random access.

Normalisation uses FIXED PUBLIC constants per dataset (the usual published
per-channel means and standard deviations of the training images), never
statistics computed from the private data at run time: those would be a
data-dependent release outside the privacy accounting. Unknown datasets (e.g.
a user's ``.npz``) get the data-independent mean 0.5, std 0.5.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


class DatasetInfo(NamedTuple):
  """Public facts about a dataset: classes, normalisation, augmentation.

  ``hflip`` says whether horizontal flips preserve the label (not for digits
  or characters); ``crop_padding`` is the padding of the random crop.
  """

  num_classes: int | None
  mean: tuple[float, ...]
  std: tuple[float, ...]
  hflip: bool
  crop_padding: int


# Per-channel mean / std of the training images in [0, 1], from the
# literature (CIFAR-100, SVHN: as in timm / torchvision examples); digits'
# were computed once over the 1797 images shipped with scikit-learn. Crop
# padding 4 for 28–32 pixel images, 1 for the 8×8 digits (the same ~1/8 shift).
DATASETS: dict[str, DatasetInfo] = {
    "cifar10": DatasetInfo(10, (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616), True, 4),
    "cifar100": DatasetInfo(100, (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762), True, 4),
    "svhn_cropped": DatasetInfo(10, (0.4377, 0.4438, 0.4728), (0.1980, 0.2010, 0.1970), False, 4),
    "mnist": DatasetInfo(10, (0.1307,), (0.3081,), False, 4),
    "fashion_mnist": DatasetInfo(10, (0.2860,), (0.3530,), False, 4),
    "digits": DatasetInfo(10, (0.3053,), (0.3759,), False, 1),
}
_UNKNOWN = DatasetInfo(None, (0.5,), (0.5,), False, 4)


def dataset_info(name: str) -> DatasetInfo:
  """The public constants of ``name``; data-independent defaults if unknown."""
  return DATASETS.get(name, _UNKNOWN)


@dataclasses.dataclass(frozen=True, eq=False)
class ImageDataset:
  """Train and test splits held as numpy arrays.

  Images are uint8 NHWC; (N, H, W) arrays (MNIST layout) get a channel axis.
  Labels are int32 of shape (N,) ((N, 1), the Keras CIFAR layout, is
  flattened). ``num_classes=None`` takes the public number of classes of a
  known ``name`` and otherwise max(label) + 1 over both splits, which depends
  on the data: pass it explicitly for private data of an unknown layout.
  """

  x_train: np.ndarray
  y_train: np.ndarray
  x_test: np.ndarray
  y_test: np.ndarray
  num_classes: int | None = None
  name: str = "dataset"
  user_train: np.ndarray | None = None  # each training image's user (user-level DP)

  def __post_init__(self):
    set_ = lambda field, value: object.__setattr__(self, field, value)
    if self.user_train is not None:
      set_("user_train", np.asarray(self.user_train))
      if self.user_train.shape != (len(np.asarray(self.y_train)),):
        raise ValueError(f"user_train must hold one user id per training image, got shape "
                         f"{self.user_train.shape} for {len(np.asarray(self.y_train))} images.")
    for split in ("train", "test"):
      x = _images(getattr(self, f"x_{split}"), split)
      y = _labels(getattr(self, f"y_{split}"), split)
      if len(x) != len(y):
        raise ValueError(f"x_{split} has {len(x)} images but y_{split} has {len(y)} labels.")
      set_(f"x_{split}", x)
      set_(f"y_{split}", y)
    if self.x_train.shape[1:] != self.x_test.shape[1:]:
      raise ValueError(
          f"Train and test images differ in shape: {self.x_train.shape[1:]} vs "
          f"{self.x_test.shape[1:]}."
      )
    num_classes = self.num_classes or dataset_info(self.name).num_classes
    if num_classes is None:
      num_classes = int(max(self.y_train.max(initial=0), self.y_test.max(initial=0))) + 1
    for split, y in (("train", self.y_train), ("test", self.y_test)):
      if y.size and (y.min() < 0 or y.max() >= num_classes):
        raise ValueError(f"y_{split} has labels outside [0, {num_classes}).")
    set_("num_classes", int(num_classes))

  @property
  def image_shape(self) -> tuple[int, int, int]:
    return tuple(self.x_train.shape[1:])

  @property
  def num_train(self) -> int:
    return len(self.y_train)

  @property
  def num_test(self) -> int:
    return len(self.y_test)

  @property
  def info(self) -> DatasetInfo:
    """Public normalisation and augmentation constants (by ``name``)."""
    return dataset_info(self.name)


def _images(x, split: str) -> np.ndarray:
  x = np.asarray(x)
  if x.dtype != np.uint8:
    raise ValueError(f"x_{split} must be uint8 images in [0, 255], got dtype {x.dtype}.")
  if x.ndim == 3:
    x = x[..., None]
  if x.ndim != 4:
    raise ValueError(f"x_{split} must be (N, H, W, C) or (N, H, W), got shape {x.shape}.")
  return x


def _labels(y, split: str) -> np.ndarray:
  y = np.asarray(y)
  if y.ndim == 2 and y.shape[1] == 1:
    y = y[:, 0]
  if y.ndim != 1 or not np.issubdtype(y.dtype, np.integer):
    raise ValueError(f"y_{split} must be integer labels of shape (N,), got {y.dtype} {y.shape}.")
  return y.astype(np.int32)


def normalize(images: jax.Array, mean, std) -> jax.Array:
  """(x / 255 − mean) / std per channel, in float32; jittable, on device."""
  x = jnp.asarray(images, jnp.float32) / 255.0
  return (x - jnp.asarray(mean, jnp.float32)) / jnp.asarray(std, jnp.float32)
