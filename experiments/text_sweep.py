"""Run one GPT-2 experiment of :mod:`experiments.text_configs`; write its CSVs and plot.

    python -m experiments.text_sweep e2e_cpu_im --data-dir TEXT_DATA                # CPU
    python -m experiments.text_sweep e2e_pretrained_cpu --data-dir TEXT_DATA \\
        --gpt2-dir runs/pretrained_dart                                             # CPU
    python -m experiments.text_sweep e2e_public_slice --data-dir TEXT_DATA \\
        --gpt2-dir experiments/results/e2e_public_slice/start                       # CPU
    python -m experiments.text_sweep paper2_table2_e2e --data-dir TEXT_DATA --gpt2-dir HF_GPT2
    python -m experiments.text_sweep paper2_table2_e2e --data-dir TEXT_DATA --tiny  # CI
    python -m experiments.text_sweep e2e_pretrained_cpu --data-dir TEXT_DATA --measure \\
        --variants DP-Muon DP-Muon-IM --methods vmap ghost                          # timing

``TEXT_DATA`` is a folder with ``e2e/``, ``dart/`` and ``gpt2/``, laid out as
:mod:`dpmuon_jax.text.data` describes
(:func:`~dpmuon_jax.text.data.download_text_data` fetches all three).

``--gpt2-dir`` is a local GPT-2 in the Hugging Face layout (``model.safetensors``
+ ``config.json``; nothing is downloaded): the real ``gpt2`` weights for the
``paper2_*`` experiments, the public DART-pretrained model of
:mod:`experiments.pretrain_public` (``runs/pretrained_dart``) for
``e2e_pretrained_cpu``. ``--tiny`` builds every run's optimizer and runs one
release of the first run on a tiny GPT-2 and a few validation pairs, so
configs cannot rot (every LM optimizer's step on GPT-2 is tested in
``tests/test_text.py``). ``--measure`` times releases of the chosen variants
at the experiment's settings (q, capacity, microbatch) with each
clipped-sum method and appends them to ``<out>/release_times.csv``: what the
CPU experiments' number of releases T is sized from. It trains no recorded run.

Restartable: each finished run's row is appended to ``<out>/runs.csv`` at
once (flushed and fsynced), and a rerun skips every (variant, target ε, seed)
already recorded, then rewrites the summary and plots from all the rows. A run
interrupted midway resumes from its latest checkpoint (written at every
evaluation along the way, every ``eval_every`` releases; without them a run
is redone from scratch), replaying the releases made after it
exactly (:mod:`dpmuon_jax.training.journal`); its row says ``resumed = 1``, its
``train_seconds`` still cover all its releases once (checkpoint writes left
out), while ``run_seconds`` and the peak memory are those of its last process.
A resumption that cannot complete as planned (a lost release it could not
replay) is thrown away and the run redone from scratch with the same published
seed, which draws the same samples and noise. Each run trains in a fresh
process of its own, so the peak memory in its row is its own (a process's peak
RSS and the device's peak allocation only grow).

An experiment with a learning-rate grid first runs its pilot for each ε
(:func:`pilot`, before that ε's runs; ``<out>/pilot.csv``, restartable the
same way) and records each arm's grid and chosen rates in ``<out>/rates.csv``.

Writes ``<out>/runs.csv`` (one row per variant × ε × seed: ε spent, σ,
releases, gradient evaluations per example, validation NLL per target token,
BLEU / ROUGE-L per decoded split, training and whole-run seconds, peak
memory, the rates), ``<out>/summary.csv`` (mean ± std over seeds, and the
checkpoint's zero-shot row), ``<out>/pairs.csv`` (inner momentum minus
DP-Muon per seed) with ``<out>/decision.csv`` (:func:`decide`, or
:func:`decide_co_primary` where BLEU is co-primary) and ``<out>/pair_metrics.csv``
(every metric of ``pairs.csv`` as paired mean ± SE with each seed's sign,
:func:`metric_pairs`), for runs evaluated along the way ``<out>/curves.csv``,
``valid_nll_curves.png`` and ``<out>/curve_pairs.csv`` (each arm minus DP-Muon
in validation NLL at every evaluated release, :func:`curve_pairs`),
``<out>/<metric>_vs_epsilon.png``, for fine-tuning ``<out>/zero_shot.json``
(the checkpoint before any release: validation NLL and the decoded splits'
scores, the floor every run should beat) and, for diagnostic runs,
``<out>/diagnostics.csv`` with its paired summary in ``diagnostics.json``
(NON-PRIVATE analysis).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import csv
import dataclasses
import inspect
import json
import math
import multiprocessing
import os
import shutil
import statistics
import time

from benchmarks._peak_memory import ReleaseMemory
from dpmuon_jax.analysis.polar_metrics import InnerMomentumProbe, ProtocolRow, summarise_protocol
from dpmuon_jax.extras import MissingExtraError, pyplot
from dpmuon_jax.optimizers import registry
from dpmuon_jax.privacy.disk_query import single_point
from dpmuon_jax.text.data import encode_pairs
from dpmuon_jax.text.hf_weights import WEIGHTS_FILE
from dpmuon_jax.text.metrics import mean_token_nll
from dpmuon_jax.text.tokenizer import GPT2Tokenizer
from dpmuon_jax.text.train import (
    LMTrainConfig,
    lm_optimizer,
    load_model,
    load_split,
    score_split,
    train_lm,
)
from dpmuon_jax.training.checkpoint import latest_good_step
from dpmuon_jax.training.driver import TrainingError
from dpmuon_jax.training.records import append_csv_row, write_csv
from experiments.pretrain_public import sha256_file
from experiments.text_configs import TEXT_EXPERIMENTS, TextExperiment, Variant

TINY_MODEL = {"dim": 16, "num_layers": 1, "num_heads": 2, "max_positions": 160}
METRICS = ("valid_nll", "valid_bleu", "valid_rouge_l", "test_bleu", "test_rouge_l")
RUN_FIELDS = (
    "variant", "optimizer", "target_epsilon", "seed", "epsilon_spent", "delta",
    "noise_multiplier", "releases", "grad_evals_per_example", "clipped_sum_method",
    "pretrained", "valid_nll", "valid_bleu", "valid_rouge_l", "test_bleu", "test_rouge_l",
    "train_seconds", "run_seconds", "peak_rss_gib", "peak_device_gib",
    "learning_rate", "fallback_learning_rate", "steady_peak_rss_gib", "train_cpu_seconds",
    "resumed",
)
PILOT_FIELDS = (
    "variant", "optimizer", "target_epsilon", "seed", "rate_factor", "learning_rate",
    "fallback_learning_rate", "releases", "epsilon_spent", "noise_multiplier", "valid_nll",
    "train_seconds", "run_seconds", "steady_peak_rss_gib", "train_cpu_seconds", "resumed",
)
_TEXT_FIELDS = ("variant", "optimizer", "clipped_sum_method", "pretrained", "grid", "on_edge")
_INT_FIELDS = ("seed", "pilot_seed", "pilot_releases", "resumed", "step")


def run_config(exp: TextExperiment, variant: Variant, epsilon: float, seed: int, out: str,
               data_dir: str, gpt2_dir: str | None, tiny: bool,
               rate_factor: float = 1.0) -> LMTrainConfig:
  """The :class:`LMTrainConfig` of one run (``tiny``: one release on tiny shapes), both
  learning rates multiplied by ``rate_factor``."""
  config = LMTrainConfig(
      data_dir=data_dir,
      dataset=exp.dataset,
      output_dir=run_dir(out, variant, epsilon, seed),
      init_weights=gpt2_dir if exp.pretrained else None,
      model=exp.model,
      model_overrides=dict(exp.model_overrides),
      vocab_size=exp.vocab_size,
      max_length=exp.max_length,
      optimizer=variant.optimizer,
      optimizer_kwargs=variant.optimizer_kwargs(exp.dataset, epsilon),
      learning_rate=exp.learning_rate * rate_factor,
      fallback_learning_rate=exp.fallback_learning_rate * rate_factor,
      epsilon=epsilon,
      delta=exp.delta,
      sampling_rate=exp.sampling_rate,
      steps=exp.steps * variant.releases,
      denominator=exp.denominator,
      clip=exp.clip,
      seed=seed,
      public_slice=exp.public_slice,
      microbatch_size=exp.microbatch_size,
      clipped_sum_method=exp.clipped_sum_method,
      capacity=exp.capacity,
      eval_every=exp.eval_every,
      eval_pairs=exp.eval_pairs,
      generate_splits=exp.generate_splits,
      max_new_tokens=exp.max_new_tokens,
      diagnostic_steps=exp.diagnostic_steps,
      # What an interrupted sweep resumes from (the writes are left out of the run's time).
      checkpoint_every=exp.eval_every or exp.steps * variant.releases,
  )
  if not tiny:
    return config
  # A split no run scores: DART's offline copy has no train split, so its tiny runs train
  # on test and decode nothing.
  split = "train" if exp.dataset == "e2e" else "test"
  return dataclasses.replace(
      config, init_weights=None, model="gpt2_tiny", model_overrides=TINY_MODEL, vocab_size=512,
      train_split=split, train_subset=64, sampling_rate=0.125, steps=1, denominator=8.0,
      microbatch_size=8, capacity=None, eval_every=None, eval_pairs=16, generate_groups=2,
      max_new_tokens=4, diagnostic_steps=(0,) if exp.diagnostic_steps else (),
      generate_splits=exp.generate_splits if split == "train" else (),
  )


def run_dir(out: str, variant: Variant, epsilon: float, seed: int) -> str:
  return os.path.join(out, "runs", f"{_slug(variant.label)}_eps{epsilon:g}_s{seed}")


def check_buildable(exp: TextExperiment, out: str, data_dir: str) -> None:
  """Every run's optimizer builds with the experiment's release settings."""
  release = {"l2_clip_norm": exp.clip, "noise_multiplier": 1.0,
             "denominator": exp.denominator or 256.0, "key": 0}
  for variant, epsilon, seed in exp.runs():
    lm_optimizer(run_config(exp, variant, epsilon, seed, out, data_dir, None, False), release)


def gradient_evaluations(optimizer: str, kwargs: dict, releases: int) -> int:
  """Per-example gradient evaluations over ``releases`` releases, Σ_t n_t, by the query:

  * the gradient (DP-Muon, DP-Muon-BC): n_t = 1;
  * DiSK's (KF): n_t = 2, but n_0 = 1 (d_0 = 0: both points are θ_0), and 1
    throughout when κ, γ make it a single point;
  * inner momentum's: n_t = min(K, t) + 1 with K = max(K_Muon, K_AdamW)
    (each past state's full gradient is evaluated once; K_t < K while the
    history fills);
  * KF + IM: the current state's term replaced by DiSK's, n_t = min(K, t) + 2, n_0 = 1.

  These are the evaluations the query needs. The implementation keeps static
  shapes: it evaluates K + 1 (IM) or 2 (DiSK) gradients at every release,
  weighting the missing terms zero, so its wall time per release is constant.
  """
  query = registry.OPTIMIZERS[optimizer].query
  history = 0
  if query in ("inner_momentum", "disk_inner_momentum"):
    defaults = inspect.signature(registry.OPTIMIZERS[optimizer].factory).parameters
    history = kwargs.get("history", defaults["history"].default)
    fallback = kwargs.get("fallback_history")
    history = max(history, history if fallback is None else fallback)
  two_points = query in ("disk", "disk_inner_momentum") and not (
      "kappa" in kwargs and "gamma" in kwargs
      and single_point(kwargs["kappa"], kwargs["gamma"]) is not None)
  return sum(min(history, t) + 1 + int(two_points and t > 0) for t in range(releases))


# ---------------------------------------------------------------------------
# The restartable driver.


def read_rows(path: str, fields: tuple[str, ...] = RUN_FIELDS) -> list[dict]:
  """The recorded rows, numbers parsed; an older header is rewritten to ``fields``."""
  if not os.path.exists(path):
    return []
  with open(path, newline="") as f:
    reader = csv.DictReader(f)
    rows = list(reader)
    header = tuple(reader.fieldnames or ())
  if header != fields:
    if set(header) - set(fields):
      raise SystemExit(f"{path} has columns {sorted(set(header) - set(fields))} that this "
                       "sweep does not write: move the file away to start afresh.")
    write_csv(path + ".tmp", rows, fields)
    os.replace(path + ".tmp", path)
  return [_parse(r, fields) for r in rows]


def _parse(row: dict, fields: tuple[str, ...] = RUN_FIELDS) -> dict:
  out = {}
  for name in fields:
    value = row.get(name, "")
    out[name] = value if name in _TEXT_FIELDS or value == "" else float(value)
  for name in _INT_FIELDS:  # written as integers: read back as integers, so rewrites keep them
    if out.get(name, "") != "":
      out[name] = int(out[name])
  return out


def append_row(path: str, row: dict) -> None:
  """Appends one finished run to ``runs.csv``, durably (:func:`append_csv_row`)."""
  append_csv_row(path, row, RUN_FIELDS)


def run_key(label: str, epsilon: float, seed: int) -> tuple[str, float, int]:
  """What identifies a run in ``runs.csv``: (variant label, target ε, seed)."""
  return label, float(epsilon), int(seed)


def row_key(row: dict) -> tuple[str, float, int]:
  """The :func:`run_key` of a recorded row (of ``runs.csv`` or ``curves.csv``)."""
  return run_key(row["variant"], row["target_epsilon"], row["seed"])


def run(exp: TextExperiment, out: str, data_dir: str, gpt2_dir: str | None = None,
        tiny: bool = False, log_dir: str | None = None, own_process: bool = True) -> list[dict]:
  """Trains every run not yet in ``out/runs.csv``, then summarises all of them.

  With a learning-rate grid, the pilot of each ε (:func:`pilot`) runs before
  that ε's first run, and each run takes its variant's chosen factor. ``log_dir``:
  each run's TensorBoard logs in a folder of its own. ``own_process`` (the
  default): the setup and each run happen in a fresh process of their own
  (:func:`in_own_process`), so a row's peak memory is that run's alone; ``False``
  runs them in this process (the tests use it for tiny runs, and to stand a fake in
  for :func:`train_lm`). Returns the experiment's rows, in :meth:`TextExperiment.runs`
  order.
  """
  if exp.pretrained and gpt2_dir is None and not tiny:
    raise SystemExit(f"{exp.name} fine-tunes a pretrained GPT-2: pass --gpt2-dir, {exp.weights}.")
  os.makedirs(out, exist_ok=True)
  call = in_own_process if own_process else _in_this_process
  call(_prepare, exp, out, data_dir, gpt2_dir, tiny)
  path = os.path.join(out, "runs.csv")
  done = {row_key(r) for r in read_rows(path)}
  runs = list(exp.runs())[:1] if tiny else list(exp.runs())  # tiny: the first, tiny shapes
  factors: dict[tuple[str, float], float] = {}
  for variant, epsilon, seed in runs:
    if exp.rate_grid and not tiny and (variant.rate_from or variant.label,
                                       epsilon) not in factors:
      factors.update({(label, epsilon): f for label, f in pilot(
          exp, out, data_dir, gpt2_dir, epsilon, call, log_dir).items()})
    if run_key(variant.label, epsilon, seed) in done:
      continue
    factor = factors.get((variant.rate_from or variant.label, epsilon), 1.0)
    config = run_config(exp, variant, epsilon, seed, out, data_dir, gpt2_dir, tiny, factor)
    results, seconds, resumed = _train_and_time(config, log_dir, call)
    row = _row(variant, epsilon, seed, config, results, seconds, resumed)
    append_row(path, row)
    print(json.dumps(row), flush=True)
    summarise_recorded(exp, out, runs)  # partial results stay current while the sweep runs
  return summarise_recorded(exp, out, runs)


def summarise_recorded(exp: TextExperiment, out: str,
                       runs: list[tuple[Variant, float, int]] | None = None) -> list[dict]:
  """Rewrites the summaries from ``out/runs.csv`` and the runs' folders, training nothing;
  returns the recorded rows of ``runs`` (default: all the experiment's), in their order."""
  runs = list(exp.runs()) if runs is None else runs
  order = {run_key(v.label, e, s): i for i, (v, e, s) in enumerate(runs)}
  rows = sorted((r for r in read_rows(os.path.join(out, "runs.csv")) if row_key(r) in order),
                key=lambda r: order[row_key(r)])
  if rows:
    _write_summaries(exp, out, rows, runs)
  return rows


def _train_and_time(config: LMTrainConfig, log_dir: str | None, call
                    ) -> tuple[dict, float, bool]:
  """One run, resumed from the checkpoint an interrupted sweep left, else from scratch:
  (results, seconds of the call that finished it, resumed).

  A resumption that cannot finish as the run planned (a lost release it could not replay
  exactly and charged instead, a refusal, outputs without their checkpoint) is set
  aside whole in ``<run>.discarded-<k>`` (its journal keeps the releases it made; its
  checkpoints, which hold the root key, are removed) and the run redone from scratch
  with the same published seed. A finished run's checkpoints are removed too; export/
  stays.
  """
  if log_dir is not None:
    config = dataclasses.replace(
        config, log_dir=os.path.join(log_dir, os.path.basename(config.output_dir)))
  started = time.perf_counter()
  results = _resumed(config, call) if _resumable(config.output_dir) else None
  resumed = results is not None
  if not resumed:
    if config.log_dir is not None:
      shutil.rmtree(config.log_dir, ignore_errors=True)  # an interrupted run's events
    _set_aside(config.output_dir)  # an interrupted run's files, its journal kept
    started = time.perf_counter()
    results = call(_train, config)
  shutil.rmtree(os.path.join(config.output_dir, "checkpoints"), ignore_errors=True)
  return results, time.perf_counter() - started, resumed


def _set_aside(output_dir: str) -> None:
  """Moves an interrupted run's folder to the first free ``<output_dir>.discarded-<k>``,
  less its checkpoints (SECRET), so the releases its journal records are never lost."""
  if not os.path.isdir(output_dir):
    return
  shutil.rmtree(os.path.join(output_dir, "checkpoints"), ignore_errors=True)
  k = 1
  while os.path.exists(f"{output_dir}.discarded-{k}"):
    k += 1
  os.replace(output_dir, f"{output_dir}.discarded-{k}")


def _resumable(output_dir: str) -> bool:
  """Whether an interrupted run left an intact checkpoint in ``output_dir``."""
  try:
    return latest_good_step(os.path.join(output_dir, "checkpoints")) is not None
  except OSError:  # none intact
    return False


def _resumed(config: LMTrainConfig, call) -> dict | None:
  """The results of the resumed run, or ``None`` where it did not complete as planned."""
  try:
    results = call(_train, dataclasses.replace(config, resume=True))
  except TrainingError as error:
    results = {"stop_reason": str(error)}
  if results.get("stop_reason") == "completed" and results["releases"] == config.steps:
    return results
  print(f"{config.output_dir}: the resumption did not complete as planned "
        f"({results.get('stop_reason')}); redone from scratch.", flush=True)
  return None


# ---------------------------------------------------------------------------
# The learning-rate pilot.


def pilot(exp: TextExperiment, out: str, data_dir: str, gpt2_dir: str | None, epsilon: float,
          call=None, log_dir: str | None = None) -> dict[str, float]:
  """Chooses each piloted variant's rate factor at ``epsilon``; returns {label: factor}.

  Each (variant, factor) trains once at ``exp.pilot_seed`` for ``exp.pilot_steps``
  releases (times the variant's ``releases``) without decoding; its row goes to
  ``out/pilot.csv`` at once (a rerun skips it). The grid starts at
  ``exp.rate_grid`` and grows by a factor 2 past whichever end holds the lowest
  validation NLL (a diverged run counts as +∞), until the best is inside or
  ``exp.max_rate_points`` factors were tried. Then ``out/rates.csv`` records,
  per variant and ε, the grid tried and the factor chosen. No test split is read.
  """
  call = call or in_own_process
  path = os.path.join(out, "pilot.csv")
  chosen = {}
  for variant in exp.piloted(epsilon):
    grid = sorted(exp.rate_grid)
    while True:
      tried = {float(r["rate_factor"]): r for r in read_rows(path, PILOT_FIELDS)
               if (r["variant"], r["target_epsilon"], r["seed"])
               == (variant.label, epsilon, exp.pilot_seed)}
      for factor in grid:
        if factor not in tried:
          config = dataclasses.replace(
              run_config(exp, variant, epsilon, exp.pilot_seed, out, data_dir, gpt2_dir, False,
                         factor),
              steps=exp.pilot_steps * variant.releases, generate_splits=(),
              output_dir=os.path.join(out, "runs", "pilot",
                                      f"{_slug(variant.label)}_eps{epsilon:g}_x{factor:g}"))
          results, seconds, resumed = _train_and_time(config, log_dir, call)
          row = _pilot_row(variant, epsilon, factor, config, results, seconds, resumed)
          append_csv_row(path, row, PILOT_FIELDS)
          print(json.dumps(row), flush=True)
          tried[factor] = _parse(row, PILOT_FIELDS)
      best = choose_factor({f: tried[f]["valid_nll"] for f in grid})
      if len(grid) >= exp.max_rate_points or grid[0] < best < grid[-1]:
        break
      grid = [grid[0] / 2] + grid if best == grid[0] else grid + [grid[-1] * 2]
    chosen[variant.label] = best
    _record_rate(out, exp, variant, epsilon, grid, best, tried[best])
  return chosen


def choose_factor(nll: dict[float, float]) -> float:
  """The factor of the lowest validation NLL (NaN or ∞: diverged, never chosen unless all
  did); ties go to the smaller factor."""
  finite = {f: v for f, v in nll.items() if math.isfinite(v)}
  pool = finite or nll
  return min(sorted(pool), key=lambda f: pool[f] if math.isfinite(pool[f]) else math.inf)


def _pilot_row(variant: Variant, epsilon: float, factor: float, config: LMTrainConfig,
               results: dict, run_seconds: float, resumed: bool) -> dict:
  return {"variant": variant.label, "optimizer": variant.optimizer, "target_epsilon": epsilon,
          "seed": config.seed, "rate_factor": factor, "learning_rate": config.learning_rate,
          "fallback_learning_rate": config.fallback_learning_rate,
          "releases": int(results["releases"]), "epsilon_spent": results["epsilon_spent"],
          "noise_multiplier": results["noise_multiplier"], "valid_nll": results["valid_nll"],
          "train_seconds": results["train_seconds"], "run_seconds": run_seconds,
          "steady_peak_rss_gib": results.get("steady_peak_rss_gib", ""),
          "train_cpu_seconds": results.get("train_cpu_seconds", ""), "resumed": int(resumed)}


RATE_FIELDS = ("variant", "target_epsilon", "pilot_seed", "pilot_releases", "grid",
               "rate_factor", "learning_rate", "fallback_learning_rate", "pilot_valid_nll",
               "on_edge")


def _record_rate(out: str, exp: TextExperiment, variant: Variant, epsilon: float,
                 grid: list[float], best: float, row: dict) -> None:
  """Replaces (variant, ε)'s row of ``out/rates.csv``: the grid tried and the choice."""
  path = os.path.join(out, "rates.csv")
  rows = [r for r in read_rows(path, RATE_FIELDS)
          if (r["variant"], r["target_epsilon"]) != (variant.label, epsilon)]
  rows.append({"variant": variant.label, "target_epsilon": epsilon,
               "pilot_seed": exp.pilot_seed, "pilot_releases": int(row["releases"]),
               "grid": " ".join(f"{f:g}" for f in grid), "rate_factor": best,
               "learning_rate": row["learning_rate"],
               "fallback_learning_rate": row["fallback_learning_rate"],
               "pilot_valid_nll": row["valid_nll"],
               "on_edge": best in (grid[0], grid[-1])})
  write_csv(path, rows, RATE_FIELDS)


def in_own_process(fn, *args):
  """``fn(*args)`` in a fresh (spawned) process: its result, or its exception re-raised.

  A run's peak memory (:func:`benchmarks._peak_memory.peak_memory`: the process's
  peak RSS and the device's peak allocation, neither of which can be reset) is
  then its own, not the sweep's peak so far, and the sweep's process never
  initialises a backend, so it holds no accelerator memory a run needs.
  """
  context = multiprocessing.get_context("spawn")
  with concurrent.futures.ProcessPoolExecutor(1, mp_context=context) as pool:
    return pool.submit(fn, *args).result()


def _in_this_process(fn, *args):
  return fn(*args)


def _prepare(exp: TextExperiment, out: str, data_dir: str, gpt2_dir: str | None,
             tiny: bool) -> None:
  """Before any run: every optimizer builds; a fine-tuning experiment records its
  checkpoint's zero-shot scores and refuses a checkpoint other than its runs'."""
  check_buildable(exp, out, data_dir)
  if exp.pretrained and not tiny:
    record = zero_shot(exp, data_dir, gpt2_dir, out)  # pyright: ignore[reportArgumentType]
    check_same_checkpoint(record, gpt2_dir, out)  # pyright: ignore[reportArgumentType]


def _train(config: LMTrainConfig) -> dict:
  """One run (with paper 2's probe where it has diagnostic steps) and its peak memory
  (:class:`benchmarks._peak_memory.ReleaseMemory`); plain-Python results."""
  memory = ReleaseMemory(config.steps)
  results = train_lm(config, probe=InnerMomentumProbe() if config.diagnostic_steps else None,
                     callbacks=[memory])
  return json.loads(json.dumps({**results, **memory.summary()}, default=float))


def _write_summaries(exp: TextExperiment, out: str, rows: list[dict],
                     runs: list[tuple[Variant, float, int]]) -> None:
  """summary.csv (with the checkpoint's zero-shot row), the plot, pairs.csv and
  decision.csv, curves.csv and its plot, experiment.json and (diagnostic runs)
  diagnostics.csv/json."""
  dirs = [run_dir(out, v, e, s) for v, e, s in runs]
  by_variant = {v.label: i for i, v in enumerate(exp.variants)}
  summary = sorted(summarise(rows), key=lambda r: (by_variant[r["variant"]],
                                                   r["target_epsilon"]))
  floor, zero_row = None, []
  if os.path.exists(os.path.join(out, "zero_shot.json")):
    with open(os.path.join(out, "zero_shot.json")) as f:
      record = json.load(f)
    floor = _plotted(exp, record)
    zero_row = [zero_shot_row(record)]
  write_csv(os.path.join(out, "summary.csv"), summary + zero_row)
  _plot(os.path.join(out, f"{exp.metric}_vs_epsilon.png"), summary, exp, floor)
  curves = recorded_curves(os.path.join(out, "curves.csv"), runs, collect_curves(runs, dirs))
  if curves and len({c["step"] for c in curves}) > 1:
    write_csv(os.path.join(out, "curves.csv"), curves, CURVE_FIELDS)
    _plot_curves(os.path.join(out, "valid_nll_curves.png"), curves, exp, floor)
    curve_table = curve_pairs(curves)
    if curve_table:
      write_csv(os.path.join(out, "curve_pairs.csv"), curve_table)
  pairs = paired_differences(rows)
  if pairs:
    write_csv(os.path.join(out, "pairs.csv"), pairs)
    write_csv(os.path.join(out, "pair_metrics.csv"), metric_pairs(pairs))
    rule, fields = ((decide_co_primary, CO_PRIMARY_FIELDS) if exp.bleu_co_primary
                    else (decide, DECISION_FIELDS))
    write_csv(os.path.join(out, "decision.csv"),
              rule(pairs, rates=read_rows(os.path.join(out, "rates.csv"), RATE_FIELDS)), fields)
  diagnostics = []
  for (_, _, seed), directory in zip(runs, dirs):
    path = os.path.join(directory, "diagnostics.csv")
    if os.path.exists(path):
      with open(path) as f:  # labelled with the study's (published) seed of the run
        diagnostics += [{**d, "seed": seed} for d in csv.DictReader(f)]
  if diagnostics:
    write_csv(os.path.join(out, "diagnostics.csv"), diagnostics)
    protocol = summarise_protocol([_protocol_row(d) for d in diagnostics])
    with open(os.path.join(out, "diagnostics.json"), "w") as f:
      json.dump({name: getattr(protocol, name)._asdict()
                 for name in ("polar_error", "cosine_error", "clipping_residual")}, f, indent=2)
  with open(os.path.join(out, "experiment.json"), "w") as f:
    json.dump(dataclasses.asdict(exp), f, indent=2)


def zero_shot_row(record: dict) -> dict:
  """The checkpoint before any release as a summary row (no seeds, no releases)."""
  row = {"variant": "zero-shot start", "target_epsilon": "", "seeds": 0, "releases": 0,
         "valid_nll_mean": record["valid_nll"]}
  for split, scores in record.get("scores", {}).items():
    for name in ("bleu", "rouge_l"):
      if name in scores:
        row[f"{split}_{name}_mean"] = scores[name]
  return row


CURVE_FIELDS = ("variant", "target_epsilon", "seed", "step", "epsilon_spent", "valid_nll",
                "seconds", "cpu_seconds")


def collect_curves(runs: list[tuple[Variant, float, int]], dirs: list[str]) -> list[dict]:
  """Every finished run's validation-NLL curve (its ``history.csv``), one row per
  evaluation: (variant, target ε, seed, release, ε spent so far, NLL, wall and CPU seconds
  since the first release began)."""
  curves = []
  for (variant, epsilon, seed), directory in zip(runs, dirs):
    path = os.path.join(directory, "history.csv")
    if not os.path.exists(os.path.join(directory, "results.json")) or not os.path.exists(path):
      continue  # unfinished: an interrupted run's history is not a result
    with open(path, newline="") as f:
      for r in csv.DictReader(f):
        curves.append({"variant": variant.label, "target_epsilon": epsilon, "seed": seed,
                       "step": int(r["step"]), "epsilon_spent": float(r["epsilon"]),
                       "valid_nll": float(r["valid_nll"]), "seconds": float(r["seconds"]),
                       "cpu_seconds": float(r.get("cpu_seconds") or "nan")})
  return curves


def recorded_curves(path: str, runs: list[tuple[Variant, float, int]],
                    collected: list[dict]) -> list[dict]:
  """The curves of ``path`` (``curves.csv``) updated with those ``collected`` from the
  runs' folders, in the order of ``runs``: a checkout without the folders (they are not
  committed) keeps and plots the recorded curves, and a run's folder replaces its rows."""
  order = {run_key(v.label, e, s): i for i, (v, e, s) in enumerate(runs)}
  fresh = {row_key(c) for c in collected}
  kept = [c for c in read_rows(path, CURVE_FIELDS) if row_key(c) not in fresh]
  return sorted(kept + collected, key=lambda c: (order.get(row_key(c), len(order)), c["step"]))


DECISION_FIELDS = ("comparison", "variant", "baseline", "target_epsilon", "seeds",
                   "d_valid_nll_per_seed", "d_valid_nll_mean", "d_valid_nll_paired_se",
                   "all_negative", "mean_below_minus_2se", "helps", "all_positive",
                   "mean_above_plus_2se", "verdict", "rates_on_edge")


def decide(pairs: list[dict], seeds: int = 3, rates: list[dict] = ()) -> list[dict]:
  """The pre-registered rule on ``pairs.csv``'s validation NLL, per comparison and ε.

  With Δ = NLL(inner momentum) − NLL(baseline) per seed and SE = sample std(Δ)/√n:
  inner momentum **helps** iff Δ < 0 on every one of at least ``seeds`` seeds and
  mean Δ < −2 SE; the baseline (DP-Muon) is **better** iff Δ > 0 on every seed and
  mean Δ > +2 SE; otherwise the claim is **not supported**. With fewer seeds
  ``helps`` and ``verdict`` are left empty (undecided). ``rates`` (``rates.csv``'s
  rows): the compared arms whose chosen rate factor is on its grid's edge, reported
  beside the verdict they affect.
  """
  edge = {(r["variant"], float(r["target_epsilon"])) for r in rates
          if str(r["on_edge"]) == "True"}
  out = []
  keys = dict.fromkeys((p["comparison"], p["variant"], p["baseline"], p["target_epsilon"])
                       for p in pairs if "d_valid_nll" in p)
  for key in keys:
    group = sorted((p for p in pairs if "d_valid_nll" in p and (
        p["comparison"], p["variant"], p["baseline"], p["target_epsilon"]) == key),
        key=lambda p: p["seed"])
    d = [p["d_valid_nll"] for p in group]
    mean = statistics.fmean(d)
    se = statistics.stdev(d) / math.sqrt(len(d)) if len(d) > 1 else math.nan
    negative, below = all(x < 0 for x in d), len(d) > 1 and mean < -2 * se
    positive, above = all(x > 0 for x in d), len(d) > 1 and mean > 2 * se
    decided = len(d) >= seeds
    verdict = ("helps" if negative and below else "DP-Muon better" if positive and above
               else "not supported")
    out.append({"comparison": key[0], "variant": key[1], "baseline": key[2],
                "target_epsilon": key[3], "seeds": " ".join(str(p["seed"]) for p in group),
                "d_valid_nll_per_seed": " ".join(f"{x:+.4f}" for x in d),
                "d_valid_nll_mean": mean, "d_valid_nll_paired_se": se,
                "all_negative": negative, "mean_below_minus_2se": below,
                "helps": (negative and below) if decided else "",
                "all_positive": positive, "mean_above_plus_2se": above,
                "verdict": verdict if decided else "",
                "rates_on_edge": " ".join(label for label in key[1:3]
                                          if (label, float(key[3])) in edge)})
  return out


CO_PRIMARY_FIELDS = ("comparison", "variant", "baseline", "target_epsilon", "seeds",
                     "d_test_bleu_per_seed", "d_test_bleu_mean", "d_test_bleu_paired_se",
                     "bleu_favours", "d_valid_nll_per_seed", "d_valid_nll_mean",
                     "d_valid_nll_paired_se", "nll_favours", "d_test_rouge_l_per_seed",
                     "d_test_rouge_l_mean", "d_test_rouge_l_paired_se", "verdict",
                     "rates_on_edge")


def favoured(d: list[float], lower_is_better: bool) -> str:
  """Which side one metric's paired differences Δ (inner momentum − baseline) favour:
  "inner momentum" iff every Δ is on its better side (< 0 for a loss, > 0 for a score) and
  |mean Δ| > 2 paired SE (sample std(Δ)/√n), "baseline" iff the same holds the other way,
  else ""."""
  if len(d) < 2:
    return ""
  mean, se = statistics.fmean(d), statistics.stdev(d) / math.sqrt(len(d))
  sign = -1.0 if lower_is_better else 1.0
  if all(sign * x > 0 for x in d) and sign * mean > 2 * se:
    return "inner momentum"
  if all(sign * x < 0 for x in d) and sign * mean < -2 * se:
    return "baseline"
  return ""


def decide_co_primary(pairs: list[dict], seeds: int = 3, rates: list[dict] = ()) -> list[dict]:
  """The pre-registered rule with test BLEU and validation NLL co-primary, per comparison
  and ε, on the seeds that have both metrics.

  Each metric's rule (:func:`favoured`): every seed's Δ the same sign and |mean Δ| > 2
  paired SE. Inner momentum **helps** iff the BLEU rule favours it and the NLL rule
  does not favour the baseline; the baseline (DP-Muon) is **better** iff the BLEU rule
  favours it and the NLL rule does not favour inner momentum; otherwise **not
  supported**. ``verdict`` is empty below ``seeds`` seeds. ROUGE-L is reported beside
  them and decides nothing; ``rates_on_edge`` as in :func:`decide`.
  """
  edge = {(r["variant"], float(r["target_epsilon"])) for r in rates
          if str(r["on_edge"]) == "True"}
  both = [p for p in pairs if "d_valid_nll" in p and "d_test_bleu" in p]
  out = []
  for key in dict.fromkeys((p["comparison"], p["variant"], p["baseline"], p["target_epsilon"])
                           for p in both):
    group = sorted((p for p in both if (p["comparison"], p["variant"], p["baseline"],
                                        p["target_epsilon"]) == key), key=lambda p: p["seed"])
    row = {"comparison": key[0], "variant": key[1], "baseline": key[2],
           "target_epsilon": key[3], "seeds": " ".join(str(p["seed"]) for p in group)}
    for metric in ("test_bleu", "valid_nll", "test_rouge_l"):
      d = [p[f"d_{metric}"] for p in group if f"d_{metric}" in p]
      row[f"d_{metric}_per_seed"] = " ".join(f"{x:+.4f}" for x in d)
      row[f"d_{metric}_mean"] = statistics.fmean(d) if d else math.nan
      row[f"d_{metric}_paired_se"] = (statistics.stdev(d) / math.sqrt(len(d)) if len(d) > 1
                                      else math.nan)
    bleu = favoured([p["d_test_bleu"] for p in group], lower_is_better=False)
    nll = favoured([p["d_valid_nll"] for p in group], lower_is_better=True)
    verdict = ("helps" if bleu == "inner momentum" and nll != "baseline"
               else "DP-Muon better" if bleu == "baseline" and nll != "inner momentum"
               else "not supported")
    row.update(bleu_favours=bleu, nll_favours=nll,
               verdict=verdict if len(group) >= seeds else "",
               rates_on_edge=" ".join(label for label in key[1:3]
                                      if (label, float(key[3])) in edge))
    out.append(row)
  return out


def _row(variant: Variant, epsilon: float, seed: int, config: LMTrainConfig, results: dict,
         run_seconds: float, resumed: bool) -> dict:
  releases = int(results["releases"])
  row = {"variant": variant.label, "optimizer": variant.optimizer, "target_epsilon": epsilon,
         "seed": seed, "epsilon_spent": results["epsilon_spent"], "delta": results["delta"],
         "noise_multiplier": results["noise_multiplier"], "releases": releases,
         "grad_evals_per_example": gradient_evaluations(
             variant.optimizer, config.optimizer_kwargs, releases),
         "clipped_sum_method": config.clipped_sum_method,
         "pretrained": results["pretrained"], "valid_nll": results["valid_nll"]}
  for split in ("valid", "test"):
    scores = results["scores"].get(split, {})
    row[f"{split}_bleu"] = scores.get("bleu", "")
    row[f"{split}_rouge_l"] = scores.get("rouge_l", "")
  row["train_seconds"] = results["train_seconds"]
  row["run_seconds"] = run_seconds
  row["peak_rss_gib"] = results["peak_rss_gib"]
  row["peak_device_gib"] = results.get("peak_device_gib", "")
  row["learning_rate"] = config.learning_rate
  row["fallback_learning_rate"] = config.fallback_learning_rate
  row["steady_peak_rss_gib"] = results.get("steady_peak_rss_gib", "")
  row["train_cpu_seconds"] = results.get("train_cpu_seconds", "")
  row["resumed"] = int(resumed)
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
           "releases": group[0]["releases"],
           "grad_evals_per_example": group[0]["grad_evals_per_example"],
           "max_epsilon_spent": max(r["epsilon_spent"] for r in group),
           "train_seconds_mean": statistics.fmean(r["train_seconds"] for r in group),
           "peak_rss_gib_max": max(r["peak_rss_gib"] for r in group)}
    for name in ("learning_rate", "fallback_learning_rate"):  # one per variant and ε
      if group[0].get(name, "") != "":
        row[name] = group[0][name]
    for name, reduce in (("steady_peak_rss_gib_max", max),
                         ("train_cpu_seconds_mean", statistics.fmean)):
      values = [r[name.rsplit("_", 1)[0]] for r in group
                if r.get(name.rsplit("_", 1)[0], "") != ""]
      if values:
        row[name] = reduce(values)
    for metric in METRICS:
      values = [r[metric] for r in group if r[metric] != ""]
      if values:
        row[f"{metric}_mean"] = statistics.fmean(values)
        row[f"{metric}_std"] = statistics.stdev(values) if len(values) > 1 else 0.0
    out.append(row)
  return out


PAIRED_METRICS = ("valid_nll", "test_bleu", "test_rouge_l")
INNER_MOMENTUM = ("dp_muon_im", "dp_disk_muon_im")


def paired_differences(rows: list[dict]) -> list[dict]:
  """Inner momentum minus DP-Muon, seed by seed (same ε, same seed: the same data order).

  Every run of an inner-momentum optimizer is paired with the DP-Muon run of
  its ε and seed that has the same number of releases T ("equal releases"),
  and with the DP-Muon run that has the fewest gradient evaluations per
  example at least as many as its own ("equal compute": IM with K past states
  evaluates K + 1 per release after the first, so DP-Muon gets about (K + 1)·T
  releases at a recalibrated σ; the tie goes to DP-Muon). ``d_valid_nll`` < 0
  and ``d_test_bleu``, ``d_test_rouge_l`` > 0 favour inner momentum.
  """
  out = []
  for row in (r for r in rows if r["optimizer"] in INNER_MOMENTUM):
    same = [b for b in rows if b["optimizer"] == "dp_muon"
            and (b["target_epsilon"], b["seed"]) == (row["target_epsilon"], row["seed"])]
    at_least = [b for b in same if b["grad_evals_per_example"] >= row["grad_evals_per_example"]]
    matches = [("equal releases", b) for b in same if b["releases"] == row["releases"]]
    if at_least:
      matches.append(("equal compute", min(at_least, key=lambda b: b["grad_evals_per_example"])))
    for comparison, base in matches:
      pair = {"comparison": comparison, "variant": row["variant"], "baseline": base["variant"],
              "target_epsilon": row["target_epsilon"], "seed": row["seed"]}
      for metric in PAIRED_METRICS:
        if row[metric] != "" and base[metric] != "":
          pair[f"d_{metric}"] = row[metric] - base[metric]
      out.append(pair)
  return out


def _paired_summary(d: list[float]) -> dict:
  """Paired differences as the READMEs quote them: mean, paired SE (sample std/√n; nan
  for one seed) and each seed's sign."""
  se = statistics.stdev(d) / math.sqrt(len(d)) if len(d) > 1 else math.nan
  return {"per_seed": " ".join(f"{x:+.4f}" for x in d), "mean": statistics.fmean(d),
          "paired_se": se, "signs": "".join("+" if x > 0 else "-" if x < 0 else "0" for x in d)}


def metric_pairs(pairs: list[dict]) -> list[dict]:
  """Every metric of :func:`paired_differences` per comparison and ε, seed by seed in seed
  order: validation NLL (lower is better), test BLEU and ROUGE-L (higher is better), each
  as paired mean ± SE with the seeds' signs. Descriptive: the verdict is
  :func:`decide`'s (or :func:`decide_co_primary`'s)."""
  out = []
  keys = dict.fromkeys((p["comparison"], p["variant"], p["baseline"], p["target_epsilon"])
                       for p in pairs)
  for key in keys:
    group = sorted((p for p in pairs if (p["comparison"], p["variant"], p["baseline"],
                                         p["target_epsilon"]) == key), key=lambda p: p["seed"])
    for metric in PAIRED_METRICS:
      d = [p[f"d_{metric}"] for p in group if f"d_{metric}" in p]
      if d:
        out.append({"comparison": key[0], "variant": key[1], "baseline": key[2],
                    "target_epsilon": key[3], "metric": metric,
                    "seeds": " ".join(str(p["seed"]) for p in group if f"d_{metric}" in p),
                    **_paired_summary(d)})
  return out


def curve_pairs(curves: list[dict], baseline: str = "DP-Muon") -> list[dict]:
  """Each arm minus ``baseline`` in validation NLL at every release both evaluated, same ε
  and seed, over at least two seeds: how a paired gap moves with the number of releases."""
  nll = {(c["variant"], float(c["target_epsilon"]), int(c["seed"]), int(c["step"])):
         float(c["valid_nll"]) for c in curves}
  out = []
  for variant in dict.fromkeys(c["variant"] for c in curves):
    if variant == baseline:
      continue
    for epsilon, step in sorted({(e, t) for v, e, _, t in nll if v == variant}):
      seeds = sorted(s for v, e, s, t in nll if (v, e, t) == (variant, epsilon, step)
                     and (baseline, e, s, t) in nll)
      if len(seeds) < 2:
        continue
      d = [nll[variant, epsilon, s, step] - nll[baseline, epsilon, s, step] for s in seeds]
      out.append({"variant": variant, "baseline": baseline, "target_epsilon": epsilon,
                  "step": step, "seeds": " ".join(map(str, seeds)), **_paired_summary(d)})
  return out


def _slug(label: str) -> str:
  return "".join(c if c.isalnum() else "_" for c in label).strip("_").lower()


# ---------------------------------------------------------------------------
# The pretrained checkpoint before fine-tuning, and release timing.


def zero_shot(exp: TextExperiment, data_dir: str, gpt2_dir: str, out: str) -> dict:
  """The checkpoint's own scores before any release, as the runs are scored; cached in
  ``out/zero_shot.json`` with the sha256 of its weights (and the checkpoint's own
  ``results.json`` value, if any)."""
  path = os.path.join(out, "zero_shot.json")
  if os.path.exists(path):
    with open(path) as f:
      return json.load(f)
  config = LMTrainConfig(data_dir=data_dir, dataset=exp.dataset, init_weights=gpt2_dir,
                         vocab_size=exp.vocab_size, max_length=exp.max_length,
                         eval_pairs=exp.eval_pairs, generate_groups=exp.generate_groups,
                         max_new_tokens=exp.max_new_tokens, public_slice=exp.public_slice)
  tokenizer = GPT2Tokenizer(os.path.join(data_dir, "gpt2"), exp.vocab_size)
  apply, params, _, _ = load_model(config, tokenizer.vocab_size)
  valid = load_split(config, "valid")
  arrays = encode_pairs(tokenizer, valid.pairs[:exp.eval_pairs], exp.max_length)
  started = time.perf_counter()
  record = {"checkpoint": gpt2_dir,
            "valid_nll": mean_token_nll(apply, params, arrays, config.eval_batch_size)}
  record["valid_nll_seconds"] = time.perf_counter() - started
  record["scores"] = {split: score_split(apply, params, tokenizer, load_split(config, split),
                                         config)
                      for split in exp.generate_splits}
  record["decode_seconds"] = time.perf_counter() - started - record["valid_nll_seconds"]
  record["checkpoint_sha256"] = {WEIGHTS_FILE: sha256_file(os.path.join(gpt2_dir, WEIGHTS_FILE))}
  checkpoint = os.path.join(gpt2_dir, "results.json")
  if os.path.exists(checkpoint):
    with open(checkpoint) as f:
      record["checkpoint_valid_nll"] = json.load(f).get("e2e_valid_zero_shot_nll")
  with open(path, "w") as f:
    json.dump(record, f, indent=2, default=float)
  return record


def check_same_checkpoint(record: dict, gpt2_dir: str, out: str) -> None:
  """Refuses to add runs fine-tuned from another checkpoint than the recorded runs'.

  ``zero_shot.json`` keeps the sha256 of the weights the zero-shot scores (and
  so the runs) loaded; a rebuilt checkpoint (``experiments.pretrain_public``
  with its fixed seed) must hash the same, or its runs would be mixed with the
  old ones in one table.
  """
  recorded = (record.get("checkpoint_sha256") or {}).get(WEIGHTS_FILE)
  if recorded is None:
    return
  current = sha256_file(os.path.join(gpt2_dir, WEIGHTS_FILE))
  if current != recorded:
    raise SystemExit(
        f"{os.path.join(gpt2_dir, WEIGHTS_FILE)} has sha256 {current[:16]}…, but the runs in "
        f"{out} fine-tuned {recorded[:16]}…: rebuild that checkpoint, or use a new --out.")


def _plotted(exp: TextExperiment, record: dict) -> float | None:
  metric = _plot_metric(exp)
  if metric == "valid_nll":
    return record["valid_nll"]
  split, name = metric.split("_", 1)
  return record["scores"].get(split, {}).get(name)


def measure(exp: TextExperiment, out: str, data_dir: str, gpt2_dir: str | None,
            labels: list[str] | None = None, methods: tuple[str, ...] = ("vmap", "ghost"),
            microbatch_sizes: tuple[int, ...] = (), releases: int = 2) -> list[dict]:
  """Times ``releases`` releases (after a first one that compiles) of each variant, method
  and microbatch size at the experiment's q, D, capacity and ε = max; appends the rows to
  ``out/release_times.csv`` with the 1-minute load average (the wall time of a release on
  shared cores depends on it; its CPU seconds, the process's time on all threads, much
  less). Without ``gpt2_dir`` the model is ``exp.model`` from
  scratch (the same shapes: the time does not depend on the weights' values). Peak RSS
  is the measuring process's peak so far (all measurements of a call share it)."""
  variants = [v for v in exp.variants if labels is None or v.label in labels]
  rows = []
  for variant in variants:
    for method in methods:
      for microbatch in microbatch_sizes or (exp.microbatch_size,):
        config = dataclasses.replace(  # keys from OS entropy: no study seed's noise reused
            run_config(exp, variant, max(exp.epsilons), exp.seeds[0], out, data_dir, gpt2_dir,
                       False),
            seed=None,
            output_dir=os.path.join(out, "runs", "measure",
                                    f"{_slug(variant.label)}_{method}_mb{microbatch}"),
            init_weights=gpt2_dir, steps=releases + 1, eval_every=1, eval_pairs=1,
            generate_splits=(), clipped_sum_method=method, microbatch_size=microbatch)
        shutil.rmtree(config.output_dir, ignore_errors=True)  # an earlier measurement's files
        memory = ReleaseMemory(config.steps)
        train_lm(config, callbacks=[memory])
        with open(os.path.join(config.output_dir, "history.csv")) as f:
          history = list(csv.DictReader(f))
        shutil.rmtree(os.path.join(config.output_dir, "checkpoints"))  # SECRET: the root key
        seconds = [float(r["seconds"]) for r in history]
        cpu = [float(r["cpu_seconds"]) for r in history]
        rows.append({"variant": variant.label, "optimizer": variant.optimizer,
                     "method": method, "microbatch_size": microbatch, "capacity": exp.capacity,
                     "first_release_seconds": seconds[0],
                     "release_seconds": (seconds[-1] - seconds[0]) / releases,
                     "release_cpu_seconds": (cpu[-1] - cpu[0]) / releases,
                     "timed_releases": releases, "peak_rss_gib": memory.summary()["peak_rss_gib"],
                     "load_average_1min": os.getloadavg()[0]})
        print(json.dumps(rows[-1]), flush=True)
        _append_dict(os.path.join(out, "release_times.csv"), rows[-1])
  return rows


def _append_dict(path: str, row: dict) -> None:
  previous = []
  if os.path.exists(path):
    with open(path, newline="") as f:
      previous = list(csv.DictReader(f))
  write_csv(path, previous + [row])


def _plot_metric(exp: TextExperiment) -> str:
  if exp.metric == "valid_nll":
    return "valid_nll"
  return "test_bleu" if "test" in exp.generate_splits else "valid_bleu"


def _plot(path: str, summary: list[dict], exp: TextExperiment, floor: float | None = None) -> None:
  plt = pyplot("The study's plots")
  metric = _plot_metric(exp)
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
  if floor is not None:
    ax.axhline(floor, color="gray", linestyle="--", label="pretrained, no fine-tuning")
  ax.set_ylabel(metric)
  if ax.get_legend_handles_labels()[0]:
    ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def _plot_curves(path: str, curves: list[dict], exp: TextExperiment,
                 floor: float | None = None) -> None:
  """Validation NLL against releases, mean over seeds, one panel per ε."""
  plt = pyplot("The study's plots")
  epsilons = sorted({c["target_epsilon"] for c in curves}, reverse=True)
  fig, axes = plt.subplots(1, len(epsilons), figsize=(5.5 * len(epsilons), 3.8), squeeze=False)
  for ax, epsilon in zip(axes[0], epsilons):
    for colour, variant in enumerate(exp.variants):  # one colour per arm in every panel
      mine = [c for c in curves if (c["variant"], c["target_epsilon"]) == (variant.label,
                                                                            epsilon)]
      if not mine:
        continue
      steps = sorted({c["step"] for c in mine})
      means = [statistics.fmean(c["valid_nll"] for c in mine if c["step"] == t) for t in steps]
      seeds = len({c["seed"] for c in mine})
      ax.plot(steps, means, marker="o", markersize=3, color=f"C{colour}",
              label=f"{variant.label} ({seeds} seed{'s' * (seeds > 1)})")
    ax.set_xlabel("release")
    ax.set_ylabel("validation NLL (nats / target token)")
    # The start, far above the curves, goes in the title: as a line it would flatten them.
    start = "" if floor is None else f" (public start: {floor:.3f})"
    ax.set_title(f"target ε = {epsilon:g}{start}")
    ax.legend(fontsize=6)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("experiment", choices=sorted(TEXT_EXPERIMENTS))
  parser.add_argument("--data-dir", required=True,
                      help="folder with e2e/, dart/ and gpt2/, laid out as described in "
                      "dpmuon_jax.text.data's module docstring")
  parser.add_argument("--gpt2-dir", default=None,
                      help="a local GPT-2 in the Hugging Face layout: the real gpt2 weights "
                      "(paper2_*) or experiments.pretrain_public's runs/pretrained_dart "
                      "(e2e_pretrained_cpu)")
  parser.add_argument("--out", default=None, help="default: experiments/results/<experiment>")
  parser.add_argument("--tiny", action="store_true", help="one release, tiny shapes")
  parser.add_argument("--log-dir", default=None,
                      help="also write TensorBoard event files, one folder per run (needs the "
                      "'tensorboard' extra)")
  parser.add_argument("--measure", action="store_true",
                      help="time releases instead of running the experiment")
  parser.add_argument("--variants", nargs="+", default=None, help="--measure: these labels")
  parser.add_argument("--methods", nargs="+", default=["vmap", "ghost"],
                      help="--measure: clipped-sum methods")
  parser.add_argument("--microbatch-sizes", nargs="+", type=int, default=[],
                      help="--measure: default the experiment's")
  parser.add_argument("--releases", type=int, default=2, help="--measure: timed releases")
  parser.add_argument("--summarise", action="store_true",
                      help="only rewrite the summaries and plots from the recorded runs")
  args = parser.parse_args(argv)
  exp = TEXT_EXPERIMENTS[args.experiment]
  out = args.out or os.path.join(os.path.dirname(__file__), "results", exp.name)
  try:
    if args.summarise:
      summarise_recorded(exp, out)
    elif args.measure:
      measure(exp, out, args.data_dir, args.gpt2_dir, args.variants, tuple(args.methods),
              tuple(args.microbatch_sizes), args.releases)
    else:
      run(exp, out, args.data_dir, args.gpt2_dir, args.tiny, args.log_dir)
  except MissingExtraError as error:
    raise SystemExit(f"text_sweep: error: {error}") from None
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
