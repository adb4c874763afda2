"""The package type-checks: pyright (``[tool.pyright]`` in pyproject.toml) reports no error.

Pyright's Node.js comes from PyPI (``pyright[nodejs]`` in the dev extra);
``PYRIGHT_PYTHON_IGNORE_WARNINGS`` skips its check for a newer release, so
nothing is downloaded.
"""

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _pyright(*args: str, cwd: pathlib.Path = ROOT) -> subprocess.CompletedProcess:
  pytest.importorskip("pyright")
  env = {**os.environ, "PYRIGHT_PYTHON_IGNORE_WARNINGS": "1"}
  return subprocess.run(
      [sys.executable, "-m", "pyright", "--outputjson", "--pythonpath", sys.executable, *args],
      cwd=cwd, env=env, capture_output=True, text=True, timeout=600,
  )


def _errors(result: subprocess.CompletedProcess) -> list[str]:
  report = json.loads(result.stdout)
  return [
      f"{d['file']}:{d['range']['start']['line'] + 1}: {d['message']} ({d.get('rule', '')})"
      for d in report["generalDiagnostics"] if d["severity"] == "error"
  ]


def test_pyright_reports_no_error_in_the_package():
  result = _pyright()
  assert result.stdout, result.stderr
  errors = _errors(result)
  assert errors == [], f"{len(errors)} pyright error(s):\n" + "\n".join(errors)
  report = json.loads(result.stdout)
  assert report["summary"]["filesAnalyzed"] >= 50  # the whole package, not an empty include


def test_pyright_sees_a_type_error(tmp_path):
  (tmp_path / "pyproject.toml").write_text('[tool.pyright]\ninclude = ["bad.py"]\n')
  (tmp_path / "bad.py").write_text("def f(x: int) -> str:\n  return x\n")
  errors = _errors(_pyright(cwd=tmp_path))
  assert len(errors) == 1 and "bad.py:2" in errors[0]
