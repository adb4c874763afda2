"""``dpmuon tune`` (private learning-rate selection) and ``dpmuon compare`` (optimizers side
by side): several image runs made from ``dpmuon train``'s flags.

Both take a subset of :class:`~dpmuon_jax.training.trainer.TrainConfig`'s flags
(:data:`RUN_FIELDS`, fewer epochs by default) with the same names, parsing and
checks, and flags of their own.
"""

from __future__ import annotations

import argparse

from dpmuon_jax import checks
from dpmuon_jax.help_format import HelpFormatter

RUN_FIELDS = ("model", "dataset", "data_dir", "epsilon", "delta", "batch_size", "epochs",
              "clip", "microbatch_size", "clipped_sum_method", "max_steps", "output_dir", "seed")
"""The TrainConfig fields whose ``dpmuon train`` flags ``tune`` and ``compare`` take."""


def _add_run_flags(parser: argparse.ArgumentParser, names: tuple[str, ...], epochs: float,
                   output_dir: str, helps: dict[str, str]) -> None:
  from dpmuon_jax.training.flags import add_flags
  from dpmuon_jax.training.trainer import TrainConfig

  add_flags(parser, TrainConfig, (*RUN_FIELDS, *names),
            defaults={"epochs": epochs, "output_dir": output_dir},
            helps={"epochs": "passes over the data, per run", **helps})


def add_tune(sub) -> None:
  """The ``tune`` parser on ``sub`` (the subcommands of ``dpmuon``)."""
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
  _add_run_flags(tune, ("optimizer",), 2.0, "runs/tune", {
      "epsilon": "target ε of the whole search",
      "seed": "reproducible K, draws, noise and runs (recorded as seeded); default: OS entropy",
      "output_dir": "where the runs and tuning.json go"})
  tune.add_argument("--lr-center", type=float, default=None,
                    help="centre of the grid (default: the optimizer's preset learning rate)")
  tune.add_argument("--grid-size", type=int, default=3, help="number of learning rates, spaced ×3")
  tune.add_argument("--learning-rates", default=None,
                    help="comma-separated grid, instead of --lr-center and --grid-size")
  tune.add_argument("--expected-runs", type=float, default=3.0, help="E[K]")
  tune.add_argument("--eta", type=float, default=1.0,
                    help="K ~ truncated negative binomial with this η and mean --expected-runs "
                    "(1: geometric; 0: logarithmic, a little less ε, a longer tail of K)")
  tune.add_argument("--poisson", action="store_true",
                    help="K ~ Poisson(--expected-runs) instead (K = 0 selects nothing)")
  tune.add_argument("--validation-size", type=int, default=None,
                    help="examples held out from the end of the training split "
                    "(default: a fifth of it, at most 5000)")
  tune.add_argument("--score-std", type=float, default=0.02,
                    help="std of the Gaussian noise on each run's validation accuracy")
  tune.add_argument("--show-all-runs", action="store_true",
                    help="also print and save every run's learning rate and score: NON-private, "
                    "not covered by ε (it reveals K and the other runs)")


def add_compare(sub) -> None:
  """The ``compare`` parser on ``sub`` (the subcommands of ``dpmuon``)."""
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
  _add_run_flags(compare, (), 3.0, "runs/compare", {
      "epsilon": "target ε of each run",
      "seed": "reproducible runs (recorded as seeded; each optimizer's run derives its own "
              "streams from it); default: OS entropy",
      "output_dir": "where the runs and comparison.json go"})


def _floats(text: str, flag: str) -> list[float]:
  try:
    return [float(t) for t in text.split(",")]
  except ValueError:
    raise ValueError(f"{flag} must be comma-separated numbers, got {text!r}.") from None


def _learning_rates(args: argparse.Namespace) -> tuple[float, ...] | None:
  """``--learning-rates``, each a finite number > 0 (None: not given)."""
  if args.learning_rates is None:
    return None
  return tuple(checks.check_positive("--learning-rates", rate)
               for rate in _floats(args.learning_rates, "--learning-rates"))


def _run_config(args: argparse.Namespace, **fields):
  """The runs' TrainConfig from the shared flags (checked here, before any work)."""
  from dpmuon_jax.training.trainer import TrainConfig

  shared = {name: getattr(args, name) for name in RUN_FIELDS}
  return TrainConfig(**shared, progress=False, plot=False, **fields)


def _check_tune(args: argparse.Namespace) -> None:
  """``tune``'s own numbers, in one line that names the flag."""
  runs_low = 0.0 if args.poisson else 1.0  # Poisson(μ > 0); TNB: mean > 1
  checks.check_in_range("--expected-runs", args.expected_runs, runs_low, low_inclusive=False)
  checks.check_in_range("--eta", args.eta, -1.0, low_inclusive=False)
  checks.check_positive("--score-std", args.score_std)
  checks.check_positive_int("--grid-size", args.grid_size)
  if args.lr_center is not None:  # 0 would silently mean the preset
    checks.check_positive("--lr-center", args.lr_center)
  if args.validation_size is not None:
    checks.check_positive_int("--validation-size", args.validation_size)


def _tune_options(args: argparse.Namespace, num_train: int):
  from dpmuon_jax.optimizers.registry import preset
  from dpmuon_jax.privacy.tuning import Poisson, truncated_negative_binomial
  from dpmuon_jax.training.selection import TuneOptions, learning_rate_grid

  rates = _learning_rates(args)
  if rates is None:
    center = args.lr_center or preset(args.optimizer).learning_rate
    rates = learning_rate_grid(center, args.grid_size, 3.0)
  if args.poisson:
    distribution = Poisson(args.expected_runs)
  else:
    distribution = truncated_negative_binomial(args.expected_runs, args.eta)
  size = args.validation_size or max(1, min(5000, num_train // 5))
  return TuneOptions(rates, distribution, size, args.score_std, args.seed, args.show_all_runs)


def run_tune(args: argparse.Namespace) -> int:
  """Runs the search and prints the chosen learning rate and the search's ε."""
  from dpmuon_jax.data.loaders import load_dataset
  from dpmuon_jax.training.selection import tune_learning_rate

  config = _run_config(args, optimizer=args.optimizer)
  _check_tune(args)
  _learning_rates(args)  # checked before any work
  data = load_dataset(args.dataset, args.data_dir)
  options = _tune_options(args, data.num_train)
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


def run_compare(args: argparse.Namespace) -> int:
  """Trains each optimizer and prints the table and the combined ε."""
  from dpmuon_jax.data.loaders import load_dataset
  from dpmuon_jax.training.compare import check_optimizer_names, compare_optimizers, format_table

  config = _run_config(args)
  rates = _learning_rates(args)
  names = check_optimizer_names([n.strip() for n in args.optimizers.split(",") if n.strip()])
  data = load_dataset(args.dataset, args.data_dir)
  summary = compare_optimizers(config, names, data, None if rates is None else list(rates))
  print(format_table(summary["rows"]))
  print(f"each run: ε ≤ {args.epsilon:g} at δ = {args.delta:g}; all {len(names)} published "
        f"together: ε = {summary['combined_epsilon']:.3f}. Plot: {summary['plot']}; "
        f"summary: {args.output_dir}/comparison.json")
  return 0
