"""Turning a Flax NNX module into pure functions of a parameter pytree.

The per-example query needs ``loss_fn(params, batch)`` with ``params`` a plain
nested dict of arrays (what Optax transforms see). Parameter paths follow one
convention that the Muon routing presets rely on (docs/design.md, "The optimizers"):

* the final classifier / LM head is the submodule ``head``;
* embeddings have ``embed`` in their name (``patch_embed``, ``pos_embed``,
  ``token_embed``);
* normalisation layers have ``norm`` in their name; biases are ``bias``,
  norm scales ``scale``, matrices ``kernel`` (Dense: (in, out); Conv:
  (kh, kw, in, out)).

No model of this library uses BatchNorm: batch statistics mix examples and
break per-example privacy. GroupNorm / LayerNorm are per example.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

PyTree = Any
ApplyFn = Callable[[PyTree, jax.Array], jax.Array]


class PureModel(NamedTuple):
  """``apply(params, inputs) -> outputs`` and the initial ``params`` dict."""

  apply: ApplyFn
  params: PyTree


def pure_model(module: nnx.Module) -> PureModel:
  """Splits an NNX module into a pure apply function and a dict of parameters."""
  graphdef, state = nnx.split(module)

  def apply(params: PyTree, inputs: jax.Array) -> jax.Array:
    return nnx.merge(graphdef, nnx.State(params))(inputs)

  return PureModel(apply, nnx.to_pure_dict(state))


def classification_loss(apply: ApplyFn) -> Callable[[PyTree, PyTree], jax.Array]:
  """Mean softmax cross-entropy of ``apply`` on ``{"image", "label"}`` batches."""

  def loss_fn(params: PyTree, batch: PyTree) -> jax.Array:
    logits = apply(params, batch["image"])
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]))

  return loss_fn
