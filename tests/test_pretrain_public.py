"""Public pretraining on DART (without its E2E part), saved as Hugging Face GPT-2, then
private fine-tuning from that directory as from the real ``gpt2`` weights."""

import builtins
import gzip
import json
import os
import re

import jax
import numpy as np
import pytest
from text_folder import TEXT_DIR, needs_text_data

from dpmuon_jax.text.data import TextPair, dart_source, load_e2e
from dpmuon_jax.text.hf_weights import WEIGHTS_FILE, load_hf_gpt2, save_hf_gpt2
from dpmuon_jax.text.train import LMTrainConfig, train_lm
from experiments import pretrain_public as pp

TINY = dict(dim=16, layers=1, heads=2, steps=2, batch_size=4, log_every=1, eval_every=1,
            eval_batch_size=8, seed=5)


def _write_dart(path, rows, compress):
  text = "".join(json.dumps(r) + "\n" for r in rows)
  opener = gzip.open if compress else open
  with opener(path, "wt", encoding="utf-8") as f:
    f.write(text)


def _record_opened(monkeypatch) -> list[str]:
  opened = []
  for module, name in ((builtins, "open"), (gzip, "open")):
    real = getattr(module, name)

    def spy(file, *args, _real=real, **kwargs):
      opened.append(os.path.abspath(os.fspath(file)))
      return _real(file, *args, **kwargs)

    monkeypatch.setattr(module, name, spy)
  return opened


def test_public_dart_pairs_drop_e2e_references_and_read_only_dart(tmp_path, monkeypatch):
  (tmp_path / "dart").mkdir()
  (tmp_path / "e2e").mkdir()
  (tmp_path / "e2e" / "src1_train.txt").write_text("name : The Eagle||The Eagle is here. \n")
  triples = [["Alan_Bean", "OCCUPATION", "Test pilot"]]
  _write_dart(tmp_path / "dart" / "dev.jsonl", [
      {"tripleset": triples, "references": ["Alan Bean was a test pilot.", None],
       "sources": ["webnlg", "webnlg"]},
      {"tripleset": [["The Eagle", "eatType", "pub"]],
       "references": ["The Eagle is a pub.", "A pub: The Eagle."], "sources": ["e2e", "e2e"]},
  ], compress=False)
  _write_dart(tmp_path / "dart" / "test.jsonl.gz", [
      {"tripleset": [["X", "p", "Y"]], "references": ["Keep me.", "Drop me."],
       "sources": ["WikiSQL_lily", "e2e"]},
  ], compress=True)
  opened = _record_opened(monkeypatch)
  pairs, paths = pp.public_dart_pairs(str(tmp_path))
  assert pairs == [TextPair(dart_source(triples), "Alan Bean was a test pilot."),
                   TextPair("X : p : Y", "Keep me.")]
  assert dart_source(triples) == "Alan_Bean : occupation : Test pilot"
  dart = os.path.abspath(tmp_path / "dart")
  assert opened and all(p.startswith(dart + os.sep) for p in opened)
  assert sorted(map(os.path.abspath, paths)) == sorted(set(opened))


@needs_text_data
def test_real_public_dart_pairs_share_no_text_with_e2e():
  pairs, _ = pp.public_dart_pairs(TEXT_DIR)
  assert len(pairs) == 10_551  # of 19,532 DART dev + test references; 8,980 come from E2E
  norm = lambda text: " ".join(re.findall(r"\w+", text.lower()))
  e2e = {norm(p.target) for split in ("train", "valid", "test")
         for p in load_e2e(TEXT_DIR, split).pairs}
  names = {p.source.split("|")[0].split(":")[1].strip() for p in load_e2e(TEXT_DIR, "test").pairs}
  assert not e2e & {norm(p.target) for p in pairs}
  assert not [p for p in pairs if any(name in p.source for name in names)]


class _WordTokenizer:
  """One id per whitespace-separated word; ``<|endoftext|>`` is 0."""

  eos_id = 0

  def encode_batch(self, texts):
    return [[len(w) for w in t.split()] for t in texts]


def test_all_token_mask_covers_every_real_token_and_no_padding():
  pairs = [TextPair("a b", "c d e"), TextPair("a b c d e f g", "h i")]
  arrays = pp.all_token_arrays(_WordTokenizer(), pairs, max_length=10)
  # Row 0: a b <eos> c d e <eos> + 3 pads → positions 1..6 predicted; row 1 is cut at 10.
  np.testing.assert_array_equal(arrays["loss_mask"], [[0, 1, 1, 1, 1, 1, 1, 0, 0, 0],
                                                      [0, 1, 1, 1, 1, 1, 1, 1, 1, 1]])
  short = pp.trim(arrays, np.array([0]), multiple=4)  # 7 real tokens → width 8
  np.testing.assert_array_equal(short["tokens"], arrays["tokens"][:1, :8])
  np.testing.assert_array_equal(short["loss_mask"], arrays["loss_mask"][:1, :8])
  assert pp.trim(arrays, np.array([1, 0]), multiple=4)["tokens"].shape == (2, 10)  # capped


def test_batch_indices_cover_each_epoch_once_and_are_seeded():
  lengths = np.arange(40) % 7
  it = pp.batch_indices(lengths, 4, seed=1, pool=2)
  epoch = np.concatenate([next(it) for _ in range(10)])
  assert sorted(epoch) == list(range(40))
  again = pp.batch_indices(lengths, 4, seed=1, pool=2)
  np.testing.assert_array_equal(np.concatenate([next(again) for _ in range(10)]), epoch)
  with pytest.raises(ValueError, match="fewer than one batch"):
    next(pp.batch_indices(lengths[:3], 4, seed=1))


@needs_text_data
def test_tiny_pretraining_round_trips_and_fine_tunes_privately(tmp_path, monkeypatch):
  public = tmp_path / "public"  # dart/ and gpt2/ only: E2E cannot be read
  public.mkdir()
  for name in ("dart", "gpt2"):
    os.symlink(os.path.abspath(os.path.join(TEXT_DIR, name)), public / name)
  config = pp.PretrainConfig(data_dir=str(public), out=str(tmp_path / "w"), vocab_size=None,
                            **TINY)
  opened = _record_opened(monkeypatch)
  tokenizer, train, heldout, counts = pp.public_data(config)
  monkeypatch.undo()
  inside = {os.path.relpath(p, public) for p in opened if p.startswith(str(public) + os.sep)}
  assert {"dart/dev.jsonl.gz", "dart/test.jsonl.gz"} <= inside  # tiktoken's cache is outside
  assert all(p.split(os.sep)[0] in ("dart", "gpt2") for p in inside), inside
  assert counts["pairs"] == counts["train_pairs"] + counts["heldout_pairs"]
  heldout = {k: v[:8] for k, v in heldout.items()}
  apply, params, gpt2_config, history = pp.pretrain(config, tokenizer, train, heldout)
  assert [r["step"] for r in history] == [1, 2] and np.isfinite(history[-1]["heldout_dart_nll"])
  save_hf_gpt2(params, gpt2_config, config.out)
  loaded, loaded_config = load_hf_gpt2(config.out)
  assert loaded_config == gpt2_config and gpt2_config.vocab_size == 50257
  jax.tree.map(np.testing.assert_array_equal, params, loaded)
  tokens = train["tokens"][:2, :32]
  np.testing.assert_array_equal(apply(params, tokens), apply(loaded, tokens))
  results = train_lm(LMTrainConfig(
      data_dir=TEXT_DIR, init_weights=config.out, output_dir=str(tmp_path / "ft"),
      train_split="train", train_subset=64, sampling_rate=0.125, steps=1, denominator=8.0,
      microbatch_size=8, seed=3, eval_pairs=16, eval_batch_size=16, generate_splits=()))
  assert results["pretrained"] and results["releases"] == 1
  assert results["model"] == gpt2_config._asdict() and np.isfinite(results["valid_nll"])


@needs_text_data
def test_public_e2e_slice_joins_dart_and_only_public_restaurants(tmp_path, monkeypatch):
  config = pp.PretrainConfig(data_dir=TEXT_DIR, vocab_size=512, e2e_public_slice=5, **TINY)
  opened = _record_opened(monkeypatch)
  _, train, heldout, counts = pp.public_data(config)
  monkeypatch.undo()
  e2e_files = {os.path.basename(p) for p in opened if os.sep + "e2e" + os.sep in p}
  assert e2e_files == {"src1_train.txt.gz"}  # never validation or test
  assert counts["e2e_public_names"] == sorted(PUBLIC_NAMES) and counts["dart_pairs"] == 10_551
  assert counts["e2e_public_pairs"] == 10_486 and counts["e2e_public_rule"].endswith("% 5 == 0")
  assert counts["pairs"] == 10_551 + 10_486 == len(train["tokens"]) + len(heldout["tokens"])
  pairs, names = pp.public_e2e_pairs(TEXT_DIR, 5)
  assert {p.source.split("|")[0].split(":")[1].strip() for p in pairs} == set(names)


PUBLIC_NAMES = {"The Rice Boat", "The Golden Curry", "Browns Cambridge", "Wildwood", "Cocum",
                "Midsummer House", "Bibimbap House"}


@needs_text_data
@pytest.mark.parametrize("public_slice", [None, 5])
def test_cli_writes_weights_results_and_curve(tmp_path, public_slice):
  out = tmp_path / "w"
  args = ["--data-dir", TEXT_DIR, "--out", str(out), "--dim", "16", "--layers", "1",
          "--heads", "2", "--steps", "2", "--batch-size", "4", "--log-every", "1",
          "--vocab-size", "512", "--e2e-eval-pairs", "8"]
  if public_slice:
    args += ["--e2e-public-slice", str(public_slice)]
  assert pp.main(args) == 0
  with open(out / "results.json") as f:
    results = json.load(f)
  assert results["sha256"][WEIGHTS_FILE] == pp.sha256_file(str(out / WEIGHTS_FILE))
  assert results["roundtrip_bit_exact"] and results["model"]["vocab_size"] == 512
  assert results["data"]["excluded_origins"] == ["e2e"]
  assert np.isfinite(results["e2e_valid_zero_shot_nll"]) and results["e2e_eval_pairs"] == 8
  assert results["config"]["e2e_public_slice"] == public_slice
  assert ("e2e_public_pairs" in results["data"]) == bool(public_slice)
  assert (out / "history.csv").read_text().splitlines()[0].startswith("step,")
  if not public_slice:
    return
  # The fixed seed rebuilds the same weights, bit for bit (the E2E sweep's checkpoint guard
  # relies on it; its start is a public-slice build, so the rebuild is checked there).
  assert pp.main([*args[:2], "--out", str(tmp_path / "again"), *args[4:]]) == 0
  assert pp.sha256_file(str(tmp_path / "again" / WEIGHTS_FILE)) == results["sha256"][WEIGHTS_FILE]
