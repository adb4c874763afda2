"""Parameters and optimizer state sharded over a (data, model) mesh (FSDP-style).

::

    mesh (data × model):  rows of the batch on 'data',  parameter matrices on 'model'

    leaf of rank ≥ 2 and ≥ min_size entries ─► split over 'model' along ONE axis:
        the largest axis divisible by n_model (ties: the later axis)
    bias, norm scale, small leaf            ─► replicated
    optimizer-state leaf shaped like a parameter p     ─► p's layout
    optimizer-state leaf shaped (K,) + p.shape (history) ─► (None,) + p's layout

The rule depends only on a leaf's shape, so a momentum buffer, an Adam moment
and every inner-momentum state take the layout of their parameter, and the
step can re-derive every layout from shapes while it is traced. The largest
axis is the one Newton–Schulz contracts: on the wide orientation X (r × c,
r ≤ c) the Gram product X Xᵀ sums over the c axis, so with X split along it
each device forms an r × r partial Gram and XLA adds them with one all-reduce;
the products by the Gram matrix then stay local.

The layouts only change where the numbers live, never what is computed: the
clipped sum is still added once over 'data', and the release's noise for key
k and release t is the same array on every mesh (JAX's partitionable
threefry generates each shard of ``jax.random.normal(k, shape)`` as that slice
of the unsharded draw).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dpmuon_jax.distributed.mesh import DATA_AXIS

PyTree = Any

MODEL_AXIS = "model"
MIN_SHARDED_SIZE = 1024
"""Leaves with fewer entries than this stay replicated (biases, norm scales, tiny kernels)."""


def parse_mesh_shape(text: str) -> tuple[int, int]:
  """``"DATAxMODEL"`` (e.g. ``"2x4"``) as ``(data, model)``; one-line ValueError otherwise."""
  parts = text.lower().split("x")
  if len(parts) != 2 or not all(p.strip().isdigit() and int(p) >= 1 for p in parts):
    raise ValueError(f"A mesh shape is DATAxMODEL with positive integers (e.g. 2x4), got {text!r}.")
  return int(parts[0]), int(parts[1])


def model_mesh(data: int, model: int, devices: Sequence[Any] | None = None) -> Mesh:
  """A ``(data, model)`` mesh over all ``devices`` (default ``jax.devices()``, all hosts').

  Neighbouring devices share a ``'model'`` group, so its collectives (the
  Gram all-reduces) stay within a host where they can.
  """
  devices = list(jax.devices() if devices is None else devices)
  if data < 1 or model < 1 or data * model != len(devices):
    n = len(devices)
    shapes = f"e.g. {n}x1 or 1x{n}" if n > 1 else "only 1x1"
    raise ValueError(
        f"The mesh {data}x{model} needs positive axis sizes whose product is the "
        f"{n} device{'s' if n > 1 else ''} ({shapes})."
    )
  return Mesh(np.array(devices).reshape(data, model), (DATA_AXIS, MODEL_AXIS))


def model_size(mesh: Mesh) -> int:
  """n_model, the size of the mesh's ``'model'`` axis (1 without one)."""
  return dict(mesh.shape).get(MODEL_AXIS, 1)


def leaf_spec(shape: Sequence[int], n_model: int, name: str = "<leaf>",
              min_size: int = MIN_SHARDED_SIZE) -> PartitionSpec:
  """The layout of one parameter over ``'model'`` (module docstring's rule).

  Raises:
    ValueError: a leaf of rank ≥ 2 and ≥ ``min_size`` entries none of whose
      axes n_model divides (one line, naming the leaf).
  """
  shape = tuple(int(d) for d in shape)
  if n_model == 1 or len(shape) < 2 or math.prod(shape) < min_size:
    return PartitionSpec()
  divisible = [axis for axis, d in enumerate(shape) if d % n_model == 0]
  if not divisible:
    raise ValueError(
        f"Leaf {name} of shape {shape} cannot be sharded over 'model' = {n_model}: no axis "
        f"is divisible by {n_model}; choose another model axis size."
    )
  axis = max(divisible, key=lambda a: (shape[a], a))
  return PartitionSpec(*([None] * axis + [MODEL_AXIS]))


def param_specs(params: PyTree, n_model: int, min_size: int = MIN_SHARDED_SIZE) -> PyTree:
  """:func:`leaf_spec` of every parameter, as a tree like ``params``."""
  return jax.tree_util.tree_map_with_path(
      lambda path, p: leaf_spec(np.shape(p), n_model, jax.tree_util.keystr(path), min_size),
      params,
  )


def state_specs(state: PyTree, params: PyTree, n_model: int,
                min_size: int = MIN_SHARDED_SIZE) -> PyTree:
  """Layouts of an optimizer state: a parameter's for its shape, (None,) + it for a history."""
  by_shape: dict[tuple[int, ...], PartitionSpec] = {}
  for path, p in jax.tree_util.tree_flatten_with_path(params)[0]:
    by_shape[tuple(np.shape(p))] = leaf_spec(
        np.shape(p), n_model, jax.tree_util.keystr(path), min_size)

  def one(x) -> PartitionSpec:
    shape = tuple(np.shape(x))
    if shape in by_shape:
      return by_shape[shape]
    if len(shape) > 2 and shape[1:] in by_shape:
      return PartitionSpec(None, *by_shape[shape[1:]])
    return PartitionSpec()

  return jax.tree.map(one, state)


def shardings(mesh: Mesh, specs: PyTree) -> PyTree:
  """``NamedSharding``\\ s of ``specs`` on ``mesh``."""
  return jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                      is_leaf=lambda s: isinstance(s, PartitionSpec))


def train_state_shardings(mesh: Mesh, params: PyTree, opt_state: PyTree) -> tuple[PyTree, PyTree]:
  """The shardings of ``(params, opt_state)`` on ``mesh`` by the module's rule."""
  n_model = model_size(mesh)
  return (shardings(mesh, param_specs(params, n_model)),
          shardings(mesh, state_specs(opt_state, params, n_model)))


def shard_train_state(mesh: Mesh, params: PyTree, opt_state: PyTree) -> tuple[PyTree, PyTree]:
  """Places ``params`` and ``opt_state`` on ``mesh``, each leaf by the module's rule.

  With several processes, every process passes the same whole state (e.g. the public
  initialisation, or the checkpoint each one read) and places only its devices' slices.
  """
  target = train_state_shardings(mesh, params, opt_state)
  if not mesh.is_multi_process:
    return jax.device_put((params, opt_state), target)

  def place(x, sharding: NamedSharding) -> jax.Array:
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

  return jax.tree.map(place, (params, opt_state), target)


def constrain_train_state(mesh: Mesh, params: PyTree, opt_state: PyTree) -> tuple[PyTree, PyTree]:
  """:func:`shard_train_state` as sharding constraints, inside ``jit``."""
  return jax.lax.with_sharding_constraint(
      (params, opt_state), train_state_shardings(mesh, params, opt_state))


def per_device_bytes(tree: PyTree) -> int:
  """Bytes of ``tree`` held by ONE device (the first), summed over the leaves."""
  total = 0
  for leaf in jax.tree.leaves(tree):
    shard = leaf.addressable_shards[0]
    total += shard.data.size * shard.data.dtype.itemsize
  return total
