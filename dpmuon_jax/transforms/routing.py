"""Which parameters Muon orthogonalises, and which go to a fallback (docs/design.md, optimizers).

Presets, on the path convention of :mod:`dpmuon_jax.models.common` (the head
is the submodule ``head``; embeddings have ``embed`` in their name; norms
``norm``; leaves are ``kernel`` / ``bias`` / ``scale``):

* ``"paper1"``: every weight matrix (a leaf of rank ≥ 2 not named ``bias`` or
  ``scale``) on Muon, head and embeddings included, as paper 1 ran it; biases
  and norm scales on the fallback, DP-SGD's momentum step, whatever their rank
  (Flax's multi-head attention stores its biases as (heads, head_dim)).
* ``"muon"``: the usual Muon practice: weight matrices on Muon except
  embeddings (a path entry containing ``embed``) and the output head (a path
  entry equal to ``head``), which join the biases and norm scales on the
  fallback (DP-SGD's momentum step).
* ``"paper2"``: the same split as ``"muon"``, with AdamW as the fallback and
  each group its own settings.

A callable ``route(path, leaf) -> bool`` (``path`` a tuple of strings, True
for Muon) routes arbitrarily. Routing is post-processing: the release is ONE
release over the whole tree and happens before the partition (privacy
invariant 7, docs/design.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, get_args

import jax
import jax.numpy as jnp
import optax

from dpmuon_jax.linalg.scaling import Path, path_names

PyTree = Any
RouteFn = Callable[[Path, jax.Array], bool]
RoutingPreset = Literal["paper1", "muon", "paper2"]
Routing = RoutingPreset | RouteFn

MUON = "muon"
FALLBACK = "fallback"
PRESETS: tuple[str, ...] = get_args(RoutingPreset)


def is_embedding(path: Path) -> bool:
  """A path entry contains ``embed`` (``patch_embed``, ``token_embed``, ...)."""
  return any("embed" in name.lower() for name in path)


def is_head(path: Path) -> bool:
  """A path entry is exactly ``head`` (the classifier / LM head)."""
  return any(name.lower() == "head" for name in path)


def is_weight_matrix(path: Path, leaf: jax.Array) -> bool:
  """Rank ≥ 2 and not a bias or a norm scale (the last path entry ``bias`` / ``scale``)."""
  return jnp.ndim(leaf) >= 2 and not (path and path[-1].lower() in ("bias", "scale"))


def _muon(path: Path, leaf: jax.Array) -> bool:
  return is_weight_matrix(path, leaf) and not (is_embedding(path) or is_head(path))


_PRESET_FNS: dict[str, RouteFn] = {"paper1": is_weight_matrix, "muon": _muon, "paper2": _muon}


def route_fn(routing: Routing) -> RouteFn:
  """The (path, leaf) -> bool predicate of a preset name or a callable."""
  if callable(routing):
    return routing
  if routing not in _PRESET_FNS:
    raise ValueError(f"routing must be one of {PRESETS} or a callable, got {routing!r}.")
  return _PRESET_FNS[routing]


def muon_labels(params: PyTree, routing: Routing = "paper1") -> PyTree:
  """A tree like ``params`` of ``"muon"`` / ``"fallback"`` labels."""
  fn = route_fn(routing)
  return jax.tree_util.tree_map_with_path(
      lambda p, x: MUON if fn(path_names(p), x) else FALLBACK, params
  )


def partition_muon(
    muon: optax.GradientTransformation,
    fallback: optax.GradientTransformation,
    routing: Routing = "paper1",
) -> optax.GradientTransformationExtraArgs:
  """``optax.partition`` of the two groups under ``routing``."""
  route_fn(routing)  # validate eagerly
  return optax.partition(
      {MUON: muon, FALLBACK: fallback}, lambda tree: muon_labels(tree, routing)
  )
