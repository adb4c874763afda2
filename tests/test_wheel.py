"""The package a user installs: build the sdist and the wheel from it, install the wheel
into a fresh virtual environment and run the ``dpmuon`` command from outside the checkout.

The environment reuses the dependencies installed for the interpreter running the tests:
a ``.pth`` file lists the folders of that interpreter's import path, so this works whether it is
a virtual environment (``.venv`` inside the checkout, the usual layout, or anywhere else), a
conda environment or a system Python (venv's system-site-packages option would expose the
*base* interpreter's packages, not a virtual environment's). The environment gets its own copy
of ``dpmuon_jax`` from the wheel (``--no-deps --force-reinstall``); the test checks that this
copy, not the checkout nor an editable install, is the one imported.
"""

import email
import json
import os
import pathlib
import subprocess
import sys
import tarfile
import zipfile

import pytest
from packaging.version import Version

import dpmuon_jax

ROOT = pathlib.Path(__file__).resolve().parents[1]
VERSION = dpmuon_jax.__version__


def _env() -> dict[str, str]:
  env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
  env["JAX_PLATFORMS"] = "cpu"
  return env


def _run(args, cwd, timeout=300) -> subprocess.CompletedProcess:
  result = subprocess.run(args, cwd=cwd, env=_env(), capture_output=True, text=True,
                          timeout=timeout)
  assert result.returncode == 0, f"{args}\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}"
  return result


def _import_folders(path=None, root=ROOT, environments=None) -> list[str]:
  """The folders of the running interpreter's import path (``sys.path``) that the wheel's
  environment reuses: its standard library and site-packages, wherever they are.

  Left out: the checkout and its other folders (``tests/``, the current folder), which would
  shadow the wheel, and an editable install's own folders (``__editable__*``). A folder inside
  the checkout is kept when it belongs to the running environment (``sys.prefix``, e.g.
  ``<checkout>/.venv/lib/python3.11/site-packages``). The editable install's hook (its
  ``__editable__*.pth`` and finder module in site-packages) does not run: the ``.pth`` file
  the environment gets lists plain folders, and Python runs only the ``.pth`` files of its own
  site folders.
  """
  path = sys.path if path is None else path
  if environments is None:
    environments = (sys.prefix, sys.exec_prefix, sys.base_prefix)
  root = pathlib.Path(root).resolve()
  # Environments that live inside the checkout (a `.venv` folder), not the checkout itself.
  inside = [e for e in (pathlib.Path(p).resolve() for p in environments)
            if e.is_relative_to(root) and e != root]
  kept = []
  for folder in (pathlib.Path(f).resolve() for f in path if f and os.path.isdir(f)):
    if any(part.startswith("__editable__") for part in folder.parts):
      continue
    if folder.is_relative_to(root) and not any(folder.is_relative_to(e) for e in inside):
      continue
    kept.append(str(folder))
  return list(dict.fromkeys(kept))


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> pathlib.Path:
  """The sdist, and the wheel built from the unpacked sdist (so the sdist is complete)."""
  out = tmp_path_factory.mktemp("dist")
  # No isolation: setuptools and build come with the dev extra, nothing is downloaded.
  _run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(ROOT)],
       cwd=out)
  return out


@pytest.fixture(scope="module")
def venv(dist, tmp_path_factory) -> pathlib.Path:
  """A fresh environment with the wheel installed; returns its ``bin`` folder."""
  home = tmp_path_factory.mktemp("venv")
  _run([sys.executable, "-m", "venv", "--without-pip", str(home)], cwd=home)
  python = str(home / "bin" / "python")
  purelib = _run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                 cwd=home).stdout.strip()
  # Plain folder lines: the folders go on sys.path after the environment's own, and their
  # .pth files (an editable install's import hook among them) are not run.
  (pathlib.Path(purelib) / "_test_dependencies.pth").write_text(
      "".join(f"{folder}\n" for folder in _import_folders()))
  (wheel,) = dist.glob("*.whl")
  _run([sys.executable, "-m", "pip", "--python", python, "install",
        "--no-deps", "--force-reinstall", "--no-index", "--quiet", str(wheel)], cwd=home)
  return home / "bin"


def test_the_wheel_ships_the_package_typed_and_nothing_else(dist):
  (wheel,) = dist.glob("*.whl")
  assert wheel.name == f"dpmuon_jax-{VERSION}-py3-none-any.whl"
  with zipfile.ZipFile(wheel) as archive:
    names = archive.namelist()
    metadata = email.message_from_bytes(
        archive.read(f"dpmuon_jax-{VERSION}.dist-info/METADATA"))
    shipped_license = archive.read(f"dpmuon_jax-{VERSION}.dist-info/licenses/LICENSE")
  assert "dpmuon_jax/py.typed" in names
  assert "dpmuon_jax/training/trainer.py" in names
  tops = {name.split("/")[0] for name in names}
  assert tops == {"dpmuon_jax", f"dpmuon_jax-{VERSION}.dist-info"}, tops
  assert metadata["Version"] == VERSION
  assert metadata["License-Expression"] == "Apache-2.0"
  assert metadata.get_all("License-File") == ["LICENSE"]
  assert shipped_license == (ROOT / "LICENSE").read_bytes()
  assert b"Apache License" in shipped_license and b"Version 2.0, January 2004" in shipped_license
  extras = metadata.get_all("Provides-Extra")
  assert {"train", "tensorboard"} <= set(extras)


def test_the_sdist_has_the_sources_the_wheel_was_built_from(dist):
  (sdist,) = dist.glob("*.tar.gz")
  assert sdist.name == f"dpmuon_jax-{VERSION}.tar.gz"
  with tarfile.open(sdist) as archive:
    names = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
  assert {"pyproject.toml", "README.md", "LICENSE", "dpmuon_jax/py.typed",
          "dpmuon_jax/__init__.py"} <= names


def _folders(*paths: pathlib.Path) -> list[str]:
  for path in paths:
    path.mkdir(parents=True, exist_ok=True)
  return [str(path) for path in paths]


def test_the_wheel_environment_reuses_a_venv_inside_the_checkout_but_not_the_checkout(tmp_path):
  """The usual layout (`python3 -m venv .venv` in the clone): the environment's site-packages
  lie inside the checkout and are kept; the checkout, its tests/ and an editable install's
  folders are not. Likewise for an environment outside the checkout (CI, conda, a system
  Python), and for a checkout inside an environment's folder."""
  root, python = tmp_path / "clone", tmp_path / "python"
  stdlib, site, tests, editable = _folders(
      python / "lib" / "python3.11", root / ".venv" / "lib" / "python3.11" / "site-packages",
      root / "tests", root / "build" / "__editable__.dpmuon_jax-0.1.0-py3-none-any")
  path = ["", str(root), tests, stdlib, site, editable, str(root / "missing"), site]
  assert _import_folders(path, root, (root / ".venv", python)) == [stdlib, site]

  conda = tmp_path / "conda"
  (conda_site,) = _folders(conda / "lib" / "python3.11" / "site-packages")
  for checkout in (root, conda / "src" / "clone"):
    (checkout_tests,) = _folders(checkout / "tests")
    path = [str(checkout), checkout_tests, stdlib, conda_site]
    assert _import_folders(path, checkout, (conda, python)) == [stdlib, conda_site]

  import jax

  ours = _import_folders()
  assert str(pathlib.Path(jax.__file__).resolve().parents[1]) in ours
  assert str(ROOT) not in ours and str(ROOT / "tests") not in ours


def test_the_installed_wheel_is_what_runs(venv, tmp_path):
  code = ("import importlib.metadata as m, json, dpmuon_jax; "
          "print(json.dumps([dpmuon_jax.__file__, dpmuon_jax.__version__, "
          "m.version('dpmuon-jax'), str(m.distribution('dpmuon-jax').locate_file(''))]))")
  path, version, metadata_version, location = json.loads(
      _run([str(venv / "python"), "-c", code], cwd=tmp_path).stdout)
  home = venv.parent.resolve()
  assert pathlib.Path(path).resolve().is_relative_to(home), path
  assert not pathlib.Path(path).resolve().is_relative_to(ROOT)
  assert pathlib.Path(location).resolve().is_relative_to(home), location
  assert version == metadata_version == VERSION


def test_dpmuon_train_and_account_run_from_the_wheel(venv, tmp_path):
  out = tmp_path / "run"
  train = _run([str(venv / "dpmuon"), "train", "--max-steps", "2", "--output-dir", str(out),
                "--no-progress"], cwd=tmp_path)
  assert "test accuracy" in train.stdout and "after 2 releases" in train.stdout
  results = json.loads((out / "results.json").read_text())
  assert results["releases"] == 2 and 0 < results["epsilon_spent"] < 4.0
  assert (out / "curves.png").stat().st_size > 0

  account = _run([str(venv / "dpmuon"), "account", "--epsilon", "4", "--delta", "1e-5",
                  "--sampling-rate", "0.02", "--steps", "100"], cwd=tmp_path)
  report = json.loads(account.stdout.strip().splitlines()[-1])
  assert report["epsilon"] == 4 and report["steps"] == 100
  assert 0.3 < report["sigma"] < 3.0


def test_the_changelog_has_an_entry_for_this_version():
  changelog = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
  assert f"\n## {VERSION}\n" in changelog and "\n## Unreleased\n" in changelog


def test_the_floors_ci_job_pins_every_lower_bound_of_pyproject():
  """`.ci/run floors` tests the oldest releases pyproject.toml allows, and only those."""
  import tomllib

  from packaging.requirements import Requirement
  from packaging.utils import canonicalize_name

  project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
  extras = project["optional-dependencies"]
  required = [Requirement(r) for r in project["dependencies"] + extras["train"]
              + extras["audit"] + extras["text"]]
  bounds = {}
  for req in required:
    (lower,) = [s.version for s in req.specifier if s.operator == ">="]
    bounds[canonicalize_name(req.name)] = lower
  lines = (ROOT / ".ci" / "floors.txt").read_text(encoding="utf-8").splitlines()
  pins = {}
  for req in (Requirement(line) for line in lines if line and not line.startswith("#")):
    (pin,) = [s.version for s in req.specifier if s.operator == "=="]
    pins[canonicalize_name(req.name)] = pin
  assert set(pins) == set(bounds)
  for name, lower in bounds.items():
    assert Version(pins[name]) == Version(lower), name
