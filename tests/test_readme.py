"""The README's Python examples run as written (scaled down where marked)."""

import csv
import json
import math
import pathlib
import pickle
import re
import subprocess
import sys
import tarfile
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_readme_examples_run():
  blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
  assert len(blocks) == 4
  ns: dict = {}
  exec(blocks[0], ns)
  batch = {"x": jnp.ones((8, 4)), "y": jnp.ones((8, 2))}
  params, state = ns["step"](ns["params"], ns["state"], batch, jnp.arange(8) < 5)
  assert params["w"].shape == (4, 2)
  # The next block continues from the state the step returned, as a user's loop would (the
  # initial state's key was spent by that step: reusing it releases NaN, by design).
  ns.update(batch=batch, mask=jnp.ones(8, bool), state=state)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    exec(blocks[1], ns)
  assert all(bool(jnp.all(jnp.isfinite(u))) for u in jax.tree.leaves(ns["updates"]))
  exec(blocks[2], ns)
  small = (  # the Flax NNX loop, scaled down
      blocks[3]
      .replace("dataset_size=50_000", "dataset_size=256")
      .replace("expected_batch_size=1024", "expected_batch_size=32")
      .replace("epochs=10", "epochs=0.25")
  )
  rng = np.random.default_rng(0)
  ns.update(train_arrays={"x": rng.normal(size=(256, 4)).astype(np.float32),
                          "y": rng.normal(size=(256, 2)).astype(np.float32)})
  exec(small, ns)
  assert ns["setup"].ledger.count == 2
  assert 0 < ns["setup"].ledger.epsilon() <= 4.0
  trained = np.asarray(ns["model"].hidden.kernel[...])
  initial = np.asarray(ns["MLP"](ns["nnx"].Rngs(0)).hidden.kernel[...])
  assert np.all(np.isfinite(trained)) and not np.allclose(trained, initial)
  assert int(ns["optimizer"].step[...]) == 2
  # The step the text names builds, on the Optax example's loss.
  step = ns["dm"].make_private_step(ns["dm"].dp_muon(0.02, **ns["setup"].release_kwargs),
                                    ns["loss_fn"], microbatch_size=16)
  assert callable(step.released)


def test_the_names_the_readme_teaches_import_from_the_package():
  import dpmuon_jax

  text = README.read_text()
  taught = set(re.findall(r"\bdm\.([A-Za-z_][A-Za-z0-9_]*)", text))
  # The optimizer table and the list of post-processing pieces name them in backticks.
  prefixes = ("dp_", "scale_by_", "kalman", "low_pass", "partition", "newton",
              "muon_momentum", "selective")
  taught |= {n for n in re.findall(r"`([a-z_]+|[A-Z0-9_]+_PRESETS)`", text)
             if n != "dp_" and n.startswith(prefixes) or n.endswith("_PRESETS")}
  assert taught, "the README teaches no names?"
  missing = sorted(n for n in taught if n not in dpmuon_jax.__all__)
  assert missing == []
  assert all(hasattr(dpmuon_jax, n) for n in dpmuon_jax.__all__)
  assert len(dpmuon_jax.__all__) < 80  # curated: tens of names, the rest in subpackages


def _cifar_archive(path: pathlib.Path, rng) -> dict:
  """A small stand-in for cifar-10-python.tar.gz: the same members and pickled layout."""
  batches = {}
  with tarfile.open(path, "w:gz") as tar:
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
      batch = {b"data": rng.integers(0, 256, (2, 3072), dtype=np.uint8),
               b"labels": [int(v) for v in rng.integers(0, 10, 2)]}
      batches[name] = batch
      member = path.parent / name
      member.write_bytes(pickle.dumps(batch))
      tar.add(member, arcname=f"cifar-10-batches-py/{name}")
  return batches


def test_the_cifar10_npz_recipe_writes_what_the_loader_reads(tmp_path):
  from dpmuon_jax.data.loaders import load_npz

  cli_doc = README.parent / "docs" / "cli.md"
  (block,) = [b for b in re.findall(r"```bash\n(.*?)```", cli_doc.read_text(), re.S)
              if "cifar-10-python" in b]
  code = block.split("<<'EOF'\n", 1)[1].rsplit("\nEOF", 1)[0]
  url = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
  assert url in code
  batches = _cifar_archive(tmp_path / "archive.tar.gz", np.random.default_rng(0))
  (tmp_path / "DATA").mkdir()
  subprocess.run([sys.executable, "-c", code.replace(url, (tmp_path / "archive.tar.gz").as_uri())],
                 cwd=tmp_path, check=True, timeout=120)
  data = load_npz(tmp_path / "DATA" / "cifar10.npz")
  assert data.x_train.shape == (10, 32, 32, 3) and data.x_test.shape == (2, 32, 32, 3)
  first = batches["data_batch_1"]
  # Row-major planes R, G, B of 32x32 each, as the archive stores them, become NHWC pixels.
  green = first[b"data"][0, 1024:2048].reshape(32, 32)
  np.testing.assert_array_equal(data.x_train[0, :, :, 1], green)
  assert list(data.y_train[:2]) == first[b"labels"]
  assert list(data.y_test) == batches["test_batch"][b"labels"]


def test_ci_runs_the_readme_test_command_in_a_fresh_virtual_environment():
  """The README's install and test commands, as CI runs them: from a new venv, so a test
  that only passes outside one (e.g. one that relies on the base interpreter) fails CI."""
  text = README.read_text()
  (block,) = [b for b in re.findall(r"```bash\n(.*?)```", text, re.S) if "pytest" in b]
  install, test = block.strip().splitlines()
  assert install == 'pip install -e ".[dev]"' and test.startswith("python -m pytest -q")
  ci = (README.parent / ".ci" / "run").read_text()
  lines = [line.strip() for line in ci.splitlines()]
  venv = lines.index('python3 -m venv "$venv"')
  activate = lines.index('source "$venv/bin/activate"')
  default = lines.index("*)")  # the job CI runs: no argument
  assert venv < activate < default < lines.index(f"python -m {install}", default) < lines.index(
      test, default)
  assert "python -m pytest -q -m slow" in text and "python -m pytest -q -m slow" in lines


def test_the_readme_says_how_to_get_the_text_data_and_ci_requires_it(tmp_path, monkeypatch):
  """The tests that need E2E, DART and GPT-2's BPE files skip without them: the README names
  them, the variable that locates the data and the command that fetches it (run here with the
  downloads faked); .ci/run, where the data is, turns their skips into failures."""
  import hashlib
  import urllib.request

  from text_folder import require_text_data

  from dpmuon_jax.text import data

  text = " ".join(README.read_text().split())
  assert "needs_text_data" in text and "$DPMUON_TEXT_DATA" in text
  (command,) = re.findall(r'`python -c "(from dpmuon_jax\.text\.data import [^"]*)"`', text)
  folder = re.search(r"set the variable to `([^`]+)/`", text).group(1)
  assert f"'{folder}'" in command

  fake = {"encoder.json": b'{"!": 0}', "vocab.bpe": b"#version: 0.2\n"}
  monkeypatch.setattr(data, "GPT2_BPE_FILES", {
      local: (remote, hashlib.sha256(fake[remote]).hexdigest())
      for local, (remote, _) in data.GPT2_BPE_FILES.items()})

  def urlretrieve(url, path):
    name = url.rsplit("/", 1)[1]
    if "dart" in name:
      content = json.dumps([{"tripleset": [["A", "p", "B"]],
                             "annotations": [{"source": "s", "text": "A p B."}]}]).encode()
    elif name.startswith("src1_"):
      content = b"name : A | Type : pub||A is a pub . \n"
    else:
      content = fake[name]
    pathlib.Path(path).write_bytes(content)

  monkeypatch.setattr(urllib.request, "urlretrieve", urlretrieve)
  monkeypatch.chdir(tmp_path)
  exec(command, {})
  require_text_data(tmp_path / folder)  # neither skips nor fails: the folder is complete
  assert len(data.load_e2e(tmp_path / folder, "train").pairs) == 1
  assert len(data.load_dart(tmp_path / folder, "test").pairs) == 1

  monkeypatch.setenv("DPMUON_REQUIRE_TEXT_DATA", "1")
  with pytest.raises(pytest.fail.Exception, match="DPMUON_REQUIRE_TEXT_DATA=1"):
    require_text_data(tmp_path / "missing")
  monkeypatch.delenv("DPMUON_REQUIRE_TEXT_DATA")
  with pytest.raises(pytest.skip.Exception):
    require_text_data(tmp_path / "missing")

  ci = (README.parent / ".ci" / "run").read_text()
  require = ci.index('export DPMUON_REQUIRE_TEXT_DATA="${DPMUON_REQUIRE_TEXT_DATA:-1}"')
  assert require < ci.index("python -m pytest -q -n 2")


# ---------------------------------------------------------------------------
# What the README and the docs say the studies found, against the committed CSVs.

ROOT = README.parent
RESULTS = ROOT / "experiments" / "results"
# A comparison word ("better", "behind", ...) says how one arm did against another; the same
# sentence must say in what (test accuracy, validation NLL, BLEU, ...).
CLAIMS = re.compile(r"(?<![\w-])(no gain|not supported|better|behind|ahead|beats?)(?![\w-])", re.I)
METRICS = ("accuracy", "NLL", "BLEU", "ROUGE-L", "loss", "ε", "time", "memory", "nats",
           "seconds", "GiB", "throughput")
# What a study line may quote: the result columns of the committed CSVs (a paired gap or
# mean, its standard error, a change between batch sizes, a summary mean), not the raw rows
# (runs, curves, pilots, timings, learning-rate grids), whose thousands of values would match
# almost any number.
RESULT_COLUMNS = ("gap", "paired_standard_error", "standard_error", "change", "mean",
                  "paired_se", "gap_points", "step_from_previous_b", "valid_nll_mean",
                  "test_accuracy_mean", "d_valid_nll_mean", "d_valid_nll_paired_se")
NUMBER = re.compile(r"(?<![\w.])([+−-]?)(\d+\.\d+|\d+)(?![\w.]*\d)")


def _sentences(text: str) -> list[str]:
  """Prose split into sentences (code blocks dropped; a table cell is a sentence of its own)."""
  text = re.sub(r"```.*?```", "", text, flags=re.S)
  out = []
  for block in re.split(r"\n\s*\n", text):
    lines = block.splitlines()
    if lines and all(line.startswith("|") for line in lines):
      out += [cell for line in lines for cell in line.split("|")]
      continue
    out += re.split(r"(?<=[.!?])\s+(?=[A-Z(`\[])", " ".join(line.strip() for line in lines))
  return out


def unqualified_claims(text: str) -> list[str]:
  """The sentences that compare (``CLAIMS``) without naming a metric (``METRICS``)."""
  return [s for s in _sentences(text) if CLAIMS.search(s)
          and not any(m.lower() in s.lower() for m in METRICS)]


def test_every_comparison_in_the_readme_docs_and_optimizer_help_names_its_metric():
  from dpmuon_jax.optimizers import registry

  pages = {p.name: p.read_text() for p in [README, *sorted((ROOT / "docs").glob("*.md"))]}
  pages["optimizer summaries"] = "\n\n".join(e.summary + "." for e in registry.OPTIMIZERS.values())
  bad = {name: unqualified_claims(text) for name, text in pages.items()}
  assert {name: s for name, s in bad.items() if s} == {}
  assert unqualified_claims("DP-Muon-IM beats DP-Muon on every seed.")  # the check can fail
  assert not unqualified_claims("DP-Muon-IM beats DP-Muon in test BLEU on every seed.")


def _committed_numbers() -> list[list[float]]:
  """The result columns of every committed CSV, row by row."""
  rows = []
  for path in sorted(RESULTS.rglob("*.csv")):
    with open(path, newline="") as f:
      for row in csv.DictReader(f):
        values = []
        for column in RESULT_COLUMNS:
          try:
            values.append(float(row.get(column) or "nan"))
          except ValueError:
            continue
        if any(not math.isnan(v) for v in values):
          rows.append(values)
  return rows


def quoted_numbers(text: str) -> list[tuple[str, float, int]]:
  """The measured numbers of ``text``: those written with a decimal point or a sign (an
  integer without either is a setting: B = 256, ε = 8, 3 seeds, K = 1, paper 1). Each as
  (as written, value, decimals), "−" read as minus."""
  out = []
  for sign, digits in NUMBER.findall(text):
    if "." in digits or sign:
      value = float(digits) * (-1 if sign in "−-" and sign else 1)
      out.append((sign + digits, value, len(digits.partition(".")[2])))
  return out


def _matches(value: float, decimals: int, signed: bool, v: float) -> bool:
  """Whether the committed ``v`` rounds to ``value`` at its decimals, as written or as
  points (the documented conversion: a fraction v is quoted as 100·v points, so 0.0688 is
  "+6.88"). An unsigned number may quote either sign ("1.50 above", "by 0.094"); a signed
  one must have the sign of the value it quotes."""
  tolerance = 0.5 * 10 ** -decimals + 1e-9
  for shown in (v, 100 * v):
    if signed and value != 0 and (shown > 0) != (value > 0):
      continue
    if abs(abs(shown) - abs(value)) <= tolerance:
      return True
  return False


def _study_lines(text: str) -> str:
  """The README's study summary and the measured column of its optimizer table."""
  section = text[text.index("## What the studies found"):text.index("## More")]
  table = [line.split("|")[3] for line in text.splitlines()
           if line.startswith("| `dp_") and line.count("|") >= 4]
  return section + "\n" + "\n".join(table)


def unsupported_numbers(text: str, committed: list[list[float]]) -> list[str]:
  """The measured numbers of ``text`` no committed row holds. "X ± Y" must be one row's
  (a mean and its standard error side by side); a lone number, any row's."""
  bad = []
  quoted = quoted_numbers(text)
  pairs = {m.start(1): m for m in re.finditer(r"([+−-]?\d+\.\d+) ± (\d+\.\d+)", text)}
  spans = [m.start(1) for m in NUMBER.finditer(text)
           if "." in m.group(2) or m.group(1)]
  paired_se = {m.start(2) for m in pairs.values()}
  for start, (written, value, decimals) in zip(spans, quoted):
    if start in paired_se:
      continue  # checked with its mean
    signed = written[0] in "+−-"
    se = None
    if start in pairs:
      se_text = pairs[start].group(2)
      se = (float(se_text), len(se_text.partition(".")[2]))
    if not any(any(_matches(value, decimals, signed, v) for v in row)
               and (se is None or any(_matches(se[0], se[1], False, v) for v in row))
               for row in committed):
      bad.append(written if se is None else f"{written} ± {se_text}")
  return bad


def test_every_number_the_readmes_study_lines_quote_is_in_a_committed_csv():
  committed = _committed_numbers()
  lines = _study_lines(README.read_text())
  assert len(quoted_numbers(lines)) > 60
  assert unsupported_numbers(lines, committed) == []
  # The check can fail: a gap the CSVs do not hold, or one with the wrong sign.
  assert unsupported_numbers("+6.93 ± 0.19 points", committed) == ["+6.93 ± 0.19"]
  assert unsupported_numbers("+6.88 ± 0.21 points", committed) == ["+6.88 ± 0.21"]
  assert unsupported_numbers("−6.88 points", committed) == ["−6.88"]


def test_the_readme_stays_under_250_lines():
  assert len(README.read_text().splitlines()) <= 250
