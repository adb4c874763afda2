"""Loading image datasets: local ``.npz`` files, TFDS, the embedded default.

* ``.npz`` with keys ``x_train``, ``y_train``, ``x_test``, ``y_test`` (the
  Keras layout, e.g. ``cifar10.npz`` written from a Keras or TFDS copy).
* TFDS through ``tfds.data_source``: random access to array_record files,
  without TensorFlow. The splits are read once into numpy arrays (all the
  supported datasets fit in memory), in the order of the prepared files; the
  sampler then gathers batches by index. Nothing is downloaded unless
  ``download=True`` (and preparing from the internet needs TensorFlow for
  these builders); offline, load the same data from a local ``.npz``
  (:func:`load_npz`, or ``--dataset path/to/file.npz``) instead.
* ``"digits"``: scikit-learn's digits, shipped inside the package
  (:func:`~dpmuon_jax.data.embedded.load_embedded`), the default that needs
  no network and no data directory.
"""

from __future__ import annotations

import os
import zipfile
from typing import Any, cast

import numpy as np

from dpmuon_jax.data.embedded import EMBEDDED_NAME, load_embedded
from dpmuon_jax.data.images import ImageDataset

TFDS_NAMES: tuple[str, ...] = ("cifar10", "cifar100", "svhn_cropped", "mnist", "fashion_mnist")
DATASET_NAMES: tuple[str, ...] = (EMBEDDED_NAME, *TFDS_NAMES)
NPZ_KEYS: tuple[str, ...] = ("x_train", "y_train", "x_test", "y_test")
USER_KEY = "user_train"  # optional: each training image's user, for user-level DP
_READ_CHUNK = 4096


def load_npz(path: str | os.PathLike, num_classes: int | None = None) -> ImageDataset:
  """Reads an ``.npz`` with keys x_train, y_train, x_test, y_test (and, optionally,
  ``user_train``: each training image's user id, for ``--privacy-unit user``).

  The dataset is named after the file (``cifar10.npz`` → ``"cifar10"``), which
  selects the public constants of a known dataset (``images.DATASETS``).

  Raises:
    FileNotFoundError: no file at ``path``.
    ValueError: the file is not a readable ``.npz``, lacks one of the keys, or
      holds arrays of the wrong type or shape.
  """
  path = os.fspath(path)
  if not os.path.isfile(path):
    raise FileNotFoundError(f"No such .npz file: {path}")
  try:
    data = np.load(path, allow_pickle=False)
    if not isinstance(data, np.lib.npyio.NpzFile):
      raise ValueError("it holds a single array, not named arrays")
    with data:
      present = sorted(data.files)
      arrays = {k: data[k] for k in (*NPZ_KEYS, USER_KEY) if k in present}
  except (OSError, ValueError, zipfile.BadZipFile, EOFError) as e:
    raise ValueError(f"Cannot read {path} as an .npz file: {e}") from None
  missing = [k for k in NPZ_KEYS if k not in arrays]
  if missing:
    raise ValueError(
        f"{path} lacks the keys {', '.join(missing)} (it has: {', '.join(present) or 'none'}); "
        f"expected {', '.join(NPZ_KEYS)}."
    )
  name = os.path.splitext(os.path.basename(path))[0]
  try:
    return ImageDataset(**arrays, num_classes=num_classes, name=name)
  except ValueError as e:
    raise ValueError(f"{path}: {e}") from None


def load_tfds(name: str, data_dir: str | None = None, download: bool = False) -> ImageDataset:
  """Reads the train and test splits of a TFDS image dataset into memory.

  Args:
    name: one of :data:`TFDS_NAMES`.
    data_dir: the TFDS data dir (default: TFDS's, ``~/tensorflow_datasets``).
    download: let TFDS download and prepare the dataset if it is missing.

  Raises:
    ValueError: unknown name, or a dir prepared in a format without random
      access (tfrecord).
    FileNotFoundError: the dataset is not prepared under ``data_dir`` and
      ``download`` is False.
  """
  if name not in TFDS_NAMES:
    raise ValueError(f"Unknown TFDS dataset {name!r}; valid names: {', '.join(TFDS_NAMES)}.")
  import tensorflow_datasets as tfds  # slow import, only needed here

  builder = tfds.builder(name, data_dir=data_dir)
  if not download and not builder.is_prepared():
    raise FileNotFoundError(
        f"TFDS dataset {name!r} is not prepared in {builder.data_dir}; pass the prepared "
        "TFDS data dir, load the same data from a local .npz in the Keras layout "
        "(--dataset path/to/file.npz, load_npz), or allow downloading."
    )
  try:
    source = cast(Any, tfds.data_source(name, data_dir=data_dir, download=download))
  except NotImplementedError as e:  # a tfrecord dir: no random access
    raise ValueError(f"TFDS dataset {name!r} in {builder.data_dir}: {e}") from None
  num_classes = source["train"].dataset_info.features["label"].num_classes
  train, test = (_read_split(source[split]) for split in ("train", "test"))
  return ImageDataset(*train, *test, num_classes=num_classes, name=name)


def _read_split(split) -> tuple[np.ndarray, np.ndarray]:
  images, labels = [], []
  for start in range(0, len(split), _READ_CHUNK):
    examples = split.__getitems__(list(range(start, min(start + _READ_CHUNK, len(split)))))
    images.extend(ex["image"] for ex in examples)
    labels.extend(ex["label"] for ex in examples)
  return np.stack(images), np.asarray(labels, np.int64)


def load_dataset(spec: str = EMBEDDED_NAME, data_dir: str | None = None) -> ImageDataset:
  """``"digits"`` (default) | a TFDS name | a path ending in ``.npz``."""
  if spec.endswith(".npz"):
    return load_npz(spec)
  if spec == EMBEDDED_NAME:
    return load_embedded()
  if spec in TFDS_NAMES:
    return load_tfds(spec, data_dir=data_dir)
  raise ValueError(
      f"Unknown dataset {spec!r}; valid names: {', '.join(DATASET_NAMES)}, "
      "or a path to an .npz file."
  )
