"""Points every Colab link and install line at the repository named in pyproject.toml.

The project's public address is written once, as ``[project.urls] Repository``
in pyproject.toml. The notebooks (the "Open in Colab" badge of their first
cell and their install cell), README.md and docs/index.md repeat it. After
changing it in pyproject.toml, run

    python notebooks/set_repository.py            # rewrite them
    python notebooks/set_repository.py --check    # only list the lines that disagree

(``--check`` exits with status 1 when a line disagrees; tests/test_notebooks.py
runs the same check.)
"""

from __future__ import annotations

import argparse
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
BRANCH = "main"  # the branch Colab opens the notebooks from
FILES = ("README.md", "docs/index.md", "notebooks/*.ipynb")

_REPOSITORY = re.compile(r'^Repository\s*=\s*"([^"]+)"', re.M)
_GITHUB = re.compile(r"https://github\.com/([\w.-]+/[\w.-]+?)(?:\.git)?/?")
COLAB = re.compile(r"https://colab\.research\.google\.com/github/[\w.-]+/[\w.-]+/blob/[\w.-]+/"
                   r"(notebooks/[\w.-]+\.ipynb)")
# A git URL for pip, ended by a quote (\x22), an escaped quote in JSON, a space, @ or #.
GIT_INSTALL = re.compile(r"git\+https://[\w.-]+/[\w.-]+/[\w.-]+?(?:\.git)?(?=[\\\x22'\s@#]|$)")


def github_slug(root: pathlib.Path = ROOT) -> str:
  """``owner/name`` of pyproject.toml's ``[project.urls] Repository`` (a GitHub URL)."""
  text = (root / "pyproject.toml").read_text(encoding="utf-8")
  found = _REPOSITORY.search(text)
  if found is None:
    raise ValueError("pyproject.toml has no [project.urls] Repository = \"...\".")
  github = _GITHUB.fullmatch(found.group(1))
  if github is None:
    raise ValueError(f"Repository {found.group(1)!r} is not https://github.com/OWNER/NAME: "
                     "Colab opens notebooks from GitHub only.")
  return github.group(1)


def colab_url(slug: str, notebook: str) -> str:
  """The "Open in Colab" address of ``notebooks/<notebook>.ipynb``."""
  return f"https://colab.research.google.com/github/{slug}/blob/{BRANCH}/notebooks/{notebook}.ipynb"


def install_url(slug: str) -> str:
  """What pip installs from: ``git+https://github.com/<slug>.git``."""
  return f"git+https://github.com/{slug}.git"


def _files(root: pathlib.Path) -> list[pathlib.Path]:
  return sorted(p for pattern in FILES for p in root.glob(pattern))


def _rewrite(text: str, slug: str) -> str:
  text = COLAB.sub(lambda m: colab_url(slug, pathlib.Path(m.group(1)).stem), text)
  return GIT_INSTALL.sub(install_url(slug), text)


def disagreements(root: pathlib.Path = ROOT) -> list[str]:
  """``path:line: text`` of every Colab link or install line that disagrees with pyproject."""
  slug = github_slug(root)
  found = []
  for path in _files(root):
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
      if (COLAB.search(line) or GIT_INSTALL.search(line)) and _rewrite(line, slug) != line:
        found.append(f"{path.relative_to(root)}:{number}: {line.strip()[:160]}")
  return found


def rewrite(root: pathlib.Path = ROOT) -> list[str]:
  """Rewrites every disagreeing Colab link and install line; returns the files changed."""
  slug = github_slug(root)
  changed = []
  for path in _files(root):
    text = path.read_text(encoding="utf-8")
    if _rewrite(text, slug) != text:
      path.write_text(_rewrite(text, slug), encoding="utf-8")
      changed.append(str(path.relative_to(root)))
  return changed


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--check", action="store_true", help="only list disagreeing lines")
  args = parser.parse_args(argv)
  wrong = disagreements()
  for line in wrong:
    print(line)
  if args.check:
    return 1 if wrong else 0
  for name in rewrite():
    print(f"rewrote {name}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
