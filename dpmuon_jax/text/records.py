"""Your own text as training records: JSON Lines, CSV or plain text, checked line by line.

Formats, by the file's suffix:

* ``.jsonl``: one JSON object per line, ``{"prompt": ..., "completion": ...}`` (the loss
  is on the completion only) or ``{"text": ...}`` (the loss is on all of it);
* ``.csv``: a header naming the same columns (``prompt`` and ``completion``, or ``text``);
* anything else: plain UTF-8 text, one record per line (``records="line"``) or per
  paragraph, the blocks between blank lines (``records="paragraph"``).

With a user field (``user_field="author"``, user-level DP: :mod:`dpmuon_jax.data.users`),
every JSONL object or CSV row must name its user there; plain text has no field for it.

A record is encoded as GPT-2 reads it (:func:`encode_record`), the loss on the
completion (or on all of the text)::

    prompt + completion:  " {prompt} <|endoftext|> {completion} <|endoftext|>"
    text:                 "<|endoftext|> {text} <|endoftext|>"

and cut to ``max_length`` tokens; how many were cut is returned and logged, never hidden.
A file that cannot be read, holds no record, is binary or has a malformed record is
refused by :class:`RecordsError`, in one line that names the file and the line.

:func:`load_records` caches the token arrays beside the file (``F.dpmuon-cache/``, keyed
by the file's SHA-256 and the encoding settings): a second run reads them memory-mapped,
at once, and encoding streams the file in blocks into memory-mapped arrays, so memory
stays flat in the file's size.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import os
from collections.abc import Iterator
from typing import NamedTuple

import numpy as np

from dpmuon_jax.text.tokenizer import GPT2Tokenizer

LINE, PARAGRAPH = "line", "paragraph"
RECORD_LAYOUTS = (LINE, PARAGRAPH)
CACHE_SUFFIX = ".dpmuon-cache"
_BLOCK = 4096  # records encoded at a time


class RecordsError(ValueError):
  """A file of records that cannot be trained on: ``"FILE:LINE: what is wrong"``."""


class TextRecord(NamedTuple):
  """One training record: ``prompt`` ``None`` means the loss covers all of ``completion``."""

  prompt: str | None
  completion: str
  user: str | None = None


class EncodedRecords(NamedTuple):
  """Token arrays of a file's records (memory-mapped when read from the cache).

  Attributes:
    arrays: ``tokens`` (N, max_length) int32 and ``loss_mask`` (N, max_length) float32.
    users: (N,) user ids (``None`` without a user field).
    truncated: how many records were longer than ``max_length`` tokens and cut.
    sha256: the file's digest.
  """

  arrays: dict[str, np.ndarray]
  users: np.ndarray | None
  truncated: int
  sha256: str

  @property
  def num_records(self) -> int:
    return len(self.arrays["tokens"])


def _fail(path: str, line: int, message: str) -> RecordsError:
  return RecordsError(f"{path}:{line}: {message}")


def _text_lines(path: str) -> Iterator[tuple[int, str]]:
  """(line number, line without its newline), refusing a binary or non-UTF-8 file."""
  try:
    f = open(path, "rb")
  except OSError as error:
    raise RecordsError(f"{path}: cannot be read ({error.strerror or error}).") from None
  with f:
    for number, raw in enumerate(f, 1):
      if b"\0" in raw:
        raise _fail(path, number, "a NUL byte: this is a binary file, not text.")
      try:
        yield number, raw.decode("utf-8").rstrip("\r\n")
      except UnicodeDecodeError:
        raise _fail(path, number, "not UTF-8 text (a binary file?).") from None


def _record_of(fields: dict, path: str, line: int, user_field: str | None) -> TextRecord:
  """The record of one JSON object or CSV row."""
  def text(name: str) -> str:
    value = fields.get(name)
    if not isinstance(value, str):
      raise _fail(path, line, f"{name!r} must be a string, got {type(value).__name__}.")
    return value

  if "text" in fields and "prompt" not in fields and "completion" not in fields:
    prompt, completion = None, text("text")
  elif "prompt" in fields and "completion" in fields:
    prompt, completion = text("prompt"), text("completion")
  else:
    raise _fail(path, line, f"a record needs \"text\", or \"prompt\" and \"completion\"; got "
                f"fields {sorted(fields)}.")
  user = None
  if user_field is not None:
    value = fields.get(user_field)
    if value is None or str(value).strip() == "":
      raise _fail(path, line, f"no user: the record has no {user_field!r} (--user-field), "
                  "which user-level DP needs on every record.")
    user = str(value)
  return TextRecord(prompt, completion, user)


def _jsonl(path: str, user_field: str | None) -> Iterator[tuple[int, TextRecord]]:
  for number, line in _text_lines(path):
    if not line.strip():
      continue
    try:
      fields = json.loads(line)
    except json.JSONDecodeError as error:
      raise _fail(path, number, f"not valid JSON ({error.msg}).") from None
    if not isinstance(fields, dict):
      raise _fail(path, number, f"a JSON object is needed, got {type(fields).__name__}.")
    yield number, _record_of(fields, path, number, user_field)


def _csv(path: str, user_field: str | None) -> Iterator[tuple[int, TextRecord]]:
  lines = _text_lines(path)
  first = next(lines, None)
  if first is None:
    return
  header = next(csv.reader([first[1]]))
  for number, line in lines:
    if not line.strip():
      continue
    try:
      values = next(csv.reader(io.StringIO(line), strict=True))
    except csv.Error as error:
      raise _fail(path, number, f"not a CSV row ({error}).") from None
    if len(values) != len(header):
      raise _fail(path, number, f"{len(values)} values for the header's {len(header)} columns "
                  "(one record per line; quote commas).")
    yield number, _record_of(dict(zip(header, values)), path, number, user_field)


def _plain(path: str, records: str) -> Iterator[tuple[int, TextRecord]]:
  if records == LINE:
    for number, line in _text_lines(path):
      if line.strip():
        yield number, TextRecord(None, line)
    return
  start, block = 0, []
  for number, line in _text_lines(path):
    if line.strip():
      start = start or number
      block.append(line)
    elif block:
      yield start, TextRecord(None, "\n".join(block))
      start, block = 0, []
  if block:
    yield start, TextRecord(None, "\n".join(block))


def iter_records(path: str, records: str = LINE,
                 user_field: str | None = None) -> Iterator[tuple[int, TextRecord]]:
  """``(line number, record)`` of each record of ``path``, checked as it is read."""
  if records not in RECORD_LAYOUTS:
    raise ValueError(f"records must be one of {', '.join(RECORD_LAYOUTS)}, got {records!r}.")
  suffix = os.path.splitext(path)[1].lower()
  if suffix == ".jsonl":
    yield from _jsonl(path, user_field)
  elif suffix == ".csv":
    yield from _csv(path, user_field)
  elif user_field is not None:
    raise RecordsError(f"{path}: plain text has no field for the user; give a .jsonl or "
                       f".csv file with a {user_field!r} field.")
  else:
    yield from _plain(path, records)


def encode_record(tokenizer: GPT2Tokenizer, record: TextRecord,
                  max_length: int) -> tuple[list[int], int, bool]:
  """(ids, index of the first scored token, whether it was cut to ``max_length``)."""
  eos = tokenizer.eos_id
  if record.prompt is None:
    prefix = [eos]
  else:
    prefix = tokenizer.encode(f" {record.prompt} ") + [eos]
  ids = prefix + tokenizer.encode(f" {record.completion} ") + [eos]
  return ids[:max_length], len(prefix), len(ids) > max_length


def file_sha256(path: str) -> str:
  with open(path, "rb") as f:
    return hashlib.file_digest(f, "sha256").hexdigest()


def _cache_dir(path: str, tokenizer: GPT2Tokenizer, max_length: int, records: str,
               user_field: str | None, sha256: str) -> str:
  key = json.dumps([sha256, tokenizer.vocab_size, tokenizer.eos_id, max_length, records,
                    user_field])
  return os.path.join(path + CACHE_SUFFIX, hashlib.sha256(key.encode()).hexdigest()[:20])


def count_records(path: str, records: str = LINE,
                  user_field: str | None = None) -> tuple[int, int]:
  """(records, the longest user id) after checking every line; refuses a file without one."""
  count, longest = 0, 1
  for _, record in iter_records(path, records, user_field):
    count += 1
    longest = max(longest, len(record.user or ""))
  if count == 0:
    raise RecordsError(f"{path}: holds no records (an empty file, or only blank lines).")
  return count, longest


def _encode_into(folder: str, path: str, tokenizer: GPT2Tokenizer, max_length: int,
                 records: str, user_field: str | None) -> int:
  """Streams the records into ``folder``'s .npy files; returns how many were cut."""
  count, longest = count_records(path, records, user_field)
  open_memmap = np.lib.format.open_memmap
  tokens = open_memmap(os.path.join(folder, "tokens.npy"), "w+", np.int32, (count, max_length))
  mask = open_memmap(os.path.join(folder, "loss_mask.npy"), "w+", np.float32,
                     (count, max_length))
  users = None if user_field is None else open_memmap(
      os.path.join(folder, "users.npy"), "w+", f"<U{longest}", (count,))
  tokens[:] = tokenizer.eos_id
  truncated = 0
  for i, (_, record) in enumerate(iter_records(path, records, user_field)):
    ids, first_scored, cut = encode_record(tokenizer, record, max_length)
    tokens[i, :len(ids)] = ids
    mask[i, first_scored:len(ids)] = 1.0
    truncated += cut
    if users is not None:
      users[i] = record.user
  for array in (tokens, mask, users):
    if array is not None:
      array.flush()
  return truncated


def load_records(path: str, tokenizer: GPT2Tokenizer, max_length: int, records: str = LINE,
                 user_field: str | None = None) -> EncodedRecords:
  """The token arrays of ``path``'s records: from the cache beside it, else encoded now.

  Raises:
    RecordsError: the file cannot be read, holds no record, is binary, or a record is
      malformed or has no user (with ``user_field``), naming the file and the line.
  """
  try:
    sha256 = file_sha256(path)
  except OSError as error:
    raise RecordsError(f"{path}: cannot be read ({error.strerror or error}).") from None
  folder = _cache_dir(path, tokenizer, max_length, records, user_field, sha256)
  done = os.path.join(folder, "records.json")
  if not os.path.isfile(done):
    partial = folder + ".partial"
    os.makedirs(partial, exist_ok=True)
    truncated = _encode_into(partial, path, tokenizer, max_length, records, user_field)
    with open(os.path.join(partial, "records.json"), "w") as f:
      json.dump({"file": os.path.basename(path), "sha256": sha256, "truncated": truncated}, f)
    os.replace(partial, folder)
  with open(done) as f:
    meta = json.load(f)
  load = lambda name: np.load(os.path.join(folder, f"{name}.npy"), mmap_mode="r")
  users = load("users") if user_field is not None else None
  return EncodedRecords({"tokens": load("tokens"), "loss_mask": load("loss_mask")}, users,
                        int(meta["truncated"]), sha256)
