"""ONE optimizer registry: no other table of optimizer names, and a new optimizer touches only it.

The registry (:mod:`dpmuon_jax.optimizers.registry`) is read by the trainer,
the CLI, the GPT-2 training, the experiment configs and the conformance suite.
The library and the experiments are parsed with :mod:`ast`: a literal that
lists two or more registered names outside the registry is a second table
(the experiments may list the optimizers a paper's table compares, a tuple of
names, but not a mapping keyed by them, e.g. learning rates).
"""

from __future__ import annotations

import ast
import dataclasses
import pathlib

import jax.numpy as jnp
import optax
import pytest

from dpmuon_jax import cli
from dpmuon_jax.optimizers import registry
from dpmuon_jax.optimizers.private import ReleaseSettings, private
from dpmuon_jax.privacy.query import GRADIENT_QUERY
from dpmuon_jax.privacy.release import ADD_REMOVE
from dpmuon_jax.training.trainer import TrainConfig, train
from dpmuon_jax.transforms.filters import applied_update
from dpmuon_jax.transforms.history import find_history

ROOT = pathlib.Path(__file__).resolve().parents[1]
REGISTRY = ROOT / "dpmuon_jax" / "optimizers" / "registry.py"
RELEASE = {"l2_clip_norm": 1.0, "noise_multiplier": 1.0, "denominator": 8.0, "key": 0}
PARAMS = {"dense": {"kernel": jnp.zeros((4, 3)), "bias": jnp.zeros(3)}}


# ------------------------------------------------------------------------ one table of names


def _listed(node: ast.AST, names: set[str], mappings_only: bool) -> set[str]:
  """The registered names a literal lists: dict keys and values, ``dict(name=...)``, elements."""
  if isinstance(node, ast.Dict):
    items = [*node.keys, *node.values]
  elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "dict":
    return {kw.arg for kw in node.keywords if kw.arg in names}
  elif isinstance(node, (ast.List, ast.Tuple, ast.Set)) and not mappings_only:
    items = node.elts
  else:
    return set()
  return {i.value for i in items if isinstance(i, ast.Constant) and i.value in names}


def name_tables(source: str, names: set[str], mappings_only: bool = False) -> list[str]:
  """``"line: names"`` for every literal of ``source`` that lists >= 2 of ``names``.

  ``__all__`` (what a module exports, function names) is not a table.
  """
  tree = ast.parse(source)
  exports = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Assign)
             and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)}
  found = []
  for node in ast.walk(tree):
    listed = set() if id(node) in exports else _listed(node, names, mappings_only)
    if len(listed) >= 2:
      found.append(f"{node.lineno}: {', '.join(sorted(listed))}")
  return found


def _tables(folder: str, mappings_only: bool) -> list[str]:
  names = set(registry.names())
  found = []
  for path in sorted((ROOT / folder).rglob("*.py")):
    if path != REGISTRY:
      found += [f"{path.relative_to(ROOT)}:{t}"
                for t in name_tables(path.read_text(), names, mappings_only)]
  return found


def test_no_other_table_of_optimizer_names():
  assert _tables("dpmuon_jax", mappings_only=False) == []
  assert _tables("experiments", mappings_only=True) == []


def test_each_entry_names_itself_once_as_the_papers_write_it():
  titles = {name: registry.OPTIMIZERS[name].title for name in registry.names()}
  assert titles["dp_sgd"] == "DP-SGD" and titles["dp_muon_s"] == "DP-Muon-S"
  assert titles["dp_disk_muon"] == "DiSK-Muon" and titles["dp_adam"] == "DP-Adam"
  assert len(set(titles.values())) == len(titles)


def test_each_temporal_filter_names_the_registered_optimizer_it_smooths():
  """Paper 1's ablation pairs DiSK / DOPPLER with the optimizer they filter; a filter of a
  filter, or of a name the registry lacks, would pair the ablation's rows wrongly."""
  filters = {name: e.filters for name, e in registry.OPTIMIZERS.items() if e.filters}
  assert filters == {"dp_disk_sgd": "dp_sgd", "dp_doppler_sgd": "dp_sgd",
                     "dp_disk_muon": "dp_muon", "dp_doppler_muon": "dp_muon",
                     "dp_disk_muon_im": "dp_muon_im"}
  assert all(not registry.OPTIMIZERS[base].filters for base in filters.values())


def test_the_checker_sees_tables_and_passes_single_names():
  names = {"dp_a", "dp_b"}
  source = ('LR = {"dp_a": 0.3, "dp_b": 0.02}\nGRID = ("dp_a", "dp_b")\n'
            'K = dict(dp_a=1, dp_b=2)\nONE = {"dp_a": 1, "other": 2}\nif x == "dp_b": pass\n'
            '__all__ = ["dp_a", "dp_b"]\n')
  assert name_tables(source, names) == ["1: dp_a, dp_b", "2: dp_a, dp_b", "3: dp_a, dp_b"]
  assert name_tables(source, names, mappings_only=True) == ["1: dp_a, dp_b", "3: dp_a, dp_b"]


# ------------------------------------------------------------------ entries, presets, queries


@pytest.mark.parametrize("name", registry.names())
def test_every_preset_builds_with_the_query_its_entry_names(name):
  entry = registry.OPTIMIZERS[name]
  for workload in entry.presets:
    opt = registry.build(name, None, RELEASE, workload)
    assert (opt.query is GRADIENT_QUERY) == (entry.query == "gradient")
  state = registry.build(name, None, RELEASE).init(PARAMS)
  if "disk" in entry.query:
    applied_update(state)  # DiSK's query reads d_t from the state
  if "inner_momentum" in entry.query:
    find_history(state)  # inner momentum's query reads the past states


def test_paper_presets():
  assert registry.preset("dp_sgd") == (0.3, {"momentum": 0.9})
  assert registry.preset("dp_muon").learning_rate == 0.02
  assert registry.preset("dp_muon_s").learning_rate == 0.3
  assert registry.preset("dp_disk_sgd") == (1.0, {"kappa": 1.5, "gamma": -1.0})
  assert registry.preset("dp_doppler_sgd").learning_rate == 3.0
  assert {k: v for k, v in registry.preset("dp_muon_im").kwargs.items() if k != "fallback"} == {
      "history": 1, "decay": 0.5}
  assert registry.preset("dp_muon", registry.CIFAR100).learning_rate == 0.1
  assert registry.preset("dp_muon_s", registry.CIFAR100).learning_rate == 0.5
  assert registry.preset("dp_muon", registry.VIT_SMALL).learning_rate == 0.002
  for name in registry.names(registry.GPT2):  # paper 2: 0.002 / 0.0035, paper2 routing
    start = registry.preset(name, registry.GPT2)
    fallback = start.kwargs["fallback"]
    assert (start.learning_rate, start.kwargs["routing"]) == (0.002, "paper2")
    assert (fallback.kind, fallback.learning_rate) == ("adamw", 0.0035)
  assert registry.names(registry.GPT2) == (
      "dp_muon", "dp_disk_muon", "dp_muon_im", "dp_disk_muon_im", "dp_muon_bc")


def test_every_muon_family_preset_runs_its_1d_group_as_the_workloads_dp_sgd():
  """Paper 1: "standard DP-SGD with momentum is retained for 1D parameters"."""
  muon_family = [n for n, e in registry.OPTIMIZERS.items() if "muon" in n]
  for name in muon_family:
    for workload, start in registry.OPTIMIZERS[name].presets.items():
      fallback = start.kwargs["fallback"]
      if workload == registry.GPT2:  # paper 2's AdamW group
        continue
      sgd = registry.preset("dp_sgd", workload)
      expected = ("sgd", sgd.learning_rate, sgd.kwargs["momentum"])
      if name == "dp_doppler_muon":  # the EMA replaces all momentum: DOPPLER-SGD's step
        expected = ("sgd", registry.preset("dp_doppler_sgd", workload).learning_rate, 0.0)
      assert (fallback.kind, fallback.learning_rate, fallback.momentum) == expected, name


def test_unknown_names_and_workloads_are_refused_with_the_choices():
  with pytest.raises(ValueError, match="Unknown optimizer 'dp_lion'.*dp_sgd"):
    registry.build("dp_lion", 0.1, RELEASE)
  with pytest.raises(ValueError, match="Unknown optimizer 'dp_sgd' for workload 'gpt2'.*dp_muon"):
    registry.build("dp_sgd", 0.1, RELEASE, registry.GPT2)
  with pytest.raises(ValueError, match="Unknown workload"):
    registry.names("mnist")
  with pytest.raises(ValueError, match="already registered"):
    registry.register("dp_sgd", registry.OPTIMIZERS["dp_sgd"])
  with pytest.raises(ValueError, match="query"):
    registry.Entry(dp_toy, "toy", query="hessian")
  with pytest.raises(ValueError, match="workloads"):
    registry.Entry(dp_toy, "toy", presets={"mnist": registry.Preset(0.1)})


def test_build_overrides_the_preset_options():
  opt = registry.build("dp_disk_muon", None, RELEASE, kappa=0.5, gamma=0.8)
  assert opt.release.noise_multiplier == 1.0  # without reference_noise_rescaling
  with pytest.raises(ValueError, match="kappa"):
    registry.build("dp_disk_muon", None, RELEASE, kappa=3.0)



def test_every_entry_knows_its_options_and_its_presets_use_only_them():
  """Each factory declares where its ``**options`` go, so every option is known."""
  for name, entry in registry.OPTIMIZERS.items():
    accepted = registry.option_names(name)
    assert accepted is not None, name
    assert not accepted & set(registry.RUN_SETTINGS), name
    for workload, start in entry.presets.items():
      assert set(start.kwargs) <= accepted, (name, workload)
  assert registry.option_names("dp_sgd") == {"momentum", "nesterov"}
  assert {"history", "decay", "beta", "fallback"} <= registry.option_names("dp_muon_im")
  assert {"gamma", "kappa", "reference_noise_rescaling"} <= registry.option_names("dp_disk_muon")


def test_run_settings_and_unknown_options_are_refused_in_one_line():
  release_names = {f.name for f in dataclasses.fields(ReleaseSettings)}
  assert set(registry.RUN_SETTINGS) == {"learning_rate", *release_names}
  for name in release_names:
    with pytest.raises(ValueError, match=f"^options: '{name}' is a privacy setting"):
      registry.build("dp_muon", None, RELEASE, **{name: None})
  with pytest.raises(ValueError, match="dp_muon_s takes no option 'attention_blocks'; its "
                                       "options: beta, buffer, exact_svd, fallback, mu_dtype"):
    registry.build("dp_muon_s", None, RELEASE, attention_blocks="fused")
  with pytest.raises(ValueError, match="^kwargs: dp_adam takes no option 'momentum'"):
    registry.check_options("dp_adam", {"momentum": 0.9}, "kwargs")


# ------------------------------------------------------------ a new optimizer: one entry


def dp_toy(learning_rate, l2_clip_norm, noise_multiplier, denominator, key=None, *,
           clipping=None, neighbouring=ADD_REMOVE):
  """A toy private optimizer: the release, then plain SGD."""
  release = ReleaseSettings(l2_clip_norm, noise_multiplier, denominator, key, clipping,
                            neighbouring)
  return private(release, optax.sgd(learning_rate))


@pytest.fixture
def toy():
  entry = registry.Entry(dp_toy, "a toy: the release, then optax.sgd",
                         presets={registry.DEFAULT_WORKLOAD: registry.Preset(0.1)})
  registry.register("dp_toy", entry)
  yield "dp_toy"
  registry.unregister("dp_toy")


def test_a_registered_optimizer_builds_trains_and_is_a_cli_choice(toy, tiny_data, tmp_path):
  assert registry.build(toy, None, RELEASE).query is GRADIENT_QUERY
  assert cli._parser().parse_args(["train", "--optimizer", toy]).optimizer == toy
  config = TrainConfig(model="mlp", dataset="tiny", optimizer=toy, epsilon=3.0, delta=1e-3,
                       batch_size=16, epochs=2, seed=3, output_dir=str(tmp_path),
                       progress=False, plot=False, max_steps=1)
  assert train(config, tiny_data)["releases"] == 1


def test_unregister_restores_the_registry():
  before = registry.names()
  registry.register("dp_toy", registry.Entry(dp_toy, "toy"))
  assert registry.unregister("dp_toy").factory is dp_toy
  assert registry.names() == before
  with pytest.raises(SystemExit):
    cli._parser().parse_args(["train", "--optimizer", "dp_toy"])
