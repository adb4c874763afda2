"""One release, and the plain loop of releases: budget → sample → step → record.

::

    release(state):  Poisson sample with key index k ─► padded chunks ─► ONE private step
                     ─► the next state (step t + 1, key index k + 1), the step's output
                     and the released clipped sum's seal

    run_releases:    for each schedule step t: stop if one more release would exceed the
                     budget (the ledger); release(state); ledger.record(...)

:func:`release` is the unit every loop is written from: the one trainer
(:func:`~dpmuon_jax.training.driver.run_task`) writes its own loop around it
(journal, evaluation, checkpoints, in that order, each a call from the loop
into a named function), the privacy audit another (the white-box adversary's
residual). :func:`run_releases` is the loop with nothing around the
releases, for a Python training run with a ledger and no files. The key
index k selects the sample, the noise key and the augmentation of a release;
it equals t unless a resumed run had to skip the keys of releases lost in a
crash (:mod:`dpmuon_jax.training.journal`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
import optax

from dpmuon_jax.privacy.accounting import PrivacyLedger
from dpmuon_jax.privacy.release import PrivateTransformation
from dpmuon_jax.privacy.sampling import PaddedBatch, PoissonSampler
from dpmuon_jax.training.step import PrivateStep, StepOutput

PyTree = Any
Chunks = Sequence[tuple[PyTree, Any]]
ToChunks = Callable[[list[PaddedBatch], int], Chunks]

COMPLETED, BUDGET = "completed", "budget"


class LoopState(NamedTuple):
  """Where a run is: parameters, optimizer state, schedule step and next key index."""

  params: PyTree
  opt_state: optax.OptState
  step: int
  key_index: int


class Released(NamedTuple):
  """One release: the state after it, the step's output (its NON-PRIVATE clip statistics
  included) and the seal of the clipped sum it released (SECRET: the journal's)."""

  state: LoopState
  out: StepOutput
  seal: Any


def host_words(seal: Any) -> tuple[int, ...]:
  """A seal's words on this host (from one local copy: it is replicated everywhere)."""
  local = seal.addressable_data(0) if isinstance(seal, jax.Array) else seal
  return tuple(int(w) for w in np.asarray(local).ravel())


def release(step_fn: PrivateStep, state: LoopState, *, sampler: PoissonSampler,
            to_chunks: ToChunks) -> Released:
  """The release of schedule step ``state.step`` with key index ``state.key_index``.

  Args:
    step_fn: the private step (:func:`~dpmuon_jax.training.step.make_private_step`).
    state: where the run is.
    sampler: the Poisson sampler; the release uses ``sampler.sample(state.key_index)``.
    to_chunks: ``(padded_batches, key_index) -> [(batch, mask), …]``: gathers
      (and augments, places on devices) each padded batch of one sample.

  Returns:
    The state after the release (step and key index one further), the step's output and
    the released sum's seal. The caller accounts for it (``ledger.record``).
  """
  chunks = to_chunks(sampler.sample(state.key_index), state.key_index)
  out, seal = step_fn.released(state.params, state.opt_state, chunks)
  return Released(LoopState(out.params, out.opt_state, state.step + 1, state.key_index + 1),
                  out, seal)


def run_releases(
    step_fn: PrivateStep,
    state: LoopState,
    end: int,
    *,
    sampler: PoissonSampler,
    optimizer: PrivateTransformation,
    to_chunks: ToChunks,
    ledger: PrivacyLedger,
) -> tuple[LoopState, str]:
  """Runs the releases of schedule steps ``state.step, …, end − 1``, each recorded.

  Args:
    step_fn, sampler, to_chunks: as :func:`release`.
    state: where to start.
    end: the schedule step to stop before.
    optimizer: the private optimizer the step releases with (read by the ledger).
    ledger: stops the loop before a release that would exceed the budget and
      records every release made.

  Returns:
    The final state and why the loop stopped: ``"completed"`` (reached ``end``) or
    ``"budget"``.
  """
  ledger.check(sampler, optimizer)  # before the first release, not after it
  while state.step < end:
    if not ledger.can_release(1):
      return state, BUDGET
    state = release(step_fn, state, sampler=sampler, to_chunks=to_chunks).state
    ledger.record(sampler, optimizer)
  return state, COMPLETED
