"""The settings every private run shares, each field with its flag, its help and its one check.

A run's configuration (:class:`~dpmuon_jax.training.trainer.TrainConfig`,
:class:`~dpmuon_jax.text.train.LMTrainConfig`) is a frozen, keyword-only
dataclass built on :class:`PrivacySettings` and :class:`RunControl`. Each field
is declared with :func:`setting`, whose metadata carries what the command line
needs (help text, flag name, old aliases, choices, metavar) and ONE check of
the value. Every check runs once, when the configuration is made, and names
the field's flag::

    >>> PrivacySettings(epsilon=-1)
    Traceback (most recent call last):
    ...
    ValueError: --epsilon must be a finite number > 0, got -1.

A field whose type admits ``None`` is not checked when it is ``None``. Checks
that need several fields or the data (a batch size against N, a split against
the decoded ones, the optimizer's options) stay with each task.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from dpmuon_jax import checks
from dpmuon_jax.privacy.accounting import ACCOUNTANTS, RDP
from dpmuon_jax.privacy.clipping import EXAMPLE, PRIVACY_UNITS, USER
from dpmuon_jax.privacy.correlated import BANDMF, BLT, IID, MAX_BUFFERS, NOISES
from dpmuon_jax.privacy.ghost import CLIPPED_SUM_METHODS

Check = Callable[[str, Any], Any]
"""``check(flag, value)``: raises ``ValueError("<flag> must be ..., got <value>.")``."""

Choices = Sequence[str] | Callable[[], Sequence[str]]
"""The values a field allows, or a function that returns them as of now."""


def setting(default: Any = dataclasses.MISSING, *, help: str, check: Check | None = None,
            flag: str | None = None, aliases: Sequence[str] = (),
            choices: Choices | None = None, metavar: str | None = None,
            default_factory: Callable[[], Any] | None = None) -> Any:
  """A dataclass field with its command-line metadata and its one check.

  ``flag`` defaults to ``--field-name``; ``aliases`` are older spellings that
  still parse; ``choices`` (or a function that returns them as of now, for a
  registry that grows) without a ``check`` checks membership.
  """
  if check is None and choices is not None:
    check = one_of(choices)
  metadata = {"help": help, "check": check, "flag": flag, "aliases": tuple(aliases),
              "choices": choices, "metavar": metavar}
  if default_factory is not None:
    return dataclasses.field(default_factory=default_factory, metadata=metadata)
  return dataclasses.field(default=default, metadata=metadata)


def redefault(cls: type, name: str, default: Any) -> Any:
  """``cls``'s field ``name`` with another default (a subclass redeclares it with this)."""
  return dataclasses.field(default=default, metadata=cls.__dataclass_fields__[name].metadata)


def flag_of(field: dataclasses.Field) -> str:
  """The flag of a field: its own, or ``--`` and its name with hyphens."""
  return field.metadata.get("flag") or "--" + field.name.replace("_", "-")


def is_optional(field: dataclasses.Field) -> bool:
  """Whether the field's type admits ``None`` (``'none'`` on the command line)."""
  return str(field.type).replace(" ", "").endswith("|None")


def choices_of(field: dataclasses.Field) -> tuple[str, ...] | None:
  """The values ``field`` allows as of now (None: any)."""
  choices: Choices | None = field.metadata.get("choices")
  if choices is None:
    return None
  return tuple(choices() if callable(choices) else choices)


def one_of(choices: Choices) -> Check:
  """A check that the value is one of ``choices`` (as of the check)."""

  def check(flag: str, value: Any) -> Any:
    allowed = tuple(choices() if callable(choices) else choices)
    if value not in allowed:
      raise ValueError(f"{flag} must be one of {', '.join(allowed)}, got {value!r}.")
    return value

  return check


def in_open_unit_interval(flag: str, value: Any) -> float:
  """A probability strictly between 0 and 1 (δ)."""
  return checks.check_in_range(flag, value, 0.0, 1.0, False, False)


def in_unit_interval(flag: str, value: Any) -> float:
  """A rate in (0, 1] (a sampling rate)."""
  return checks.check_in_range(flag, value, 0.0, 1.0, False, True)


def check_setting(cls: type, name: str, value: Any) -> None:
  """Runs the check of ``cls``'s field ``name`` on ``value`` (not ``None`` where allowed)."""
  field = cls.__dataclass_fields__[name]
  check = field.metadata.get("check")
  if check is not None and not (value is None and is_optional(field)):
    check(flag_of(field), value)


def validate(config: Any) -> None:
  """Runs each field's check on its value, in field order."""
  for field in dataclasses.fields(config):
    check_setting(type(config), field.name, getattr(config, field.name))


def _check_buffers(name: str, value: Any) -> int:
  """An int in [1, MAX_BUFFERS], the buffers jax_privacy's BLT optimisation takes."""
  buffers = checks.check_positive_int(name, value)
  if buffers > MAX_BUFFERS:
    raise ValueError(f"{name} must be at most {MAX_BUFFERS} (more buffers are numerically "
                     f"unstable), got {value!r}.")
  return buffers


@dataclasses.dataclass(frozen=True, kw_only=True)
class PrivacySettings:
  """What every private run is calibrated to: (ε, δ), the clip C, the accountant, the seed,
  the privacy unit and the noise.

  ``seed=None`` draws noise and sampling randomness from OS entropy; a seed
  makes the run reproducible and is recorded as seeded. ``privacy_unit="user"``
  (user-level DP, :mod:`dpmuon_jax.data.users`): users are Poisson-sampled and each
  sampled user adds ONE clipped vector, the mean gradient of their first
  ``max_examples_per_user`` records, so (ε, δ) hold per user.
  """

  epsilon: float = setting(4.0, help="target ε of the whole run", check=checks.check_positive)
  delta: float = setting(1e-5, help="target δ (keep it below 1/N)", check=in_open_unit_interval)
  clip: float = setting(1.0, help="per-example L2 clipping norm C", check=checks.check_positive)
  accountant: str = setting(
      RDP, choices=ACCOUNTANTS, help="dp-accounting's Rényi-DP (rdp) or privacy-loss-"
      "distribution (pld, tighter, slower) accountant")
  seed: int | None = setting(
      None, check=checks.check_int, help="makes noise and sampling reproducible (recorded as "
      "seeded); default: OS entropy")
  privacy_unit: str = setting(
      EXAMPLE, choices=PRIVACY_UNITS, help="example: (ε, δ) per record; user: per user, all "
      "of one user's records (needs each record's user)")
  max_examples_per_user: int = setting(
      16, check=checks.check_positive_int, help="user level: each user's first this many "
      "records (data order) form its one clipped mean gradient; the rest are dropped, counted")
  noise: str = setting(
      IID, choices=NOISES, help="iid: fresh Gaussian noise per release; bandmf: banded "
      "matrix-factorization noise, correlated over --bands releases, with cyclic Poisson "
      "sampling (each example in one of b groups, sampled every b-th release); blt: "
      "buffered-linear-Toeplitz noise with --buffers k, cyclic over b = N/B groups (one "
      "release per example per epoch), accounted without amplification")
  bands: int | None = setting(
      None, check=checks.check_positive_int, help="--noise bandmf: the bands b (and groups "
      "of the cyclic sampler); b = 1 is independent noise")
  buffers: int | None = setting(
      None, check=_check_buffers,
      help=f"--noise blt: the buffers k (1 to {MAX_BUFFERS}), k copies of the parameters")

  def __post_init__(self) -> None:
    validate(self)
    self.check_noise()

  def check_noise(self) -> None:
    """``--bands`` exactly when ``--noise bandmf``, ``--buffers`` exactly when ``--noise blt``."""
    if (self.noise == BANDMF) != (self.bands is not None):
      raise ValueError("--bands goes with --noise bandmf, and --noise bandmf needs --bands.")
    if (self.noise == BLT) != (self.buffers is not None):
      raise ValueError("--buffers goes with --noise blt, and --noise blt needs --buffers.")

  def noise_config(self) -> dict:
    """The correlated-noise settings, as a checkpoint records them (none for iid noise)."""
    if self.noise == IID:
      return {}
    if self.noise == BLT:
      return {"noise": self.noise, "buffers": self.buffers}
    return {"noise": self.noise, "bands": self.bands}


def _positive_int(help: str, default: int | None = None) -> Any:
  return setting(default, help=help, check=checks.check_positive_int)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunControl:
  """How a run is computed, where it writes, how it resumes and what it shows: never what
  it releases (the driver, :mod:`dpmuon_jax.training.driver`, reads these)."""

  output_dir: str = setting("runs/dpmuon", help="the run's folder: results.json, history.csv, "
                            "export/ (public), and the secret checkpoints and release journal")
  resume: bool = setting(False, help="continue (or finish) the run in --output-dir from its "
                         "latest checkpoint, with its recorded settings unless given again")
  microbatch_size: int | None = _positive_int(
      "accumulate the clipped sum in chunks of this many rows (flat memory)")
  clipped_sum_method: str = setting(
      "vmap", choices=CLIPPED_SUM_METHODS, help="vmap: per-example gradients; ghost: ghost "
      "norms and one weighted backward pass (same sum and sensitivity, less memory); "
      "automatic: ghost when every weight matrix is covered")
  max_steps: int | None = _positive_int(
      "stop after this many releases (smoke runs); the ledger stays exact")
  eval_every: int | None = _positive_int("evaluate every this many releases "
                                         "(default: the task's)")
  checkpoint_every: int | None = _positive_int(
      "releases between checkpoints (default: one epoch, round(1/q))")
  log_clip_stats: bool = setting(
      False, help="log clip fraction and gradient norms (NON-private statistics)")
  log_dir: str | None = setting(None, help="also write the metrics as TensorBoard event files "
                                "here (the 'tensorboard' extra; view: tensorboard --logdir DIR)")
  devices: int | None = _positive_int(
      "data-parallel over this many devices (noise added once to the global sum; several "
      "processes: all of them)")
  mesh: str | None = setting(
      None, metavar="DATAxMODEL", help="a (data, model) mesh over all devices, e.g. 2x4: rows "
      "split over data, each matrix and its optimizer state split over model "
      "(docs/sharp-edges.md, Multi-device training)")
  model_seed: int = setting(0, help="public initialisation seed", check=checks.check_int)
  progress: bool = setting(True, help="show a progress bar (the final line is printed anyway)")
  plot: bool = setting(True, help="draw curves.png (matplotlib)")

  def __post_init__(self) -> None:
    validate(self)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunSettings(PrivacySettings, RunControl):
  """What the one trainer (:mod:`dpmuon_jax.training.driver`) reads from every task's config:
  the privacy settings, the run control and the optimizer's name (each task redeclares
  ``optimizer`` with its own default and check)."""

  optimizer: str = setting("dp_muon", help="a registered optimizer name")

  def __post_init__(self) -> None:
    validate(self)
    self.check_noise()
    if self.privacy_unit == USER and self.clipped_sum_method != "vmap":
      raise ValueError("--privacy-unit user clips each user's mean gradient; ghost clipping "
                       "clips per record: use --clipped-sum-method vmap.")
