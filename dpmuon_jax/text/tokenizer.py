"""GPT-2's byte-level BPE from a local ``vocab.json`` + ``merges.txt``, via ``tiktoken``.

The two files are OpenAI's ``encoder.json`` / ``vocab.bpe`` (the same bytes as
Hugging Face's ``gpt2/vocab.json`` / ``merges.txt``). ``tiktoken`` builds the
encoding from them offline; ``tiktoken.get_encoding("gpt2")`` would download
and is never used. ``"Hello world"`` → ``[15496, 995]``; ``<|endoftext|>`` is 50256.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

EOS_TOKEN = "<|endoftext|>"
EOS_ID = 50256
VOCAB_FILE = "vocab.json"
MERGES_FILE = "merges.txt"
# GPT-2's pre-tokenisation regex (openai/gpt-2 encoder.py).
_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


class GPT2Tokenizer:
  """Encode / decode text with GPT-2's BPE. Special tokens are never parsed from text.

  Args:
    directory: folder holding ``vocab.json`` and ``merges.txt``
      (here: ``shared/data/text/gpt2``).
  """

  def __init__(self, directory: str | os.PathLike):
    import tiktoken
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks

    vocab, merges = (os.path.join(directory, f) for f in (VOCAB_FILE, MERGES_FILE))
    for path in (vocab, merges):
      if not os.path.isfile(path):
        raise FileNotFoundError(f"GPT-2 BPE file not found: {path!r}.")
    ranks = data_gym_to_mergeable_bpe_ranks(merges, vocab)
    self._encoding = tiktoken.Encoding(
        name="gpt2", mergeable_ranks=ranks, special_tokens={EOS_TOKEN: EOS_ID}, pat_str=_PATTERN
    )

  @property
  def vocab_size(self) -> int:
    return self._encoding.n_vocab

  @property
  def eos_id(self) -> int:
    return EOS_ID

  def encode(self, text: str) -> list[int]:
    """BPE ids of ``text``; ``<|endoftext|>`` inside it is encoded as plain text."""
    return self._encoding.encode_ordinary(text)

  def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
    return self._encoding.encode_ordinary_batch(list(texts))

  def decode(self, ids: Sequence[int]) -> str:
    """Text of ``ids`` (invalid UTF-8 byte sequences become U+FFFD)."""
    return self._encoding.decode(list(ids))
