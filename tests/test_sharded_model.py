"""Parameters and optimizer state sharded over a (data, model) mesh of 8 CPU devices.

The release must not depend on the mesh: 1 × 8, 2 × 4, 4 × 2 and 8 × 1 give
the same parameters after a few releases of DP-SGD, DP-Muon and DP-Muon-IM,
the noise of one key is the same array under every layout, and on a sharded
mesh the noise on the sum has standard deviation σC (χ², both sides). One
subprocess (``sharded_model_step.py``) computes it all; the sharding rule's
errors are checked here, in process.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import text_folder
from devices import host_devices_env
from jax.sharding import PartitionSpec
from stats import std_interval

from dpmuon_jax.distributed.sharding import (
    leaf_spec,
    model_mesh,
    param_specs,
    parse_mesh_shape,
    state_specs,
)

HERE = Path(__file__).resolve().parent
MESHES = ("1x8", "2x4", "4x2", "8x1")
TOLERANCE = 1e-6
# sharded_model_step.py's constants.
DATA_PARALLEL = {"1x8": 1, "2x4": 2, "4x2": 4, "8x1": 8}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
  out = tmp_path_factory.mktemp("sharded") / "results.json"
  env = host_devices_env(8, TF_CPP_MIN_LOG_LEVEL="3")
  proc = subprocess.run([sys.executable, str(HERE / "sharded_model_step.py"), str(out)],
                        env=env, capture_output=True, text=True, timeout=600, cwd=HERE.parent)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return json.loads(out.read_text())


def test_four_meshes_give_the_same_parameters(results):
  assert results["devices"] == 8
  assert set(results["runs"]) == {"dp_sgd/vmap", "dp_muon/vmap", "dp_muon_im/ghost"}
  for case, runs in results["runs"].items():
    reference = runs["1x8"]["params"]
    for mesh in MESHES[1:]:
      for leaf, value in runs[mesh]["params"].items():
        diff = np.max(np.abs(np.asarray(value) - np.asarray(reference[leaf])))
        assert diff <= TOLERANCE, (case, mesh, leaf, diff)


def test_the_steps_moved_the_parameters(results):
  for case, runs in results["runs"].items():
    assert min(run["moved"] for run in runs.values()) > 1e-3, case


def test_matrices_and_their_state_are_split_over_model(results):
  for case, runs in results["runs"].items():
    for mesh in ("1x8", "2x4", "4x2"):
      specs = runs[mesh]["param_specs"]
      assert specs["['fc1']['kernel']"] == str(PartitionSpec(None, "model")), (case, mesh)
      assert specs["['head']['kernel']"] == str(PartitionSpec("model")), (case, mesh)
      assert specs["['fc1']['bias']"] == str(PartitionSpec()), (case, mesh)
    assert set(runs["8x1"]["param_specs"].values()) == {str(PartitionSpec())}, case
  # Muon's momentum takes its matrix's layout; DP-Muon-IM's K states stack on a new axis.
  assert str(PartitionSpec(None, "model")) in results["runs"]["dp_muon/vmap"]["2x4"]["state_specs"]
  im_specs = results["runs"]["dp_muon_im/ghost"]["2x4"]["state_specs"]
  assert str(PartitionSpec(None, None, "model")) in im_specs
  assert str(PartitionSpec(None, "model")) in im_specs


def test_per_device_state_shrinks_with_the_model_axis(results):
  for case, runs in results["runs"].items():
    assert runs["8x1"]["bytes"] == runs["8x1"]["total_bytes"], case
    for mesh, data in DATA_PARALLEL.items():
      run, model = runs[mesh], 8 // data
      split = run["total_bytes"] - run["replicated_bytes"]
      assert run["bytes"] == run["replicated_bytes"] + split // model, (case, mesh)
      if model > 1:
        assert split > 0.8 * run["total_bytes"], (case, mesh)  # the matrices and their state


def test_the_noise_of_a_key_is_the_same_array_on_every_mesh(results):
  assert results["noise_equal"] == {mesh: True for mesh in MESHES}


def test_sharded_noise_std_is_sigma_c_once(results):
  assert results["noise_spec"] == str(PartitionSpec(None, "model"))
  n, rms = results["noise_size"], results["noise_rms_over_std"]
  lo, hi = std_interval(n, 1.0)
  assert lo <= rms <= hi
  # Noise per data shard, averaged (privacy bug) or summed (utility bug), must fail.
  for wrong in (1 / np.sqrt(2), np.sqrt(2)):
    lo_w, hi_w = std_interval(n, wrong)
    assert not lo_w <= rms <= hi_w
  assert abs(results["noise_mean"]) < 6 / np.sqrt(n)


def test_the_rule_splits_the_largest_divisible_axis():
  assert leaf_spec((50257, 768), 8) == PartitionSpec(None, "model")
  assert leaf_spec((3072, 768), 4) == PartitionSpec("model")
  assert leaf_spec((128, 128), 2) == PartitionSpec(None, "model")  # ties: the later axis
  assert leaf_spec((768,), 8) == PartitionSpec()
  assert leaf_spec((8, 8), 8) == PartitionSpec()  # small
  assert leaf_spec((3072, 768), 1) == PartitionSpec()


def test_a_leaf_that_cannot_be_split_is_named():
  params = {"blocks": {"fc": jnp.zeros((1023, 5))}}
  with pytest.raises(ValueError, match=r"Leaf \['blocks'\]\['fc'\] of shape \(1023, 5\)") as err:
    param_specs(params, 2)
  assert "\n" not in str(err.value)


def test_state_layouts_follow_the_parameters():
  params = {"w": jnp.zeros((64, 32)), "b": jnp.zeros((32,))}
  state = {"mu": jnp.zeros((64, 32)), "history": jnp.zeros((3, 64, 32)), "count": jnp.int32(0)}
  specs = state_specs(state, params, 4)
  assert specs == {"mu": PartitionSpec("model"), "history": PartitionSpec(None, "model"),
                   "count": PartitionSpec()}


@pytest.mark.parametrize("text", ["2x", "0x8", "2*4", "ax4", "2x4x1"])
def test_a_bad_mesh_shape_is_refused(text):
  with pytest.raises(ValueError, match="DATAxMODEL"):
    parse_mesh_shape(text)


def test_a_mesh_must_use_every_device():
  devices = jax.devices() * 8  # only counted
  assert parse_mesh_shape("2x4") == (2, 4)
  with pytest.raises(ValueError, match=r"The mesh 3x2 needs positive axis sizes whose product "
                                       r"is the 8 devices"):
    model_mesh(3, 2, devices=devices[:8])


def test_dpmuon_train_refuses_a_mesh_that_does_not_fit_the_devices(tmp_path, capsys):
  from dpmuon_jax import cli

  code = cli.main(["train", "--mesh", "2x4", "--max-steps", "1", "--no-progress", "--no-plot",
                   "--output-dir", str(tmp_path / "run")])
  err = capsys.readouterr().err.strip()
  assert code == 2
  n = jax.device_count()
  fits = f"{n} devices (e.g. {n}x1 or 1x{n})" if n > 1 else "1 device (only 1x1)"
  assert err == (f"dpmuon train: error: --mesh: The mesh 2x4 needs positive axis sizes whose "
                 f"product is the {fits}.")


def test_train_lm_refuses_a_malformed_mesh_before_loading_anything(tmp_path):
  from dpmuon_jax.text.train import LMTrainConfig, train_lm

  with pytest.raises(ValueError, match="DATAxMODEL"):
    train_lm(LMTrainConfig(data_dir=str(tmp_path / "absent"), mesh="2by4"))


_TRAINER_SCRIPT = """
import json, sys
from dpmuon_jax.training.trainer import TrainConfig, train
out = {}
for name, layout in (("one", {}), ("mesh", {"mesh": "1x2"})):
  cfg = TrainConfig(model="mlp", max_steps=2, seed=1, batch_size=64, epochs=1, progress=False,
                    plot=False, output_dir=f"{sys.argv[1]}/{name}", **layout)
  out[name] = train(cfg)
print(json.dumps(out))
"""


def test_dpmuon_train_on_a_model_mesh_matches_one_device(tmp_path):
  env = host_devices_env(2, TF_CPP_MIN_LOG_LEVEL="3")
  proc = subprocess.run([sys.executable, "-c", _TRAINER_SCRIPT, str(tmp_path)], env=env,
                        capture_output=True, text=True, timeout=600, cwd=HERE.parent)
  assert proc.returncode == 0, proc.stderr[-3000:]
  results = json.loads(proc.stdout.strip().splitlines()[-1])
  one, mesh = results["one"], results["mesh"]
  assert one["releases"] == mesh["releases"] == 2
  assert one["epsilon_spent"] == mesh["epsilon_spent"]
  np.testing.assert_allclose(one["final_test_loss"], mesh["final_test_loss"], rtol=1e-5)


TEXT_DIR = Path(text_folder.TEXT_DIR)
_LM_SCRIPT = """
import json, sys
sys.path.insert(0, sys.argv[2])
from test_text_train import _tiny_config
from pathlib import Path
from dpmuon_jax.text.train import train_lm
from devices import host_devices_env
out = {name: train_lm(_tiny_config(Path(sys.argv[1]) / name, generate_splits=(), steps=2,
                                   clipped_sum_method="ghost", **layout))
       for name, layout in (("one", {}), ("mesh", {"mesh": "1x2"}))}
try:
  train_lm(_tiny_config(Path(sys.argv[1]) / "bad", mesh="3x1"))
  refused = ""
except ValueError as error:
  refused = str(error)
print(json.dumps({"refused": refused, **{k: {"nll": v["valid_nll"], "releases": v["releases"]}
                                         for k, v in out.items()}}))
"""


@text_folder.needs_text_data
def test_train_lm_on_a_model_mesh_matches_one_device(tmp_path):
  env = host_devices_env(2, TF_CPP_MIN_LOG_LEVEL="3")
  proc = subprocess.run([sys.executable, "-c", _LM_SCRIPT, str(tmp_path), str(HERE)], env=env,
                        capture_output=True, text=True, timeout=600, cwd=HERE.parent)
  assert proc.returncode == 0, proc.stderr[-3000:]
  results = json.loads(proc.stdout.strip().splitlines()[-1])
  assert results["one"]["releases"] == results["mesh"]["releases"] == 2
  assert results["mesh"]["nll"] == pytest.approx(results["one"]["nll"], rel=1e-5)
  assert results["refused"].startswith("--mesh: The mesh 3x1 needs positive axis sizes whose "
                                       "product is the 2 devices")
