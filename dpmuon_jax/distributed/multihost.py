"""Several JAX processes, one data-parallel mesh (privacy invariants 2 and 4, docs/design.md).

::

    process 0 ─┐                      ┌─ same root key (broadcast from process 0)
    process 1 ─┼─ jax.distributed ────┼─ same Poisson sample at every step
      …        │   initialize          ├─ each process feeds ONLY its devices' rows
    process P ─┘                      └─ psum over all devices ─► ONE Gaussian release

JAX's multi-controller model runs the same program in every process; a global
array has its rows on the devices of several processes, and a ``psum`` over the
mesh's ``'data'`` axis adds the per-device clipped sums of all of them. The
private step is then correct across processes exactly when every process
holds the same replicated inputs to the release: the same parameters, the same
optimizer state (hence the same noise key ``fold_in(noise_stream, t)``) and
the same Poisson sample. The noise is then drawn identically on every device
and added ONCE to the global sum, as on one device. Two ways to break this are
guarded here:

* a root key drawn per process (OS entropy without a seed) would give every
  process its own sample and its own noise key: :func:`agree_on_root`
  broadcasts process 0's root to all;
* processes started with different settings or data: :func:`check_same_everywhere`
  compares a digest of them across processes and fails on every process.

Files (checkpoints, the release journal, the export) are written by process 0
only (:func:`is_primary`); every process reads the same checkpoint to resume.
"""

from __future__ import annotations

import hashlib
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh

from dpmuon_jax.distributed.mesh import replicated
from dpmuon_jax.privacy.keys import RootKey

PyTree = Any

CPU_COLLECTIVES = ("gloo", "mpi")
"""Cross-process collectives of the CPU backend (``jax_cpu_collectives_implementation``)."""


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    cpu_collectives: str | None = None,
    autodetect: bool = False,
) -> bool:
  """Joins this process to a JAX process group; call it before any other JAX use.

  Args:
    coordinator_address: ``host:port`` of process 0's coordinator, e.g.
      ``"127.0.0.1:12345"`` for several processes on one machine.
    num_processes: P, the number of processes of the group.
    process_id: this process's index in ``0..P-1``.
    cpu_collectives: ``"gloo"`` (or ``"mpi"``) for collectives between CPU
      processes; without it, CPU devices of different processes cannot psum.
    autodetect: with no address, count or id, call
      ``jax.distributed.initialize()`` with no arguments, so JAX reads them
      from the cluster (TPU pods, SLURM, Open MPI, …).

  Returns:
    True when the process joined a group, False when nothing was asked (one
    process, nothing done).
  """
  if cpu_collectives is not None:
    if cpu_collectives not in CPU_COLLECTIVES:
      raise ValueError(
          f"cpu_collectives must be one of {', '.join(CPU_COLLECTIVES)}, got {cpu_collectives!r}."
      )
    jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
  given = (coordinator_address, num_processes, process_id)
  if all(value is None for value in given) and not autodetect:
    return False
  if num_processes is not None and num_processes < 1:
    raise ValueError(f"num_processes must be >= 1, got {num_processes}.")
  if process_id is not None and not (
      process_id >= 0 and (num_processes is None or process_id < num_processes)
  ):
    raise ValueError(f"process_id must be in [0, num_processes), got {process_id}.")
  jax.distributed.initialize(
      coordinator_address=coordinator_address, num_processes=num_processes,
      process_id=process_id,
  )
  return True


def is_multi_process() -> bool:
  return jax.process_count() > 1


def is_primary() -> bool:
  """Whether this process writes the run's files (process 0; always True alone)."""
  return jax.process_index() == 0


def sync(name: str) -> None:
  """A barrier of all processes (nothing with one process)."""
  if is_multi_process():
    multihost_utils.sync_global_devices(name)


def agree_on_root(root: RootKey) -> RootKey:
  """Process 0's root key, on every process (unchanged with one process).

  Every randomness of a run derives from its root: the Poisson sample of
  step t from the sampling stream, the noise of release t from
  ``fold_in(noise_stream, t)``. One root for all processes is what makes them
  draw ONE sample and add ONE noise; a root drawn from OS entropy in each
  process would silently give each its own. The broadcast is a collective, so
  it is also a barrier: every process has got this far.
  """
  if not is_multi_process():
    return root
  words = np.asarray(root.key, np.uint32)
  shared = multihost_utils.broadcast_one_to_all(
      {"key": words, "seeded": np.asarray(bool(root.seeded), np.int32)}
  )
  key = jax.numpy.asarray(np.asarray(shared["key"], np.uint32))
  return RootKey(key, bool(np.asarray(shared["seeded"])))


def digest_words(text: str) -> np.ndarray:
  """The SHA-256 digest of ``text`` as 8 uint32 words."""
  return np.frombuffer(hashlib.sha256(text.encode()).digest(), np.uint32).copy()


def check_same_everywhere(what: str, text: str) -> None:
  """Raises ValueError on EVERY process unless all processes hold the same ``text``.

  ``text`` is, e.g., a run's fingerprint (settings and data) and where it
  resumes: processes that disagree would feed different samples or different
  states into one release. Only a digest crosses between processes. A
  collective, so also a barrier.
  """
  if not is_multi_process():
    return
  everyone = np.asarray(multihost_utils.process_allgather(digest_words(text)))
  differing = [p for p in range(everyone.shape[0]) if not np.array_equal(everyone[p], everyone[0])]
  if differing:
    raise ValueError(
        f"The {jax.process_count()} processes disagree on {what}: processes {differing} "
        "differ from process 0 (start them all with the same settings and data)."
    )


def replicate(mesh: Mesh, tree: PyTree) -> PyTree:
  """Host-local arrays (the same on every process) as global arrays replicated on ``mesh``.

  E.g. parameters restored from a checkpoint by every process. Each process
  places its own copy on its own devices; nothing crosses processes.
  """
  sharding = replicated(mesh)

  def one(x):
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

  return jax.tree.map(one, tree)


def gather_to_host(tree: PyTree) -> PyTree:
  """``tree`` with every leaf split over several processes' devices gathered whole.

  A collective: every process calls it (with the same layouts), and each gets
  the whole arrays, e.g. for process 0 to write them to a checkpoint. Leaves
  that every device holds whole are left as they are; one process: unchanged.
  """
  if not is_multi_process():
    return tree
  return jax.tree.map(
      lambda x: x if getattr(x, "is_fully_replicated", True)
      else multihost_utils.process_allgather(x, tiled=True), tree)
