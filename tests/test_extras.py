"""A missing optional dependency is one error naming the extra that installs it."""

import sys

import pytest

from dpmuon_jax import cli
from dpmuon_jax.data.embedded import load_embedded
from dpmuon_jax.extras import MissingExtraError, requires
from dpmuon_jax.text import metrics
from dpmuon_jax.text.gpt2 import GPT2Config
from dpmuon_jax.text.hf_weights import save_hf_gpt2
from dpmuon_jax.text.tokenizer import GPT2Tokenizer
from dpmuon_jax.training.trainer import JOURNAL_NAME, TrainConfig, train


def _hide(monkeypatch, package: str) -> None:
  """Importing ``package`` or a module of it now fails as if it were not installed."""
  for name in [m for m in sys.modules if m.split(".")[0] == package] + [package]:
    monkeypatch.setitem(sys.modules, name, None)


@pytest.mark.parametrize(
    "call, module, extra",
    [
        (lambda tmp: GPT2Tokenizer(tmp), "tiktoken", "text"),
        (lambda tmp: metrics.bleu(["a"], [["a"]]), "sacrebleu", "text"),
        (lambda tmp: metrics.dart_rouge_l(["a"], [["a"]]), "rouge_score", "text"),
        (lambda tmp: save_hf_gpt2({}, GPT2Config(), tmp), "safetensors", "text"),
        (lambda tmp: load_embedded(), "sklearn", "train"),
    ],
    ids=["tokenizer", "bleu", "dart_rouge_l", "hf_weights", "digits"],
)
def test_a_missing_optional_module_names_its_extra(call, module, extra, monkeypatch, tmp_path):
  _hide(monkeypatch, module)
  needs = rf"needs {module}: pip install 'dpmuon-jax\[{extra}\]'\.$"
  with pytest.raises(MissingExtraError, match=needs):
    call(tmp_path)


@pytest.mark.parametrize(
    "option, module",
    [("plot", "matplotlib"), ("progress", "tqdm"), ("log_dir", "tensorboardX")],
)
def test_a_run_missing_an_extra_stops_before_its_first_release(option, module, monkeypatch,
                                                               tmp_path, tiny_data):
  _hide(monkeypatch, module)
  options = {"plot": False, "progress": False, "log_dir": None}
  options[option] = str(tmp_path / "tb") if option == "log_dir" else True
  config = TrainConfig(model="mlp", dataset="tiny", optimizer="dp_sgd", epsilon=3.0, delta=1e-3,
                       batch_size=16, epochs=1, seed=3, output_dir=str(tmp_path / "run"),
                       learning_rate=0.1, **options)
  with pytest.raises(MissingExtraError, match=rf"needs {module}: pip install"):
    train(config, tiny_data)
  journal = tmp_path / "run" / JOURNAL_NAME  # its first entry precedes the first release
  assert not journal.exists() or not journal.read_text().strip()


def test_requires_passes_other_errors_and_an_inner_missing_extra_through():
  with pytest.raises(KeyError), requires("text", "x"):
    raise KeyError("not an import problem")
  inner = MissingExtraError("inner message")
  with pytest.raises(MissingExtraError) as raised, requires("train", "outer"):
    raise inner
  assert raised.value is inner
  assert issubclass(MissingExtraError, ImportError)  # `except ImportError` still catches it


def test_the_cli_reports_a_missing_extra_in_one_line(monkeypatch, tmp_path, capsys):
  _hide(monkeypatch, "sklearn")
  status = cli.main(["train", "--epochs", "1", "--seed", "0", "--output-dir", str(tmp_path / "r")])
  err = capsys.readouterr().err.strip()
  assert status == 2
  assert err == ("dpmuon train: error: The embedded 'digits' dataset needs sklearn: "
                 "pip install 'dpmuon-jax[train]'.")
