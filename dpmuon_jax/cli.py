"""The ``dpmuon`` command: ``train``, ``train-lm``, ``tune``, ``compare``, ``export``,
``account``, ``audit``.

    dpmuon train                       # DP-Muon on the embedded digits data, ε = 4
    dpmuon train --dataset cifar10.npz --model cnn --optimizer dp_muon \\
        --epsilon 4 --batch-size 1024 --epochs 5 --seed 42
    dpmuon train-lm --data-dir TEXT_DATA --model gpt2_cpu --optimizer dp_muon_im \\
        --epsilon 8 --steps 400 --sampling-rate 0.008 --denominator none
    dpmuon export runs/dpmuon          # public params + privacy certificate, no secrets
    dpmuon export runs/dpmuon --out model/
    dpmuon account --epsilon 4 --delta 1e-5 --sampling-rate 0.02 --steps 2500
    dpmuon account --sigma 1.1 --delta 1e-5 --sampling-rate 0.02 --steps 2500
    dpmuon account --epsilon 4 --dataset-size 50000 --epochs 50 \\
        --batch-sizes 256,512,1024,2048,4096
    dpmuon audit --seed 1 --noise-scale 1.0      # one-run privacy audit
    dpmuon tune --optimizer dp_muon --epsilon 4  # private learning-rate selection, ε in total
    dpmuon compare --optimizers dp_sgd,dp_muon --epsilon 4   # side by side, one plot
"""

from __future__ import annotations

import argparse
import json
import os
import sys

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


TRAIN_BATCH_SIZE = 256  # the expected batch size of every command that trains


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
  _add_account(sub)
  _add_tune(sub)
  _add_compare(sub)
  return parser


def _add_clipping_arguments(train) -> None:
  """How each example is clipped and how the clipped sum is computed."""
  train.add_argument("--clip", type=float, default=1.0, help="per-example L2 clipping norm C")
  train.add_argument("--clipping", choices=("flat", "per_layer", "automatic",
                                            "automatic_per_layer"), default="flat",
                     help="how each example is scaled to norm ≤ C: one flat clip, per layer "
                     "(C/√L each), automatic (C·g/(‖g‖+0.01)), or automatic per layer")
  train.add_argument("--microbatch-size", type=_positive_int, default=None,
                     help="accumulate per-example gradients in chunks (flat memory)")
  train.add_argument("--clipped-sum-method", choices=("vmap", "ghost", "automatic"),
                     default="vmap", help="vmap: per-example gradients; ghost: ghost norms "
                     "and one weighted backward pass (same sum and sensitivity, less memory); "
                     "automatic: ghost when every weight matrix is covered")


def _add_train(sub) -> None:
  from dpmuon_jax.data.loaders import TFDS_NAMES
  from dpmuon_jax.models.registry import MODEL_NAMES
  from dpmuon_jax.optimizers.registry import OPTIMIZERS

  train = sub.add_parser(
      "train",
      allow_abbrev=False,  # --resume reuses every setting not written out in full
      help="train a model privately to a target (ε, δ)",
      description="Train an image classifier with a differentially private optimizer.",
      formatter_class=HelpFormatter,
  )
  train.add_argument("--model", default="cnn", choices=MODEL_NAMES,
                     help="cnn: the small benchmark CNN; wrn16_4, wrn28_10, resnet18 "
                     "(GroupNorm); vit_small (LayerNorm)")
  train.add_argument(
      "--dataset",
      default="digits",
      help="'digits' (embedded, no download), a TFDS name "
      f"({', '.join(TFDS_NAMES)}), or a path to an .npz with x_train, y_train, x_test, y_test",
  )
  train.add_argument("--data-dir", default=None, help="TFDS data directory")
  optimizer_help = "; ".join(f"{k}: {v.summary}" for k, v in OPTIMIZERS.items())
  train.add_argument("--optimizer", default="dp_muon", choices=list(OPTIMIZERS),
                     help=optimizer_help)
  train.add_argument("--epsilon", type=float, default=4.0, help="target ε of the whole run")
  train.add_argument("--delta", type=float, default=1e-5, help="target δ (keep it below 1/N)")
  train.add_argument("--batch-size", type=int, default=TRAIN_BATCH_SIZE,
                     help="expected batch size qN of Poisson sampling (also the noise denominator)")
  train.add_argument("--epochs", type=float, default=10.0,
                     help="length of the run in passes over the training set: "
                     "about epochs/q releases of Poisson-sampled batches")
  train.add_argument("--lr", dest="learning_rate", type=float, default=None,
                     help="peak learning rate (default: the optimizer's paper preset)")
  train.add_argument("--fallback-lr", dest="fallback_learning_rate", type=float, default=None,
                     help="Muon family: peak learning rate of the group Muon does not take "
                     "(biases, norm scales), on the same schedule (default: the preset's, "
                     "DP-SGD's rate)")
  _add_clipping_arguments(train)
  train.add_argument("--augment", action="store_true", help="random crop and flip per example")
  train.add_argument("--noise-multiplier", type=float, default=None,
                     help="fix σ instead of calibrating it; the run stops before ε "
                     "would exceed --epsilon")
  train.add_argument("--seed", type=int, default=None,
                     help="makes noise and sampling reproducible (recorded as seeded); "
                     "default: OS entropy")
  _add_train_outputs(train)


def _add_train_outputs(train) -> None:
  """Where a run writes, how it resumes and what it shows and logs."""
  train.add_argument("--output-dir", default="runs/dpmuon",
                     help="the run's folder: results.json, history.csv, curves.png, export/ "
                     "(public), and the secret checkpoints and release journal")
  train.add_argument("--resume", action="store_true",
                     help="continue (or finish) the run in --output-dir from its latest "
                     "checkpoint, with its recorded settings unless given again")
  train.add_argument("--max-steps", type=_positive_int, default=None,
                     help="stop after this many steps (smoke runs)")
  train.add_argument("--log-clip-stats", action="store_true",
                     help="log clip fraction and gradient norms (NON-private statistics)")
  train.add_argument("--log-dir", default=None, help="also write the metrics as TensorBoard "
                     "event files here (the 'tensorboard' extra; view: tensorboard --logdir DIR)")
  train.add_argument("--accountant", choices=("rdp", "pld"), default="rdp",
                     help="dp-accounting's Rényi-DP (rdp) or privacy-loss-distribution (pld, "
                     "tighter, slower) accountant")
  train.add_argument("--init-weights", default=None,
                     help="public pretrained weights (flax.serialization msgpack of the params "
                     "dict) to fine-tune from; default: from scratch")
  train.add_argument("--devices", type=_positive_int, default=None,
                     help="data-parallel over this many devices (noise added once to the "
                     "global sum)")
  train.add_argument("--mesh", default=None, metavar="DATAxMODEL",
                     help="a (data, model) mesh over all devices, e.g. 2x4: rows split over "
                     "data, each matrix and its optimizer state split over model "
                     "(docs/sharp-edges.md, Multi-device training)")
  train.add_argument("--secure-noise", action="store_true",
                     help="exact discrete Gaussian noise on an integer grid of the clipped sum, "
                     "from OS entropy: resists floating-point attacks; one device; see "
                     "docs/sharp-edges.md")
  train.add_argument("--no-progress", dest="progress", action="store_false",
                     help="no progress bar (the final line is still printed)")
  train.add_argument("--no-plot", dest="plot", action="store_false",
                     help="do not draw curves.png (no matplotlib needed)")


def _optional(parse):
  """``parse``, with ``none`` for None (e.g. ``--denominator none``: qN)."""
  return lambda text: None if text.lower() == "none" else parse(text)


def _json_object(text: str) -> dict:
  value = json.loads(text)
  if not isinstance(value, dict):
    raise ValueError(f"expected a JSON object, got {text!r}")
  return value


def _lm_flag_type(hint: str):
  """How ``dpmuon train-lm`` parses an LMTrainConfig field of type annotation ``hint``."""
  base = hint.replace(" | None", "")
  parse = {"int": int, "float": float, "str": str, "dict": _json_object,
           "tuple[str, ...]": lambda text: tuple(t for t in text.split(",") if t),
           "tuple[int, ...]": lambda text: tuple(int(t) for t in text.split(",") if t)}[base]
  return _optional(parse) if hint.endswith("| None") else parse


def _add_train_lm(sub) -> None:
  """``dpmuon train-lm``: one flag per field of :class:`~dpmuon_jax.text.train.LMTrainConfig`."""
  import dataclasses

  from dpmuon_jax.text.train import FLAG_HELP, LMTrainConfig

  train_lm = sub.add_parser(
      "train-lm", allow_abbrev=False,
      help="fine-tune or train GPT-2 privately on E2E or DART (paper 2)",
      description="Private table-to-text training of GPT-2 with the image trainer's rules "
      "(checkpoints, release journal, --resume, several processes). Each flag is the "
      "LMTrainConfig field of the same name (dpmuon_jax.text.train); lists are "
      "comma-separated, dicts JSON, and 'none' clears an optional value.",
      formatter_class=HelpFormatter)
  for field in dataclasses.fields(LMTrainConfig):
    flag, hint = "--" + field.name.replace("_", "-"), str(field.type)
    if field.default_factory is not dataclasses.MISSING:
      default = field.default_factory()
    else:
      default = field.default
    help = FLAG_HELP[field.name]
    if default is dataclasses.MISSING:  # required, but --resume may take the recorded one
      train_lm.add_argument(flag, type=_lm_flag_type(hint), default=None,
                            help=f"{help} (required; --resume: the run's)")
    elif hint == "bool":
      train_lm.add_argument(flag, action=argparse.BooleanOptionalAction, default=default,
                            help=help)
    else:
      train_lm.add_argument(flag, type=_lm_flag_type(hint), default=default, help=help)


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


def _add_account(sub) -> None:
  account = sub.add_parser(
      "account",
      help="σ from ε, ε from σ, or a table of σ across batch sizes",
      description="Privacy accounting of T Poisson-sampled Gaussian releases, without "
      "training: the noise multiplier σ that reaches a target ε (--epsilon), the ε that a "
      "given σ spends (--sigma), both with --sampling-rate q and --steps T; or a table of σ, "
      "q and T across expected batch sizes B at a fixed number of epochs (--batch-sizes, "
      "with --epsilon, --dataset-size N and --epochs: q = B/N, T = epochs/q). Prints JSON "
      "(or the table).",
      formatter_class=HelpFormatter,
  )
  account.add_argument("--epsilon", type=float, default=None,
                       help="target ε: print the σ that reaches it")
  account.add_argument("--sigma", type=float, default=None,
                       help="noise multiplier σ: print the ε it spends")
  account.add_argument("--delta", type=float, default=1e-5, help="target δ")
  account.add_argument("--sampling-rate", type=float, default=None,
                       help="Poisson sampling rate q = B/N")
  account.add_argument("--steps", type=int, default=None, help="T, the number of releases")
  account.add_argument("--dataset-size", type=int, default=None,
                       help="N, the number of training examples (for --batch-sizes)")
  account.add_argument("--epochs", type=float, default=None,
                       help="passes over the data, T = epochs/q (for --batch-sizes)")
  account.add_argument("--batch-sizes", default=None,
                       help="comma-separated expected batch sizes for a σ table")
  account.add_argument("--accountant", choices=("rdp", "pld"), default="rdp",
                       help="dp-accounting's Rényi-DP (rdp) or privacy-loss-distribution "
                       "(pld) accountant")


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


def _account(args: argparse.Namespace) -> int:
  from dpmuon_jax.privacy.accounting import calibrate_noise_multiplier, compute_epsilon

  if args.batch_sizes is not None:
    if None in (args.epsilon, args.dataset_size, args.epochs):
      raise ValueError("--batch-sizes needs --epsilon, --dataset-size and --epochs.")
    rows = []
    for text in args.batch_sizes.split(","):
      batch = int(text)
      if not 0 < batch <= args.dataset_size:
        raise ValueError(f"batch size {batch} must be in [1, {args.dataset_size}].")
      q = batch / args.dataset_size
      steps = max(1, round(args.epochs / q))
      sigma = calibrate_noise_multiplier(args.epsilon, args.delta, q, steps, args.accountant)
      rows.append({"batch_size": batch, "sampling_rate": q, "steps": steps, "sigma": sigma})
    print(f"{'B':>8} {'q':>10} {'T':>8} {'σ':>10}")
    for r in rows:
      print(f"{r['batch_size']:>8} {r['sampling_rate']:>10.5f} {r['steps']:>8} {r['sigma']:>10.4f}")
    return 0
  if args.sampling_rate is None or args.steps is None:
    raise ValueError("give --sampling-rate and --steps (or --batch-sizes with a dataset size).")
  if (args.epsilon is None) == (args.sigma is None):
    raise ValueError("give exactly one of --epsilon (to get σ) and --sigma (to get ε).")
  if args.sigma is not None:
    eps = compute_epsilon(args.sigma, args.sampling_rate, args.steps, args.delta, args.accountant)
    print(json.dumps({"epsilon": eps, "sigma": args.sigma, "delta": args.delta,
                      "sampling_rate": args.sampling_rate, "steps": args.steps}))
  else:
    sigma = calibrate_noise_multiplier(
        args.epsilon, args.delta, args.sampling_rate, args.steps, args.accountant
    )
    print(json.dumps({"sigma": sigma, "epsilon": args.epsilon, "delta": args.delta,
                      "sampling_rate": args.sampling_rate, "steps": args.steps}))
  return 0


def _add_run_arguments(parser, epochs: float, batch_size: int, output_dir: str) -> None:
  """The trainer flags ``dpmuon tune`` and ``dpmuon compare`` share (fewer epochs than
  ``dpmuon train``; the same batch size)."""
  from dpmuon_jax.models.registry import MODEL_NAMES

  parser.add_argument("--model", default="cnn", choices=MODEL_NAMES, help="as for dpmuon train")
  parser.add_argument("--dataset", default="digits",
                      help="'digits' (embedded), a TFDS name, or an .npz path (as dpmuon train)")
  parser.add_argument("--data-dir", default=None, help="TFDS data directory")
  parser.add_argument("--epsilon", type=float, default=4.0,
                      help="target ε (tune: of the whole search; compare: of each run)")
  parser.add_argument("--delta", type=float, default=1e-5, help="target δ")
  parser.add_argument("--batch-size", type=_positive_int, default=batch_size,
                      help="expected batch size qN of Poisson sampling")
  parser.add_argument("--epochs", type=float, default=epochs, help="passes over the data, per run")
  parser.add_argument("--clip", type=float, default=1.0, help="per-example L2 clipping norm C")
  parser.add_argument("--microbatch-size", type=_positive_int, default=None,
                      help="as for dpmuon train")
  parser.add_argument("--clipped-sum-method", choices=("vmap", "ghost", "automatic"),
                      default="vmap", help="as for dpmuon train")
  parser.add_argument("--max-steps", type=_positive_int, default=None,
                      help="stop each run after this many steps (smoke runs)")
  parser.add_argument("--output-dir", default=output_dir, help="where the runs and summary go")


def _add_tune(sub) -> None:
  from dpmuon_jax.optimizers.registry import OPTIMIZERS

  tune = sub.add_parser(
      "tune",
      help="private learning-rate selection; ε covers the whole search",
      description="Select a learning rate privately (Papernot & Steinke, 'Hyperparameter "
      "Tuning with Renyi Differential Privacy', ICLR 2022): a random number K of private runs, "
      "each with a learning rate drawn from a ×3 grid and scored by its noisy accuracy on a "
      "validation part held out from the training split; only the best run is kept. σ is "
      "calibrated so that the WHOLE procedure spends at most --epsilon. K, the other runs and "
      "their scores stay secret (they are not printed without --show-all-runs).",
      formatter_class=HelpFormatter,
  )
  tune.add_argument("--optimizer", default="dp_muon", choices=list(OPTIMIZERS),
                    help="a registered optimizer (dpmuon train --help lists them)")
  _add_run_arguments(tune, epochs=2.0, batch_size=TRAIN_BATCH_SIZE, output_dir="runs/tune")
  tune.add_argument("--lr-center", type=float, default=None,
                    help="centre of the grid (default: the optimizer's preset learning rate)")
  tune.add_argument("--grid-size", type=_positive_int, default=3,
                    help="number of learning rates, spaced ×3")
  tune.add_argument("--learning-rates", default=None,
                    help="comma-separated grid, instead of --lr-center and --grid-size")
  tune.add_argument("--expected-runs", type=float, default=3.0, help="E[K]")
  tune.add_argument("--eta", type=float, default=1.0,
                    help="K ~ truncated negative binomial with this η and mean --expected-runs "
                    "(1: geometric; 0: logarithmic, a little less ε, a longer tail of K)")
  tune.add_argument("--poisson", action="store_true",
                    help="K ~ Poisson(--expected-runs) instead (K = 0 selects nothing)")
  tune.add_argument("--validation-size", type=_positive_int, default=None,
                    help="examples held out from the end of the training split "
                    "(default: a fifth of it, at most 5000)")
  tune.add_argument("--score-std", type=float, default=0.02,
                    help="std of the Gaussian noise on each run's validation accuracy")
  tune.add_argument("--seed", type=int, default=None,
                    help="reproducible K, draws, noise and runs (recorded as seeded); "
                    "default: OS entropy")
  tune.add_argument("--show-all-runs", action="store_true",
                    help="also print and save every run's learning rate and score: NON-private, "
                    "not covered by ε (it reveals K and the other runs)")


def _add_compare(sub) -> None:
  compare = sub.add_parser(
      "compare",
      help="train several optimizers at one ε on the same data; table and plot",
      description="Train each optimizer once (its preset learning rate unless --learning-rates "
      "is given) at the same (ε, δ) and data; print a table and plot test accuracy per "
      "epoch. Each run is (ε, δ)-DP on its own; all of them published together compose "
      "(the combined ε is printed too).",
      formatter_class=HelpFormatter,
  )
  compare.add_argument("--optimizers", default="dp_sgd,dp_muon",
                       help="comma-separated registered optimizer names")
  compare.add_argument("--learning-rates", default=None,
                       help="comma-separated, one per optimizer (default: their presets)")
  _add_run_arguments(compare, epochs=3.0, batch_size=TRAIN_BATCH_SIZE, output_dir="runs/compare")
  compare.add_argument("--seed", type=int, default=None,
                       help="reproducible runs (recorded as seeded; each optimizer's run "
                       "derives its own streams from it); default: OS entropy")


def _floats(text: str, flag: str) -> list[float]:
  try:
    return [float(t) for t in text.split(",")]
  except ValueError:
    raise ValueError(f"{flag} must be comma-separated numbers, got {text!r}.") from None


def _run_config(args: argparse.Namespace, **fields):
  from dpmuon_jax.training.trainer import TrainConfig

  return TrainConfig(
      model=args.model, dataset=args.dataset, data_dir=args.data_dir, epsilon=args.epsilon,
      delta=args.delta, batch_size=args.batch_size, epochs=args.epochs, clip=args.clip,
      microbatch_size=args.microbatch_size, clipped_sum_method=args.clipped_sum_method,
      max_steps=args.max_steps,
      output_dir=args.output_dir, progress=False, **fields)


def _tune_options(args: argparse.Namespace, num_train: int):
  from dpmuon_jax.optimizers.registry import preset
  from dpmuon_jax.privacy.tuning import Poisson, truncated_negative_binomial
  from dpmuon_jax.training.selection import TuneOptions, learning_rate_grid

  if args.learning_rates is not None:
    rates = tuple(_floats(args.learning_rates, "--learning-rates"))
    if not all(r > 0 for r in rates):
      raise ValueError(f"--learning-rates must be positive, got {args.learning_rates}.")
  else:
    center = args.lr_center or preset(args.optimizer).learning_rate
    rates = learning_rate_grid(center, args.grid_size, 3.0)
  if args.poisson:
    distribution = Poisson(args.expected_runs)
  else:
    distribution = truncated_negative_binomial(args.expected_runs, args.eta)
  size = args.validation_size or max(1, min(5000, num_train // 5))
  return TuneOptions(rates, distribution, size, args.score_std, args.seed, args.show_all_runs)


def _tune(args: argparse.Namespace) -> int:
  from dpmuon_jax.data.loaders import load_dataset
  from dpmuon_jax.training.selection import tune_learning_rate

  data = load_dataset(args.dataset, args.data_dir)
  options = _tune_options(args, data.num_train)
  config = _run_config(args, optimizer=args.optimizer, plot=False)
  print(f"tuning {args.optimizer} on {data.name}: learning rates "
        f"{', '.join(f'{r:.4g}' for r in options.learning_rates)}, E[K] = "
        f"{args.expected_runs:g} runs, {options.validation_size} validation examples")
  s = tune_learning_rate(config, data, options)
  if args.show_all_runs:
    print(f"NON-private, not covered by ε: {len(s['nonprivate_runs'])} run(s):")
    for r in s["nonprivate_runs"]:
      print(f"  learning rate {r['learning_rate']:.4g}: noisy validation accuracy {r['score']:.4f}")
  if s["selected_run"] is None:
    print("K = 0 runs were drawn: nothing is selected (the Poisson law allows it).")
  else:
    print(f"chosen learning rate {s['learning_rate']:.4g}: noisy validation accuracy "
          f"{s['score']:.4f} (noise std {s['score_std']:g}); its test accuracy "
          f"{s['selected_run']['final_test_accuracy']:.4f}")
  print(f"ε = {s['epsilon']:.3f} at δ = {s['delta']:g} for the whole tuning procedure "
        f"(target {s['target_epsilon']:g}; σ = {s['noise_multiplier']:.4f} per run, "
        f"{s['steps_per_run']} steps); summary in {args.output_dir}/tuning.json")
  return 0


def _compare(args: argparse.Namespace) -> int:
  from dpmuon_jax.data.loaders import load_dataset
  from dpmuon_jax.training.compare import check_optimizer_names, compare_optimizers, format_table

  names = check_optimizer_names([n.strip() for n in args.optimizers.split(",") if n.strip()])
  rates = None if args.learning_rates is None else _floats(args.learning_rates,
                                                           "--learning-rates")
  data = load_dataset(args.dataset, args.data_dir)
  summary = compare_optimizers(_run_config(args, seed=args.seed, plot=False), names, data, rates)
  print(format_table(summary["rows"]))
  print(f"each run: ε ≤ {args.epsilon:g} at δ = {args.delta:g}; all {len(names)} published "
        f"together: ε = {summary['combined_epsilon']:.3f}. Plot: {summary['plot']}; "
        f"summary: {args.output_dir}/comparison.json")
  return 0


def _given_options(parser: argparse.ArgumentParser, argv: list[str]) -> set[str]:
  """The destinations of the options written out in ``argv`` (not left at their defaults)."""
  command = parser.parse_known_args(argv)[0].command
  subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
  return {action.dest for action in subparsers.choices[command]._actions
          for option in action.option_strings
          if any(token == option or token.startswith(option + "=") for token in argv)}


def _check_numbers(args: argparse.Namespace) -> None:
  """Refuses a NaN, infinite or out-of-range number of ``account``, ``tune`` or ``compare``.

  Before any work, in one line that names the flag; ``train`` checks its own
  numbers in its ``TrainConfig``.
  """
  from dpmuon_jax import checks

  if args.command not in ("account", "tune", "compare"):
    return
  runs_low = 0.0 if getattr(args, "poisson", False) else 1.0  # Poisson(μ > 0); TNB: mean > 1
  rules = {
      "epsilon": checks.check_positive,
      "sigma": checks.check_nonnegative,
      "delta": lambda flag, v: checks.check_in_range(flag, v, 0.0, 1.0, False, False),
      "sampling_rate": lambda flag, v: checks.check_in_range(flag, v, 0.0, 1.0, False, True),
      "steps": checks.check_positive_int,
      "dataset_size": checks.check_positive_int,
      "epochs": checks.check_positive,
      "clip": checks.check_positive,
      "lr_center": checks.check_positive,
      "expected_runs": lambda flag, v: checks.check_in_range(flag, v, runs_low,
                                                             low_inclusive=False),
      "eta": lambda flag, v: checks.check_in_range(flag, v, -1.0, low_inclusive=False),
      "score_std": checks.check_positive,
  }
  for dest, check in rules.items():
    if getattr(args, dest, None) is not None:
      check("--" + dest.replace("_", "-"), getattr(args, dest))
  if getattr(args, "learning_rates", None) is not None:
    for rate in _floats(args.learning_rates, "--learning-rates"):
      checks.check_positive("--learning-rates", rate)


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
    _check_numbers(args)
    commands = {"train": _train, "train-lm": _train_lm, "export": _export,
                "account": _account, "tune": _tune, "compare": _compare}
    return commands[args.command](args)
  except (ValueError, OSError, KeyError, MissingExtraError) as error:
    message = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    print(f"dpmuon {args.command}: error: {message}", file=sys.stderr)
    return 2


if __name__ == "__main__":
  sys.exit(main())
