"""Run one GPT-2 experiment of :mod:`experiments.text_configs`; write its CSVs and plot.

    python -m experiments.text_sweep e2e_cpu_im --data-dir ../shared/data/text      # CPU
    python -m experiments.text_sweep paper2_table2_e2e --data-dir DATA --gpt2-dir HF_GPT2
    python -m experiments.text_sweep paper2_table2_e2e --data-dir DATA --tiny        # CI

``--gpt2-dir`` is a local Hugging Face ``gpt2`` directory (``model.safetensors``
+ ``config.json``; nothing is downloaded). ``--tiny`` builds every run's
optimizer and runs one release of the first run on a tiny GPT-2 and a few
validation pairs, so configs cannot rot (every LM optimizer's step on GPT-2
is tested in ``tests/test_text.py``).

Writes ``<out>/runs.csv`` (one row per variant × ε × seed: ε spent, σ,
releases, validation NLL per target token, BLEU / ROUGE-L per decoded split,
training seconds, peak memory), ``<out>/summary.csv`` (mean ± std over
seeds), ``<out>/<metric>_vs_epsilon.png`` and, for diagnostic runs,
``<out>/diagnostics.csv`` with its paired summary in ``diagnostics.json``
(NON-PRIVATE analysis).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import os
import statistics

from dpmuon_jax.analysis.polar_metrics import InnerMomentumProbe, ProtocolRow, summarise_protocol
from dpmuon_jax.text.train import LMTrainConfig, lm_optimizer, train_lm
from dpmuon_jax.training.records import write_csv
from dpmuon_jax.training.tracking import MissingExtraError
from experiments.text_configs import TEXT_EXPERIMENTS, TextExperiment

TINY_MODEL = {"dim": 16, "num_layers": 1, "num_heads": 2, "max_positions": 160}
METRICS = ("valid_nll", "valid_bleu", "valid_rouge_l", "test_bleu", "test_rouge_l")


def run_config(exp: TextExperiment, variant, epsilon: float, seed: int, out: str,
               data_dir: str, gpt2_dir: str | None, tiny: bool) -> LMTrainConfig:
  """The :class:`LMTrainConfig` of one run (``tiny``: one release on tiny shapes)."""
  config = LMTrainConfig(
      data_dir=data_dir,
      dataset=exp.dataset,
      output_dir=os.path.join(out, "runs", f"{_slug(variant.label)}_eps{epsilon:g}_s{seed}"),
      init_weights=gpt2_dir if exp.pretrained else None,
      model=exp.model,
      model_overrides=dict(exp.model_overrides),
      vocab_size=exp.vocab_size,
      max_length=exp.max_length,
      optimizer=variant.optimizer,
      optimizer_kwargs=variant.optimizer_kwargs(exp.dataset, epsilon),
      learning_rate=exp.learning_rate,
      fallback_learning_rate=exp.fallback_learning_rate,
      epsilon=epsilon,
      delta=exp.delta,
      sampling_rate=exp.sampling_rate,
      steps=exp.steps,
      denominator=exp.denominator,
      clip=exp.clip,
      seed=seed,
      microbatch_size=exp.microbatch_size,
      capacity=exp.capacity,
      eval_pairs=exp.eval_pairs,
      generate_splits=exp.generate_splits,
      diagnostic_steps=exp.diagnostic_steps,
  )
  if not tiny:
    return config
  return dataclasses.replace(
      config, init_weights=None, model="gpt2_tiny", model_overrides=TINY_MODEL, vocab_size=512,
      train_split="valid", train_subset=64, sampling_rate=0.125, steps=1, denominator=8.0,
      microbatch_size=8, capacity=None, eval_pairs=16, generate_groups=2, max_new_tokens=4,
      diagnostic_steps=(0,) if exp.diagnostic_steps else (),
  )


def check_buildable(exp: TextExperiment, out: str, data_dir: str) -> None:
  """Every run's optimizer builds with the experiment's release settings."""
  release = {"l2_clip_norm": exp.clip, "noise_multiplier": 1.0,
             "denominator": exp.denominator or 256.0, "key": 0}
  for variant, epsilon, seed in exp.runs():
    lm_optimizer(run_config(exp, variant, epsilon, seed, out, data_dir, None, False), release)


def run(exp: TextExperiment, out: str, data_dir: str, gpt2_dir: str | None = None,
        tiny: bool = False, log_dir: str | None = None) -> list[dict]:
  """Runs the experiment; ``log_dir``: each run's TensorBoard logs in a folder of its own."""
  if exp.pretrained and gpt2_dir is None and not tiny:
    raise SystemExit(f"{exp.name} fine-tunes GPT-2 small: pass --gpt2-dir, a local Hugging Face "
                     "gpt2 directory (model.safetensors + config.json).")
  os.makedirs(out, exist_ok=True)
  check_buildable(exp, out, data_dir)
  runs = list(exp.runs())
  if tiny:  # every run was built above; one release of the first, on tiny shapes
    runs = runs[:1]
  rows, diagnostics = [], []
  for variant, epsilon, seed in runs:
    config = run_config(exp, variant, epsilon, seed, out, data_dir, gpt2_dir, tiny)
    if log_dir is not None:
      config = dataclasses.replace(
          config, log_dir=os.path.join(log_dir, os.path.basename(config.output_dir)))
    results = train_lm(config, probe=InnerMomentumProbe() if config.diagnostic_steps else None)
    rows.append(_row(variant.label, variant.optimizer, epsilon, seed, results))
    print(json.dumps(rows[-1]), flush=True)
    path = os.path.join(config.output_dir, "diagnostics.csv")
    if os.path.exists(path):
      with open(path) as f:
        diagnostics += list(csv.DictReader(f))
  write_csv(os.path.join(out, "runs.csv"), rows)
  summary = summarise(rows)
  write_csv(os.path.join(out, "summary.csv"), summary)
  _plot(os.path.join(out, f"{exp.metric}_vs_epsilon.png"), summary, exp)
  if diagnostics:
    write_csv(os.path.join(out, "diagnostics.csv"), diagnostics)
    protocol = summarise_protocol([_protocol_row(d) for d in diagnostics])
    with open(os.path.join(out, "diagnostics.json"), "w") as f:
      json.dump({name: getattr(protocol, name)._asdict()
                 for name in ("polar_error", "cosine_error", "clipping_residual")}, f, indent=2)
  with open(os.path.join(out, "experiment.json"), "w") as f:
    json.dump(dataclasses.asdict(exp), f, indent=2)
  return rows


def _row(label: str, optimizer: str, epsilon: float, seed: int, results: dict) -> dict:
  row = {"variant": label, "optimizer": optimizer, "target_epsilon": epsilon, "seed": seed,
         "epsilon_spent": results["epsilon_spent"], "delta": results["delta"],
         "noise_multiplier": results["noise_multiplier"], "releases": results["releases"],
         "pretrained": results["pretrained"], "valid_nll": results["valid_nll"]}
  for split in ("valid", "test"):
    scores = results["scores"].get(split, {})
    row[f"{split}_bleu"] = scores.get("bleu", "")
    row[f"{split}_rouge_l"] = scores.get("rouge_l", "")
  row["train_seconds"] = results["train_seconds"]
  row["peak_rss_gib"] = results["peak_rss_gib"]
  row["peak_device_gib"] = results.get("peak_device_gib", "")
  return row


def _protocol_row(d: dict) -> ProtocolRow:
  fields = ProtocolRow._fields
  return ProtocolRow(**{k: (d[k] if k == "path" else float(d[k])) for k in fields})


def summarise(rows: list[dict]) -> list[dict]:
  """Mean and sample std over seeds of every metric, per variant and ε."""
  out = []
  for key in dict.fromkeys((r["variant"], r["target_epsilon"]) for r in rows):
    group = [r for r in rows if (r["variant"], r["target_epsilon"]) == key]
    row = {"variant": key[0], "target_epsilon": key[1], "seeds": len(group),
           "max_epsilon_spent": max(r["epsilon_spent"] for r in group),
           "train_seconds_mean": statistics.fmean(r["train_seconds"] for r in group),
           "peak_rss_gib_max": max(r["peak_rss_gib"] for r in group)}
    for metric in METRICS:
      values = [r[metric] for r in group if r[metric] != ""]
      if values:
        row[f"{metric}_mean"] = statistics.fmean(values)
        row[f"{metric}_std"] = statistics.stdev(values) if len(values) > 1 else 0.0
    out.append(row)
  return out


def _slug(label: str) -> str:
  return "".join(c if c.isalnum() else "_" for c in label).strip("_").lower()


def _plot(path: str, summary: list[dict], exp: TextExperiment) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  metric = exp.metric if exp.metric == "valid_nll" else (
      "test_bleu" if "test" in exp.generate_splits else "valid_bleu")
  fig, ax = plt.subplots(figsize=(5.5, 3.6))
  labels = list(dict.fromkeys(r["variant"] for r in summary if f"{metric}_mean" in r))
  if len({r["target_epsilon"] for r in summary}) == 1:  # one ε: a bar per variant
    rows = [next(r for r in summary if r["variant"] == label) for label in labels]
    ax.bar(range(len(rows)), [r[f"{metric}_mean"] for r in rows],
           yerr=[r[f"{metric}_std"] for r in rows], capsize=4, tick_label=labels)
    ax.set_xlabel(f"target ε = {summary[0]['target_epsilon']:g}")
    if metric == "valid_nll":
      low = min(r[f"{metric}_mean"] - 3 * r[f"{metric}_std"] for r in rows)
      ax.set_ylim(0.98 * low, None)
  else:
    for label in labels:
      rows = [r for r in summary if r["variant"] == label and f"{metric}_mean" in r]
      ax.errorbar([r["target_epsilon"] for r in rows], [r[f"{metric}_mean"] for r in rows],
                  yerr=[r[f"{metric}_std"] for r in rows], marker="o", capsize=3, label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("target ε")
  if ax.get_legend_handles_labels()[0]:
    ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("experiment", choices=sorted(TEXT_EXPERIMENTS))
  parser.add_argument("--data-dir", required=True,
                      help="folder with e2e/, dart/ and gpt2/ (the layout of shared/data/text)")
  parser.add_argument("--gpt2-dir", default=None, help="local Hugging Face gpt2 weights")
  parser.add_argument("--out", default=None, help="default: experiments/results/<experiment>")
  parser.add_argument("--tiny", action="store_true", help="one release, tiny shapes")
  parser.add_argument("--log-dir", default=None,
                      help="also write TensorBoard event files, one folder per run (needs the "
                      "'tensorboard' extra)")
  args = parser.parse_args(argv)
  exp = TEXT_EXPERIMENTS[args.experiment]
  out = args.out or os.path.join(os.path.dirname(__file__), "results", exp.name)
  try:
    run(exp, out, args.data_dir, args.gpt2_dir, args.tiny, args.log_dir)
  except MissingExtraError as error:
    raise SystemExit(f"text_sweep: error: {error}") from None
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
