"""Per-example data augmentation on device: random crop and horizontal flip.

For every example i of a batch, with its own key k_i::

    x̃_i = flip_{b_i}(crop_{(u_i, v_i)}(pad_p(x_i))),
    (u_i, v_i) ~ Uniform{0..2p}²,  b_i ~ Bernoulli(½),

i.e. zero-pad by p pixels on each side, cut an H×W window at offset
(u_i, v_i), and mirror left–right when b_i = 1 (the standard CIFAR recipe,
p = 4). The keys k_1..k_B are split from one key, which the trainer derives
from the augmentation stream and the step (``fold_in(stream, step)``), so the
augmentation differs across examples and steps and never touches the noise or
sampling streams (``privacy/keys.py``). Each example depends on its own image
and key only, so augmentation does not mix examples.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def augment_image(key: jax.Array, image: jax.Array, *, crop_padding: int, hflip: bool) -> jax.Array:
  """Random crop (zero padding ``crop_padding``) and optional flip of one (H, W, C) image."""
  h, w, c = image.shape
  p = crop_padding
  crop_key, flip_key = jax.random.split(key)
  padded = jnp.pad(image, ((p, p), (p, p), (0, 0)))
  dy, dx = jax.random.randint(crop_key, (2,), 0, 2 * p + 1)
  out = jax.lax.dynamic_slice(padded, (dy, dx, 0), (h, w, c))
  if hflip:
    out = jnp.where(jax.random.bernoulli(flip_key), out[:, ::-1], out)
  return out


def augment(
    key: jax.Array, images: jax.Array, *, crop_padding: int = 4, hflip: bool = True
) -> jax.Array:
  """Augments a (B, H, W, C) batch, each example with its own key; keeps dtype.

  Args:
    key: this step's augmentation key (a typed key or raw uint32 key).
    images: the batch, any dtype (usually uint8, before :func:`~dpmuon_jax.data.images.normalize`).
    crop_padding: p of the random crop; 0 disables cropping.
    hflip: random horizontal flips (off for digits and characters; see
      ``DatasetInfo.hflip``).
  """
  keys = jax.random.split(key, images.shape[0])
  one = functools.partial(augment_image, crop_padding=crop_padding, hflip=hflip)
  return jax.vmap(one)(keys, images)
