"""The one training loop: budget → sample → step → record, with hooks for the rest.

::

    for each schedule step t:
      stop if one more release would exceed the budget (the ledger)
      before(t)                       e.g. journal the release, non-private probes
      Poisson sample with key index k ─► padded chunks ─► ONE private step
      a replay: stop unless its clipped sum's seal is the recorded one
      sealed(t, seal)                 e.g. journal the seal (SECRET)
      k ← k + 1;  ledger.record(...)
      after(t + 1)                    e.g. evaluate, log, checkpoint

The image trainer, the GPT-2 trainer and the privacy audit all run this loop;
what differs between them (how a sample becomes a batch, what is evaluated and
saved) is passed in. The key index k selects the sample, the noise key and the
augmentation of a release; it equals t unless a resumed run had to skip the
keys of releases lost in a crash (:mod:`dpmuon_jax.training.journal`).
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

COMPLETED, BUDGET, REPLAY_MISMATCH = "completed", "budget", "replay_mismatch"


class LoopState(NamedTuple):
  """Where a run is: parameters, optimizer state, schedule step and next key index."""

  params: PyTree
  opt_state: optax.OptState
  step: int
  key_index: int


class Hooks(NamedTuple):
  """What a run does around each release (all optional).

  Attributes:
    before: ``before(state)`` before release ``state.step`` (e.g. write the
      journal record that must precede it).
    expected_seal: ``expected_seal(state) -> seal or None``: a replayed release must
      release a clipped sum of this seal; otherwise its output is discarded unseen
      and the loop stops (``"replay_mismatch"``) before recording it.
    sealed: ``sealed(state, seal)`` right after the release of key index
      ``state.key_index``, before anything else (e.g. journal the SECRET seal).
    after: ``after(previous, state, out)`` after it; ``out`` carries the
      NON-PRIVATE clip statistics of the step.
  """

  before: Callable[[LoopState], None] | None = None
  expected_seal: Callable[[LoopState], Sequence[int] | None] | None = None
  sealed: Callable[[LoopState, Any], None] | None = None
  after: Callable[[LoopState, LoopState, StepOutput], None] | None = None


def host_words(seal: Any) -> tuple[int, ...]:
  """A seal's words on this host (from one local copy: it is replicated everywhere)."""
  local = seal.addressable_data(0) if isinstance(seal, jax.Array) else seal
  return tuple(int(w) for w in np.asarray(local).ravel())


def run_releases(
    step_fn: PrivateStep,
    state: LoopState,
    end: int,
    *,
    sampler: PoissonSampler,
    optimizer: PrivateTransformation,
    to_chunks: Callable[[list[PaddedBatch], int], Chunks],
    ledger: PrivacyLedger | None,
    hooks: Hooks | None = None,
) -> tuple[LoopState, str]:
  """Runs the releases of schedule steps ``state.step, …, end − 1``.

  Args:
    step_fn: the private step (:func:`~dpmuon_jax.training.step.make_private_step`).
    state: where to start.
    end: the schedule step to stop before.
    sampler: the Poisson sampler; release k uses ``sampler.sample(k)``.
    optimizer: the private optimizer the step releases with (read by the ledger).
    to_chunks: ``(padded_batches, key_index) -> [(batch, mask), …]``: gathers
      (and augments, places on devices) each padded batch of one sample.
    ledger: stops the loop before a release that would exceed the budget and
      records every release made; ``None`` only where the caller accounts
      itself (the privacy audit).
    hooks: see :class:`Hooks` (default: none).

  Returns:
    The final state and why the loop stopped: ``"completed"`` (reached
    ``end``), ``"budget"`` or ``"replay_mismatch"`` (:attr:`Hooks.expected_seal`).
  """
  hooks = Hooks() if hooks is None else hooks
  if ledger is not None:  # before the first release, not after it
    ledger.check(sampler, optimizer)
  while state.step < end:
    if ledger is not None and not ledger.can_release(1):
      return state, BUDGET
    if hooks.before is not None:
      hooks.before(state)
    chunks = to_chunks(sampler.sample(state.key_index), state.key_index)
    out, seal = step_fn.released(state.params, state.opt_state, chunks)
    expected = None if hooks.expected_seal is None else hooks.expected_seal(state)
    if expected is not None and host_words(seal) != tuple(expected):
      return state, REPLAY_MISMATCH  # another sum under a used key: ``out`` is never seen
    if hooks.sealed is not None:
      hooks.sealed(state, seal)
    previous = state
    state = LoopState(out.params, out.opt_state, state.step + 1, state.key_index + 1)
    if ledger is not None:
      ledger.record(sampler, optimizer)
    if hooks.after is not None:
      hooks.after(previous, state, out)
  return state, COMPLETED
