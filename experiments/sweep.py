"""Run one experiment of :mod:`experiments.configs` and write its CSV and plot.

    python -m experiments.sweep cpu_phase_transition --data-dir DATA
    python -m experiments.sweep main_table --data-dir ~/tensorflow_datasets   # GPU/TPU
    python -m experiments.sweep main_table --tiny      # one step per run on tiny shapes (CI)
    python -m experiments.sweep svhn_cpu --stand-in    # wall time only: random data, /tmp
    python -m experiments.sweep batch_size_study --data-dir DATA --workers 2

``DATA`` is a folder holding the image datasets as ``.npz`` files in the Keras
layout (``cifar10.npz`` with keys ``x_train``, ``y_train``, ``x_test``,
``y_test``); a config's relative ``.npz`` path is read from it.
Writes ``<out>/runs.csv`` (one row per optimizer × batch size × seed, with the
ε each run spent), ``<out>/summary.csv`` (mean ± std over seeds of the final
and the best test accuracy), ``<out>/accuracy_vs_batch.png`` and, with
``--layer-report``, ``<out>/layer_report.csv``: the NON-PRIVATE per-layer
SNR / recovery-threshold analysis of paper 1 at each batch size, computed on
a probe batch at initialisation (analysis only; it never feeds training).

``--stand-in`` replaces the data with random uint8 images and labels of the
real dataset's image shape, split sizes (after the config's subset) and
number of classes, to measure a config's wall time where the dataset is
absent. Its accuracies are meaningless: it is labelled ``stand-in-<dataset>``
everywhere and written under the system's temporary folder by default.
``--compilation-cache DIR`` keeps XLA executables on disk, so the runs of
one (optimizer, batch size) that differ only in the seed compile once.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import tempfile
import time

import numpy as np

from dpmuon_jax.data.images import ImageDataset
from dpmuon_jax.data.loaders import load_dataset
from dpmuon_jax.extras import pyplot
from dpmuon_jax.training.records import write_csv
from dpmuon_jax.training.trainer import TrainConfig, train
from experiments.configs import EXPERIMENTS, Experiment
from experiments.study_configs import STUDIES

RUN_FIELDS = (
    "optimizer", "batch_size", "seed", "learning_rate", "noise_multiplier", "epsilon_spent",
    "delta", "releases", "final_test_accuracy", "best_test_accuracy", "seconds",
)


def load_experiment_data(exp: Experiment, data_dir: str | None) -> ImageDataset:
  """The experiment's dataset, cut to its CPU-scale subset if it has one."""
  spec = exp.dataset
  if spec.endswith(".npz") and data_dir and not os.path.isabs(spec):
    spec = os.path.join(data_dir, spec)
  data = load_dataset(spec, data_dir)
  n_train = exp.train_subset or data.num_train
  n_test = exp.test_subset or data.num_test
  return ImageDataset(data.x_train[:n_train], data.y_train[:n_train], data.x_test[:n_test],
                      data.y_test[:n_test], data.num_classes, data.name)


# (H, W, C), classes, train and test sizes of the real datasets (SVHN: cropped digits).
STAND_IN_SHAPES: dict[str, tuple[tuple[int, int, int], int, int, int]] = {
    "cifar10": ((32, 32, 3), 10, 50_000, 10_000),
    "cifar100": ((32, 32, 3), 100, 50_000, 10_000),
    "svhn_cropped": ((32, 32, 3), 10, 73_257, 26_032),
}


def stand_in_data(exp: Experiment) -> ImageDataset:
  """Random data of the real dataset's shapes, sizes (after the subset) and classes.

  For measuring wall time only; named ``stand-in-<dataset>``.
  """
  name = os.path.basename(exp.dataset).removesuffix(".npz")
  if name not in STAND_IN_SHAPES:
    raise ValueError(f"No stand-in for {exp.dataset!r}; known: {', '.join(STAND_IN_SHAPES)}.")
  shape, num_classes, num_train, num_test = STAND_IN_SHAPES[name]
  num_train = min(exp.train_subset or num_train, num_train)
  num_test = min(exp.test_subset or num_test, num_test)
  rng = np.random.default_rng(0)
  x = rng.integers(0, 256, size=(num_train + num_test, *shape), dtype=np.uint8)
  y = rng.integers(0, num_classes, size=num_train + num_test)
  return ImageDataset(x[:num_train], y[:num_train], x[num_train:], y[num_train:], num_classes,
                      f"stand-in-{name}")


def tiny_data(exp: Experiment, num_classes: int = 10) -> ImageDataset:
  """Random 8×8 images standing in for the dataset (``--tiny``: configs cannot rot)."""
  rng = np.random.default_rng(0)
  channels = 3
  x = rng.integers(0, 256, size=(48, 8, 8, channels), dtype=np.uint8)
  y = rng.integers(0, num_classes, size=48)
  return ImageDataset(x[:32], y[:32], x[32:], y[32:], num_classes, f"tiny-{exp.dataset}")


def train_config(exp: Experiment, optimizer: str, batch_size: int, seed: int, out: str,
                 tiny: bool) -> TrainConfig:
  return TrainConfig(
      model=exp.model,
      dataset=exp.dataset,
      optimizer=optimizer,
      epsilon=exp.epsilon,
      delta=exp.delta,
      batch_size=4 if tiny else batch_size,
      epochs=exp.epochs,
      learning_rate=exp.learning_rate(optimizer),
      seed=seed,
      output_dir=os.path.join(out, "runs", f"{optimizer}_B{batch_size}_s{seed}"),
      microbatch_size=None if tiny else exp.microbatch_size,
      augment=exp.augment,
      max_steps=1 if tiny else None,
      progress=False,
      plot=False,
      model_overrides=dict(exp.model_overrides),
      init_weights=None if tiny else exp.init_weights,
  )


def run(exp: Experiment, out: str, data_dir: str | None = None, tiny: bool = False,
        layer_report: bool = False, stand_in: bool = False) -> list[dict]:
  os.makedirs(out, exist_ok=True)
  if tiny:
    data = tiny_data(exp)
  elif stand_in:
    data = stand_in_data(exp)
    exp = dataclasses.replace(exp, dataset=data.name)  # labels every output
  else:
    data = load_experiment_data(exp, data_dir)
  rows = []
  runs = list(exp.runs())
  check_buildable(exp, out)
  if tiny:  # every run was built above; one step of the first, on tiny shapes
    runs = runs[:1]
  for optimizer, batch_size, seed in runs:
    config = train_config(exp, optimizer, batch_size, seed, out, tiny)
    start = time.perf_counter()
    results = train(config, data)
    rows.append({
        "optimizer": optimizer, "batch_size": batch_size, "seed": seed,
        "learning_rate": config.learning_rate, "noise_multiplier": results["noise_multiplier"],
        "epsilon_spent": results["epsilon_spent"], "delta": exp.delta,
        "releases": results["releases"], "final_test_accuracy": results["final_test_accuracy"],
        "best_test_accuracy": results["best_test_accuracy"],
        "seconds": time.perf_counter() - start,
    })
    print(json.dumps(rows[-1]), flush=True)
  write_csv(os.path.join(out, "runs.csv"), rows, RUN_FIELDS)
  summary = summarise(rows)
  write_csv(os.path.join(out, "summary.csv"), summary, tuple(summary[0]))
  _plot(os.path.join(out, "accuracy_vs_batch.png"), summary, exp)
  with open(os.path.join(out, "experiment.json"), "w") as f:
    json.dump(dataclasses.asdict(exp), f, indent=2)
  if layer_report and not tiny:
    write_layer_report(exp, data, os.path.join(out, "layer_report.csv"))
  return rows


def check_buildable(exp: Experiment, out: str) -> None:
  """Every run's config and optimizer can be built (so configs cannot rot)."""
  from dpmuon_jax.models.registry import MODEL_NAMES
  from dpmuon_jax.optimizers import registry

  if exp.model not in MODEL_NAMES:
    raise ValueError(f"{exp.name}: unknown model {exp.model!r}.")
  release = {"l2_clip_norm": 1.0, "noise_multiplier": 1.0, "denominator": 256.0, "key": 0}
  for optimizer, batch_size, seed in exp.runs():
    config = train_config(exp, optimizer, batch_size, seed, out, tiny=False)
    registry.build(optimizer, config.learning_rate, release)


def summarise(rows: list[dict]) -> list[dict]:
  out = []
  keys = sorted({(r["optimizer"], r["batch_size"]) for r in rows}, key=lambda k: (k[0], k[1]))
  for optimizer, batch_size in keys:
    group = [r for r in rows if r["optimizer"] == optimizer and r["batch_size"] == batch_size]
    row = {"optimizer": optimizer, "batch_size": batch_size, "seeds": len(group),
           "noise_multiplier": group[0]["noise_multiplier"],
           "max_epsilon_spent": max(r["epsilon_spent"] for r in group)}
    for metric in ("final_test_accuracy", "best_test_accuracy"):
      values = [r[metric] for r in group]
      row[f"{metric}_mean"] = statistics.fmean(values)
      row[f"{metric}_std"] = statistics.stdev(values) if len(values) > 1 else 0.0
    out.append(row)
  return out


def write_layer_report(exp: Experiment, data: ImageDataset, path: str) -> None:
  """NON-PRIVATE per-layer SNR at each batch size (probe batch, initial parameters)."""
  import jax.numpy as jnp

  from dpmuon_jax.analysis.diagnostics import PrivacyBudget, nonprivate_layer_report
  from dpmuon_jax.data.images import normalize
  from dpmuon_jax.models.registry import model_and_loss

  model, loss_fn = model_and_loss(exp.model, data.num_classes, data.image_shape, seed=0,
                                  **exp.model_overrides)
  info = data.info
  probe = {"image": normalize(jnp.asarray(data.x_train[:512]), info.mean, info.std),
           "label": jnp.asarray(data.y_train[:512])}
  budget = PrivacyBudget(exp.epsilon, exp.delta, data.num_train, exp.epochs)
  rows = []
  for batch_size in exp.batch_sizes:
    sigma = budget.noise_multiplier(batch_size)
    report = nonprivate_layer_report(loss_fn, model.params, probe, 1.0, sigma, float(batch_size),
                                     budget=budget if batch_size == exp.batch_sizes[0] else None,
                                     microbatch_size=128)
    for r in report:
      rows.append({"batch_size": batch_size, "sigma": sigma, "layer": r.path,
                   "shape": "x".join(map(str, r.shape)), "gap": r.spectrum.gap,
                   "release_snr": r.snr, "buffer_snr": r.buffer_snr,
                   "above_threshold": r.above_threshold,
                   "buffer_above_threshold": r.buffer_above_threshold,
                   "recovery_batch_size": r.recovery_batch_size})
  write_csv(path, rows, tuple(rows[0]))


def _plot(path: str, summary: list[dict], exp: Experiment) -> None:
  plt = pyplot("accuracy_vs_batch.png")
  fig, ax = plt.subplots(figsize=(5.5, 3.6))
  for optimizer in sorted({r["optimizer"] for r in summary}):
    rows = [r for r in summary if r["optimizer"] == optimizer]
    ax.errorbar([r["batch_size"] for r in rows], [100 * r["best_test_accuracy_mean"] for r in rows],
                yerr=[100 * r["best_test_accuracy_std"] for r in rows], marker="o", capsize=3,
                label=optimizer)
  ax.set_xscale("log", base=2)
  ax.set_xlabel("expected batch size B")
  ax.set_ylabel("best test accuracy (%)")
  ax.set_title(f"{exp.name} ({exp.dataset}): ε = {exp.epsilon}, {exp.epochs:g} epochs, "
               "σ recalibrated per B", fontsize=9)
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def run_study_command(study, args) -> int:
  """A :mod:`experiments.study` study: train what is missing, then write its report.

  ``--report-only``: the report of the runs recorded so far, training nothing.
  """
  from experiments.study import read_rows, run_study
  from experiments.study_report import write_report

  out = args.out or os.path.join(os.path.dirname(__file__), "results", study.name)
  if args.report_only:
    rows = read_rows(os.path.join(out, "runs.csv"))
  else:
    rows = run_study(study, out, args.data_dir, workers=args.workers)
  write_report(study, rows, out, args.data_dir)
  return 0


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("experiment", choices=sorted(EXPERIMENTS) + sorted(STUDIES))
  parser.add_argument("--out", default=None, help="default: experiments/results/<experiment>")
  parser.add_argument("--data-dir", default=None,
                      help="TFDS data dir, and the folder of relative .npz paths")
  parser.add_argument("--tiny", action="store_true", help="one step per optimizer, tiny shapes")
  parser.add_argument("--layer-report", action="store_true")
  parser.add_argument("--stand-in", action="store_true",
                      help="random data of the real shapes (wall time only); default --out in "
                      "the temporary folder")
  parser.add_argument("--compilation-cache", default=None, metavar="DIR",
                      help="persistent XLA compilation cache (seeds of one run compile once)")
  parser.add_argument("--workers", type=int, default=1,
                      help="studies: runs trained side by side (separate processes)")
  parser.add_argument("--report-only", action="store_true",
                      help="studies: write the report of the runs recorded so far")
  args = parser.parse_args(argv)
  if args.compilation_cache:
    import jax

    jax.config.update("jax_compilation_cache_dir", args.compilation_cache)
  if args.experiment in STUDIES:
    return run_study_command(STUDIES[args.experiment], args)
  exp = EXPERIMENTS[args.experiment]
  if args.stand_in:
    out = args.out or os.path.join(tempfile.gettempdir(), "dpmuon_stand_in", exp.name)
  else:
    out = args.out or os.path.join(os.path.dirname(__file__), "results", exp.name)
  run(exp, out, args.data_dir, args.tiny, args.layer_report, args.stand_in)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
