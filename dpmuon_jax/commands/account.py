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

_SHARED = ("epsilon", "delta", "noise_multiplier", "epochs", "accountant", "noise", "bands")


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
      "those are what is composed. Prints JSON (or the table).",
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


def _composed(args: argparse.Namespace, q: float, steps: int) -> tuple[float, int]:
  """(rate, compositions) the accountant composes: (q, T), or (b·q, ⌈T/b⌉) under b-cyclic
  Poisson sampling."""
  from dpmuon_jax.privacy.accounting import participations

  bands = args.bands or 1
  if bands * q > 1:
    raise ValueError(f"--bands {bands} × q = {bands * q:g} > 1: each group would be sampled "
                     "at a rate above 1.")
  return bands * q, participations(steps, bands)


def _table(args: argparse.Namespace) -> None:
  """σ, q and T for each expected batch size at a fixed number of epochs."""
  from dpmuon_jax.privacy.accounting import calibrate_noise_multiplier

  if None in (args.epsilon, args.dataset_size, args.epochs):
    raise ValueError("--batch-sizes needs --epsilon, --dataset-size and --epochs.")
  print(f"{'B':>8} {'q':>10} {'T':>8} {'σ':>10}")
  for text in args.batch_sizes.split(","):
    batch = int(text)
    if not 0 < batch <= args.dataset_size:
      raise ValueError(f"batch size {batch} must be in [1, {args.dataset_size}].")
    q = batch / args.dataset_size
    steps = max(1, round(args.epochs / q))
    sigma = calibrate_noise_multiplier(args.epsilon, args.delta, *_composed(args, q, steps),
                                       args.accountant)
    print(f"{batch:>8} {q:>10.5f} {steps:>8} {sigma:>10.4f}")


def run(args: argparse.Namespace) -> int:
  """Prints the table, or one JSON line with σ and ε."""
  from dpmuon_jax.privacy.accounting import calibrate_noise_multiplier, compute_epsilon

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
  rate, compositions = _composed(args, args.sampling_rate, args.steps)
  if sigma is not None:
    epsilon = compute_epsilon(sigma, rate, compositions, args.delta, args.accountant)
  else:
    sigma = calibrate_noise_multiplier(epsilon, args.delta, rate, compositions, args.accountant)
  bandmf = {"noise": args.noise, "bands": args.bands, "rate_in_group": rate,
            "participations": compositions} if args.bands else {"noise": args.noise}
  print(json.dumps({"sigma": sigma, "epsilon": epsilon, "delta": args.delta,
                    "sampling_rate": args.sampling_rate, "steps": args.steps, **bandmf}))
  return 0
