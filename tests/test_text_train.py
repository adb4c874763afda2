"""Private GPT-2 training runs and paper 2's experiment configs."""

import csv
import dataclasses
import json
import os
import shutil

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from text_folder import TEXT_DIR, needs_text_data

from benchmarks._peak_memory import ReleaseMemory, peak_rss_gib
from dpmuon_jax.analysis.polar_metrics import InnerMomentumProbe
from dpmuon_jax.privacy.accounting import compute_epsilon
from dpmuon_jax.text.data import encode_pairs, load_text_dataset
from dpmuon_jax.text.hf_weights import save_hf_gpt2
from dpmuon_jax.text.metrics import mean_token_nll
from dpmuon_jax.text.tokenizer import GPT2Tokenizer
from dpmuon_jax.text.train import LMTrainConfig, lm_optimizer, load_model, train_lm
from dpmuon_jax.training.checkpoint import latest_good_step
from dpmuon_jax.training.export import load_exported
from dpmuon_jax.training.journal import JOURNAL_NAME, read_journal
from dpmuon_jax.training.records import write_csv
from dpmuon_jax.transforms.history import ordered_history, param_history
from experiments import text_sweep
from experiments.pretrain_public import sha256_file
from experiments.text_configs import TEXT_EXPERIMENTS, TextExperiment, Variant, im_preset
from tests.run_files import public_files


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
      model_overrides=text_sweep.TINY_MODEL, vocab_size=512, train_split="train",
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
  memory, calls = ReleaseMemory(config.steps), []
  results = train_lm(config, callbacks=[memory, calls.append])
  assert results["releases"] == 3 and not results["pretrained"]
  assert calls == [1, 2, 3]  # each callback, once after each release
  assert results["train_pairs"] == 64 and results["denominator"] == 8.0
  # The ledger's ε is the accountant's for (q, σ, T) and within the target.
  expected = compute_epsilon(results["noise_multiplier"], 0.125, 3, config.delta)
  assert results["epsilon_spent"] == pytest.approx(expected, rel=1e-6)
  assert results["epsilon_spent"] <= config.epsilon
  with open(os.path.join(config.output_dir, "history.csv")) as f:
    history = list(csv.DictReader(f))
  assert [int(r["step"]) for r in history] == [1, 2, 3]
  cpu = [float(r["cpu_seconds"]) for r in history]
  assert 0 < cpu[0] < cpu[1] < cpu[2] <= results["train_cpu_seconds"]
  # The steady-state peak (releases 2..T, after the reset) is within the run's own peak.
  assert 0 < memory.summary()["steady_peak_rss_gib"] <= memory.summary()["peak_rss_gib"]
  assert np.isfinite(results["valid_nll"]) and results["valid_nll"] > 0
  assert results["scores"]["test"]["groups"] == 2
  assert np.isfinite(results["scores"]["test"]["bleu"])
  with open(os.path.join(config.output_dir, "results.json")) as f:
    assert json.load(f)["releases"] == 3
  # The one trainer's files: a journal entry before each release, the final checkpoint, export/.
  journal = read_journal(os.path.join(config.output_dir, JOURNAL_NAME))
  assert [(e.step, e.key_index) for e in journal] == [(0, 0), (1, 1), (2, 2)]
  assert latest_good_step(os.path.join(config.output_dir, "checkpoints")) == 3
  certificate = load_exported(os.path.join(config.output_dir, "export")).certificate
  assert certificate["releases"] == 3
  assert certificate["model"]["architecture"] == "gpt2" and not certificate["model"][
      "pretrained_initialisation"]
  assert certificate["model"]["preset"] == "gpt2_tiny"
  assert certificate["model"]["shape"]["dim"] == text_sweep.TINY_MODEL["dim"]


@needs_text_data
def test_a_fine_tuned_export_describes_the_loaded_model_not_the_preset(tmp_path):
  """With ``init_weights``, the certificate gives the checkpoint's shape (``config.model``
  names a preset that was not trained)."""
  checkpoint = str(tmp_path / "checkpoint")
  _, params, gpt2_config, _ = load_model(_tiny_config(tmp_path, model_overrides={
      **text_sweep.TINY_MODEL, "dim": 32}), 512)
  save_hf_gpt2(params, gpt2_config, checkpoint)
  config = _tiny_config(tmp_path, init_weights=checkpoint, model="gpt2_small", steps=1,
                        generate_splits=(), optimizer="dp_muon", optimizer_kwargs={})
  train_lm(config)
  model = load_exported(os.path.join(config.output_dir, "export")).certificate["model"]
  assert model["architecture"] == "gpt2" and model["pretrained_initialisation"]
  assert model["shape"] == json.loads(json.dumps(gpt2_config._asdict()))
  assert "preset" not in model and "overrides" not in model


@needs_text_data
def test_the_probe_leaves_training_bit_identical_and_publishes_no_seed(tmp_path):
  """The NON-PRIVATE inner-momentum probe (left out of the fingerprint) changes no
  parameter, and a seeded run's public files (diagnostics.csv included) hold no seed: it
  is the run's root key."""
  seed = 908172635
  probed = _tiny_config(tmp_path / "probed", seed=seed, diagnostic_steps=(1, 2),
                        diagnostic_examples=4, generate_splits=())
  plain = dataclasses.replace(probed, output_dir=str(tmp_path / "plain"), diagnostic_steps=())
  train_lm(probed, InnerMomentumProbe())
  train_lm(plain)
  exported = [load_exported(os.path.join(c.output_dir, "export")).params for c in (probed, plain)]
  chex.assert_trees_all_equal(*exported)
  public = public_files(probed.output_dir)
  assert "diagnostics.csv" in {p.name for p in public}
  for path in public:
    assert str(seed).encode() not in path.read_bytes(), path


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
  # Training on a split the run scores would publish its scores as held-out ones.
  with pytest.raises(ValueError, match="train_split 'valid' is also scored"):
    train_lm(_tiny_config(tmp_path, train_split="valid"))
  with pytest.raises(ValueError, match="train_split 'test' is also scored"):
    train_lm(_tiny_config(tmp_path, train_split="test", generate_splits=("test",)))
  with pytest.raises(ValueError, match="dp_muon_im"):
    train_lm(_tiny_config(tmp_path, optimizer="dp_muon", diagnostic_steps=(1,)))
  with pytest.raises(ValueError, match="multiple of microbatch_size"):
    train_lm(_tiny_config(tmp_path, capacity=20))
  with pytest.raises(ValueError, match="--clipped-sum-method must be one of"):
    train_lm(_tiny_config(tmp_path, clipped_sum_method="fast"))
  with pytest.raises(ValueError, match="Unknown optimizer"):
    lm_optimizer(_tiny_config(tmp_path, optimizer="dp_sgd"),
                 {"l2_clip_norm": 1.0, "noise_multiplier": 1.0, "denominator": 8.0, "key": 0})


def test_paper2_settings_in_the_full_scale_configs():
  for exp in TEXT_EXPERIMENTS.values():
    if exp.scale == "cpu":
      assert exp.scaling
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


# One tiny release per config runs in the fast job only for one config per distinct tiny
# training path (data set, public slice, first run's optimizer and settings, diagnostics):
# the others train the same tiny GPT-2 the same way, so their twin's fast run pins their
# path, and test_every_text_config_builds_every_run (fast) still builds each of their runs.
SLOW_TEXT_CONFIGS = {
    "e2e_cpu_im": "paper2_table1_e2e",
    "e2e_pretrained_cpu": "paper2_table1_e2e",
    "e2e_public_slice_half_rate": "e2e_public_slice",
    "e2e_paper2_regime": "e2e_public_slice",
    "paper2_table2_e2e": "paper2_table1_e2e",
    "paper2_table5_group_ablation": "paper2_k_sweep",
}


def _tiny_training(exp: TextExperiment) -> tuple:
  first = exp.variants[0]
  return (exp.dataset, exp.public_slice, bool(exp.diagnostic_steps), first.optimizer,
          first.optimizer_kwargs(exp.dataset, exp.epsilons[0]), first.releases)


def test_each_slow_text_config_has_a_fast_twin_that_trains_the_same_way():
  for slow, fast in SLOW_TEXT_CONFIGS.items():
    assert fast not in SLOW_TEXT_CONFIGS and fast in TEXT_EXPERIMENTS, slow
    twin, config = TEXT_EXPERIMENTS[fast], TEXT_EXPERIMENTS[slow]
    assert _tiny_training(twin) == _tiny_training(config), slow
    assert set(config.generate_splits) <= set(twin.generate_splits), slow


@needs_text_data
@pytest.mark.parametrize("name", sorted(TEXT_EXPERIMENTS))
def test_every_text_config_builds_every_run(tmp_path, name):
  text_sweep.check_buildable(TEXT_EXPERIMENTS[name], str(tmp_path), TEXT_DIR)


@needs_text_data
@pytest.mark.parametrize("name", [
    pytest.param(name, marks=pytest.mark.slow) if name in SLOW_TEXT_CONFIGS else name
    for name in sorted(TEXT_EXPERIMENTS)])
def test_every_text_config_builds_and_runs_one_release(tmp_path, name):
  exp = TEXT_EXPERIMENTS[name]
  # In this process: the spawned-process path is pinned by the CLI test below, and a fresh
  # interpreter per run would only repeat the imports and the small programs' compilation.
  rows = text_sweep.run(exp, str(tmp_path), TEXT_DIR, tiny=True, own_process=False)
  assert [r["variant"] for r in rows] == [exp.variants[0].label]
  assert rows[0]["releases"] == 1 and 0 < rows[0]["epsilon_spent"] <= rows[0]["target_epsilon"]
  with open(tmp_path / "summary.csv") as f:
    assert len(list(csv.DictReader(f))) == 1
  # The run's secret checkpoints are gone once it is recorded; its export stays.
  assert not list(tmp_path.rglob("checkpoints")) and list(tmp_path.rglob("export"))
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


def test_pretrained_cpu_experiment_keeps_paper2_protocol():
  exp = TEXT_EXPERIMENTS["e2e_pretrained_cpu"]
  assert exp.pretrained and exp.vocab_size == 8192 and exp.scaling
  assert exp.sampling_rate == pytest.approx(1 / 41) and exp.denominator == 1025.0
  assert exp.epsilons == (1.0, 8.0) and exp.seeds == (37, 38, 39) and exp.delta == 1e-5
  assert (exp.learning_rate, exp.fallback_learning_rate) == (0.002, 0.0035)
  assert exp.capacity % exp.microbatch_size == 0
  # The most informative runs first: ε = 8, seed 37, every variant; ε = 1 last.
  runs = list(exp.runs())
  assert [v.label for v, _, _ in runs[:len(exp.variants)]] == [v.label for v in exp.variants]
  assert {(e, s) for _, e, s in runs[:len(exp.variants)]} == {(8.0, 37)}
  # The c_attn row (fused q, k, v for Newton–Schulz) runs at ε = 8 only.
  variants = {v.label: v for v in exp.variants}
  fused = variants["DP-Muon-IM (fused c_attn)"]
  assert fused.kwargs == {"attention_blocks": "fused"} and fused.epsilons == (8.0,)
  assert runs[-1][1] == 1.0 and len(runs) == (len(exp.variants) - 1) * 6 + 3
  assert {e for v, e, _ in runs if v is fused} == {8.0}
  assert variants["DP-Muon-IM"].optimizer_kwargs("e2e", 8.0) == im_preset("e2e", 8.0)
  assert variants["DP-Muon-IM"].optimizer_kwargs("e2e", 1.0) == im_preset("e2e", 1.0)
  kf_im = variants["KF+IM"].optimizer_kwargs("e2e", 8.0)
  assert kf_im == {**im_preset("e2e", 8.0), "kappa": 0.5, "gamma": 0.8}
  assert variants["KF-Muon"].optimizer_kwargs("e2e", 1.0) == {"kappa": 0.5, "gamma": 0.8}
  # Equal compute: IM at K = 1 (two gradients per example) vs DP-Muon with 2T releases.
  config = text_sweep.run_config(exp, variants["DP-Muon (2T releases)"], 8.0, 37, "o", "d",
                                 "w", False)
  assert config.steps == 2 * exp.steps and config.init_weights == "w"
  k1 = variants["DP-Muon-IM (K = 1)"]
  assert text_sweep.gradient_evaluations(k1.optimizer, k1.optimizer_kwargs("e2e", 8.0),
                                         exp.steps) == 2 * exp.steps - 1


def test_gradient_evaluations_count_each_query_exactly():
  count = text_sweep.gradient_evaluations
  assert count("dp_muon", {}, 10) == 10 and count("dp_muon_bc", {}, 10) == 10
  # Inner momentum: min(K, t) + 1 with K the longest history of both groups.
  im = {"history": 4, "decay": 0.5, "fallback_history": 2, "fallback_decay": 0.5}
  assert count("dp_muon_im", im, 3) == 1 + 2 + 3
  assert count("dp_muon_im", im, 10) == 1 + 2 + 3 + 4 + 6 * 5
  assert count("dp_muon_im", {**im, "history": 0, "fallback_history": 3}, 5) == 1 + 2 + 3 + 4 + 4
  assert count("dp_muon_im", {}, 4) == 1 + 3 * 2  # the factory's default K = 1
  # DiSK: two points after the first release (d_0 = 0), one when κ, γ make it one point.
  assert count("dp_disk_muon", {"kappa": 0.5, "gamma": 0.8}, 10) == 1 + 9 * 2
  assert count("dp_disk_muon", {"kappa": 0.5, "gamma": 1.0}, 10) == 10  # c = 1
  assert count("dp_disk_muon_im", {**im, "kappa": 0.5, "gamma": 0.8}, 6) == 1 + 3 + 4 + 5 + 6 + 6


def _fake_experiment(**kw) -> TextExperiment:
  base = dict(name="fake", table="fake", dataset="e2e",
              variants=(Variant("A", "dp_muon"), Variant("B", "dp_muon", releases=2)),
              epsilons=(1.0, 8.0), seeds=(37, 38), steps=3, pretrained=False, model="gpt2_tiny",
              generate_splits=("test",), scale="cpu", scaling="fake")
  return TextExperiment(**{**base, **kw})


class _FakeTrainer:
  """Stands in for train_lm: records the runs, fails on call ``fail_at`` (1-based)."""

  def __init__(self, fail_at: int | None = None):
    self.calls, self.fail_at, self.leftovers = [], fail_at, []

  def __call__(self, config, probe=None, callbacks=()):
    marker = os.path.join(config.output_dir, "partial")
    self.leftovers.append(os.path.exists(marker))
    os.makedirs(config.output_dir, exist_ok=True)
    open(marker, "w").close()
    self.calls.append((config.optimizer, config.epsilon, config.seed, config.steps))
    if len(self.calls) == self.fail_at:
      raise KeyboardInterrupt  # the run dies midway
    nll = 3.0 + config.seed / 100 + len(self.calls) / 1000
    return {"epsilon_spent": config.epsilon * 0.99, "delta": config.delta,
            "noise_multiplier": 1.0, "releases": config.steps, "pretrained": False,
            "valid_nll": nll, "scores": {"test": {"bleu": 10.0 * nll, "rouge_l": 20.0}},
            "train_seconds": 1.0, "peak_rss_gib": 0.5}


def test_sweep_is_restartable_and_a_rerun_trains_nothing_new(tmp_path, monkeypatch):
  exp = _fake_experiment()
  fake = _FakeTrainer(fail_at=3)
  monkeypatch.setattr(text_sweep, "train_lm", fake)
  with pytest.raises(KeyboardInterrupt):
    text_sweep.run(exp, str(tmp_path), TEXT_DIR, own_process=False)
  recorded = text_sweep.read_rows(str(tmp_path / "runs.csv"))
  assert [(r["variant"], r["target_epsilon"], r["seed"]) for r in recorded] == [
      ("A", 8.0, 37), ("B", 8.0, 37)]  # appended as each run finished
  # The rerun redoes the interrupted run from scratch (its files set aside), then the rest.
  fake = _FakeTrainer()
  monkeypatch.setattr(text_sweep, "train_lm", fake)
  rows = text_sweep.run(exp, str(tmp_path), TEXT_DIR, own_process=False)
  assert [c[1:3] for c in fake.calls] == [(8.0, 38), (8.0, 38), (1.0, 37), (1.0, 37), (1.0, 38),
                                          (1.0, 38)]
  assert fake.leftovers == [False] * 6
  assert [(r["variant"], r["target_epsilon"], r["seed"]) for r in rows] == [
      (v.label, e, s) for v, e, s in exp.runs()]
  # The releases multiplier: B has 2T releases and 2T gradient evaluations per example.
  assert {r["variant"]: (r["releases"], r["grad_evals_per_example"]) for r in rows} == {
      "A": (3, 3), "B": (6, 6)}
  # A third invocation trains nothing and rewrites the summary from the recorded rows.
  (tmp_path / "summary.csv").unlink()
  fake = _FakeTrainer()
  monkeypatch.setattr(text_sweep, "train_lm", fake)
  again = text_sweep.run(exp, str(tmp_path), TEXT_DIR, own_process=False)
  assert fake.calls == [] and again == rows
  with open(tmp_path / "summary.csv") as f:
    summary = list(csv.DictReader(f))
  assert [(r["variant"], float(r["target_epsilon"]), int(r["seeds"])) for r in summary] == [
      ("A", 1.0, 2), ("A", 8.0, 2), ("B", 1.0, 2), ("B", 8.0, 2)]
  with open(tmp_path / "runs.csv") as f:
    assert len(list(csv.DictReader(f))) == 8


@needs_text_data
def test_an_interrupted_sweep_run_resumes_from_its_checkpoint_bit_for_bit(tmp_path):
  """The sweep resumes a run its interruption left at a checkpoint; the result is the
  uninterrupted run's. A checkpoint it may not resume (other settings) is redone from
  scratch, the attempt set aside with its journal. Either way the secret checkpoints
  are gone afterwards."""
  config = _tiny_config(tmp_path, eval_every=None, generate_splits=(), checkpoint_every=1)
  train_lm(dataclasses.replace(config, max_steps=2))  # the interruption: a checkpoint at 2
  results, _, resumed = text_sweep._train_and_time(config, None, text_sweep._in_this_process)
  assert resumed and results["releases"] == 3 and results["stop_reason"] == "completed"
  assert not os.path.exists(os.path.join(config.output_dir, "checkpoints"))
  shutil.rmtree(config.output_dir)
  train_lm(dataclasses.replace(config, max_steps=2, clip=2.0))  # a run the sweep no longer makes
  whole, _, resumed = text_sweep._train_and_time(config, None, text_sweep._in_this_process)
  assert not resumed and whole["releases"] == 3
  aside = config.output_dir + ".discarded-1"  # the set-aside attempt keeps its journal
  assert len(read_journal(os.path.join(aside, JOURNAL_NAME))) == 2
  assert not os.path.exists(os.path.join(aside, "checkpoints"))
  assert results["valid_nll"] == whole["valid_nll"]  # the resumed run is the whole run
  assert not os.path.exists(os.path.join(config.output_dir, "checkpoints"))


def test_an_older_runs_file_gains_the_new_columns(tmp_path, monkeypatch):
  exp = _fake_experiment(epsilons=(8.0,), seeds=(37,))
  old = {"variant": "A", "optimizer": "dp_muon", "target_epsilon": 8.0, "seed": 37,
         "epsilon_spent": 7.9, "delta": 1e-5, "noise_multiplier": 1.0, "releases": 3,
         "pretrained": False, "valid_nll": 3.1, "valid_bleu": "", "valid_rouge_l": "",
         "test_bleu": 5.0, "test_rouge_l": 20.0, "train_seconds": 2.0, "peak_rss_gib": 1.0,
         "peak_device_gib": ""}
  write_csv(str(tmp_path / "runs.csv"), [old])
  fake = _FakeTrainer()
  monkeypatch.setattr(text_sweep, "train_lm", fake)
  rows = text_sweep.run(exp, str(tmp_path), TEXT_DIR, own_process=False)
  assert [c[3] for c in fake.calls] == [6]  # only B (2T = 6 releases); A was recorded
  assert rows[0]["valid_nll"] == 3.1 and rows[0]["grad_evals_per_example"] == ""
  assert rows[1]["grad_evals_per_example"] == 6
  write_csv(str(tmp_path / "runs.csv"), [{**old, "extra": 1}])
  with pytest.raises(SystemExit, match="extra"):
    text_sweep.run(exp, str(tmp_path), TEXT_DIR, own_process=False)


@needs_text_data
def test_pretrained_sweep_records_the_checkpoint_before_fine_tuning(tmp_path, monkeypatch):
  """zero_shot.json: the checkpoint's validation NLL and scores before any release, and
  the sha256 of the weights it loaded (a checkpoint need not record its own)."""
  checkpoint = str(tmp_path / "checkpoint")
  config = _tiny_config(tmp_path)
  apply, params, gpt2_config, _ = load_model(config, 512)
  save_hf_gpt2(params, gpt2_config, checkpoint)
  weights = os.path.join(checkpoint, "model.safetensors")
  with open(os.path.join(checkpoint, "results.json"), "w") as f:  # no sha256 of its own
    json.dump({"e2e_valid_zero_shot_nll": 6.25}, f)
  exp = dataclasses.replace(
      TEXT_EXPERIMENTS["e2e_pretrained_cpu"], variants=(Variant("A", "dp_muon"),),
      epsilons=(8.0,), seeds=(37,), vocab_size=512, eval_pairs=16, generate_groups=2,
      max_new_tokens=4)
  monkeypatch.setattr(text_sweep, "train_lm", _FakeTrainer())
  text_sweep.run(exp, str(tmp_path / "out"), TEXT_DIR, gpt2_dir=checkpoint, own_process=False)
  with open(tmp_path / "out" / "zero_shot.json") as f:
    record = json.load(f)
  tokenizer = GPT2Tokenizer(os.path.join(TEXT_DIR, "gpt2"), 512)
  valid = load_text_dataset("e2e", TEXT_DIR, "valid").pairs[:16]
  expected = mean_token_nll(apply, params, encode_pairs(tokenizer, valid, exp.max_length), 64)
  assert record["valid_nll"] == pytest.approx(expected, rel=1e-6)
  assert record["checkpoint_valid_nll"] == 6.25 and record["scores"]["test"]["groups"] == 2
  assert record["checkpoint_sha256"] == {"model.safetensors": sha256_file(weights)}
  with open(tmp_path / "out" / "summary.csv") as f:
    zero = list(csv.DictReader(f))[-1]  # the start's own row, after the runs'
  assert zero["variant"] == "zero-shot start" and zero["releases"] == "0"
  assert float(zero["valid_nll_mean"]) == pytest.approx(record["valid_nll"])
  assert float(zero["test_bleu_mean"]) == pytest.approx(record["scores"]["test"]["bleu"])
  assert (tmp_path / "out" / f"{exp.metric}_vs_epsilon.png").exists()
  # A rebuilt checkpoint that differs may not add runs to the same table (the refusal
  # comes from the setup's own process, as in a real sweep).
  save_hf_gpt2(jax.tree.map(lambda p: p + 1.0, params), gpt2_config, checkpoint)
  with pytest.raises(SystemExit, match="sha256"):
    text_sweep.run(exp, str(tmp_path / "out"), TEXT_DIR, gpt2_dir=checkpoint)


@needs_text_data
def test_cli_tiny_run_of_the_pretrained_cpu_experiment_and_its_rerun(tmp_path, monkeypatch):
  args = ["e2e_pretrained_cpu", "--data-dir", TEXT_DIR, "--tiny", "--out", str(tmp_path)]
  assert text_sweep.main(args) == 0
  rows = text_sweep.read_rows(str(tmp_path / "runs.csv"))
  assert [(r["variant"], r["target_epsilon"], r["seed"]) for r in rows] == [("DP-Muon", 8.0, 37)]
  assert rows[0]["releases"] == 1 and rows[0]["grad_evals_per_example"] == 1
  assert 0 < rows[0]["epsilon_spent"] <= 8.0 and rows[0]["test_bleu"] != ""
  fake = _FakeTrainer()
  monkeypatch.setattr(text_sweep, "train_lm", fake)
  assert text_sweep.main(args) == 0
  assert fake.calls == [] and text_sweep.read_rows(str(tmp_path / "runs.csv")) == rows


def test_the_steady_peak_leaves_out_what_the_first_release_held():
  """The meter's first call (a resumption's first release: 5 of 8) keeps the peak so far and
  resets the high-water mark: 1 GiB held and freed before it (as the compiler's is) is in
  the run's peak, not the steady one. A first call at the last release resets nothing: no
  steady state follows."""
  memory = ReleaseMemory(8)
  ballast = np.ones(2**27)  # 1 GiB, every page written
  assert ballast.sum() == 2**27
  del ballast
  memory(5)
  memory(6)
  summary = memory.summary()
  assert summary["peak_rss_gib"] > 1.0
  assert summary["steady_peak_rss_gib"] < summary["peak_rss_gib"] - 0.5, summary
  last = ReleaseMemory(8)
  last(8)
  assert "steady_peak_rss_gib" not in last.summary()


def test_a_run_in_its_own_process_reports_its_own_peak_memory():
  """The sweep's rows record each run's peak RSS, not the sweep process's peak so far
  (which only grows): a child spawned after this process touched 1 GiB peaks below it."""
  ballast = np.ones(2**27)  # 1 GiB, every page written
  parent = peak_rss_gib()
  child = text_sweep.in_own_process(peak_rss_gib)
  assert ballast.sum() == 2**27 and parent > 1.0
  assert child < parent - 0.5, (child, parent)
  with pytest.raises(SystemExit, match="child"):  # a run's error reaches the sweep
    text_sweep.in_own_process(_exit, "child")


def _exit(message: str) -> None:
  raise SystemExit(message)


def _sweep_row(variant, optimizer, seed, releases, evals, nll, bleu, rouge, epsilon=8.0):
  return {"variant": variant, "optimizer": optimizer, "target_epsilon": epsilon, "seed": seed,
          "releases": releases, "grad_evals_per_example": evals, "valid_nll": nll,
          "test_bleu": bleu, "test_rouge_l": rouge}


def test_paired_differences_match_seeds_at_equal_releases_and_equal_compute():
  rows = [
      _sweep_row("DP-Muon", "dp_muon", 37, 6, 6, 4.9, 2.4, 21.0),
      _sweep_row("DP-Muon (2T releases)", "dp_muon", 37, 12, 12, 3.8, 7.2, 29.0),
      _sweep_row("DP-Muon", "dp_muon", 38, 6, 6, 5.0, 2.0, 20.0),
      _sweep_row("DP-Muon", "dp_muon", 37, 6, 6, 6.0, 0.0, 0.0, epsilon=1.0),
      _sweep_row("IM (K = 1)", "dp_muon_im", 37, 6, 11, 5.1, 1.0, 17.0),
      _sweep_row("IM", "dp_muon_im", 38, 6, 24, 5.2, "", 16.0),
      _sweep_row("BC", "dp_muon_bc", 37, 6, 6, 4.8, 2.5, 22.0),
  ]
  pairs = text_sweep.paired_differences(rows)
  got = {(p["comparison"], p["variant"], p["baseline"], p["seed"]): p for p in pairs}
  assert set(got) == {("equal releases", "IM (K = 1)", "DP-Muon", 37),
                      ("equal compute", "IM (K = 1)", "DP-Muon (2T releases)", 37),
                      ("equal releases", "IM", "DP-Muon", 38)}  # no ε = 1 or BC pair, and
  # no equal-compute pair for IM (24 evaluations): no DP-Muon run of seed 38 has as many
  compute = got[("equal compute", "IM (K = 1)", "DP-Muon (2T releases)", 37)]
  assert compute["d_valid_nll"] == pytest.approx(5.1 - 3.8)
  assert compute["d_test_bleu"] == pytest.approx(1.0 - 7.2)
  assert "d_test_bleu" not in got[("equal releases", "IM", "DP-Muon", 38)]  # a missing score
