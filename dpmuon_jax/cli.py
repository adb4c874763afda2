"""The ``dpmuon`` command: ``dpmuon train``, ``dpmuon export``, ``dpmuon account``.

    dpmuon train                       # DP-SGD on the embedded digits data, ε = 4
    dpmuon train --dataset cifar10.npz --model cnn --optimizer dp_muon \\
        --epsilon 4 --batch-size 1024 --epochs 5 --seed 42
    dpmuon export runs/dpmuon          # public params + privacy certificate, no secrets
    dpmuon export runs/dpmuon --out model/
    dpmuon account --epsilon 4 --delta 1e-5 --sampling-rate 0.02 --steps 2500
    dpmuon account --sigma 1.1 --delta 1e-5 --sampling-rate 0.02 --steps 2500
    dpmuon account --epsilon 4 --dataset-size 50000 --epochs 50 \\
        --batch-sizes 256,512,1024,2048,4096
    dpmuon audit --seed 1 --noise-scale 1.0      # one-run privacy audit
"""

from __future__ import annotations

import argparse
import json
import sys

_DESCRIPTION = """\
Differentially private training with spectral (Muon-style) optimizers.

Every run samples batches with Poisson sampling, clips each example's gradient
to L2 norm C, adds Gaussian noise N(0, σ²C²) to the sum and divides by the
expected batch size; σ is calibrated so the whole run spends at most the
target ε (dp-accounting, RDP). The guarantee is per run (add/remove one
example); a search over many runs is not covered.
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
  sub = parser.add_subparsers(dest="command", required=True)
  _add_train(sub)
  _add_export(sub)
  sub.add_parser(
      "audit",
      help="one-run empirical privacy audit (dpmuon audit --help)",
      add_help=False,
  )
  _add_account(sub)
  return parser


def _add_train(sub) -> None:
  from dpmuon_jax.data.loaders import TFDS_NAMES
  from dpmuon_jax.models.registry import MODEL_NAMES
  from dpmuon_jax.optimizers.registry import OPTIMIZERS

  train = sub.add_parser(
      "train",
      help="train a model privately to a target (ε, δ)",
      description="Train an image classifier with a differentially private optimizer.",
      formatter_class=argparse.ArgumentDefaultsHelpFormatter,
  )
  train.add_argument("--model", default="cnn", choices=MODEL_NAMES)
  train.add_argument(
      "--dataset",
      default="digits",
      help="'digits' (embedded, no download), a TFDS name "
      f"({', '.join(TFDS_NAMES)}), or a path to an .npz with x_train, y_train, x_test, y_test",
  )
  train.add_argument("--data-dir", default=None, help="TFDS data directory")
  optimizer_help = "; ".join(f"{k}: {v.summary}" for k, v in OPTIMIZERS.items())
  train.add_argument("--optimizer", default="dp_sgd", choices=list(OPTIMIZERS),
                     help=optimizer_help)
  train.add_argument("--epsilon", type=float, default=4.0, help="target ε of the whole run")
  train.add_argument("--delta", type=float, default=1e-5, help="target δ (keep it below 1/N)")
  train.add_argument("--batch-size", type=int, default=256,
                     help="expected batch size qN of Poisson sampling (also the noise denominator)")
  train.add_argument("--epochs", type=float, default=10.0)
  train.add_argument("--lr", dest="learning_rate", type=float, default=None,
                     help="peak learning rate (default: the optimizer's paper preset)")
  train.add_argument("--clip", type=float, default=1.0, help="per-example L2 clipping norm C")
  train.add_argument("--noise-multiplier", type=float, default=None,
                     help="fix σ instead of calibrating it; the run stops before ε "
                     "would exceed --epsilon")
  train.add_argument("--seed", type=int, default=None,
                     help="makes noise and sampling reproducible (recorded as seeded); "
                     "default: OS entropy")
  train.add_argument("--output-dir", default="runs/dpmuon")
  train.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
  train.add_argument("--microbatch-size", type=_positive_int, default=None,
                     help="accumulate per-example gradients in chunks (flat memory)")
  train.add_argument("--augment", action="store_true", help="random crop and flip per example")
  train.add_argument("--max-steps", type=_positive_int, default=None,
                     help="stop after this many steps (smoke runs)")
  train.add_argument("--log-clip-stats", action="store_true",
                     help="log clip fraction and gradient norms (NON-private statistics)")
  train.add_argument("--accountant", choices=("rdp", "pld"), default="rdp")
  train.add_argument("--init-weights", default=None,
                     help="public pretrained weights (flax.serialization msgpack of the params "
                     "dict) to fine-tune from; default: from scratch")
  train.add_argument("--devices", type=_positive_int, default=None,
                     help="data-parallel over this many devices (noise added once to the "
                     "global sum)")
  train.add_argument("--secure-noise", action="store_true",
                     help="exact discrete Gaussian noise on an integer grid of the clipped sum, "
                     "from OS entropy: resists floating-point attacks; one device; see "
                     "docs/sharp-edges.md")
  train.add_argument("--no-progress", dest="progress", action="store_false")
  train.add_argument("--no-plot", dest="plot", action="store_false")


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
      formatter_class=argparse.ArgumentDefaultsHelpFormatter,
  )
  account.add_argument("--epsilon", type=float, default=None)
  account.add_argument("--sigma", type=float, default=None, help="noise multiplier σ")
  account.add_argument("--delta", type=float, default=1e-5)
  account.add_argument("--sampling-rate", type=float, default=None, help="q")
  account.add_argument("--steps", type=int, default=None, help="T, the number of releases")
  account.add_argument("--dataset-size", type=int, default=None)
  account.add_argument("--epochs", type=float, default=None)
  account.add_argument("--batch-sizes", default=None,
                       help="comma-separated expected batch sizes for a σ table")
  account.add_argument("--accountant", choices=("rdp", "pld"), default="rdp")


def _train(args: argparse.Namespace) -> int:
  from dpmuon_jax.training.trainer import TrainConfig, train

  fields = {k: v for k, v in vars(args).items() if k != "command"}
  results = train(TrainConfig(**fields))
  print(
      f"test accuracy {results['final_test_accuracy']:.4f} "
      f"(best {results['best_test_accuracy']:.4f}); "
      f"ε = {results['epsilon_spent']:.3f} at δ = {results['delta']:g} "
      f"after {results['releases']} releases (σ = {results['noise_multiplier']:.4f}, "
      f"q = {results['sampling_rate']:.5f}); results in {args.output_dir}/results.json"
  )
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


def main(argv: list[str] | None = None) -> int:
  from absl import logging as absl_logging

  absl_logging.set_verbosity(absl_logging.ERROR)  # TFDS' warnings would precede our one line
  argv = sys.argv[1:] if argv is None else argv
  if argv[:1] == ["audit"]:
    from dpmuon_jax.audit.run_audit import main as audit_main

    return audit_main(argv[1:])
  args = _parser().parse_args(argv)
  try:
    commands = {"train": _train, "export": _export, "account": _account}
    return commands[args.command](args)
  except (ValueError, OSError, KeyError) as error:
    message = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    print(f"dpmuon {args.command}: error: {message}", file=sys.stderr)
    return 2


if __name__ == "__main__":
  sys.exit(main())
