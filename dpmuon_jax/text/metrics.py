"""Table-to-text metrics as the E2E challenge and GEM score them, and validation NLL.

* **BLEU** (E2E and DART): NIST ``mteval-v13a`` — case-insensitive, 13a
  tokenization, a variable number of references per source. ``sacrebleu``
  with ``lowercase=True, tokenize="13a"`` and missing references passed as
  ``None`` reproduces the official E2E scorer exactly (both give
  66.801311752 on the same system output); Li et al. score DART the same way.
* **ROUGE-L, E2E**: the official scorer (e2e-metrics) runs the MS-COCO
  caption code: Stanford's PTB tokenizer (Java; lower-cases and drops
  punctuation tokens), then ``pycocoevalcap``'s ``Rouge``: per source
  P = max_r LCS/len(h), R = max_r LCS/len(r) over references r, and
  F = (1 + β²)PR / (R + β²P) with β = 1.2, averaged over sources. ROUGE-L
  itself is pure Python and used as is; the tokenizer needs ``java``.
  ``rouge-score`` does not match it (0.6904 vs 0.7011 on a TGen output).
* **ROUGE-L, DART**: GEM-metrics: ``rouge-score``'s rougeL F1 with the Porter
  stemmer, jackknifed over references (mean over leave-one-out subsets of the
  best F1 in the subset; one reference: its F1).
* **NLL**: Σ nll / Σ target tokens over the split, nats per target token
  (token-weighted, not a mean of per-example means).

All scores are on a 0–100 scale except NLL.
"""

from __future__ import annotations

import csv
import json
import os
import shutil
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from dpmuon_jax.extras import requires
from dpmuon_jax.text.gpt2 import ApplyFn, token_nll

PyTree = Any
References = Sequence[Sequence[str]]


def _check(hypotheses: Sequence[str], references: References) -> None:
  if len(hypotheses) != len(references):
    raise ValueError(f"{len(hypotheses)} hypotheses for {len(references)} reference lists.")
  if any(len(r) == 0 for r in references):
    raise ValueError("Every hypothesis needs at least one reference.")


def bleu(hypotheses: Sequence[str], references: References) -> float:
  """Corpus BLEU as the official E2E scorer (mteval-v13a): lowercase, 13a, multi-reference.

  ``force=True`` only silences sacrebleu's warning about pre-tokenized text
  (the ``src1`` references are); the score is unchanged.
  """
  with requires("text", "BLEU"):
    import sacrebleu

  _check(hypotheses, references)
  k = max(len(r) for r in references)
  streams = [[r[j] if j < len(r) else None for r in references] for j in range(k)]
  return sacrebleu.corpus_bleu(
      list(hypotheses), streams,  # pyright: ignore[reportArgumentType]  # None: no reference
      lowercase=True, tokenize="13a", force=True
  ).score


def ptb_tokenize(texts: Sequence[str]) -> list[str]:
  """The COCO caption tokenizer: Stanford PTB, lower-cased, punctuation tokens removed."""
  if shutil.which("java") is None:
    raise RuntimeError("The official E2E ROUGE-L tokenizes with Stanford's PTBTokenizer, which "
                       "needs `java` on PATH (e.g. `apt-get install default-jre-headless`).")
  with requires("text", "The official E2E ROUGE-L"):
    from pycocoevalcap.tokenizer.ptbtokenizer import PTBTokenizer

  out = PTBTokenizer().tokenize({i: [{"caption": t}] for i, t in enumerate(texts)})
  return [out[i][0] for i in range(len(texts))]


def e2e_rouge_l(
    hypotheses: Sequence[str], references: References, tokenized: bool = False
) -> float:
  """ROUGE-L of the official E2E scorer (pycocoevalcap ``Rouge``, β = 1.2), ×100.

  Args:
    tokenized: the texts are already PTB-tokenized (tokens split on single
      spaces); otherwise :func:`ptb_tokenize` runs first, as e2e-metrics does.
  """
  with requires("text", "The official E2E ROUGE-L"):
    from pycocoevalcap.rouge.rouge import Rouge

  _check(hypotheses, references)
  if not tokenized:
    flat = ptb_tokenize([*hypotheses, *(r for refs in references for r in refs)])
    hypotheses, rest = flat[:len(hypotheses)], iter(flat[len(hypotheses):])
    references = [[next(rest) for _ in refs] for refs in references]
  score, _ = Rouge().compute_score(
      {i: list(r) for i, r in enumerate(references)},
      {i: [h] for i, h in enumerate(hypotheses)},
  )
  return 100.0 * float(score)


def dart_rouge_l(hypotheses: Sequence[str], references: References) -> float:
  """GEM's ROUGE-L: rouge-score rougeL F1 with stemming, jackknifed over references, ×100."""
  with requires("text", "GEM's ROUGE-L"):
    from rouge_score import rouge_scorer

  _check(hypotheses, references)
  scorer = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)
  per_source = []
  for hyp, refs in zip(hypotheses, references):
    f = [scorer.score(r, hyp)["rougeL"].fmeasure for r in refs]
    if len(f) == 1:
      per_source.append(f[0])
    else:
      per_source.append(np.mean([max(f[:i] + f[i + 1:]) for i in range(len(f))]))
  return 100.0 * float(np.mean(per_source))


def mean_token_nll(
    apply: ApplyFn, params: PyTree, data: Mapping[str, np.ndarray], batch_size: int
) -> float:
  """Σ target-token NLL / Σ target tokens over ``data`` (``{"tokens", "loss_mask"}``), nats.

  The last batch is padded with rows of zero ``loss_mask``, so one compiled
  shape serves the whole split.
  """
  fn = jax.jit(lambda p, b: token_nll(apply, p, b))
  n = len(data["tokens"])
  total, count = 0.0, 0.0
  for start in range(0, n, batch_size):
    batch = {k: np.asarray(v[start:start + batch_size]) for k, v in data.items()}
    pad = batch_size - len(batch["tokens"])
    if pad:
      batch = {k: np.concatenate([v, np.zeros((pad,) + v.shape[1:], v.dtype)])
               for k, v in batch.items()}
    s, c = fn(params, batch)
    total += float(np.asarray(s, np.float64).sum())
    count += float(np.asarray(c, np.float64).sum())
  if count == 0:
    raise ValueError("No target tokens: the NLL per target token is undefined.")
  return total / count


def write_results(
    results: Mapping[str, Mapping[str, float]], directory: str | os.PathLike,
    name: str = "results",
) -> tuple[str, str]:
  """Writes ``{split: {metric: value}}`` as ``name.json`` and ``name.csv`` (one row per split)."""
  os.makedirs(directory, exist_ok=True)
  json_path = os.path.join(directory, f"{name}.json")
  csv_path = os.path.join(directory, f"{name}.csv")
  with open(json_path, "w") as f:
    json.dump({s: dict(m) for s, m in results.items()}, f, indent=2, sort_keys=True)
  metrics = sorted({m for row in results.values() for m in row})
  with open(csv_path, "w", newline="") as f:
    writer = csv.writer(f)
    writer.writerow(["split", *metrics])
    for split, row in results.items():
      writer.writerow([split, *(row.get(m, "") for m in metrics)])
  return json_path, csv_path
