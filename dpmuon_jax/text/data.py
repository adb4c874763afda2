"""E2E and DART table-to-text data in the DP fine-tuning literature's format.

Each training example is one (source, target) pair; Li et al. (2021,
"Large Language Models Can Be Strong Differentially Private Learners"),
following Li & Liang (2021, Prefix-Tuning), feed GPT-2 ::

    " {source} <|endoftext|> {target} <|endoftext|>"

and score only the tokens after the first ``<|endoftext|>`` (the target and
the closing end-of-text). For evaluation, the references of one source are
grouped and the model generates once per source.

* **E2E** (Novikova et al., 2017): the ``src1_{train,valid,test}.txt`` files
  of Prefix-Tuning, lines ``source||target `` where the meaning representation
  is written ``name : X | Type : Y | ...`` and the target is space-tokenized
  with one trailing space (kept, as those papers did). 42,061 training pairs
  (the N of the privacy accounting); consecutive lines with one source form an
  evaluation group (547 valid, 630 test).
* **DART** (Nan et al., 2021) v1.1.1: the source of an entry is
  ``" | ".join(f"{s} : {p.lower()} : {o}")`` over its tripleset (Li et al.'s
  ``LineByLineTriplesTextDataset``); every reference is one training pair,
  every entry one evaluation group (entries that repeat a tripleset are kept,
  ``null`` references dropped). The trailing space Li et al. append after the
  closing ``<|endoftext|>`` is not reproduced.

E2E's public slice (:func:`split_public_slice`): the pairs of the restaurants
whose name hashes to 0 mod m (:func:`in_public_slice`) may serve as public
data, e.g. to pretrain a start, and are then removed from every split a
private run trains on or is scored on; ``LMTrainConfig(public_slice=m)``
does so.

Local files: one data folder, each file plain or gzipped:
``e2e/src1_{train,valid,test}.txt[.gz]``; ``dart/{split}.jsonl[.gz]`` (lines
``{"tripleset", "references"}``) or the official
``dart/dart-v1.1.1-full-{split}.json[.gz]`` (a list of ``{"tripleset",
"annotations": [{"source", "text"}]}``); ``gpt2/vocab.json`` and
``gpt2/merges.txt``, GPT-2's BPE files
(:class:`~dpmuon_jax.text.tokenizer.GPT2Tokenizer`). The CPU-scale configs
were run without DART's training split; with the official file in place it
loads like dev.

Official sources (for users with internet; :func:`download_text_data` writes
them into this layout, nothing in the library downloads on its own):

* E2E ``src1`` files: Prefix-Tuning, commit 6519d30e, ``data/e2e_data/``
  (:data:`E2E_URL`); the original E2E release:
  https://github.com/tuetschek/e2e-dataset/releases/download/v1.0.0/e2e-dataset.zip
* DART v1.1.1 JSON: Yale-LILY/dart, commit 43dde3b4, ``data/v1.1.1/``
  (:data:`DART_URL`), the July 2020 release Li et al. used.
* GPT-2's BPE files: OpenAI's ``encoder.json`` and ``vocab.bpe`` (:data:`GPT2_BPE_URL`),
  the files ``tiktoken`` fetches for ``"gpt2"``, checked against its sha256 sums and
  saved as ``gpt2/vocab.json`` and ``gpt2/merges.txt``.
"""

from __future__ import annotations

import gzip
import hashlib
import itertools
import json
import os
import urllib.request
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from dpmuon_jax.text.tokenizer import GPT2Tokenizer

E2E_URL = (
    "https://raw.githubusercontent.com/XiangLi1999/PrefixTuning/"
    "6519d30e69b15a180f23e2cd41b766d3f62b8e82/data/e2e_data/src1_{split}.txt"
)
DART_URL = (
    "https://raw.githubusercontent.com/Yale-LILY/dart/"
    "43dde3b4f6a54efb8241510f47a17895763e5360/data/v1.1.1/dart-v1.1.1-full-{split}.json"
)
GPT2_BPE_URL = "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/{file}"
# Local name: (OpenAI's name, sha256), the sums tiktoken checks.
GPT2_BPE_FILES = {
    "vocab.json": ("encoder.json",
                   "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"),
    "merges.txt": ("vocab.bpe",
                   "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"),
}
E2E_SPLITS = {"train": "train", "valid": "valid", "dev": "valid", "validation": "valid",
              "test": "test"}
DART_SPLITS = {"train": "train", "valid": "dev", "dev": "dev", "validation": "dev",
               "test": "test"}


class TextPair(NamedTuple):
  source: str
  target: str


class EvalGroup(NamedTuple):
  """One source and all its references (stripped)."""

  source: str
  references: list[str]


class TextDataset(NamedTuple):
  """A split: the training pairs and the same data grouped per source."""

  name: str
  split: str
  pairs: list[TextPair]
  groups: list[EvalGroup]


def _open_text(path: str):
  if path.endswith(".gz"):
    return gzip.open(path, "rt", encoding="utf-8", newline="")
  return open(path, encoding="utf-8", newline="")


def _find(candidates: Sequence[str]) -> str:
  for path in candidates:
    for p in (path, path + ".gz"):
      if os.path.isfile(p):
        return p
  raise FileNotFoundError(
      f"None of {list(candidates)} (plain or .gz) exists. See dpmuon_jax.text.data's "
      "docstring for the layout and download_text_data for the official sources."
  )


def _group(pairs: Sequence[TextPair]) -> list[EvalGroup]:
  return [EvalGroup(src, [p.target.strip() for p in grp])
          for src, grp in itertools.groupby(pairs, key=lambda p: p.source)]


def load_e2e(data_dir: str | os.PathLike, split: str) -> TextDataset:
  """E2E from ``data_dir/e2e/src1_{train,valid,test}.txt[.gz]``.

  ``split``: ``"train"``, ``"valid"`` (alias ``"dev"``, ``"validation"``) or ``"test"``.
  """
  name = E2E_SPLITS[split]
  path = _find([os.path.join(data_dir, "e2e", f"src1_{name}.txt")])
  pairs = []
  with _open_text(path) as f:
    for line in f.read().split("\n"):
      if line.strip():
        source, target = line.split("||")
        pairs.append(TextPair(source, target))
  return TextDataset("e2e", name, pairs, _group(pairs))


def e2e_name(source: str) -> str:
  """The restaurant of an E2E ``src1`` source: the value of its ``name : X`` field
  (always the first field)."""
  field, _, value = source.split("|")[0].partition(":")
  if field.strip() != "name":
    raise ValueError(f"E2E source without a leading name field: {source!r}")
  return value.strip()


def in_public_slice(name: str, modulus: int) -> bool:
  """Whether restaurant ``name`` is public: sha256(name, UTF-8) ≡ 0 (mod ``modulus``).

  A rule on the name alone, fixed before any run: about one name in ``modulus``
  is public, whatever the data, and every example of a name falls on one side.
  """
  return int(hashlib.sha256(name.encode("utf-8")).hexdigest(), 16) % modulus == 0


def split_public_slice(data: TextDataset, modulus: int) -> tuple[TextDataset, TextDataset]:
  """(private, public) parts of an E2E split by :func:`in_public_slice` of each pair's name
  (the evaluation groups of each part are the split's own, not regrouped).

  The public part may be used without privacy (e.g. to pretrain); the private
  part is what a private run trains on (its N is the private count) and is
  evaluated on, so no public restaurant is ever scored.
  """
  if data.name != "e2e":
    raise ValueError(f"The public slice is defined by E2E restaurant names, not {data.name!r}.")
  public = lambda source: in_public_slice(e2e_name(source), modulus)
  private_part, public_part = (
      TextDataset(data.name, data.split, [p for p in data.pairs if public(p.source) is side],
                  [g for g in data.groups if public(g.source) is side])
      for side in (False, True))
  return private_part, public_part


def dart_source(tripleset: Sequence[Sequence[str]]) -> str:
  """``s : p : o | ...`` with lower-cased predicates (Li et al.'s DART source)."""
  return " | ".join(f"{s} : {p.lower()} : {o}" for s, p, o in tripleset)


def _dart_entries(path: str) -> list[tuple[list, list[str]]]:
  with _open_text(path) as f:
    if ".jsonl" in os.path.basename(path):
      rows = [json.loads(line) for line in f if line.strip()]
      return [(r["tripleset"], r["references"]) for r in rows]
    rows = json.load(f)
  return [(r["tripleset"], [a["text"] for a in r["annotations"]]) for r in rows]


def load_dart(data_dir: str | os.PathLike, split: str) -> TextDataset:
  """DART v1.1.1 from ``data_dir/dart/`` (JSONL first, then the official JSON).

  ``split``: ``"train"``, ``"dev"`` (alias ``"valid"``, ``"validation"``) or ``"test"``.
  """
  name = DART_SPLITS[split]
  d = os.path.join(data_dir, "dart")
  path = _find([os.path.join(d, f"{name}.jsonl"),
                os.path.join(d, f"dart-v1.1.1-full-{name}.json")])
  pairs, groups = [], []
  for tripleset, references in _dart_entries(path):
    source = dart_source(tripleset)
    refs = [r for r in references if r is not None]
    if refs:
      pairs.extend(TextPair(source, r) for r in refs)
      groups.append(EvalGroup(source, [r.strip() for r in refs]))
  return TextDataset("dart", name, pairs, groups)


def load_text_dataset(name: str, data_dir: str | os.PathLike, split: str) -> TextDataset:
  """``"e2e"`` or ``"dart"``."""
  loaders = {"e2e": load_e2e, "dart": load_dart}
  if name not in loaders:
    raise ValueError(f"Unknown text dataset {name!r}; expected one of {sorted(loaders)}.")
  return loaders[name](data_dir, split)


def download_text_data(name: str, data_dir: str | os.PathLike, splits: Sequence[str] = (
    "train", "valid", "test")) -> list[str]:
  """Fetches the official files of ``name`` (``"e2e"``, ``"dart"`` or ``"gpt2"``, the
  tokenizer's BPE files, which have no splits) into the local layout; returns their paths.

  Only for users with internet (never called by the library or its tests).

  Raises:
    ValueError: a GPT-2 BPE file is not the one tiktoken expects (it is removed).
  """
  if name == "gpt2":
    paths = []
    for local, (remote, sha256) in GPT2_BPE_FILES.items():
      path = os.path.join(data_dir, "gpt2", local)
      os.makedirs(os.path.dirname(path), exist_ok=True)
      urllib.request.urlretrieve(GPT2_BPE_URL.format(file=remote), path)
      with open(path, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
      if digest != sha256:
        os.remove(path)
        raise ValueError(f"{GPT2_BPE_URL.format(file=remote)} has sha256 {digest}, "
                         f"not {sha256}.")
      paths.append(path)
    return paths
  url, table, pattern = {
      "e2e": (E2E_URL, E2E_SPLITS, os.path.join("e2e", "src1_{split}.txt")),
      "dart": (DART_URL, DART_SPLITS, os.path.join("dart", "dart-v1.1.1-full-{split}.json")),
  }[name]
  paths = []
  for split in splits:
    path = os.path.join(data_dir, pattern.format(split=table[split]))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    urllib.request.urlretrieve(url.format(split=table[split]), path)
    paths.append(path)
  return paths


def prompt_ids(tokenizer: GPT2Tokenizer, source: str) -> list[int]:
  """Ids of ``" {source} <|endoftext|>"``: the conditioning part."""
  return tokenizer.encode(f" {source} ") + [tokenizer.eos_id]


def target_ids(tokenizer: GPT2Tokenizer, target: str) -> list[int]:
  """Ids of ``" {target} <|endoftext|>"``: the scored part."""
  return tokenizer.encode(f" {target} ") + [tokenizer.eos_id]


def encode_pairs(
    tokenizer: GPT2Tokenizer, pairs: Sequence[TextPair], max_length: int
) -> dict[str, np.ndarray]:
  """``{"tokens", "loss_mask"}`` (N, max_length), right-padded with ``<|endoftext|>``.

  ``loss_mask`` is 1 on target tokens (see :func:`dpmuon_jax.text.gpt2.lm_loss`).
  Sequences longer than ``max_length`` are cut at the right.
  """
  tokens = np.full((len(pairs), max_length), tokenizer.eos_id, np.int32)
  mask = np.zeros((len(pairs), max_length), np.float32)
  sources = tokenizer.encode_batch([f" {p.source} " for p in pairs])
  targets = tokenizer.encode_batch([f" {p.target} " for p in pairs])
  for i, (s, t) in enumerate(zip(sources, targets)):
    ids = (s + [tokenizer.eos_id] + t + [tokenizer.eos_id])[:max_length]
    tokens[i, :len(ids)] = ids
    mask[i, len(s) + 1:len(ids)] = 1.0
  return {"tokens": tokens, "loss_mask": mask}


def encode_prompts(
    tokenizer: GPT2Tokenizer, sources: Sequence[str], max_length: int
) -> tuple[np.ndarray, np.ndarray]:
  """Right-padded prompts (N, max_length) and their lengths (N,), for generation.

  Raises:
    ValueError: a prompt is longer than ``max_length``.
  """
  tokens = np.full((len(sources), max_length), tokenizer.eos_id, np.int32)
  lengths = np.zeros((len(sources),), np.int32)
  for i, ids in enumerate(tokenizer.encode_batch([f" {s} " for s in sources])):
    ids = ids + [tokenizer.eos_id]
    if len(ids) > max_length:
      raise ValueError(f"Prompt {i} has {len(ids)} tokens > max_length={max_length}.")
    tokens[i, :len(ids)] = ids
    lengths[i] = len(ids)
  return tokens, lengths


def dataset_stats(tokenizer: GPT2Tokenizer, data: TextDataset) -> dict[str, Any]:
  """Counts and the longest encoded pair, to choose ``max_length``."""
  lengths = [len(prompt_ids(tokenizer, p.source)) + len(target_ids(tokenizer, p.target))
             for p in data.pairs]
  return {"pairs": len(data.pairs), "groups": len(data.groups),
          "references": sum(len(g.references) for g in data.groups),
          "max_tokens": max(lengths, default=0)}
