"""``dpmuon account``: σ from ε, ε from σ, or a table of σ across batch sizes, without training.

Its flags share their names, checks and parsing with the run settings
(``--epsilon``, ``--delta``, ``--noise-multiplier`` alias ``--sigma``,
``--epochs``, ``--accountant``; ``--sampling-rate`` and ``--steps`` as for
``dpmuon train-lm``).
"""

from __future__ import annotations

import argparse
import json

from dpmuon_jax import checks
from dpmuon_jax.help_format import HelpFormatter

_SHARED = ("epsilon", "delta", "noise_multiplier", "epochs", "accountant", "noise", "bands",
           "buffers")


def add(sub) -> None:
  """The ``account`` parser on ``sub`` (the subcommands of ``dpmuon``)."""
  from dpmuon_jax.training.flags import add_flags
  from dpmuon_jax.training.trainer import TrainConfig

  account = sub.add_parser(
      "account",
      help="σ from ε, ε from σ, or a table of σ across batch sizes",
      description="Privacy accounting of T Poisson-sampled Gaussian releases, without "
      "training: the noise multiplier σ that reaches a target ε (--epsilon), the ε that a "
      "given σ spends (--noise-multiplier), both with --sampling-rate q and --steps T; or a "
      "table of σ, q and T across expected batch sizes B at a fixed number of epochs "
      "(--batch-sizes, with --epsilon, --dataset-size N and --epochs: q = B/N, "
      "T = epochs/q). With --noise bandmf --bands b (cyclic Poisson sampling over b groups, "
      "each sampled at rate b·q in its turn) an example takes part in ⌈T/b⌉ releases, and "
      "those are what is composed. With --noise blt --buffers k (cyclic over b = ⌊1/q⌋ groups, "
      "one release per example per epoch) the T releases are ONE Gaussian mechanism of "
      "noise multiplier σ/Δ_T, Δ_T the sensitivity of the k-buffer BLT optimised for them, "
      "without amplification. Prints JSON (or the table).",
      formatter_class=HelpFormatter,
  )
  add_flags(account, TrainConfig, _SHARED, defaults={"epsilon": None, "epochs": None},
            helps={"epsilon": "target ε: print the σ that reaches it",
                   "noise_multiplier": "noise multiplier σ: print the ε it spends",
                   "delta": "target δ",
                   "epochs": "passes over the data, T = epochs/q (for --batch-sizes)"})
  account.add_argument("--sampling-rate", type=float, default=None,
                       help="Poisson sampling rate q = B/N")
  account.add_argument("--steps", type=int, default=None, help="T, the number of releases")
  account.add_argument("--dataset-size", type=int, default=None,
                       help="N, the number of training examples (for --batch-sizes)")
  account.add_argument("--batch-sizes", default=None,
                       help="comma-separated expected batch sizes for a σ table")


def check(args: argparse.Namespace) -> None:
  """Refuses a NaN, infinite or out-of-range number before any work, in one line that
  names its flag: the shared flags with their fields' own checks."""
  from dpmuon_jax.training.settings import check_setting, in_unit_interval
  from dpmuon_jax.training.trainer import TrainConfig

  for name in _SHARED:
    if getattr(args, name) is not None:
      check_setting(TrainConfig, name, getattr(args, name))
  if args.sampling_rate is not None:
    in_unit_interval("--sampling-rate", args.sampling_rate)
  for flag, value in (("--steps", args.steps), ("--dataset-size", args.dataset_size)):
    if value is not None:
      checks.check_positive_int(flag, value)
  if (args.noise == "bandmf") != (args.bands is not None):
    raise ValueError("--bands goes with --noise bandmf, and --noise bandmf needs --bands.")
  if (args.noise == "blt") != (args.buffers is not None):
    raise ValueError("--buffers goes with --noise blt, and --noise blt needs --buffers.")


def _composed(args: argparse.Namespace, q: float, steps: int) -> tuple[float, int]:
  """(rate, compositions) the accountant composes: (q, T), or (b·q, ⌈T/b⌉) under b-cyclic
  Poisson sampling."""
  from dpmuon_jax.privacy.accounting import participations

  bands = args.bands or 1
  if bands * q > 1:
    raise ValueError(f"--bands {bands} × q = {bands * q:g} > 1: each group would be sampled "
                     "at a rate above 1.")
  return bands * q, participations(steps, bands)


def _blt(args: argparse.Namespace, q: float, steps: int):
  """The k-buffer BLT for T releases ⌊1/q⌋ apart (make_private's, with q = B/N)."""
  from dpmuon_jax.privacy.correlated import blt_groups, blt_strategy

  return blt_strategy(steps, args.buffers, blt_groups(1.0, q))


def _sigma(args: argparse.Namespace, epsilon: float, q: float, steps: int) -> float:
  """The σ that spends ``epsilon`` over T releases at rate q, for the noise of ``args``."""
  from dpmuon_jax.privacy.accounting import (
      calibrate_blt_noise_multiplier,
      calibrate_noise_multiplier,
  )

  if args.noise == "blt":
    return calibrate_blt_noise_multiplier(epsilon, args.delta, _blt(args, q, steps),
                                          args.accountant)
  return calibrate_noise_multiplier(epsilon, args.delta, *_composed(args, q, steps),
                                    args.accountant)


def _epsilon(args: argparse.Namespace, sigma: float, q: float, steps: int) -> float:
  """The ε that σ spends over T releases at rate q, for the noise of ``args``."""
  from dpmuon_jax.privacy.accounting import compute_blt_epsilon, compute_epsilon

  if args.noise == "blt":
    return compute_blt_epsilon(sigma, args.delta, _blt(args, q, steps), args.accountant)
  return compute_epsilon(sigma, *_composed(args, q, steps), args.delta, args.accountant)


def _table(args: argparse.Namespace) -> None:
  """σ, q and T for each expected batch size at a fixed number of epochs."""
  if None in (args.epsilon, args.dataset_size, args.epochs):
    raise ValueError("--batch-sizes needs --epsilon, --dataset-size and --epochs.")
  print(f"{'B':>8} {'q':>10} {'T':>8} {'σ':>10}")
  for text in args.batch_sizes.split(","):
    batch = int(text)
    if not 0 < batch <= args.dataset_size:
      raise ValueError(f"batch size {batch} must be in [1, {args.dataset_size}].")
    q = batch / args.dataset_size
    steps = max(1, round(args.epochs / q))
    sigma = _sigma(args, args.epsilon, q, steps)
    print(f"{batch:>8} {q:>10.5f} {steps:>8} {sigma:>10.4f}")


def run(args: argparse.Namespace) -> int:
  """Prints the table, or one JSON line with σ and ε."""
  check(args)
  if args.batch_sizes is not None:
    _table(args)
    return 0
  if args.sampling_rate is None or args.steps is None:
    raise ValueError("give --sampling-rate and --steps (or --batch-sizes with a dataset size).")
  sigma, epsilon = args.noise_multiplier, args.epsilon
  if (epsilon is None) == (sigma is None):
    raise ValueError("give exactly one of --epsilon (to get σ) and --noise-multiplier "
                     "(--sigma, to get ε).")
  q, steps = args.sampling_rate, args.steps
  if sigma is not None:
    epsilon = _epsilon(args, sigma, q, steps)
  else:
    sigma = _sigma(args, epsilon, q, steps)
  print(json.dumps({"sigma": sigma, "epsilon": epsilon, "delta": args.delta,
                    "sampling_rate": q, "steps": steps, **_mechanism(args, q, steps)}))
  return 0


def _mechanism(args: argparse.Namespace, q: float, steps: int) -> dict:
  """The noise, and for correlated noise the groups and what the accountant composed."""
  from dpmuon_jax.privacy.correlated import blt_sensitivity

  if args.noise == "blt":
    strategy = _blt(args, q, steps)
    return {"noise": "blt", "buffers": args.buffers, "cycle_length": strategy.min_sep,
            "sensitivity": blt_sensitivity(strategy)}
  if args.bands:
    rate, compositions = _composed(args, q, steps)
    return {"noise": args.noise, "bands": args.bands, "rate_in_group": rate,
            "participations": compositions}
  return {"noise": args.noise}
