"""Canaries for the one-run audit (Steinke, Nasr & Jagielski 2023, §§2, 7).

Each of m canaries is included in the training set with probability 1/2,
independently (S_i = ±1). The draw uses a dedicated AUDIT key, never the run's
root key, so membership is independent of the sampling and noise streams of
the mechanism under test.

* White-box (gradient) canaries: canary i is an example whose per-example
  query is the fixed vector C·e_{k_i}, a distinct coordinate of the flattened
  parameters ("Dirac" canaries, the paper's §7 white-box setting). It passes
  through the same clipping (its norm is exactly C), summing and release as
  every other example. Score: −(θ_T − θ_0)[k_i], the descent along the canary.
* Black-box (input) canaries: real inputs with a random label; score: −loss.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree

from dpmuon_jax.privacy.keys import KeyLike, root_key
from dpmuon_jax.privacy.query import LossFn, QueryFn, add_batch_axis

PyTree = Any

NOT_A_CANARY = -1
"""``coordinate`` of a real (non-gradient-canary) example."""


def _audit_rng(key: KeyLike, purpose: int) -> np.random.Generator:
  """A numpy generator from the audit key (OS entropy when ``key`` is None)."""
  words = [int(w) for w in np.asarray(root_key(key).key, dtype=np.uint32)]
  return np.random.Generator(np.random.PCG64(np.random.SeedSequence(words, spawn_key=(purpose,))))


def canary_membership(key: KeyLike, num_canaries: int) -> np.ndarray:
  """S_i = +1 (True: included) with probability 1/2, independently, from the audit key."""
  return _audit_rng(key, 0).random(num_canaries) < 0.5


def canary_coordinates(key: KeyLike, num_canaries: int, num_params: int) -> np.ndarray:
  """Distinct coordinates k_i of the flattened parameters, one per gradient canary."""
  if num_canaries > num_params:
    raise ValueError(
        f"{num_canaries} gradient canaries need at least as many parameters, "
        f"the model has {num_params}; use a wider model or fewer canaries."
    )
  return _audit_rng(key, 1).permutation(num_params)[:num_canaries].astype(np.int32)


def canary_labels(key: KeyLike, true_labels: np.ndarray, num_classes: int) -> np.ndarray:
  """A random WRONG label for each black-box canary input."""
  shift = _audit_rng(key, 2).integers(1, num_classes, size=len(true_labels))
  return ((true_labels + shift) % num_classes).astype(np.int32)


def canary_query(loss_fn: LossFn, l2_clip_norm: float) -> QueryFn:
  """The gradient query, except that a gradient canary returns C·e_{k_i}.

  Examples are dicts with the loss's fields plus ``coordinate`` (k_i, or
  :data:`NOT_A_CANARY`). The result is clipped like any query.
  """

  def query(params: PyTree, example: PyTree) -> PyTree:
    coordinate = example["coordinate"]
    data = {k: v for k, v in example.items() if k != "coordinate"}
    flat, unravel = ravel_pytree(jax.grad(loss_fn)(params, add_batch_axis(data)))
    dirac = l2_clip_norm * jax.nn.one_hot(coordinate, flat.shape[0], dtype=flat.dtype)
    return unravel(jnp.where(coordinate >= 0, dirac, flat))

  return query


def white_box_scores(initial: PyTree, final: PyTree, coordinates: np.ndarray) -> np.ndarray:
  """Y_i = −(θ_T − θ_0)[k_i]: how far training descended along canary i."""
  delta = ravel_pytree(final)[0] - ravel_pytree(initial)[0]
  return -np.asarray(delta)[coordinates]


def split_scores(scores: np.ndarray, included: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """(scores of included canaries, scores of excluded canaries)."""
  scores = np.asarray(scores)
  return scores[included], scores[~included]
