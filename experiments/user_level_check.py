"""What user-level DP costs on E2E: DP-Muon at (ε = 8) per table against per record.

    python -m experiments.user_level_check --data-dir TEXT_DATA \\
        --gpt2-dir experiments/results/e2e_public_slice/start

One descriptive run, no decision rule: ``e2e_public_slice``'s DP-Muon run at
ε = 8, seed 37 (its committed row is the example-level arm), trained again with
the privacy unit a *user*: every reference written for one E2E table (its
meaning representation, ``--user-field source``). Each sampled user adds ONE
vector, the clipped mean gradient of its first ``MAX_RECORDS`` references, so
(ε, δ) hold for adding or removing a table with all its references. The
restaurant name (``--user-field name``) would leave 27 users in the private set:
too few to learn from at any ε, which is true but says nothing more.

Equal compute per release: ``USERS_PER_RELEASE`` expected users of at most
``MAX_RECORDS`` references each is 256 records, the example-level arm's
expected batch; the same T = 400, C = 1, δ, start and learning rates (not chosen
again). The sampling rate is q = ``USERS_PER_RELEASE`` / U over the U users, and
the denominator D = qU = 32 users, so each release's noise σC/D is 8 times the
example-level one's relative to a full batch of signal: that is the price.

Writes ``experiments/results/e2e_user_level/``: ``runs.csv`` (the user-level
row, as the text sweep writes it), ``history.csv`` (its validation NLL every 50
releases) and ``comparison.csv`` (both arms: privacy
unit, units N, q, D, σ, validation NLL, test BLEU and ROUGE-L, and the
user-level minus example-level difference). Restartable: a recorded row is not
trained again, an interrupted run resumes from its checkpoint.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import os
import shutil

from dpmuon_jax.privacy.clipping import USER
from dpmuon_jax.text.train import LMTrainConfig, load_split
from experiments.text_configs import DP_MUON, E2E_PRIVATE_TRAIN_PAIRS, TEXT_EXPERIMENTS
from experiments.text_sweep import _row, _train, append_row, in_own_process, read_rows, run_config

OUT = "experiments/results/e2e_user_level"
EXAMPLE_LEVEL = "experiments/results/e2e_public_slice/runs.csv"
EPSILON, SEED = 8.0, 37
USER_FIELD = "source"
MAX_RECORDS = 8
USERS_PER_RELEASE = 32  # × MAX_RECORDS = 256 records: the example-level expected batch
CAPACITY, MICROBATCH = 64, 4  # users: P(more than 64 sampled | mean 32) < 1e-6
LABEL = "DP-Muon (user level)"


def count_users(config: LMTrainConfig) -> int:
  """U: the distinct tables among the private training pairs."""
  return len({pair.source for pair in load_split(config, config.train_split).pairs})


def user_level_config(data_dir: str, gpt2_dir: str,
                      out: str = OUT) -> tuple[int, LMTrainConfig]:
  """``e2e_public_slice``'s DP-Muon ε = 8 seed-37 run at user level (module docstring), after
  the number of users U."""
  exp = TEXT_EXPERIMENTS["e2e_public_slice"]
  base = run_config(exp, DP_MUON, EPSILON, SEED, out, data_dir, gpt2_dir, tiny=False)
  users = count_users(base)
  return users, dataclasses.replace(
      base, output_dir=os.path.join(out, "runs", f"dp_muon_user_eps{EPSILON:g}_s{SEED}"),
      privacy_unit=USER, user_field=USER_FIELD, max_examples_per_user=MAX_RECORDS,
      sampling_rate=USERS_PER_RELEASE / users, capacity=CAPACITY, microbatch_size=MICROBATCH)



def comparison(example: dict, user: dict, num_users: int, num_pairs: int) -> list[dict]:
  """Both arms side by side and the user-level minus example-level difference."""
  rows = []
  for unit, row, n in (("example", example, num_pairs), ("user", user, num_users)):
    q = float(row["sampling_rate"])
    rows.append({"privacy_unit": unit, "units": n, "sampling_rate": q,
                 "denominator": q * n, "noise_multiplier": float(row["noise_multiplier"]),
                 "releases": int(row["releases"]),
                 "epsilon_spent": float(row["epsilon_spent"]),
                 **{k: float(row[k]) for k in ("valid_nll", "test_bleu", "test_rouge_l")}})
  rows.append({"privacy_unit": "user − example",
               **{k: rows[1][k] - rows[0][k] for k in ("valid_nll", "test_bleu",
                                                      "test_rouge_l")}})
  return rows


def _example_row() -> dict:
  with open(EXAMPLE_LEVEL, newline="") as f:  # read as committed (read_rows may rewrite)
    rows = list(csv.DictReader(f))
  for row in rows:
    if (row["variant"], float(row["target_epsilon"]), int(row["seed"])) == (
        DP_MUON.label, EPSILON, SEED):
      # The runs.csv rows have no sampling-rate column; the q is the experiment's.
      return {**row, "sampling_rate": TEXT_EXPERIMENTS["e2e_public_slice"].sampling_rate}
  raise SystemExit(f"{EXAMPLE_LEVEL} has no {DP_MUON.label} ε = {EPSILON:g} seed {SEED} row.")


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m experiments.user_level_check",
                                   description=__doc__.split("\n\n")[0])
  parser.add_argument("--data-dir", required=True, help="folder with e2e/ and gpt2/")
  parser.add_argument("--gpt2-dir", required=True,
                      help="the committed start: experiments/results/e2e_public_slice/start")
  parser.add_argument("--out", default=OUT)
  args = parser.parse_args(argv)
  os.makedirs(args.out, exist_ok=True)
  num_users, config = user_level_config(args.data_dir, args.gpt2_dir, args.out)
  path = os.path.join(args.out, "runs.csv")
  recorded = [r for r in read_rows(path) if r["variant"] == LABEL]
  if recorded:
    row = recorded[0]
  else:
    results = in_own_process(_train, config)
    row = _row(dataclasses.replace(DP_MUON, label=LABEL), EPSILON, SEED, config, results,
               results["train_seconds"], False)
    append_row(path, row)
  rows = comparison(_example_row(), {**row, "sampling_rate": config.sampling_rate}, num_users,
                    E2E_PRIVATE_TRAIN_PAIRS)
  history = os.path.join(config.output_dir, "history.csv")  # validation NLL every 50 releases
  if os.path.exists(history):  # a recorded row whose run folder is gone keeps the committed one
    shutil.copyfile(history, os.path.join(args.out, "history.csv"))
  with open(os.path.join(args.out, "comparison.csv"), "w", newline="") as f:
    writer = csv.DictWriter(f, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)
  print(json.dumps(rows, indent=1))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
