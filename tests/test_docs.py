"""The API reference builds with warnings as errors and documents the whole package.

One ``sphinx-build -W --keep-going -b html docs OUT`` in a subprocess (sphinx is in
the ``docs`` extra, which ``dev`` installs: a missing sphinx fails here). The built
site has the Markdown pages, an optimizer family page, every name of
``dpmuon_jax.__all__`` linked from the top-level API page, and every module of the
package documented on some page; the build writes nothing into ``docs/``.
"""

import importlib.util
import os
import pathlib
import re
import subprocess
import sys
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
BUILD_TIMEOUT_S = 300
# Not API: the command line and its help formatter (documented by `dpmuon --help`) and
# `python -m` entry points.
UNDOCUMENTED_MODULES = {"dpmuon_jax.cli", "dpmuon_jax.help_format", "dpmuon_jax.__main__",
                        "dpmuon_jax.commands", "dpmuon_jax.commands.account",
                        "dpmuon_jax.commands.search"}  # the command line's, as cli


def _tree(root: pathlib.Path) -> set[str]:
  return {str(p.relative_to(root)) for p in root.rglob("*")
          if "_build" not in p.parts and "__pycache__" not in p.parts}


@pytest.fixture(scope="module")
def site(tmp_path_factory):
  assert importlib.util.find_spec("sphinx"), "sphinx is missing: pip install -e '.[docs]'"
  out = tmp_path_factory.mktemp("docs")
  before = _tree(DOCS)
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "TF_CPP_MIN_LOG_LEVEL": "3"}
  env.pop("DPMUON_DOCS_INTERSPHINX", None)  # the test build stays offline
  start = time.perf_counter()
  proc = subprocess.run(
      [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html",
       "-d", str(out / "doctrees"), str(DOCS), str(out / "html")],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S,
  )
  seconds = time.perf_counter() - start
  assert proc.returncode == 0, f"sphinx-build failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
  assert _tree(DOCS) <= before, f"the build wrote into docs/: {sorted(_tree(DOCS) - before)}"
  print(f"docs built in {seconds:.1f} s")
  return out / "html"


def _page(site: pathlib.Path, name: str) -> str:
  path = site / name
  assert path.is_file(), f"{name} was not built"
  return path.read_text(encoding="utf-8")


def test_markdown_pages_are_included(site):
  index = _page(site, "index.html")
  assert 'href="sharp-edges.html"' in index and 'href="design.html"' in index
  edges = _page(site, "sharp-edges.html")
  assert "Privacy sharp edges" in edges and "secure-noise" in edges
  assert "Privacy invariants" in _page(site, "design.html")


def test_optimizer_family_pages_document_their_optimizers(site):
  families = {
      "classic": ["dp_sgd", "dp_adam", "dp_adamw"],
      "muon": ["dp_muon", "dp_muon_s", "muon", "muon_s"],
      "filters": ["dp_disk_sgd", "dp_disk_muon", "dp_doppler_sgd", "dp_doppler_muon"],
      "paper2": ["dp_muon_im", "dp_muon_bc", "dp_adam_bc"],
  }
  for family, names in families.items():
    html = _page(site, f"optimizers/{family}.html")
    for name in names:
      anchor = f'id="dpmuon_jax.optimizers.{family}.{name}"'
      assert anchor in html, f"{name} is not documented on optimizers/{family}.html"
  assert 'id="dpmuon_jax.optimizers.registry.build"' in _page(site, "optimizers/building.html")


def test_every_top_level_name_links_to_its_documentation(site):
  import dpmuon_jax

  html = _page(site, "api/toplevel.html")
  linked = {name: page for page, name in re.findall(
      r'<a class="reference internal" href="([^"#]*)#dpmuon_jax\.[\w.]*\.(\w+)"', html)}
  missing = sorted(set(dpmuon_jax.__all__) - set(linked))
  assert missing == [], f"add these names to docs/api/toplevel.md: {missing}"
  targets = {(page, anchor) for page, anchor in re.findall(
      r'href="([^"#]*)#(dpmuon_jax\.[\w.]+)"', html)}
  for page, anchor in targets:  # each link lands on a documented object
    assert f'id="{anchor}"' in _page(site, f"api/{page}"), (page, anchor)
  assert 'id="dpmuon_jax.optimizers.muon.dp_muon"' in _page(site, "optimizers/muon.html")


def test_every_module_is_documented(site):
  documented = set()
  for path in site.rglob("*.html"):
    documented |= set(re.findall(r'id="module-(dpmuon_jax[\w.]*)"', path.read_text("utf-8")))
  modules = set()
  for path in (ROOT / "dpmuon_jax").rglob("*.py"):
    parts = path.relative_to(ROOT).with_suffix("").parts
    name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    if not any(part.startswith("_") and part != "__init__" for part in parts):
      modules.add(name)
  missing = sorted(modules - documented - UNDOCUMENTED_MODULES)
  assert missing == [], f"add these modules to a page under docs/api/: {missing}"


def test_docstrings_render_as_written(site):
  """Equations are in ``::`` literal blocks in the docstrings themselves: no page has an
  indented block rendered as a quotation, and the configuration rewrites no docstring."""
  for path in [*(site / "api").glob("*.html"), *(site / "optimizers").glob("*.html")]:
    assert "<blockquote>" not in path.read_text("utf-8"), path.name
  assert "autodoc-process-docstring" not in (DOCS / "conf.py").read_text(encoding="utf-8")
  assert "<pre>" in _page(site, "api/privacy.html")  # e.g. the release's equation
