"""Sphinx configuration: the API reference from the docstrings, the Markdown pages as they are.

The docstrings are reStructuredText as written (Google-style sections for napoleon, equations
in ``::`` literal blocks), rendered without rewriting.

Build (no network needed): ``sphinx-build -W --keep-going -b html docs docs/_build/html``.
Set ``DPMUON_DOCS_INTERSPHINX=1`` to link Python, NumPy, JAX and Optax names to their
online documentation (that build downloads the inventories).
"""

import importlib.util
import os
import pathlib
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


def _skip_field_alias(app, what, name, obj, skip, options):
  """NamedTuple fields are described in their class's "Attributes:" section, not twice."""
  del app, name, options
  if what == "class" and (getattr(obj, "__doc__", None) or "").startswith("Alias for field number"):
    return True
  return skip


def setup(app):
  app.connect("autodoc-skip-member", _skip_field_alias)
