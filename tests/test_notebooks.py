"""The notebooks show their results, run top to bottom at tiny scale and are Colab-ready.

The committed notebooks carry the outputs of a top-to-bottom run at their
default scale (``python notebooks/execute.py``): every code cell executed in
order, at least one inline plot, no error, under the size limit. Each notebook
also executes in a fresh ``python3`` kernel with DPMUON_NOTEBOOK_SCALE=tiny and
JAX_PLATFORMS=cpu, so a notebook whose code breaks fails CI. The static checks:
the first code cell installs the package only when ``import dpmuon_jax`` fails,
no cell refers to a local path, and every "Open in Colab" link and install line
(notebooks, README) agrees with pyproject.toml's ``[project.urls] Repository``.
"""

import importlib.util
import itertools
import pathlib
import re
import shutil

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
NAMES = [p.stem for p in NOTEBOOKS]


def _script(name: str):
  """A helper script of notebooks/ as a module."""
  spec = importlib.util.spec_from_file_location(name, ROOT / "notebooks" / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


execute = _script("execute")
set_repository = _script("set_repository")
CELL_TIMEOUT_S = 240
LOCAL_PATH = re.compile(r"(/work\b|/tmp\b|\.\./shared|/home/|/root\b|/Users/|[A-Za-z]:\\\\)")


def _read(path: pathlib.Path):
  return nbformat.read(path, as_version=4)


def _code_cells(nb):
  return [c for c in nb.cells if c.cell_type == "code"]


def _install_guard(source: str) -> bool:
  """``try: import dpmuon_jax / except ImportError: <indented %pip install>``."""
  lines = [ln for ln in source.splitlines() if ln.strip() and not ln.strip().startswith("#")]
  try:
    start = next(i for i, ln in enumerate(lines) if ln.strip() == "try:")
  except StopIteration:
    return False
  body = lines[start + 1:]
  if not body or not re.fullmatch(r"\s+import dpmuon_jax( .*)?", body[0]):
    return False
  if len(body) < 3 or body[1].strip() != "except ImportError:":
    return False
  handler = list(itertools.takewhile(lambda ln: ln.startswith((" ", "\t")), body[2:]))
  return any(ln.strip().startswith("%pip install") for ln in handler)


def test_notebooks_exist():
  assert set(NAMES) >= {"quickstart", "phase_transition", "diagnostics"}


def test_install_guard_detects_unguarded_install():
  assert _install_guard('try:\n  import dpmuon_jax\nexcept ImportError:\n  %pip install -q x\n')
  assert not _install_guard('%pip install -q x\nimport dpmuon_jax\n')
  assert not _install_guard('try:\n  import numpy\nexcept ImportError:\n  %pip install -q x\n')
  assert _install_guard('try:\n  import dpmuon_jax\nexcept ImportError:\n  if not s:\n'
                        '    raise RuntimeError("set s")\n  %pip install -q x\n')
  assert not _install_guard('try:\n  import dpmuon_jax\nexcept ImportError:\n  pass\n'
                            '%pip install -q x\n')


@pytest.mark.parametrize("path", NOTEBOOKS, ids=NAMES)
def test_notebook_is_colab_ready(path):
  nb = _read(path)
  nbformat.validate(nb)
  cells = _code_cells(nb)
  assert _install_guard(cells[0].source), "first code cell must install only on ImportError"
  for cell in cells[1:]:
    assert not re.search(r"^\s*[%!]\s*pip\b", cell.source, re.M), "pip outside the guard"
  for cell in nb.cells:
    match = LOCAL_PATH.search(cell.source)
    assert match is None, f"local path {match.group(0)!r} in a cell"
  assert nb.metadata.kernelspec.name == "python3"


def _text(outputs) -> str:
  return "".join(o.get("text", "") + o.get("data", {}).get("text/plain", "")
                 for o in outputs)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=NAMES)
def test_committed_notebook_shows_its_results(path):
  """Saved by ``python notebooks/execute.py``: one top-to-bottom run at full scale."""
  size = path.stat().st_size
  assert size <= execute.MAX_BYTES, f"{size} bytes: smaller figures, or fewer of them"
  nb = _read(path)
  cells = _code_cells(nb)
  counts = [c.execution_count for c in cells]
  assert counts == list(range(1, len(cells) + 1)), f"not run top to bottom once: {counts}"
  assert cells[0].outputs == [], "the committed install cell shows pip output"
  outputs = [o for c in cells for o in c.outputs]
  errors = [o for o in outputs if o.output_type == "error"]
  assert not errors, f"error outputs: {[e.get('ename') for e in errors]}"
  assert not [o for o in outputs if o.get("name") == "stderr"], "stderr in the outputs"
  assert any("image/png" in o.get("data", {}) for o in outputs), "no inline plot"
  text = _text(outputs)
  assert "scale: full" in text, "committed outputs must come from the full scale"
  match = LOCAL_PATH.search(text)
  assert match is None, f"local path {match.group(0)!r} in an output"


def test_colab_links_and_install_lines_agree_with_pyproject():
  wrong = set_repository.disagreements()
  assert wrong == [], ("these lines disagree with pyproject.toml's Repository; run "
                       "`python notebooks/set_repository.py`:\n" + "\n".join(wrong))
  slug = set_repository.github_slug()
  readme = (ROOT / "README.md").read_text(encoding="utf-8")
  for path in NOTEBOOKS:
    nb = _read(path)
    colab = set_repository.colab_url(slug, path.stem)
    first_markdown = next(c for c in nb.cells if c.cell_type == "markdown")
    assert f"]({colab})" in first_markdown.source, f"{path.name}: no Open-in-Colab badge"
    assert colab in readme, f"README does not link {path.name} on Colab"
    install = _code_cells(nb)[0].source
    assert set_repository.install_url(slug) in install
    assert "os.environ" not in install, "the install cell must work without configuration"


def test_set_repository_rewrites_every_link(tmp_path):
  for name in set_repository.FILES:
    for path in ROOT.glob(name):
      target = tmp_path / path.relative_to(ROOT)
      target.parent.mkdir(parents=True, exist_ok=True)
      shutil.copy(path, target)
  pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
  moved = re.sub(r'^Repository = ".*"$', 'Repository = "https://github.com/elsewhere/fork"',
                 pyproject, flags=re.M)
  (tmp_path / "pyproject.toml").write_text(moved, encoding="utf-8")
  assert len(set_repository.disagreements(tmp_path)) >= 2 * len(NOTEBOOKS) + 1
  changed = set_repository.rewrite(tmp_path)
  assert {f"notebooks/{p.name}" for p in NOTEBOOKS} <= set(changed)
  assert set_repository.disagreements(tmp_path) == []
  text = (tmp_path / "notebooks" / NOTEBOOKS[0].name).read_text(encoding="utf-8")
  assert "github/elsewhere/fork/blob/main/notebooks/" in text
  assert "git+https://github.com/elsewhere/fork.git" in text
  assert "dpmuon-jax/dpmuon_jax" not in text


@pytest.mark.parametrize("path", NOTEBOOKS, ids=NAMES)
def test_notebook_runs_at_tiny_scale(path, tmp_path, monkeypatch):
  monkeypatch.setenv("DPMUON_NOTEBOOK_SCALE", "tiny")
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "3")
  nb = _read(path)
  client = nbclient.NotebookClient(
      nb, timeout=CELL_TIMEOUT_S, kernel_name="python3",
      resources={"metadata": {"path": str(tmp_path)}},
  )
  client.execute()  # raises CellExecutionError on the first failing cell
  cells = _code_cells(nb)
  assert cells[0].outputs == [], "the install cell ran pip although dpmuon_jax is importable"
  outputs = [o for c in cells for o in c.outputs]
  assert not [o for o in outputs if o.output_type == "error"]
  text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
  assert "scale: tiny" in text
  images = [o for o in outputs if "image/png" in o.get("data", {})]
  assert images, "no inline plot"
