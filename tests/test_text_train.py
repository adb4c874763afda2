"""Private GPT-2 training runs and paper 2's experiment configs."""

import csv
import dataclasses
import json
import os

import jax.numpy as jnp
import numpy as np
import pytest

from dpmuon_jax.privacy.accounting import compute_epsilon
from dpmuon_jax.text.tokenizer import GPT2Tokenizer
from dpmuon_jax.text.train import LMTrainConfig, lm_optimizer, train_lm
from dpmuon_jax.transforms.history import ordered_history, param_history
from experiments import text_sweep
from experiments.text_configs import TEXT_EXPERIMENTS, im_preset

TEXT_DIR = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "text")
needs_text_data = pytest.mark.skipif(
    not os.path.isdir(os.path.join(TEXT_DIR, "gpt2")), reason="shared/data/text is not present"
)


@needs_text_data
@pytest.mark.parametrize("vocab_size", [300, 4096])
def test_truncated_vocabulary_is_lossless_and_in_range(vocab_size):
  full = GPT2Tokenizer(os.path.join(TEXT_DIR, "gpt2"))
  cut = GPT2Tokenizer(os.path.join(TEXT_DIR, "gpt2"), vocab_size)
  assert cut.vocab_size == vocab_size and cut.eos_id == vocab_size - 1
  texts = ["name : The Eagle | Type : coffee shop | food : French", "Fitzbillies, £20–25 ünïcode"]
  for text in texts:
    ids = cut.encode(text)
    assert max(ids) < vocab_size - 1  # never the end-of-text id
    assert cut.decode(ids) == text
    assert len(ids) >= len(full.encode(text))
  # Tokens GPT-2 ranks below the cut are encoded exactly as GPT-2 does.
  common = " the"
  assert cut.encode(common) == full.encode(common)


@needs_text_data
def test_vocabulary_size_is_validated():
  for bad in (256, 50258, True):
    with pytest.raises(ValueError, match="vocab_size"):
      GPT2Tokenizer(os.path.join(TEXT_DIR, "gpt2"), bad)
  assert GPT2Tokenizer(os.path.join(TEXT_DIR, "gpt2"), 50257).encode("Hello world") == [15496, 995]


def test_ordered_history_is_most_recent_first_across_the_ring():
  history = param_history(3)
  params = {"w": jnp.zeros(2)}
  state = history.init(params)
  for t in range(1, 6):  # stores θ_1 … θ_5 (θ_t = t)
    _, state = history.update({"w": jnp.zeros(2)}, state, {"w": jnp.full(2, float(t))})
  got = [float(p["w"][0]) for p in ordered_history((state,))]
  assert got == [5.0, 4.0, 3.0]


def _tiny_config(tmp_path, **kw) -> LMTrainConfig:
  base = dict(
      data_dir=TEXT_DIR, output_dir=str(tmp_path / "run"), model="gpt2_tiny",
      model_overrides=text_sweep.TINY_MODEL, vocab_size=512, train_split="valid",
      train_subset=64, sampling_rate=0.125, steps=3, denominator=8.0, epsilon=8.0,
      microbatch_size=8, seed=3, eval_pairs=16, eval_every=1, generate_splits=("test",),
      generate_groups=2, max_new_tokens=4, optimizer="dp_muon_im",
      optimizer_kwargs={"history": 1, "decay": 0.5}, learning_rate=0.02,
      fallback_learning_rate=0.003,
  )
  return LMTrainConfig(**{**base, **kw})


@needs_text_data
def test_train_lm_accounts_every_release_and_writes_its_results(tmp_path):
  config = _tiny_config(tmp_path)
  results = train_lm(config)
  assert results["releases"] == 3 and not results["pretrained"]
  assert results["train_pairs"] == 64 and results["denominator"] == 8.0
  # The ledger's ε is the accountant's for (q, σ, T) and within the target.
  expected = compute_epsilon(results["noise_multiplier"], 0.125, 3, config.delta)
  assert results["epsilon_spent"] == pytest.approx(expected, rel=1e-6)
  assert results["epsilon_spent"] <= config.epsilon
  with open(os.path.join(config.output_dir, "history.csv")) as f:
    history = list(csv.DictReader(f))
  assert [int(r["step"]) for r in history] == [1, 2, 3]
  assert np.isfinite(results["valid_nll"]) and results["valid_nll"] > 0
  assert results["scores"]["test"]["groups"] == 2
  assert np.isfinite(results["scores"]["test"]["bleu"])
  with open(os.path.join(config.output_dir, "results.json")) as f:
    assert json.load(f)["releases"] == 3


@needs_text_data
def test_ghost_clipping_gives_the_same_inner_momentum_run(tmp_path):
  """DP-Muon-IM with clipped_sum_method='ghost' (a tapped GPT-2, the query over θ_t and
  θ_{t−1} ghost-clipped with its cross terms) matches the vmap run's validation NLL."""
  nll = {}
  for method in ("vmap", "ghost"):
    config = _tiny_config(tmp_path / method, clipped_sum_method=method, generate_splits=())
    nll[method] = train_lm(config)["valid_nll"]
  assert nll["ghost"] == pytest.approx(nll["vmap"], rel=1e-4)


def test_bad_settings_are_refused(tmp_path):
  with pytest.raises(ValueError, match="dp_muon_im"):
    train_lm(_tiny_config(tmp_path, optimizer="dp_muon", diagnostic_steps=(1,)))
  with pytest.raises(ValueError, match="multiple of microbatch_size"):
    train_lm(_tiny_config(tmp_path, capacity=20))
  with pytest.raises(ValueError, match="clipped_sum_method"):
    train_lm(_tiny_config(tmp_path, clipped_sum_method="fast"))
  with pytest.raises(ValueError, match="Unknown optimizer"):
    lm_optimizer(_tiny_config(tmp_path, optimizer="dp_sgd"),
                 {"l2_clip_norm": 1.0, "noise_multiplier": 1.0, "denominator": 8.0, "key": 0})


def test_paper2_settings_in_the_full_scale_configs():
  for exp in TEXT_EXPERIMENTS.values():
    if exp.scale == "cpu":
      assert exp.scaling and not exp.pretrained
      continue
    assert exp.pretrained and exp.model == "gpt2" and exp.vocab_size is None
    assert exp.seeds[0] == 37 and exp.clip == 1.0
    assert (exp.learning_rate, exp.fallback_learning_rate) == (0.002, 0.0035)
    e2e = exp.dataset == "e2e"
    assert exp.sampling_rate == pytest.approx(1 / 41 if e2e else 1 / 61)
    assert (exp.steps, exp.denominator) == ((410, 1025.0) if e2e else (610, 1027.0))
  assert im_preset("e2e", 8.0) == {"history": 4, "decay": 0.5, "fallback_history": 2,
                                   "fallback_decay": 0.5}
  assert im_preset("e2e", 2.0)["fallback_history"] == 3
  assert im_preset("dart", 1.0)["decay"] == 0.7


@needs_text_data
@pytest.mark.parametrize("name", sorted(TEXT_EXPERIMENTS))
def test_every_text_config_builds_and_runs_one_release(tmp_path, name):
  exp = TEXT_EXPERIMENTS[name]
  rows = text_sweep.run(exp, str(tmp_path), TEXT_DIR, tiny=True)
  assert [r["variant"] for r in rows] == [exp.variants[0].label]
  assert rows[0]["releases"] == 1 and 0 < rows[0]["epsilon_spent"] <= rows[0]["target_epsilon"]
  with open(tmp_path / "summary.csv") as f:
    assert len(list(csv.DictReader(f))) == 1
  assert (tmp_path / f"{exp.metric}_vs_epsilon.png").exists()
  if exp.diagnostic_steps:
    with open(tmp_path / "diagnostics.json") as f:
      summary = json.load(f)
    assert summary["polar_error"]["count"] > 0


def test_full_scale_configs_refuse_to_run_without_weights(tmp_path):
  exp = TEXT_EXPERIMENTS["paper2_table2_e2e"]
  with pytest.raises(SystemExit, match="--gpt2-dir"):
    text_sweep.run(exp, str(tmp_path), TEXT_DIR)
  assert dataclasses.replace(exp, pretrained=False).pretrained is False
