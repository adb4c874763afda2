"""Optional dependencies: a missing one is an error that names the extra installing it.

The core (the releases, the optimizers, the accounting) needs only the core
dependencies. Progress bars, plots, checkpoints and the digits data come with
``train``, the GPT-2 tokenizer, metrics and weights with ``text``, TensorBoard
logs with ``tensorboard``. Each optional import sits in a :func:`requires` block::

    with requires("text", "The GPT-2 tokenizer"):
      import tiktoken

which turns the ``ImportError`` into a :class:`MissingExtraError` such as
"The GPT-2 tokenizer needs tiktoken: pip install 'dpmuon-jax[text]'." The
command line prints that one line (exit status 2). Every plot draws with
:func:`pyplot`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


class MissingExtraError(ImportError):
  """An optional dependency is not installed; the message names the extra that installs it."""


@contextlib.contextmanager
def requires(extra: str, purpose: str) -> Iterator[None]:
  """Raises :class:`MissingExtraError` naming ``extra`` for an ``ImportError`` in the block."""
  try:
    yield
  except ImportError as error:
    if isinstance(error, MissingExtraError):
      raise
    package = (error.name or "an optional dependency").split(".")[0]
    raise MissingExtraError(
        f"{purpose} needs {package}: pip install 'dpmuon-jax[{extra}]'.", name=error.name
    ) from error


def pyplot(purpose: str):
  """``matplotlib.pyplot`` on the file-only Agg backend, for ``purpose`` (the ``train`` extra)."""
  with requires("train", purpose):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  return plt
