"""The library stays readable: no function body (docstring excluded) over 60 lines."""

import ast
import pathlib

LIBRARY = pathlib.Path(__file__).resolve().parents[1] / "dpmuon_jax"
MAX_BODY_LINES = 60


def _body_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
  first = node.body[0]
  docstring = (
      isinstance(first, ast.Expr)
      and isinstance(first.value, ast.Constant)
      and isinstance(first.value.value, str)
  )
  skipped = first.end_lineno - first.lineno + 1 if docstring else 0
  return node.end_lineno - node.lineno + 1 - skipped


def long_functions(root: pathlib.Path, limit: int) -> list[str]:
  found = []
  for path in sorted(root.rglob("*.py")):
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        lines = _body_lines(node)
        if lines > limit:
          found.append(f"{path.relative_to(root.parent)}:{node.lineno} {node.name} ({lines})")
  return found


def test_no_function_body_over_sixty_lines():
  assert long_functions(LIBRARY, MAX_BODY_LINES) == []


def test_the_checker_sees_a_long_function(tmp_path):
  package = tmp_path / "pkg"
  package.mkdir()
  body = "\n".join(f"  x{i} = {i}" for i in range(61))
  (package / "m.py").write_text(f'def f():\n  """Doc."""\n{body}\n')
  assert long_functions(package, MAX_BODY_LINES) == ["pkg/m.py:1 f (62)"]
