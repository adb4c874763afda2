"""Sphinx configuration: the API reference from the docstrings, the Markdown pages as they are.

Build (no network needed): ``sphinx-build -W --keep-going -b html docs docs/_build/html``.
Set ``DPMUON_DOCS_INTERSPHINX=1`` to link Python, NumPy, JAX and Optax names to their
online documentation (that build downloads the inventories).
"""

import importlib.util
import os
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

project = "dpmuon_jax"
author = "dpmuon_jax authors"
copyright = "dpmuon_jax authors, Apache-2.0"  # noqa: A001

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx.ext.mathjax",
    "sphinx.ext.viewcode",
]

source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
root_doc = "index"
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store"]

# Autodoc: signatures as written in the code, members in source order. The optional
# extras are imported lazily, except orbax (checkpoints): without the ``train`` extra
# it and the other extras are mocked, so ``pip install -e ".[docs]"`` suffices.
_EXTRAS = ("orbax", "tqdm", "matplotlib", "sklearn", "tensorboardX", "tiktoken", "sacrebleu",
           "rouge_score", "pycocoevalcap", "safetensors")
autodoc_mock_imports = [m for m in _EXTRAS if importlib.util.find_spec(m) is None]
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_preserve_defaults = True
# Long unions shown by the names the code uses.
autodoc_type_aliases = {
    "optax.ScalarOrSchedule": "optax.ScalarOrSchedule",
    "jax.lax.PrecisionLike": "jax.lax.PrecisionLike",
}
autodoc_default_options = {"show-inheritance": False}
# Tables link to the objects documented on the pages; no stub files are generated,
# so a build never writes into the source tree.
autosummary_generate = False

# Napoleon: the docstrings are Google style ("Args:", "Returns:", "Raises:").
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
napoleon_attr_annotations = True
napoleon_use_ivar = True  # "Attributes:" as a field list: no clash with documented properties

# MyST: docs/design.md and docs/sharp-edges.md are included unchanged.
myst_enable_extensions = ["dollarmath", "colon_fence"]
myst_heading_anchors = 3

html_theme = "furo"
html_title = "dpmuon_jax"
html_static_path: list[str] = []

if os.environ.get("DPMUON_DOCS_INTERSPHINX") == "1":
  extensions.append("sphinx.ext.intersphinx")
  intersphinx_mapping = {
      "python": ("https://docs.python.org/3", None),
      "numpy": ("https://numpy.org/doc/stable", None),
      "jax": ("https://docs.jax.dev/en/latest", None),
      "optax": ("https://optax.readthedocs.io/en/latest", None),
  }


# The docstrings are written for ``help()``: Unicode equations in indented blocks
# (aligned by hand, sometimes with deeper continuation lines) and |x| for absolute
# values. In reStructuredText those are block quotes (alignment lost, continuation
# lines an error) and substitution references. ``_as_rest`` shows such blocks
# verbatim, as literal blocks, and |x| as text; everything else is left to napoleon.
_SUBSTITUTION = re.compile(r"(?<![\w|\\])\|(?=\S)([^|`]*?\S)\|(?![\w|])")
_BULLET = re.compile(r"^(\s*)([*+-]|\d+\.|#\.)\s+")


def _indent(line: str) -> int:
  return len(line) - len(line.lstrip())


def _text_indent(line: str) -> int:
  """Where a paragraph's text starts: after the marker for a list item."""
  bullet = _BULLET.match(line)
  return bullet.end() if bullet else _indent(line)


def _literal_text(line: str) -> str:
  """|x| outside ``inline literals`` escaped, so it is not a substitution."""
  parts = line.split("``")
  parts[::2] = [_SUBSTITUTION.sub(r"\\|\1|", part) for part in parts[::2]]
  return "``".join(parts)


def _as_rest(app, what, name, obj, options, lines):
  """Indented blocks after a blank line become literal blocks; |x| becomes text."""
  del app, what, name, obj, options
  out: list[str] = []
  literal_at = None  # indentation of the literal block we are in, if any
  for i, line in enumerate(lines):
    if literal_at is not None and line.strip() and _indent(line) < literal_at:
      literal_at = None
    if literal_at is not None or not line.strip():
      out.append(line)
      continue
    previous = next((p for p in reversed(out) if p.strip()), None)
    after_blank = i > 0 and not lines[i - 1].strip()
    if previous is not None and after_blank and previous.rstrip().endswith("::"):
      literal_at = _indent(line)
    elif (previous is not None and after_blank and not line.lstrip().startswith(".. ")
          and _indent(line) >= _text_indent(previous) + 4):
      out[-1:-1] = ["", " " * _text_indent(previous) + "::"]
      literal_at = _indent(line)
    out.append(line if literal_at is not None else _literal_text(line))
  lines[:] = out


def _skip_field_alias(app, what, name, obj, skip, options):
  """NamedTuple fields are described in their class's "Attributes:" section, not twice."""
  del app, name, options
  if what == "class" and (getattr(obj, "__doc__", None) or "").startswith("Alias for field number"):
    return True
  return skip


def setup(app):
  app.connect("autodoc-skip-member", _skip_field_alias)
  app.connect("autodoc-process-docstring", _as_rest, priority=400)  # before napoleon
