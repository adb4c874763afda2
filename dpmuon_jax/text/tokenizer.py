"""GPT-2's byte-level BPE from a local ``vocab.json`` + ``merges.txt``, via ``tiktoken``.

The two files are OpenAI's ``encoder.json`` / ``vocab.bpe`` (the same bytes as
Hugging Face's ``gpt2/vocab.json`` / ``merges.txt``). ``tiktoken`` builds the
encoding from them offline. Without local files,
:meth:`GPT2Tokenizer.from_tiktoken` uses ``tiktoken.get_encoding("gpt2")``,
which fetches the same two files once (online) into tiktoken's cache.
``"Hello world"`` → ``[15496, 995]``; ``<|endoftext|>`` is 50256.

``vocab_size=V`` keeps GPT-2's first V − 1 tokens in merge order (the 256
bytes and the first V − 257 merges) and puts ``<|endoftext|>`` at V − 1. That
is byte-pair encoding with a shorter merge list: lossless (every text still
encodes and decodes exactly, in more tokens), and built from the public BPE
files alone, never from the training data. It is for models trained from
scratch on a CPU, where the (V × d) embedding and tied head dominate the
cost; pretrained GPT-2 weights need the full 50,257.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence

from dpmuon_jax.extras import requires

EOS_TOKEN = "<|endoftext|>"
EOS_ID = 50256
VOCAB_FILE = "vocab.json"
MERGES_FILE = "merges.txt"
# GPT-2's pre-tokenisation regex (openai/gpt-2 encoder.py).
_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def _sha256(path: str) -> str:
  with open(path, "rb") as f:
    return hashlib.file_digest(f, "sha256").hexdigest()


class GPT2Tokenizer:
  """Encode / decode text with GPT-2's BPE. Special tokens are never parsed from text.

  Args:
    directory: folder holding ``vocab.json`` and ``merges.txt`` (the
      ``gpt2/`` folder of the layout described in :mod:`dpmuon_jax.text.data`).
    vocab_size: ``None`` (GPT-2's 50,257) or V in [257, 50,257]: the first
      V − 1 BPE tokens and ``<|endoftext|>`` = V − 1 (see the module docstring).
  """

  def __init__(self, directory: str | os.PathLike, vocab_size: int | None = None):
    with requires("text", "The GPT-2 tokenizer"):
      import tiktoken
      from tiktoken.load import data_gym_to_mergeable_bpe_ranks

    vocab, merges = (os.path.join(directory, f) for f in (VOCAB_FILE, MERGES_FILE))
    for path in (vocab, merges):
      if not os.path.isfile(path):
        raise FileNotFoundError(f"GPT-2 BPE file not found: {path!r}.")
    # tiktoken caches the files it reads under the system's temporary folder, keyed by path:
    # the files' hashes make it reread them when they changed (or the cache was tampered with).
    ranks = data_gym_to_mergeable_bpe_ranks(merges, vocab, _sha256(merges), _sha256(vocab))
    if vocab_size is None:
      vocab_size = EOS_ID + 1
    if isinstance(vocab_size, bool) or not 257 <= int(vocab_size) <= EOS_ID + 1:
      raise ValueError(f"vocab_size must be an int in [257, {EOS_ID + 1}], got {vocab_size!r}.")
    self._eos_id = int(vocab_size) - 1
    ranks = {token: rank for token, rank in ranks.items() if rank < self._eos_id}
    self._encoding = tiktoken.Encoding(
        name=f"gpt2-{vocab_size}", mergeable_ranks=ranks,
        special_tokens={EOS_TOKEN: self._eos_id}, pat_str=_PATTERN,
    )

  @classmethod
  def from_tiktoken(cls, vocab_size: int | None = None) -> GPT2Tokenizer:
    """tiktoken's ``"gpt2"`` encoding (fetched once, online); GPT-2's full vocabulary only.

    Raises:
      ValueError: ``vocab_size`` other than GPT-2's (a truncated vocabulary needs the files).
      FileNotFoundError: tiktoken cannot fetch the files (offline), naming the layout to give.
    """
    if vocab_size not in (None, EOS_ID + 1):
      raise ValueError(f"vocab_size {vocab_size}: a truncated vocabulary is built from local "
                       "BPE files; give --tokenizer-dir (vocab.json, merges.txt).")
    with requires("text", "The GPT-2 tokenizer"):
      import tiktoken

    try:
      encoding = tiktoken.get_encoding("gpt2")
    except Exception as error:  # tiktoken raises requests' errors when offline
      raise FileNotFoundError(
          f"tiktoken could not fetch GPT-2's BPE files ({type(error).__name__}); offline, give "
          "--tokenizer-dir DIR with DIR/vocab.json and DIR/merges.txt (OpenAI's encoder.json "
          "and vocab.bpe, or download_text_data('gpt2', ...)).") from None
    tokenizer = cls.__new__(cls)
    tokenizer._eos_id = EOS_ID
    tokenizer._encoding = encoding
    return tokenizer

  @property
  def vocab_size(self) -> int:
    return self._encoding.n_vocab

  @property
  def eos_id(self) -> int:
    return self._eos_id

  def encode(self, text: str) -> list[int]:
    """BPE ids of ``text``; ``<|endoftext|>`` inside it is encoded as plain text."""
    return self._encoding.encode_ordinary(text)

  def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
    return self._encoding.encode_ordinary_batch(list(texts))

  def decode(self, ids: Sequence[int]) -> str:
    """Text of ``ids`` (invalid UTF-8 byte sequences become U+FFFD)."""
    return self._encoding.decode(list(ids))
