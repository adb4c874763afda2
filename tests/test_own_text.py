"""Your own text files: records read, checked line by line, encoded, cached beside the file."""

import json
import os
import pathlib
import re
import shlex

import numpy as np
import pytest
from text_folder import TEXT_DIR, needs_text_data

from dpmuon_jax.text.records import (
    CACHE_SUFFIX,
    RecordsError,
    count_records,
    iter_records,
    load_records,
)
from dpmuon_jax.text.tokenizer import GPT2Tokenizer


def _write(path, text: str | bytes) -> str:
  mode = "wb" if isinstance(text, bytes) else "w"
  with open(path, mode) as f:
    f.write(text)
  return str(path)


def _jsonl(path, rows) -> str:
  return _write(path, "".join(json.dumps(r) + "\n" for r in rows))


def test_each_format_gives_its_records(tmp_path):
  jsonl = _jsonl(tmp_path / "a.jsonl", [{"prompt": "p1", "completion": "c1", "author": "x"},
                                         {"text": "t2", "author": "y"}])
  got = [r for _, r in iter_records(jsonl, user_field="author")]
  assert [(r.prompt, r.completion, r.user) for r in got] == [("p1", "c1", "x"),
                                                             (None, "t2", "y")]
  csv_path = _write(tmp_path / "a.csv", 'prompt,completion,author\n"a, b",c,u1\nd,e,u2\n')
  got = [r for _, r in iter_records(csv_path, user_field="author")]
  assert [(r.prompt, r.completion, r.user) for r in got] == [("a, b", "c", "u1"),
                                                             ("d", "e", "u2")]
  plain = _write(tmp_path / "a.txt", "one\ntwo\n\nthree\nfour\n")
  assert [r.completion for _, r in iter_records(plain)] == ["one", "two", "three", "four"]
  assert [(n, r.completion) for n, r in iter_records(plain, "paragraph")] == [
      (1, "one\ntwo"), (4, "three\nfour")]


@pytest.mark.parametrize("name, content, user_field, message", [
    ("empty.jsonl", "", None, r"empty.jsonl: holds no records"),
    ("blank.txt", "\n  \n", None, r"blank.txt: holds no records"),
    ("bad.jsonl", '{"text": "ok"}\n{"text": "no end"\n', None, r"bad.jsonl:2: not valid JSON"),
    ("list.jsonl", '[1, 2]\n', None, r"list.jsonl:1: a JSON object is needed"),
    ("fields.jsonl", '{"text": "a"}\n\n{"prompt": "only"}\n', None,
     r"fields.jsonl:3: a record needs \"text\", or \"prompt\" and \"completion\""),
    ("number.jsonl", '{"text": 5}\n', None, r"number.jsonl:1: 'text' must be a string"),
    ("nouser.jsonl", '{"text": "a", "author": "x"}\n{"text": "b"}\n', "author",
     r"nouser.jsonl:2: no user"),
    ("emptyuser.csv", "text,author\na,x\nb,\n", "author", r"emptyuser.csv:3: no user"),
    ("columns.csv", "text,author\na,x,extra\n", "author", r"columns.csv:2: 3 values"),
    ("plain.txt", "a\n", "author", r"plain.txt: plain text has no field for the user"),
    ("binary.jsonl", b'{"text": "a"}\n\x00\x01\x02\n', None, r"binary.jsonl:2: a NUL byte"),
    ("latin1.txt", b"ok\ncaf\xe9\n", None, r"latin1.txt:2: not UTF-8"),
])
def test_a_bad_file_is_refused_in_one_line_naming_the_file_and_line(
    tmp_path, name, content, user_field, message):
  path = _write(tmp_path / name, content)
  with pytest.raises(RecordsError, match=message) as error:
    count_records(path, user_field=user_field)
  assert "\n" not in str(error.value)


def test_an_unreadable_file_is_refused(tmp_path):
  with pytest.raises(RecordsError, match="cannot be read"):
    load_records(str(tmp_path / "missing.jsonl"), None, 8)  # type: ignore[arg-type]


@needs_text_data
def test_records_are_encoded_truncated_with_a_count_and_cached_memory_mapped(tmp_path):
  tokenizer = GPT2Tokenizer(os.path.join(TEXT_DIR, "gpt2"))
  path = _jsonl(tmp_path / "mine.jsonl", [
      {"prompt": "Hello", "completion": " world", "author": "a"},
      {"text": "A long text " * 20, "author": "b"}])
  first = load_records(path, tokenizer, 16, user_field="author")
  assert first.num_records == 2 and first.truncated == 1
  tokens, mask = np.asarray(first.arrays["tokens"]), np.asarray(first.arrays["loss_mask"])
  prompt = tokenizer.encode(" Hello ") + [tokenizer.eos_id]
  completion = tokenizer.encode("  world ") + [tokenizer.eos_id]
  ids = prompt + completion
  assert tokens[0, :len(ids)].tolist() == ids
  assert mask[0].tolist() == [0.0] * len(prompt) + [1.0] * len(completion) + [0.0] * (
      16 - len(ids))  # the loss is on the completion only
  assert tokens[1, 0] == tokenizer.eos_id and mask[1, 0] == 0 and mask[1, 1:].all()
  assert list(first.users) == ["a", "b"]
  assert isinstance(first.arrays["tokens"], np.memmap)
  assert os.path.isdir(path + CACHE_SUFFIX)
  again = load_records(path, tokenizer, 16, user_field="author")  # from the cache
  np.testing.assert_array_equal(again.arrays["tokens"], tokens)
  assert again.sha256 == first.sha256 and again.truncated == 1
  _jsonl(path, [{"text": "changed", "author": "a"}])  # another file: not the old cache
  assert load_records(path, tokenizer, 16, user_field="author").num_records == 1


def _readme_own_text_commands() -> list[str]:
  readme = pathlib.Path(__file__).resolve().parents[1] / "README.md"
  blocks = re.findall(r"```bash\n(.*?)```", readme.read_text(), re.S)
  (block,) = [b for b in blocks if "--train-file" in b]
  commands = block.replace("\\\n", " ").splitlines()
  return [c for c in commands if c.startswith("dpmuon train-lm")]


@needs_text_data
def test_the_readmes_own_text_commands_fine_tune_and_certify_per_record_and_per_user(tmp_path):
  """Both README commands, on a tiny JSONL of E2E pairs with an author per record and a tiny
  local GPT-2 instead of the hub's (no network here): the fine-tune (at ε = 1000, so that 8
  releases of 86 records are not drowned in noise) lowers the validation NLL of the weights it
  starts from, and the user-level run (at the README's ε = 8) certifies (ε, δ) per user."""
  from dpmuon_jax.cli import main
  from dpmuon_jax.text.data import load_text_dataset
  from dpmuon_jax.text.hf_weights import save_hf_gpt2
  from dpmuon_jax.text.train import LMTrainConfig, load_model
  from dpmuon_jax.training.export import load_exported
  from experiments.text_sweep import TINY_MODEL

  pairs = load_text_dataset("e2e", TEXT_DIR, "train").pairs[:96]
  notes = _jsonl(tmp_path / "notes.jsonl", [
      {"prompt": p.source, "completion": p.target, "author": f"a{i % 24}"}
      for i, p in enumerate(pairs)])
  weights = str(tmp_path / "tiny-gpt2")
  config = LMTrainConfig(data_dir=TEXT_DIR, model="gpt2_tiny", model_overrides=TINY_MODEL,
                         vocab_size=512)
  _, params, gpt2_config, _ = load_model(config, 512)
  save_hf_gpt2(params, gpt2_config, weights)
  commands = _readme_own_text_commands()
  assert len(commands) == 2 and "--privacy-unit user --user-field author" in commands[1]
  for command, name in zip(commands, ("notes", "users")):
    argv = shlex.split(command)[1:]
    argv = [notes if a == "notes.jsonl" else a for a in argv]
    argv[argv.index("--init-weights") + 1] = weights
    argv[argv.index("--steps") + 1] = "8"
    argv[argv.index("--sampling-rate") + 1] = "0.5"
    argv[argv.index("--output-dir") + 1] = str(tmp_path / name)
    if name == "notes":  # 8 releases over 86 records move the NLL only with little noise
      argv[argv.index("--epsilon") + 1] = "1000"
    argv += ["--tokenizer-dir", os.path.join(TEXT_DIR, "gpt2"), "--vocab-size", "512",
             "--max-length", "64", "--microbatch-size", "8", "--learning-rate", "0.02",
             "--fallback-learning-rate", "0.02", "--seed", "0", "--max-examples-per-user", "4"]
    assert main(argv) == 0
  per_record = json.loads((tmp_path / "notes" / "results.json").read_text())
  per_user = load_exported(str(tmp_path / "users" / "export")).certificate
  assert per_user["privacy_unit"] == "user" and "per user" in per_user["guarantee"]
  assert "add/remove-one-user" in per_user["guarantee"]
  users = json.loads((tmp_path / "users" / "results.json").read_text())
  assert users["privacy_unit"] == "user" and users["epsilon_spent"] <= 8.0
  assert per_record["privacy_unit"] == "example" and per_record["epsilon_spent"] <= 1000
  # The validation NLL of the starting weights on the same held-out records, for comparison.
  from dpmuon_jax.text.metrics import mean_token_nll
  from dpmuon_jax.text.train import _load_lm_data
  start = LMTrainConfig(train_file=notes, tokenizer_dir=os.path.join(TEXT_DIR, "gpt2"),
                        vocab_size=512, max_length=64, init_weights=weights)
  apply, start_params, _, _ = load_model(start, 512)
  before = mean_token_nll(apply, start_params, _load_lm_data(start).valid_arrays, 64)
  assert per_record["valid_nll"] < before - 0.05, (per_record["valid_nll"], before)


def test_weights_and_tokenizer_by_name_offline_say_what_to_give_instead(tmp_path, monkeypatch):
  """No network here: the hub's and tiktoken's failures become one error naming the files."""
  import sys
  import types

  from dpmuon_jax.text import hf_weights
  from dpmuon_jax.text.tokenizer import GPT2Tokenizer

  def offline(*args, **kwargs):
    raise OSError("no network")

  monkeypatch.setitem(sys.modules, "huggingface_hub",
                      types.SimpleNamespace(snapshot_download=offline))
  with pytest.raises(FileNotFoundError, match="model.safetensors and config.json"):
    hf_weights.resolve_weights("gpt2")
  assert hf_weights.resolve_weights(str(tmp_path)) == str(tmp_path)  # a folder: as it is
  assert hf_weights.resolve_weights("not-a-model") == "not-a-model"  # load_hf_gpt2 says why
  monkeypatch.setitem(sys.modules, "tiktoken", types.SimpleNamespace(get_encoding=offline))
  with pytest.raises(FileNotFoundError, match="--tokenizer-dir DIR with DIR/vocab.json"):
    GPT2Tokenizer.from_tiktoken()
  with pytest.raises(ValueError, match="truncated vocabulary"):
    GPT2Tokenizer.from_tiktoken(512)


@needs_text_data
def test_train_lm_refuses_a_bad_file_in_one_line_naming_file_and_line(tmp_path, capsys):
  from dpmuon_jax.cli import main

  bad = _write(tmp_path / "bad.jsonl", '{"text": "fine"}\n{"text": "no user"}\n')
  code = main(["train-lm", "--train-file", bad, "--tokenizer-dir",
               os.path.join(TEXT_DIR, "gpt2"), "--privacy-unit", "user", "--user-field",
               "author", "--output-dir", str(tmp_path / "run")])
  err = capsys.readouterr().err.strip()
  assert code == 2 and err.count("\n") == 0
  assert f"{bad}:1: no user" in err
  assert not (tmp_path / "run").exists() or not os.listdir(tmp_path / "run")
