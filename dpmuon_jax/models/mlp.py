"""The multilayer perceptron: flatten → [dense → act] × len(hidden) → ``head``.

::

    x → flatten → dense0 → act → … → dense{k-1} → act → head

The classic DP-SGD baseline model (Abadi et al. 2016, "Deep Learning with
Differential Privacy", §5.1, trained MNIST with one hidden layer of 1000
units). With one hidden layer of 128 units it has 9.6k parameters on 8×8
digits and 102k on 28×28 MNIST. Its per-example gradients are batched
matmuls only, so a private step compiles about three times faster than
:class:`~dpmuon_jax.models.cnn.SmallCNN`'s: the model for quick runs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
from flax import nnx

from dpmuon_jax.models.cnn import _ACTIVATIONS


class MLP(nnx.Module):
  """Dense layers ``dense0``… of widths ``hidden``, each followed by ``activation``, then ``head``.

  Args:
    num_classes: outputs of ``head``.
    in_features: H·W·C of one (flattened) input image.
    hidden: widths of the hidden layers (at least one).
    activation: ``"relu"`` or ``"tanh"``.
    rngs: NNX random streams for initialisation.
  """

  def __init__(self, num_classes: int, in_features: int, *, hidden: Sequence[int] = (128,),
               activation: str = "relu", rngs: nnx.Rngs):
    if activation not in _ACTIVATIONS:
      raise ValueError(f"activation must be one of {sorted(_ACTIVATIONS)}, got {activation!r}.")
    widths = tuple(int(w) for w in hidden)
    if not widths or min(widths) < 1:
      raise ValueError(f"hidden must list at least one positive width, got {tuple(hidden)}.")
    self.activation = activation
    self.num_hidden = len(widths)
    for i, (fan_in, fan_out) in enumerate(zip((in_features, *widths[:-1]), widths, strict=True)):
      setattr(self, f"dense{i}", nnx.Linear(fan_in, fan_out, rngs=rngs))
    self.head = nnx.Linear(widths[-1], num_classes, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    act = _ACTIVATIONS[self.activation]
    x = x.reshape(x.shape[:-3] + (-1,))
    for i in range(self.num_hidden):
      x = act(getattr(self, f"dense{i}")(x))
    return self.head(x)


def in_features(image_shape: Sequence[int]) -> int:
  """H·W·C of an (H, W, C) image: the MLP's input width."""
  return math.prod(int(s) for s in image_shape)
