"""The ``dpmuon`` command: ``train``, ``train-lm``, ``tune``, ``compare``, ``export``,
``account``, ``audit``.

The flags of ``train`` and ``train-lm`` are made from their configs' fields
(:mod:`dpmuon_jax.training.flags`), and ``tune``, ``compare``, ``account`` and
``audit`` spell a shared setting the same way (``--learning-rate``,
``--noise-multiplier``, ...; the older ``--lr``, ``--fallback-lr``, ``--sigma``
and ``--data`` still parse). Each value is checked once, by its field, in one
line that names the flag.

    dpmuon train                       # DP-Muon on the embedded digits data, ε = 4
    dpmuon train --dataset cifar10.npz --model cnn --optimizer dp_muon \\
        --epsilon 4 --batch-size 1024 --epochs 5 --seed 42
    dpmuon train-lm --data-dir TEXT_DATA --model gpt2_cpu --optimizer dp_muon_im \\
        --epsilon 8 --steps 400 --sampling-rate 0.008 --denominator none
    dpmuon export runs/dpmuon          # public params + privacy certificate, no secrets
    dpmuon export runs/dpmuon --out model/
    dpmuon account --epsilon 4 --delta 1e-5 --sampling-rate 0.02 --steps 2500
    dpmuon account --noise-multiplier 1.1 --delta 1e-5 --sampling-rate 0.02 --steps 2500
    dpmuon account --epsilon 4 --dataset-size 50000 --epochs 50 \\
        --batch-sizes 256,512,1024,2048,4096
    dpmuon audit --seed 1 --noise-scale 1.0      # one-run privacy audit
    dpmuon tune --optimizer dp_muon --epsilon 4  # private learning-rate selection, ε in total
    dpmuon compare --optimizers dp_sgd,dp_muon --epsilon 4   # side by side, one plot
"""

from __future__ import annotations

import argparse
import os
import sys

from dpmuon_jax.commands import account, search
from dpmuon_jax.extras import MissingExtraError
from dpmuon_jax.help_format import HelpFormatter

_DESCRIPTION = """\
Differentially private training with spectral (Muon-style) optimizers.

Every run samples batches with Poisson sampling, clips each example's gradient
to L2 norm C, adds Gaussian noise N(0, σ²C²) to the sum and divides by the
expected batch size; σ is calibrated so the whole run spends at most the
target ε (dp-accounting, RDP). The guarantee is per run (add/remove one
example); a search over many runs is not covered, except by 'dpmuon tune',
whose (ε, δ) accounts for its whole learning-rate search.

Each command has its own help: dpmuon train --help, dpmuon audit --help, ...
"""


def _positive_int(text: str) -> int:
  value = int(text)
  if value <= 0:
    raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
  return value


class _OneLineErrorParser(argparse.ArgumentParser):
  """Bad arguments get one line on stderr and exit status 2, never a traceback."""

  def error(self, message: str):
    self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _parser() -> argparse.ArgumentParser:
  parser = _OneLineErrorParser(
      prog="dpmuon", description=_DESCRIPTION, formatter_class=argparse.RawTextHelpFormatter
  )
  from dpmuon_jax import __version__

  parser.add_argument("--version", action="version", version=f"dpmuon {__version__}")
  sub = parser.add_subparsers(dest="command", required=True)
  _add_train(sub)
  _add_distributed(sub.choices["train"])
  _add_train_lm(sub)
  _add_distributed(sub.choices["train-lm"])
  _add_export(sub)
  sub.add_parser(
      "audit",
      help="one-run empirical privacy audit (dpmuon audit --help)",
      add_help=False,
  )
  account.add(sub)
  search.add_tune(sub)
  search.add_compare(sub)
  return parser


def _optimizer_help() -> str:
  """Every registered optimizer with its summary, as of now."""
  from dpmuon_jax.optimizers.registry import OPTIMIZERS

  return "; ".join(f"{k}: {v.summary}" for k, v in OPTIMIZERS.items())


def _add_train(sub) -> None:
  """``dpmuon train``: one flag per field of :class:`~dpmuon_jax.training.trainer.TrainConfig`."""
  from dpmuon_jax.training.flags import add_flags
  from dpmuon_jax.training.trainer import TrainConfig

  train = sub.add_parser(
      "train",
      allow_abbrev=False,  # --resume reuses every setting not written out in full
      help="train a model privately to a target (ε, δ)",
      description="Train an image classifier with a differentially private optimizer. Each "
      "flag is the TrainConfig field of the same name (dpmuon_jax.training.trainer); dicts "
      "are JSON, and 'none' clears an optional value.",
      formatter_class=HelpFormatter,
  )
  add_flags(train, TrainConfig, helps={"optimizer": _optimizer_help()})


def _add_train_lm(sub) -> None:
  """``dpmuon train-lm``: one flag per field of :class:`~dpmuon_jax.text.train.LMTrainConfig`."""
  from dpmuon_jax.text.train import LMTrainConfig
  from dpmuon_jax.training.flags import add_flags

  train_lm = sub.add_parser(
      "train-lm", allow_abbrev=False,
      help="fine-tune or train GPT-2 privately on E2E or DART (paper 2)",
      description="Private table-to-text training of GPT-2 with the image trainer's rules "
      "(checkpoints, release journal, --resume, several processes). Each flag is the "
      "LMTrainConfig field of the same name (dpmuon_jax.text.train); lists are "
      "comma-separated, dicts JSON, and 'none' clears an optional value.",
      formatter_class=HelpFormatter)
  add_flags(train_lm, LMTrainConfig)


_DISTRIBUTED = ("coordinator_address", "num_processes", "process_id", "distributed",
                "cpu_collectives")


def _add_distributed(train) -> None:
  """``dpmuon train``'s flags for several JAX processes (one data-parallel mesh)."""
  group = train.add_argument_group(
      "several processes",
      "Start the same command in every process (same --seed or none: process 0's root key "
      "is shared), with its own --process-id; the mesh spans all processes' devices. "
      "Process 0 writes checkpoints, journal and export; --output-dir must be one directory "
      "that all processes see.")
  group.add_argument("--coordinator-address", default=None,
                     help="host:port of process 0's coordinator, e.g. 127.0.0.1:12345")
  group.add_argument("--num-processes", type=_positive_int, default=None,
                     help="number of processes of the group")
  group.add_argument("--process-id", type=int, default=None, help="this process's index, 0..P-1")
  group.add_argument("--distributed", action="store_true",
                     help="without the three flags above, let JAX read them from the cluster "
                     "(jax.distributed.initialize() on TPU pods, SLURM, Open MPI)")
  group.add_argument("--cpu-collectives", choices=("gloo", "mpi"), default=None,
                     help="collectives between CPU processes (gloo for testing on one machine)")


def _add_export(sub) -> None:
  export = sub.add_parser(
      "export",
      help="publish a run's parameters with a privacy certificate (no keys, no optimizer state)",
      description="Export the newest intact checkpoint of a training run: params.msgpack "
      "(usable as --init-weights) and privacy_certificate.json. Checkpoints stay secret.",
  )
  export.add_argument("run_dir", metavar="RUN_DIR", help="the --output-dir of a training run")
  export.add_argument("--out", default=None, help="output directory (default: RUN_DIR/export)")


def _resolved_config(args: argparse.Namespace, cls: type):
  """Joins the process group (before the first use of a device; nothing without the flags),
  then the run's ``cls`` config: the command line's settings, and with ``--resume`` the
  recorded ones it leaves out."""
  import dataclasses

  from dpmuon_jax.distributed.multihost import initialize
  from dpmuon_jax.training.driver import recorded_config

  initialize(args.coordinator_address, args.num_processes, args.process_id,
             cpu_collectives=args.cpu_collectives, autodetect=args.distributed)
  fields = {k: v for k, v in vars(args).items() if k not in ("command", "given", *_DISTRIBUTED)}
  if args.resume:  # the run's own settings, unless the command line states them anew
    recorded = recorded_config(args.output_dir) or {}
    foreign = set(recorded) - {f.name for f in dataclasses.fields(cls)}
    if foreign:
      raise ValueError(f"--resume: {args.output_dir} holds a run of another kind (its settings "
                       f"include {', '.join(sorted(foreign))}).")
    fields = {**fields, **{k: tuple(v) if isinstance(v, list) else v  # JSON made tuples lists
                           for k, v in recorded.items() if k not in args.given}}
  for field in dataclasses.fields(cls):  # no default: given, or the run's own with --resume
    if field.default is field.default_factory is dataclasses.MISSING and fields[field.name] is None:
      raise ValueError(f"--{field.name.replace('_', '-')} is required.")
  return cls(**fields)


def _privacy_line(results: dict, output_dir: str) -> str:
  """What a finished run spent, and where its results and publishable model are."""
  return (f"ε = {results['epsilon_spent']:.3f} at δ = {results['delta']:g} "
          f"after {results['releases']} releases (σ = {results['noise_multiplier']:.4f}, "
          f"q = {results['sampling_rate']:.5f}); results in {output_dir}/results.json, "
          f"the publishable model and its privacy certificate in "
          f"{os.path.join(output_dir, results['export'])}/")


def _train(args: argparse.Namespace) -> int:
  from dpmuon_jax.training.trainer import TrainConfig, train  # importing uses no device

  results = train(_resolved_config(args, TrainConfig))
  print(f"test accuracy {results['final_test_accuracy']:.4f} "
        f"(best {results['best_test_accuracy']:.4f}); {_privacy_line(results, args.output_dir)}",
        flush=True)
  return 0


def _train_lm(args: argparse.Namespace) -> int:
  from dpmuon_jax.text.train import LMTrainConfig, train_lm  # importing uses no device

  config = _resolved_config(args, LMTrainConfig)
  probe = None
  if config.diagnostic_steps:
    from dpmuon_jax.analysis.polar_metrics import InnerMomentumProbe

    probe = InnerMomentumProbe()
  results = train_lm(config, probe=probe)
  print(f"validation NLL {results['valid_nll']:.4f}; {_privacy_line(results, args.output_dir)}",
        flush=True)
  return 0


def _export(args: argparse.Namespace) -> int:
  """Exit status 1 with one line when the run cannot be exported."""
  from dpmuon_jax.training.export import export_run, load_exported

  try:
    out = export_run(args.run_dir, args.out)
    certificate = load_exported(out).certificate
  except (ValueError, OSError, KeyError) as error:
    message = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    print(f"dpmuon export: error: {message}", file=sys.stderr)
    return 1
  print(
      f"exported step {certificate['model']['step']} to {out} (params.msgpack, "
      f"privacy_certificate.json): ε = {certificate['epsilon']:.3f} at "
      f"δ = {certificate['delta']:g} after {certificate['releases']} releases"
  )
  return 0


def _given_options(parser: argparse.ArgumentParser, argv: list[str]) -> set[str]:
  """The destinations of the options written out in ``argv`` (not left at their defaults)."""
  command = parser.parse_known_args(argv)[0].command
  subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
  return {action.dest for action in subparsers.choices[command]._actions
          for option in action.option_strings
          if any(token == option or token.startswith(option + "=") for token in argv)}


def main(argv: list[str] | None = None) -> int:
  from absl import logging as absl_logging

  absl_logging.set_verbosity(absl_logging.ERROR)  # TFDS' warnings would precede our one line
  argv = sys.argv[1:] if argv is None else argv
  if argv[:1] == ["audit"]:
    from dpmuon_jax.audit.run_audit import main as audit_main

    return audit_main(argv[1:], prog="dpmuon audit")
  parser = _parser()
  args = parser.parse_args(argv)
  args.given = _given_options(parser, argv)
  try:
    commands = {"train": _train, "train-lm": _train_lm, "export": _export,
                "account": account.run, "tune": search.run_tune, "compare": search.run_compare}
    return commands[args.command](args)
  except (ValueError, OSError, KeyError, MissingExtraError) as error:
    message = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    print(f"dpmuon {args.command}: error: {message}", file=sys.stderr)
    return 2


if __name__ == "__main__":
  sys.exit(main())
