"""Data: npz and TFDS loaders agree, the embedded digits, errors, augmentation."""

import io
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dpmuon_jax.data import loaders
from dpmuon_jax.data.augment import augment
from dpmuon_jax.data.embedded import load_embedded
from dpmuon_jax.data.images import ImageDataset, dataset_info, normalize
from dpmuon_jax.data.loaders import DATASET_NAMES, load_dataset, load_npz, load_tfds
from dpmuon_jax.privacy.keys import split_streams


def _tiny_arrays(n_train=7, n_test=4, seed=0):
  """MNIST-layout arrays: (N, 28, 28) uint8 images without channel axis, int64 labels."""
  rng = np.random.default_rng(seed)
  return {
      "x_train": rng.integers(0, 256, (n_train, 28, 28), dtype=np.uint8),
      "y_train": rng.integers(0, 10, n_train).astype(np.int64),
      "x_test": rng.integers(0, 256, (n_test, 28, 28), dtype=np.uint8),
      "y_test": rng.integers(0, 10, n_test).astype(np.int64),
  }


def _write_tfds_mnist(arrays, data_dir):
  """A prepared array_record TFDS ``mnist`` dir from arrays, without TensorFlow.

  Same approach as shared/data/npz2tfds.py: the catalog builder (name, version,
  features) with local split generators; images go in as PNG bytes (lossless).
  """
  tfds = pytest.importorskip("tensorflow_datasets")
  image_module = pytest.importorskip("PIL.Image")

  def png(a):
    buf = io.BytesIO()
    image_module.fromarray(a).save(buf, format="PNG")
    return buf.getvalue()

  class LocalMnist(tfds.image_classification.MNIST, skip_registration=True):
    name = "mnist"

    def _split_generators(self, dl_manager):
      return {split: self._examples(arrays[f"x_{split}"], arrays[f"y_{split}"])
              for split in ("train", "test")}

    def _examples(self, x, y):
      for i in range(len(y)):
        yield i, {"image": png(x[i]), "label": int(y[i])}

  builder = LocalMnist(data_dir=str(data_dir), file_format="array_record")
  builder.download_and_prepare(
      download_config=tfds.download.DownloadConfig(try_download_gcs=False))


def _sorted_examples(x, y):
  """Examples as a sorted list of (label, image bytes): TFDS shuffles at preparation."""
  return sorted((int(label), image.tobytes()) for image, label in zip(x, y, strict=True))


def test_npz_and_tfds_loaders_give_the_same_examples(tmp_path, monkeypatch):
  monkeypatch.setattr(loaders, "_READ_CHUNK", 3)  # several chunks per split
  arrays = _tiny_arrays()
  np.savez(tmp_path / "mnist.npz", **arrays)
  _write_tfds_mnist(arrays, tmp_path / "tfds")

  from_npz = load_npz(tmp_path / "mnist.npz")
  from_tfds = load_tfds("mnist", data_dir=str(tmp_path / "tfds"))
  for ds in (from_npz, from_tfds):
    assert ds.name == "mnist" and ds.num_classes == 10
    assert ds.x_train.dtype == np.uint8 and ds.x_train.shape == (7, 28, 28, 1)
    assert ds.y_train.dtype == np.int32 and ds.x_test.shape == (4, 28, 28, 1)
  np.testing.assert_array_equal(from_npz.x_train[..., 0], arrays["x_train"])  # file order
  for split in ("train", "test"):
    examples = [_sorted_examples(getattr(ds, f"x_{split}"), getattr(ds, f"y_{split}"))
                for ds in (from_npz, from_tfds)]
    assert examples[0] == examples[1]
  # The same through load_dataset (TFDS name + data dir, and an .npz path).
  ds = load_dataset("mnist", data_dir=str(tmp_path / "tfds"))
  assert _sorted_examples(ds.x_test, ds.y_test) == _sorted_examples(from_npz.x_test,
                                                                   from_npz.y_test)
  np.testing.assert_array_equal(load_dataset(str(tmp_path / "mnist.npz")).y_test, arrays["y_test"])


def test_tfds_without_prepared_dir_is_a_clear_error(tmp_path):
  with pytest.raises(FileNotFoundError, match="not prepared in"):
    load_tfds("cifar10", data_dir=str(tmp_path))
  with pytest.raises(ValueError, match="valid names: cifar10"):
    load_tfds("imagenet2012", data_dir=str(tmp_path))


def test_npz_errors_are_clear(tmp_path):
  with pytest.raises(FileNotFoundError, match="No such .npz file: .*absent.npz"):
    load_npz(tmp_path / "absent.npz")
  arrays = _tiny_arrays()
  partial = {k: v for k, v in arrays.items() if k != "y_test"}
  np.savez(tmp_path / "partial.npz", **partial, extra=np.zeros(2))
  with pytest.raises(ValueError, match=r"lacks the keys y_test \(it has: extra, x_test"):
    load_npz(tmp_path / "partial.npz")
  (tmp_path / "garbage.npz").write_bytes(b"this is not a zip file")
  with pytest.raises(ValueError, match="Cannot read .*garbage.npz as an .npz"):
    load_npz(tmp_path / "garbage.npz")
  np.save(tmp_path / "single.npy", np.zeros(3))
  (tmp_path / "single.npy").rename(tmp_path / "single.npz")
  with pytest.raises(ValueError, match="single array"):
    load_npz(tmp_path / "single.npz")
  np.savez(tmp_path / "floats.npz", **{**arrays, "x_train": arrays["x_train"] / 255.0})
  with pytest.raises(ValueError, match="floats.npz: x_train must be uint8"):
    load_npz(tmp_path / "floats.npz")
  np.savez(tmp_path / "short.npz", **{**arrays, "y_train": arrays["y_train"][:3]})
  with pytest.raises(ValueError, match="x_train has 7 images but y_train has 3 labels"):
    load_npz(tmp_path / "short.npz")


def test_npz_keras_layout_and_unknown_names(tmp_path):
  rng = np.random.default_rng(1)
  keras = {
      "x_train": rng.integers(0, 256, (5, 4, 4, 3), dtype=np.uint8),
      "y_train": np.array([[0], [1], [2], [1], [0]], np.uint8),  # Keras CIFAR: (N, 1)
      "x_test": rng.integers(0, 256, (2, 4, 4, 3), dtype=np.uint8),
      "y_test": np.array([[2], [0]], np.uint8),
  }
  np.savez(tmp_path / "mine.npz", **keras)
  ds = load_npz(tmp_path / "mine.npz")
  assert ds.y_train.shape == (5,) and ds.image_shape == (4, 4, 3)
  assert ds.num_classes == 3  # unknown name: max label + 1
  assert ds.info == dataset_info("never-heard-of-it")
  assert ds.info.mean == (0.5,) and not ds.info.hflip
  assert load_npz(tmp_path / "mine.npz", num_classes=7).num_classes == 7
  with pytest.raises(ValueError, match="labels outside"):
    load_npz(tmp_path / "mine.npz", num_classes=2)
  with pytest.raises(ValueError, match="valid names: digits, cifar10, cifar100, svhn_cropped"):
    load_dataset("cifar11")
  assert DATASET_NAMES[0] == "digits"


def test_embedded_digits():
  ds = load_dataset()  # the default needs no network and no data dir
  assert ds.name == "digits" and ds.num_classes == 10
  assert ds.x_train.shape == (1500, 8, 8, 1) and ds.x_test.shape == (297, 8, 8, 1)
  assert ds.x_train.dtype == np.uint8 and ds.x_train.max() == 255 and ds.x_train.min() == 0
  assert set(np.unique(ds.y_train)) == set(range(10)) == set(np.unique(ds.y_test))
  assert np.bincount(ds.y_test).min() >= 25  # both splits balanced
  # Fixed split: the first 1500 examples of scikit-learn's file train, the rest test.
  from sklearn.datasets import load_digits

  raw = load_digits()
  np.testing.assert_array_equal(ds.y_test, raw.target[1500:])
  np.testing.assert_array_equal(ds.x_train[..., 0], np.round(raw.images[:1500] * 255 / 16))
  again = load_embedded()
  np.testing.assert_array_equal(again.x_train, ds.x_train)


def test_normalize_uses_public_constants():
  info = dataset_info("cifar10")
  images = jnp.full((2, 4, 4, 3), 255, jnp.uint8)
  out = normalize(images, info.mean, info.std)
  assert out.dtype == jnp.float32
  np.testing.assert_allclose(out[0, 0, 0], (1 - np.array(info.mean)) / np.array(info.std),
                             rtol=1e-6)


def _image_batch(n=4, size=8, channels=3):
  rng = np.random.default_rng(0)
  return jnp.asarray(rng.integers(0, 256, (n, size, size, channels), dtype=np.uint8))


def _crops(image, padding):
  """All crops and flipped crops of one (H, W, C) image with zero padding."""
  h, w, _ = image.shape
  padded = np.pad(image, ((padding, padding), (padding, padding), (0, 0)))
  crops = [padded[dy:dy + h, dx:dx + w] for dy in range(2 * padding + 1)
           for dx in range(2 * padding + 1)]
  return crops + [c[:, ::-1] for c in crops]


def test_augment_keeps_shapes_dtypes_and_is_a_crop_or_flip():
  images = _image_batch()
  key = jax.random.fold_in(split_streams(0)[0].augmentation, 0)  # a raw uint32 stream key
  aug = jax.jit(augment)
  for batch in (images, images.astype(jnp.float32)):
    out = aug(key, batch)
    assert out.shape == batch.shape and out.dtype == batch.dtype
  out = np.asarray(aug(key, images))
  for i in range(len(images)):
    assert any(np.array_equal(out[i], c) for c in _crops(np.asarray(images[i]), 4))
  identity = augment(key, images, crop_padding=0, hflip=False)
  np.testing.assert_array_equal(identity, images)


def test_augment_differs_across_steps_and_examples():
  stream = split_streams(0)[0].augmentation
  same = jnp.broadcast_to(_image_batch(1), (16, 8, 8, 3))  # 16 copies of one image
  out = np.asarray(augment(jax.random.fold_in(stream, 0), same))
  assert len({o.tobytes() for o in out}) > 8  # examples draw independently (162 outcomes)
  out_next = np.asarray(augment(jax.random.fold_in(stream, 1), same))
  assert not np.array_equal(out, out_next)
  # Example i depends only on its own image and key: changing example j leaves it alone.
  images = _image_batch()
  key = jax.random.fold_in(stream, 2)
  changed = images.at[3].set(255 - images[3])
  a, b = augment(key, images), augment(key, changed)
  np.testing.assert_array_equal(a[:3], b[:3])
  assert not np.array_equal(a[3], b[3])


def test_augment_flip_and_offset_frequencies():
  """Flips are Bernoulli(1/2) and offsets cover 0..2p: binomial bounds, fixed key."""
  n = 2000
  image = np.asarray(_image_batch(1))[0]
  batch = jnp.broadcast_to(image, (n, 8, 8, 3))
  key = jax.random.fold_in(split_streams(0)[0].augmentation, 3)
  flipped = np.asarray(augment(key, batch, crop_padding=0))
  num_flips = sum(np.array_equal(f, image[:, ::-1]) for f in flipped)
  assert all(np.array_equal(f, image) or np.array_equal(f, image[:, ::-1]) for f in flipped)
  assert abs(num_flips - n / 2) < 5 * math.sqrt(n / 4)  # 5 standard deviations
  cropped = np.asarray(augment(key, batch[:200], crop_padding=1, hflip=False))
  crops = _crops(image, 1)[:9]
  seen = {next(k for k, c in enumerate(crops) if np.array_equal(o, c)) for o in cropped}
  assert seen == set(range(9))  # P(an offset unseen in 200 draws) ≤ 9·(8/9)^200 ≈ 5e-10


def test_image_dataset_adds_channel_axis_and_validates():
  arrays = _tiny_arrays()
  ds = ImageDataset(**arrays, name="fashion_mnist")
  assert ds.image_shape == (28, 28, 1) and ds.num_train == 7 and ds.num_test == 4
  assert ds.info.mean == (0.2860,)
  with pytest.raises(ValueError, match="differ in shape"):
    ImageDataset(arrays["x_train"], arrays["y_train"], arrays["x_test"][:, :27],
                 arrays["y_test"])
