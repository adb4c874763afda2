"""Where the text tests find E2E, DART and GPT-2's BPE files, and what they do without them.

The folder is ``$DPMUON_TEXT_DATA`` or else ``shared/data/text`` beside the checkout, laid out
as :mod:`dpmuon_jax.text.data` describes (the README's "Run the tests" says how to fetch it).
Without it those tests skip; with ``DPMUON_REQUIRE_TEXT_DATA=1`` (set by CI, which has the
data) they fail instead, so a moved or broken data folder cannot pass CI by skipping.
"""

import os
import pathlib

import pytest

TEXT_DIR = os.path.abspath(os.environ.get("DPMUON_TEXT_DATA") or os.fspath(
    pathlib.Path(__file__).resolve().parents[2] / "shared" / "data" / "text"))
REASON = ("the text data is not present: fetch it as the README's 'Run the tests' says "
          "(DPMUON_TEXT_DATA names its folder)")


def require_text_data(text_dir: str | os.PathLike = TEXT_DIR) -> None:
  """Skips the calling test when ``text_dir`` lacks GPT-2's BPE folder; fails it instead when
  ``DPMUON_REQUIRE_TEXT_DATA=1``."""
  if os.path.isdir(os.path.join(text_dir, "gpt2")):
    return
  if os.environ.get("DPMUON_REQUIRE_TEXT_DATA") == "1":
    pytest.fail(f"DPMUON_REQUIRE_TEXT_DATA=1 but {text_dir} has no gpt2/ folder", pytrace=False)
  pytest.skip(REASON)


# Marks a test (or, as `pytestmark`, a file) that reads TEXT_DIR: conftest's fixture of this
# name calls require_text_data before it runs.
needs_text_data = pytest.mark.usefixtures("text_data_dir")
