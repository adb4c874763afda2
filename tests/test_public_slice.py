"""The E2E public slice (restaurants made public by a fixed rule), the learning-rate pilot
and the pre-registered decision rule of the public-slice fine-tuning study."""

import csv
import dataclasses
import math
import os
import shutil

import pytest
from text_folder import TEXT_DIR, needs_text_data

from dpmuon_jax.text.data import (
    EvalGroup,
    TextDataset,
    TextPair,
    e2e_name,
    in_public_slice,
    load_e2e,
    split_public_slice,
)
from dpmuon_jax.text.train import LMTrainConfig, _load_lm_data, load_split
from dpmuon_jax.training.records import write_csv
from experiments import text_sweep
from experiments.text_configs import (
    E2E_PRIVATE_TRAIN_PAIRS,
    E2E_PUBLIC_SLICE,
    TEXT_EXPERIMENTS,
    TextExperiment,
    Variant,
    im_preset,
)

PUBLIC_NAMES = {"The Rice Boat", "The Golden Curry", "Browns Cambridge", "Wildwood", "Cocum",
                "Midsummer House", "Bibimbap House"}


def test_public_slice_splits_by_name_only():
  pairs = [TextPair(f"name : {n} | Type : pub", f"{n} is a pub . ")
           for n in ("The Rice Boat", "The Eagle", "The Rice Boat", "Cocum", "Zizzi")]
  groups = [EvalGroup(p.source, [p.target.strip()]) for p in pairs]
  data = TextDataset("e2e", "train", pairs, groups)
  private, public = split_public_slice(data, 5)
  assert [e2e_name(p.source) for p in public.pairs] == ["The Rice Boat", "The Rice Boat", "Cocum"]
  assert [e2e_name(p.source) for p in private.pairs] == ["The Eagle", "Zizzi"]
  assert public.groups == [groups[0], groups[2], groups[3]]  # the split's own groups
  assert in_public_slice("The Rice Boat", 5) and not in_public_slice("The Eagle", 5)
  assert all(in_public_slice(n, 1) for n in ("a", "b"))  # modulus 1: everything public
  with pytest.raises(ValueError, match="name"):
    e2e_name("Type : pub | name : X")
  with pytest.raises(ValueError, match="E2E"):
    split_public_slice(TextDataset("dart", "dev", pairs, []), 5)


@needs_text_data
def test_real_public_slice_counts_and_no_public_restaurant_is_private():
  train = load_e2e(TEXT_DIR, "train")
  private, public = split_public_slice(train, E2E_PUBLIC_SLICE)
  assert {e2e_name(p.source) for p in public.pairs} == PUBLIC_NAMES  # 7 of 34 names
  assert (len(private.pairs), len(public.pairs)) == (E2E_PRIVATE_TRAIN_PAIRS, 10_486)
  for split, kept in (("train", 31_575), ("valid", 3_947), ("test", 4_455)):
    config = LMTrainConfig(data_dir=TEXT_DIR, public_slice=E2E_PUBLIC_SLICE)
    data = load_split(config, split)
    assert len(data.pairs) == kept
    assert not {e2e_name(p.source) for p in data.pairs} & PUBLIC_NAMES
  # Names cross the line only in text (experiments/results/README.md says so): public
  # references that name a private restaurant, and private pairs near a public one.
  private_names = {e2e_name(p.source) for p in private.pairs}
  crossing = [(i, n) for i, p in enumerate(public.pairs) for n in private_names if n in p.target]
  assert len({i for i, _ in crossing}) == 6
  assert {n for _, n in crossing} == {"Zizzi", "The Mill", "Clowns", "The Wrestlers"}
  near = [f.partition(":")[2].strip() for p in private.pairs for f in p.source.split("|")
          if f.partition(":")[0].strip() == "near"]
  assert sum(n in PUBLIC_NAMES for n in near) == 888
  assert {n for n in near if n in PUBLIC_NAMES} == {"The Rice Boat"}
  # The private run's N is the private count (the accountant's dataset size).
  config = LMTrainConfig(data_dir=TEXT_DIR, public_slice=E2E_PUBLIC_SLICE, vocab_size=512,
                         train_split="test", generate_splits=())
  assert _load_lm_data(config).num_pairs == 4_455


def test_public_slice_experiment_is_the_preregistered_design():
  exp = TEXT_EXPERIMENTS["e2e_public_slice"]
  assert exp.pretrained and exp.public_slice == E2E_PUBLIC_SLICE
  assert exp.steps == 400 and exp.eval_every == 50 and exp.epsilons == (1.0, 8.0)
  assert exp.sampling_rate * E2E_PRIVATE_TRAIN_PAIRS == pytest.approx(256)
  assert exp.denominator is None and exp.delta == 1e-5 and exp.seeds == (37, 38, 39)
  assert exp.pilot_seed == 36 and exp.pilot_seed not in exp.seeds and exp.pilot_steps == 100
  assert exp.rate_grid == (0.5, 1.0, 2.0) and exp.capacity % exp.microbatch_size == 0
  variants = {v.label: v for v in exp.variants}
  assert variants["DP-Muon-IM (K = 1)"].kwargs == {
      "history": 1, "decay": 0.5, "fallback_history": 1, "fallback_decay": 0.5}
  assert variants["DP-Muon-IM (preset)"].optimizer_kwargs("e2e", 8.0) == im_preset("e2e", 8.0)
  assert variants["DP-Muon (2T releases)"].releases == 2
  # Every arm is piloted at each of its ε, except the two one-seed rows, which take the
  # preset's rates.
  assert [v.label for v in exp.piloted(8.0)] == [
      "DP-Muon", "DP-Muon-IM (K = 1)", "DP-Muon-IM (preset)", "DP-Muon (2T releases)",
      "DP-Muon-BC"]
  assert "DP-Muon-IM (preset)" not in [v.label for v in exp.piloted(1.0)]
  runs = list(exp.runs())
  assert runs[0][1] == 8.0 and runs[-1][1] == 1.0  # ε = 8 first
  one_seed = [(v.label, e, s) for v, e, s in runs if v.seeds]
  assert one_seed == [("KF+IM", 8.0, 37), ("DP-Muon-IM (preset, fused c_attn)", 8.0, 37)]
  assert len(runs) == 5 * 3 + 4 * 3 + 2
  config = text_sweep.run_config(exp, variants["DP-Muon"], 8.0, 37, "o", "d", "w", False, 2.0)
  assert (config.learning_rate, config.fallback_learning_rate) == (0.004, 0.007)
  assert config.public_slice == E2E_PUBLIC_SLICE and config.eval_every == 50


def test_choose_factor_skips_diverged_runs_and_breaks_ties_low():
  assert text_sweep.choose_factor({0.5: 3.0, 1.0: 2.5, 2.0: math.nan}) == 1.0
  assert text_sweep.choose_factor({0.5: 2.5, 1.0: 2.5}) == 0.5
  assert text_sweep.choose_factor({1.0: math.inf, 2.0: math.nan}) == 1.0


class _RateTrainer:
  """Stands in for train_lm: validation NLL (log2(lr / best))² + 2, with a best rate per
  optimizer; records every (optimizer, seed, steps, lr)."""

  def __init__(self, best: dict[str, float]):
    self.best, self.calls = best, []

  def __call__(self, config, probe=None, callbacks=()):
    os.makedirs(config.output_dir, exist_ok=True)
    self.calls.append((config.optimizer, config.seed, config.steps, config.learning_rate))
    nll = 2.0 + math.log2(config.learning_rate / self.best[config.optimizer]) ** 2
    write_csv(os.path.join(config.output_dir, "history.csv"),
              [{"step": t, "epsilon": 1.0, "valid_nll": nll + 1 / t, "seconds": t,
                "cpu_seconds": 2 * t} for t in (config.steps // 2, config.steps)])
    open(os.path.join(config.output_dir, "results.json"), "w").close()
    return {"epsilon_spent": config.epsilon * 0.99, "delta": config.delta,
            "noise_multiplier": 1.0, "releases": config.steps, "pretrained": False,
            "valid_nll": nll, "scores": {}, "train_seconds": 1.0, "peak_rss_gib": 0.5,
            "steady_peak_rss_gib": 0.4}


def _pilot_experiment() -> TextExperiment:
  return TextExperiment(
      name="fake", table="fake", dataset="e2e",
      variants=(Variant("A", "dp_muon"), Variant("B", "dp_muon_bc", releases=2),
                Variant("C", "dp_muon_im", seeds=(37,), rate_from="B")),
      epsilons=(8.0,), seeds=(37, 38), steps=10, pretrained=False, model="gpt2_tiny",
      generate_splits=(), scale="cpu", scaling="fake", learning_rate=0.01,
      fallback_learning_rate=0.002, rate_grid=(0.5, 1.0, 2.0), pilot_steps=4)


@needs_text_data
def test_pilot_extends_the_grid_off_an_edge_and_each_arm_runs_at_its_choice(tmp_path,
                                                                             monkeypatch):
  exp = _pilot_experiment()
  # A's best rate 0.08 = 8 × 0.01 lies past the grid's top: extended to ×4, ×8, ×16.
  # B's best 0.01 is the grid's middle; C is not piloted and takes B's factor.
  fake = _RateTrainer({"dp_muon": 0.08, "dp_muon_bc": 0.01, "dp_muon_im": 0.01})
  monkeypatch.setattr(text_sweep, "train_lm", fake)
  rows = text_sweep.run(exp, str(tmp_path), TEXT_DIR, own_process=False)
  pilot_calls = [c for c in fake.calls if c[1] == exp.pilot_seed]
  assert [(o, s, lr) for o, _, s, lr in pilot_calls] == [
      ("dp_muon", 4, lr) for lr in (0.005, 0.01, 0.02, 0.04, 0.08, 0.16)] + [
      ("dp_muon_bc", 8, lr) for lr in (0.005, 0.01, 0.02)]  # B: 2T → 8 pilot releases
  assert all(seed != exp.pilot_seed for _, seed, _, _ in fake.calls[len(pilot_calls):])
  assert {(r["variant"], r["learning_rate"], r["fallback_learning_rate"]) for r in rows} == {
      ("A", 0.08, 0.016), ("B", 0.01, 0.002), ("C", 0.01, 0.002)}
  assert [r["seed"] for r in rows if r["variant"] == "C"] == [37]
  with open(tmp_path / "rates.csv") as f:
    rates = {r["variant"]: r for r in csv.DictReader(f)}
  assert rates["A"]["grid"] == "0.5 1 2 4 8 16" and float(rates["A"]["rate_factor"]) == 8.0
  assert rates["A"]["on_edge"] == "False" and float(rates["A"]["pilot_valid_nll"]) == 2.0
  assert rates["B"]["grid"] == "0.5 1 2" and "C" not in rates
  # The curves hold the reported runs only (the pilot's seed never), evaluation by evaluation.
  with open(tmp_path / "curves.csv") as f:
    curves = list(csv.DictReader(f))
  assert {(c["variant"], int(c["seed"])) for c in curves} == {
      ("A", 37), ("A", 38), ("B", 37), ("B", 38), ("C", 37)}
  assert [int(c["step"]) for c in curves if (c["variant"], c["seed"]) == ("B", "38")] == [10, 20]
  assert (tmp_path / "valid_nll_curves.png").exists()
  with open(tmp_path / "decision.csv") as f:
    (decision,) = list(csv.DictReader(f))  # C − A at equal releases, one seed: undecided
  assert (decision["variant"], decision["baseline"], decision["helps"]) == ("C", "A", "")
  assert decision["verdict"] == "" and decision["rates_on_edge"] == ""
  # A rerun trains nothing: the pilot's and the runs' rows are all recorded.
  again = _RateTrainer(fake.best)
  monkeypatch.setattr(text_sweep, "train_lm", again)
  assert text_sweep.run(exp, str(tmp_path), TEXT_DIR, own_process=False) == rows
  assert again.calls == []
  # The summaries can be rewritten from the records alone, as while a sweep runs.
  for name in ("summary.csv", "curves.csv", "pairs.csv"):
    (tmp_path / name).unlink()
  assert text_sweep.summarise_recorded(exp, str(tmp_path)) == rows
  assert all((tmp_path / name).exists() for name in ("summary.csv", "curves.csv", "pairs.csv"))
  # A clean checkout has the committed CSVs, not the runs' folders: the curves and their
  # plot are rebuilt from curves.csv, unchanged.
  recorded = (tmp_path / "curves.csv").read_text()
  shutil.rmtree(tmp_path / "runs")
  (tmp_path / "valid_nll_curves.png").unlink()
  assert text_sweep.summarise_recorded(exp, str(tmp_path)) == rows
  assert (tmp_path / "curves.csv").read_text() == recorded
  assert (tmp_path / "valid_nll_curves.png").exists()


@needs_text_data
def test_pilot_stops_at_the_most_points_and_flags_the_edge(tmp_path, monkeypatch):
  exp = dataclasses.replace(_pilot_experiment(), variants=(Variant("A", "dp_muon"),),
                            seeds=(37,), max_rate_points=4)
  monkeypatch.setattr(text_sweep, "train_lm", _RateTrainer({"dp_muon": 1e-6}))
  text_sweep.run(exp, str(tmp_path), TEXT_DIR, own_process=False)
  with open(tmp_path / "rates.csv") as f:
    (rate,) = list(csv.DictReader(f))
  assert rate["grid"] == "0.25 0.5 1 2" and rate["on_edge"] == "True"


def _pair(comparison, seed, d, epsilon=8.0):
  return {"comparison": comparison, "variant": "IM", "baseline": "DP-Muon",
          "target_epsilon": epsilon, "seed": seed, "d_valid_nll": d}


def test_decision_rule_needs_every_seed_negative_and_the_mean_below_two_paired_se():
  helps = text_sweep.decide([_pair("equal releases", s, d)
                             for s, d in ((37, -0.05), (38, -0.04), (39, -0.06))])
  (row,) = helps
  assert row["helps"] is True and row["d_valid_nll_mean"] == pytest.approx(-0.05)
  assert row["d_valid_nll_paired_se"] == pytest.approx(0.01 / math.sqrt(3))
  assert row["d_valid_nll_per_seed"] == "-0.0500 -0.0400 -0.0600"
  noisy = text_sweep.decide([_pair("equal compute", s, d)
                             for s, d in ((37, -0.01), (38, -0.2), (39, -0.01))])
  assert noisy[0]["all_negative"] and not noisy[0]["mean_below_minus_2se"]
  assert noisy[0]["helps"] is False
  one_positive = text_sweep.decide([_pair("equal releases", s, d)
                                    for s, d in ((37, -0.3), (38, -0.3), (39, 0.001))])
  assert one_positive[0]["helps"] is False
  partial = text_sweep.decide([_pair("equal releases", 37, -0.3),
                               _pair("equal releases", 38, -0.3, epsilon=1.0)])
  assert [r["helps"] for r in partial] == ["", ""]  # one seed per ε: undecided
  assert [r["verdict"] for r in partial] == ["", ""]
  assert [helps[0]["verdict"], noisy[0]["verdict"], one_positive[0]["verdict"]] == [
      "helps", "not supported", "not supported"]


def test_every_paired_metric_is_summarised_with_its_seeds_signs():
  """pair_metrics.csv: NLL, BLEU and ROUGE-L each as paired mean ± SE with the signs, so a
  verdict decided on NLL is never read as one on BLEU."""
  pairs = [{"comparison": "equal releases", "variant": "IM", "baseline": "DP-Muon",
            "target_epsilon": 8.0, "seed": s, "d_valid_nll": n, "d_test_bleu": b}
           for s, n, b in ((39, 0.001, 0.4), (37, -0.001, 0.2), (38, 0.0, 0.3))]
  nll, bleu = text_sweep.metric_pairs(pairs)
  assert (nll["metric"], nll["signs"], nll["seeds"]) == ("valid_nll", "-0+", "37 38 39")
  assert (bleu["metric"], bleu["signs"]) == ("test_bleu", "+++")
  assert bleu["mean"] == pytest.approx(0.3) and bleu["paired_se"] == pytest.approx(0.1 / 3 ** .5)
  assert bleu["per_seed"] == "+0.2000 +0.3000 +0.4000"


def test_curve_pairs_pair_each_arm_with_dp_muon_at_every_release_both_evaluated():
  curves = [{"variant": v, "target_epsilon": 1.0, "seed": s, "step": t, "valid_nll": nll}
            for v, s, t, nll in (("DP-Muon", 37, 50, 2.0), ("DP-Muon", 38, 50, 2.1),
                                 ("BC", 37, 50, 1.9), ("BC", 38, 50, 2.0),
                                 ("DP-Muon", 37, 400, 1.5), ("DP-Muon", 38, 400, 1.6),
                                 ("BC", 37, 400, 1.6), ("BC", 38, 400, 1.7),
                                 ("BC", 37, 450, 1.6))]  # no DP-Muon at 450: no row
  early, late = text_sweep.curve_pairs(curves)
  assert (early["step"], early["signs"], late["step"], late["signs"]) == (50, "--", 400, "++")
  assert early["mean"] == pytest.approx(-0.1) and late["mean"] == pytest.approx(0.1)


def test_decision_rule_names_dp_muon_better_and_the_rates_on_an_edge():
  """The third pre-registered outcome: Δ > 0 on every seed and mean Δ > +2 paired SE."""
  rates = [{"variant": "DP-Muon", "target_epsilon": 8.0, "on_edge": "True"},
           {"variant": "IM", "target_epsilon": 8.0, "on_edge": "False"},
           {"variant": "IM", "target_epsilon": 1.0, "on_edge": "True"}]
  (better,) = text_sweep.decide([_pair("equal releases", s, d)
                                 for s, d in ((37, 0.05), (38, 0.06), (39, 0.055))], rates=rates)
  assert better["all_positive"] and better["mean_above_plus_2se"]
  assert better["helps"] is False and better["verdict"] == "DP-Muon better"
  assert better["rates_on_edge"] == "DP-Muon"  # the ε = 1 edge is another verdict's
  (spread,) = text_sweep.decide([_pair("equal releases", s, d)
                                 for s, d in ((37, 0.01), (38, 0.3), (39, 0.01))])
  assert spread["all_positive"] and not spread["mean_above_plus_2se"]
  assert spread["verdict"] == "not supported" and spread["rates_on_edge"] == ""


def test_paper2_regime_experiment_is_the_preregistered_design():
  exp, slice_ = TEXT_EXPERIMENTS["e2e_paper2_regime"], TEXT_EXPERIMENTS["e2e_public_slice"]
  assert exp.sampling_rate == pytest.approx(1 / 41) and exp.denominator is None  # D = qN
  mean = exp.sampling_rate * E2E_PRIVATE_TRAIN_PAIRS
  assert mean == pytest.approx(770.12, abs=0.01)
  sd = math.sqrt(mean * (1 - exp.sampling_rate))
  assert mean + 4 * sd <= exp.capacity < mean + 4 * sd + exp.microbatch_size
  assert exp.capacity % exp.microbatch_size == 0
  assert (exp.steps, exp.delta, exp.epsilons, exp.seeds, exp.pilot_seed) == (
      400, 1e-5, (1.0, 8.0), (37, 38, 39), 36)
  assert exp.pilot_steps == exp.steps  # each arm piloted over its full horizon
  assert exp.rate_grid == (0.25, 0.5, 1.0) and exp.max_rate_points == slice_.max_rate_points
  assert (exp.learning_rate, exp.fallback_learning_rate) == (
      slice_.learning_rate, slice_.fallback_learning_rate)
  for name in ("public_slice", "model", "model_overrides", "vocab_size", "max_length",
               "weights", "eval_every", "max_new_tokens", "microbatch_size", "clip"):
    assert getattr(exp, name) == getattr(slice_, name), name  # the same start and scoring
  assert exp.generate_splits == ("test",) and exp.bleu_co_primary
  assert [v.label for v in exp.piloted(8.0)] == [
      "DP-Muon", "DP-Muon-IM (K = 1)", "DP-Muon-IM (preset)", "DP-Muon (2T releases)"]
  assert [v.label for v in exp.piloted(1.0)] == ["DP-Muon", "DP-Muon-IM (preset)"]
  variants = {v.label: v for v in exp.variants}
  assert variants["DP-Muon-IM (K = 1)"].kwargs == {
      "history": 1, "decay": 0.5, "fallback_history": 1, "fallback_decay": 0.5}
  preset = variants["DP-Muon-IM (preset)"]
  assert preset.optimizer_kwargs("e2e", 8.0) == im_preset("e2e", 8.0)  # (4, 0.5) / (2, 0.5)
  assert preset.optimizer_kwargs("e2e", 1.0) == im_preset("e2e", 1.0)  # (4, 0.5) / (3, 0.5)
  two_t = text_sweep.run_config(
      exp, variants["DP-Muon (2T releases)"], 8.0, 37, "o", "d", "w", False, 0.25)
  assert two_t.steps == 800 and two_t.learning_rate == pytest.approx(0.0005)
  assert len(list(exp.runs())) == 4 * 3 + 2 * 3


class _ScoringTrainer(_RateTrainer):
  """_RateTrainer that also decodes: test BLEU 40 − 10·(NLL − 2), ROUGE-L 50."""

  def __call__(self, config, probe=None, callbacks=()):
    results = super().__call__(config, probe)
    if config.generate_splits:
      results["scores"] = {"test": {"bleu": 40 - 10 * (results["valid_nll"] - 2),
                                    "rouge_l": 50.0}}
    return results


@needs_text_data
def test_a_full_horizon_pilot_trains_each_arm_for_its_own_length_and_bleu_co_decides(
    tmp_path, monkeypatch):
  exp = dataclasses.replace(
      _pilot_experiment(), pilot_steps=10, bleu_co_primary=True, generate_splits=("test",),
      variants=(Variant("A", "dp_muon"), Variant("B", "dp_muon", releases=2),
                Variant("C", "dp_muon_im", {"history": 1})))
  fake = _ScoringTrainer({"dp_muon": 0.01, "dp_muon_im": 0.01})
  monkeypatch.setattr(text_sweep, "train_lm", fake)
  text_sweep.run(exp, str(tmp_path), TEXT_DIR, own_process=False)
  pilot = {(o, s) for o, seed, s, _ in fake.calls if seed == exp.pilot_seed}
  assert pilot == {("dp_muon", 10), ("dp_muon", 20), ("dp_muon_im", 10)}  # = the runs' T
  assert {(o, s) for o, seed, s, _ in fake.calls if seed != exp.pilot_seed} == pilot
  with open(tmp_path / "decision.csv") as f:
    reader = csv.DictReader(f)
    assert tuple(reader.fieldnames) == text_sweep.CO_PRIMARY_FIELDS
    rows = {r["comparison"]: r for r in reader}
  assert set(rows) == {"equal releases", "equal compute"}  # C − A, C − B (2T)
  assert rows["equal compute"]["baseline"] == "B" and rows["equal releases"]["seeds"] == "37 38"


def _pair2(seed, d_nll, d_bleu, comparison="equal releases"):
  return {"comparison": comparison, "variant": "IM", "baseline": "DP-Muon",
          "target_epsilon": 8.0, "seed": seed, "d_valid_nll": d_nll, "d_test_bleu": d_bleu,
          "d_test_rouge_l": 0.1}


def _co(nll, bleu, **kw):
  (row,) = text_sweep.decide_co_primary(
      [_pair2(s, n, b) for s, n, b in zip((37, 38, 39), nll, bleu)], **kw)
  return row


def test_co_primary_rule_needs_bleu_for_inner_momentum_and_nll_not_against_it():
  level = (0.001, -0.002, 0.0005)  # NLL: mixed signs, no side
  helps = _co(level, (0.5, 0.7, 0.6))
  assert (helps["bleu_favours"], helps["nll_favours"], helps["verdict"]) == (
      "inner momentum", "", "helps")
  assert helps["d_test_bleu_mean"] == pytest.approx(0.6)
  assert helps["d_test_bleu_paired_se"] == pytest.approx(0.1 / math.sqrt(3))
  assert helps["d_test_bleu_per_seed"] == "+0.5000 +0.7000 +0.6000"
  assert _co((-0.05, -0.04, -0.06), (0.5, 0.7, 0.6))["verdict"] == "helps"  # both agree
  against = _co((0.05, 0.04, 0.06), (0.5, 0.7, 0.6))  # BLEU for IM, NLL for the baseline
  assert against["nll_favours"] == "baseline" and against["verdict"] == "not supported"
  assert _co(level, (0.5, 0.7, -0.1))["verdict"] == "not supported"  # one seed the other way
  assert _co(level, (0.1, 3.0, 0.1))["verdict"] == "not supported"  # one sign, within 2 SE
  nll_only = _co((-0.05, -0.04, -0.06), (0.5, -0.7, 0.6))  # NLL alone does not decide
  assert nll_only["nll_favours"] == "inner momentum" and nll_only["verdict"] == "not supported"
  better = _co(level, (-0.5, -0.7, -0.6), rates=[
      {"variant": "DP-Muon", "target_epsilon": 8.0, "on_edge": "True"}])
  assert better["verdict"] == "DP-Muon better" and better["rates_on_edge"] == "DP-Muon"
  (partial,) = text_sweep.decide_co_primary([_pair2(37, 0.0, 1.0), _pair2(38, 0.0, 1.1)])
  assert partial["bleu_favours"] == "inner momentum" and partial["verdict"] == ""  # 2 seeds
