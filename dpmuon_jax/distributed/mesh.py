"""The data-parallel mesh of a private step (privacy invariants 2 and 4, docs/design.md).

::

    ONE global Poisson draw ─► padded batch (capacity = k·n_devices) ─► rows sharded on 'data'
      ─► per device: Σ_{i ∈ shard} mask_i·clip_C(q_i) ─► psum ─► ONE Gaussian release

:func:`~dpmuon_jax.training.step.make_private_step` with ``mesh=data_mesh(n)``
clips and sums each device's rows and adds the per-device sums once (``psum``
over ``'data'``), so the release sees exactly the single-device clipped sum
(up to float summation order). The release then runs replicated: the noise
N(0, σ²C² I) is drawn ONCE from the release's key ``fold_in(noise_stream, t)``,
identically on every device, and added to the global sum. (Noise drawn per
device and averaged would be √n too little, a privacy bug; per-device noise
summed would be √n too much.)

Sampling stays one global draw per step (the host-side
:class:`~dpmuon_jax.privacy.sampling.PoissonSampler`): every sampled index sits
in exactly one row of the padded batch, and the rows are partitioned among the
devices, so no example enters a step twice. Padding rows (mask False) may land
on any device; they contribute zero wherever they are.

Several processes (:mod:`dpmuon_jax.distributed.multihost`; tested with 2
processes × 4 simulated CPU devices on one machine, gloo collectives): every
process calls ``jax.distributed.initialize``, builds the mesh over
``jax.devices()`` (all processes' devices) and holds the SAME root key
(:func:`~dpmuon_jax.distributed.multihost.agree_on_root`). Each process then
draws the same Poisson sample (the sampler depends only on the root's sampling
stream and t) and builds the same padded batch, and :func:`shard_batch` gives
each of its devices only that device's rows
(``jax.make_array_from_callback``): the processes' rows are disjoint and
together they are the padded batch (:func:`process_rows`). The release's key
is the same replicated value on every process, so every device adds the same
noise to the same global sum.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dpmuon_jax.privacy.sampling import default_capacity

PyTree = Any

DATA_AXIS = "data"


def data_mesh(num_devices: int | None = None, devices=None) -> Mesh:
  """A 1-D mesh with axis ``'data'`` over the first ``num_devices`` devices.

  Args:
    num_devices: how many devices (default: all of ``devices``).
    devices: the devices to use (default ``jax.devices()``, all hosts').
  """
  devices = list(jax.devices() if devices is None else devices)
  num_devices = len(devices) if num_devices is None else num_devices
  if not 1 <= num_devices <= len(devices):
    raise ValueError(f"num_devices must be in [1, {len(devices)}], got {num_devices}.")
  return Mesh(np.array(devices[:num_devices]), (DATA_AXIS,))


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Rows (axis 0) split over the ``'data'`` axis, other axes whole."""
  return NamedSharding(mesh, PartitionSpec(DATA_AXIS))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, PartitionSpec())


def sharded_capacity(
    dataset_size: int, sampling_rate: float, num_devices: int, microbatch_size: int | None = None
) -> int:
  """:func:`~dpmuon_jax.privacy.sampling.default_capacity`, a multiple of n_devices·microbatch.

  Every device then holds the same number of rows, which its microbatches divide.
  """
  multiple = num_devices * (microbatch_size or 1)
  return default_capacity(dataset_size, sampling_rate, math.lcm(multiple, 8))


def process_rows(mesh: Mesh, rows: int) -> np.ndarray:
  """The rows of a ``rows``-row batch that THIS process's devices hold, in device order.

  With one process, all of ``0..rows-1``; with several, the processes' row sets
  are disjoint and their union is every row.
  """
  index_map = batch_sharding(mesh).addressable_devices_indices_map((rows,))
  everything = np.arange(rows)
  return np.concatenate([everything[index[0]]  # pyright: ignore[reportOptionalSubscript]
                         for index in index_map.values()])  # (a row slice, never None)


def _from_host(sharding: NamedSharding, host: np.ndarray) -> jax.Array:
  """A global array of which this process places only its own devices' slices."""
  return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def shard_batch(mesh: Mesh, batch: PyTree, mask) -> tuple[PyTree, jax.Array]:
  """Places a padded batch and its mask with rows split over the devices.

  With several processes, every process passes the same whole padded batch
  (the same sample) and feeds its own devices only their rows; no row is fed
  by two processes.
  """
  num_devices = mesh.shape[DATA_AXIS]
  rows = np.shape(mask)[0]
  if rows % num_devices:
    raise ValueError(
        f"The padded batch has {rows} rows, not a multiple of the {num_devices} devices; "
        "use sharded_capacity() for the sampler's capacity."
    )
  sharding = batch_sharding(mesh)
  if not mesh.is_multi_process:
    return jax.device_put((batch, jnp.asarray(mask, jnp.bool_)), sharding)
  host = jax.tree.map(np.asarray, (batch, np.asarray(mask, np.bool_)))
  return jax.tree.map(lambda x: _from_host(sharding, x), host)
