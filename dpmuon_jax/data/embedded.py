"""The embedded default dataset: scikit-learn's handwritten digits.

It ships inside scikit-learn (``sklearn.datasets.load_digits``), so training
works on a fresh machine without network or data directory. 1797 grayscale
8×8 images of the digits 0–9 (the test part of UCI "Optical Recognition of
Handwritten Digits", Alpaydin & Kaynak, 1998), pixel values 0..16.

Fixed, documented split, with no randomness: the first 1500 examples train,
the last 297 test (the file cycles through the classes, so both splits are
balanced: 146–153 train and 27–33 test examples per class). Pixels are mapped
to uint8 by round(v · 255 / 16), which is one-to-one on 0..16.
"""

from __future__ import annotations

from typing import Any, cast

import numpy as np

from dpmuon_jax.data.images import ImageDataset
from dpmuon_jax.extras import requires

EMBEDDED_NAME = "digits"
NUM_TRAIN = 1500


def load_embedded() -> ImageDataset:
  """Digits as an :class:`ImageDataset` of 8×8×1 uint8 images, 1500 / 297."""
  with requires("train", "The embedded 'digits' dataset"):
    from sklearn.datasets import load_digits

  digits = cast(Any, load_digits())  # a Bunch (return_X_y=False)
  images = np.round(digits.images * (255.0 / 16.0)).astype(np.uint8)[..., None]
  labels = digits.target.astype(np.int32)
  return ImageDataset(
      images[:NUM_TRAIN], labels[:NUM_TRAIN], images[NUM_TRAIN:], labels[NUM_TRAIN:],
      num_classes=10, name=EMBEDDED_NAME,
  )
