"""Private runs of several optimizers side by side at one (ε, δ) (``dpmuon compare``).

Every optimizer trains once with the same data, model, batch size, epochs,
clipping norm and target (ε, δ); σ is calibrated per run, so runs of equal
length get the same σ. Each run is (ε, δ)-DP on its own. Publishing all of
them composes: the summary also gives the ε of all the runs together (RDP
composition of their releases), which assumes that the runs' randomness is
independent. So every run draws its own root key: from OS entropy by default,
or, with a seed, ``named_seed(seed, optimizer)`` (its own noise, sampling and
augmentation streams, reproducibly). Test accuracies use the public test split.

Writes ``comparison.json`` and ``accuracy.png`` (test accuracy per epoch) into
the output directory, and each run's ``dpmuon train`` outputs (without
``curves.png``) into ``OUTPUT_DIR/<optimizer>/``.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import os
import time
from collections.abc import Sequence

from dpmuon_jax.data.images import ImageDataset
from dpmuon_jax.extras import pyplot
from dpmuon_jax.optimizers import registry as optimizer_registry
from dpmuon_jax.privacy.accounting import PrivacyLedger, composed_ledgers_epsilon
from dpmuon_jax.privacy.keys import named_seed
from dpmuon_jax.training.trainer import TrainConfig, TrainingError, train

SUMMARY_FILE = "comparison.json"
PLOT_FILE = "accuracy.png"


def check_optimizer_names(names: Sequence[str]) -> tuple[str, ...]:
  """``names`` as a tuple, if each is registered and none repeats."""
  known = optimizer_registry.names()
  names = tuple(names)
  unknown = [n for n in names if n not in known]
  if not names or unknown:
    raise TrainingError(
        f"Unknown optimizer(s) {', '.join(unknown) or '(none given)'}; choose from "
        f"{', '.join(known)}."
    )
  if len(set(names)) != len(names):
    raise TrainingError(f"Each optimizer may appear once, got {', '.join(names)}.")
  return names


def _history(run_dir: str, results: dict) -> list[dict]:
  """The run's evaluations: ``results["history"]`` or its history.csv."""
  if results.get("history"):
    return list(results["history"])
  with open(os.path.join(run_dir, "history.csv"), newline="") as f:
    return [{k: float(v) for k, v in row.items() if v not in ("", None)}
            for row in csv.DictReader(f)]


def _row(name: str, learning_rate, results: dict, history: list[dict], seconds: float) -> dict:
  return {
      "optimizer": name,
      "learning_rate": learning_rate,
      "final_test_accuracy": results["final_test_accuracy"],
      "best_test_accuracy": results["best_test_accuracy"],
      "epsilon_spent": results["epsilon_spent"],
      "noise_multiplier": results["noise_multiplier"],
      "sampling_rate": results["sampling_rate"],
      "releases": results["releases"],
      "seconds": seconds,
      "epochs": [h["epoch"] for h in history],
      "test_accuracy": [h["test_accuracy"] for h in history],
  }


def format_table(rows: Sequence[dict]) -> str:
  """A fixed-width table: final/best test accuracy, ε spent, σ, releases, seconds."""
  header = (f"{'optimizer':<16} {'final acc':>9} {'best acc':>9} {'ε spent':>8} "
            f"{'σ':>8} {'releases':>8} {'seconds':>8}")
  lines = [header, "-" * len(header)]
  for r in rows:
    lines.append(
        f"{r['optimizer']:<16} {r['final_test_accuracy']:>9.4f} {r['best_test_accuracy']:>9.4f} "
        f"{r['epsilon_spent']:>8.3f} {r['noise_multiplier']:>8.4f} {r['releases']:>8d} "
        f"{r['seconds']:>8.1f}")
  return "\n".join(lines)


def plot_accuracy(rows: Sequence[dict], path: str, title: str = "") -> str:
  """Test accuracy against epoch, one line per optimizer (matplotlib, Agg); returns ``path``."""
  plt = pyplot("The comparison plot")
  fig, ax = plt.subplots(figsize=(5.5, 3.6))
  for r in rows:
    ax.plot(r["epochs"], r["test_accuracy"], marker="o", ms=3, label=r["optimizer"])
  ax.set_xlabel("epoch")
  ax.set_ylabel("test accuracy")
  ax.set_title(title)
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


def compare_optimizers(
    config: TrainConfig,
    names: Sequence[str],
    data: ImageDataset,
    learning_rates: Sequence[float | None] | None = None,
) -> dict:
  """Trains each named optimizer with ``config`` (its own preset learning rate unless given).

  Returns the summary written to ``comparison.json``: one row per optimizer,
  ``combined_epsilon`` (all runs published together), ``delta`` and ``plot``.
  """
  names = check_optimizer_names(names)
  learning_rates = list(learning_rates or [None] * len(names))
  if len(learning_rates) != len(names):
    raise TrainingError(
        f"Give one learning rate per optimizer ({len(names)}), got {len(learning_rates)}.")
  os.makedirs(config.output_dir, exist_ok=True)
  rows, run_results = [], []
  for name, learning_rate in zip(names, learning_rates):
    run_dir = os.path.join(config.output_dir, name)
    started = time.perf_counter()
    seed = None if config.seed is None else named_seed(config.seed, name)
    results = train(dataclasses.replace(config, optimizer=name, learning_rate=learning_rate,
                                        output_dir=run_dir, seed=seed), data)
    run_results.append(results)
    rows.append(_row(name, learning_rate, results, _history(run_dir, results),
                     time.perf_counter() - started))
  released = [PrivacyLedger.from_json(results["ledger"])
              for results in run_results if results["releases"] > 0]
  summary = {
      "rows": rows,
      "target_epsilon": config.epsilon,
      "delta": config.delta,
      "combined_epsilon": (composed_ledgers_epsilon(released, config.delta, config.accountant)
                           if released else 0.0),
      "plot": plot_accuracy(rows, os.path.join(config.output_dir, PLOT_FILE),
                            f"{data.name}, ε = {config.epsilon:g}"),
  }
  with open(os.path.join(config.output_dir, SUMMARY_FILE), "w") as f:
    json.dump(summary, f, indent=2)
  return summary
