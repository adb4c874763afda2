"""BandMF noise through every dp_* optimizer, make_private, both command lines and a resume."""

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time

import chex
import dp_accounting
import jax
import jax.numpy as jnp
import pytest

pytest.importorskip("jax_privacy")

from dpmuon_jax.optimizers import registry  # noqa: E402
from dpmuon_jax.privacy.accounting import participations  # noqa: E402
from dpmuon_jax.privacy.release import BandMFReleaseState  # noqa: E402
from dpmuon_jax.privacy.setup import make_private  # noqa: E402
from dpmuon_jax.training.export import load_exported  # noqa: E402
from dpmuon_jax.training.journal import read_journal  # noqa: E402
from dpmuon_jax.training.trainer import JOURNAL_NAME, TrainConfig, train  # noqa: E402

BANDMF = {"noise": "bandmf", "bands": 3, "steps": 5}


def _release_states(state):
  return [s for s in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, BandMFReleaseState))
          if isinstance(s, BandMFReleaseState)]


@pytest.mark.parametrize("name", registry.names())
def test_every_registered_optimizer_takes_bandmf_noise(name):
  params = {"w": jnp.ones((4, 3)), "b": jnp.zeros((3,))}
  release = {"l2_clip_norm": 1.0, "noise_multiplier": 1.0, "denominator": 8.0, "key": 0}
  optimizer = registry.build(name, None, {**release, **BANDMF})
  assert optimizer.release.bands == 3
  states = _release_states(optimizer.init(params))
  assert len(states) == 1  # ONE release, its buffers of the parameters' shapes
  iid = registry.build(name, None, release)
  assert iid.release.bands == 1 and not _release_states(iid.init(params))


@pytest.fixture(scope="module")
def blt():
  from dpmuon_jax.privacy.correlated import blt_strategy

  return blt_strategy(5, 2, 2)  # T = 5 releases, k = 2 buffers, participations 2 apart


@pytest.mark.parametrize("name", registry.names())
def test_every_registered_optimizer_takes_a_built_blt_strategy(name, blt):
  params = {"w": jnp.ones((4, 3)), "b": jnp.zeros((3,))}
  release = {"l2_clip_norm": 1.0, "noise_multiplier": 1.0, "denominator": 8.0, "key": 0}
  optimizer = registry.build(name, None, {**release, "noise": blt})
  assert optimizer.release.buffers == 2 and optimizer.release.blt_steps == 5
  states = _release_states(optimizer.init(params))
  assert len(states) == 1  # ONE release, its k buffers of the parameters' shapes
  assert jax.tree.leaves(states[0].buffers)[0].shape[0] == 2


def test_a_blt_dp_muon_is_accounted_as_one_gaussian_mechanism_without_amplification(blt):
  """dp_muon(noise=BLTStrategy) under 2-cyclic sampling: after T releases ε is that of ONE
  Gaussian mechanism of σ/Δ_T (dp_accounting directly), for the σ calibrated to ε = 3;
  plain Poisson sampling (1 group) is refused."""
  import dpmuon_jax as dm
  from dpmuon_jax.privacy.accounting import PrivacyLedger, calibrate_blt_noise_multiplier
  from dpmuon_jax.privacy.correlated import blt_sensitivity
  from dpmuon_jax.privacy.sampling import PoissonSampler

  sigma = calibrate_blt_noise_multiplier(3.0, 1e-5, blt)
  optimizer = dm.dp_muon(0.02, 1.0, sigma, 8.0, key=0, noise=blt)
  sampler = PoissonSampler(100, 0.16, key=0, cycle_length=2)
  ledger = PrivacyLedger(sampler, optimizer, 1e-5, 3.0)
  ledger.record(sampler, optimizer, 5)
  accountant = dp_accounting.rdp.RdpAccountant()
  accountant.compose(dp_accounting.GaussianDpEvent(sigma / blt_sensitivity(blt)))
  assert ledger.epsilon() == pytest.approx(accountant.get_epsilon(1e-5), rel=1e-9)
  assert 3.0 * (1 - 1e-3) <= ledger.epsilon() <= 3.0
  with pytest.raises(ValueError, match="at least 2 groups"):
    PrivacyLedger(PoissonSampler(100, 0.08, key=0), optimizer, 1e-5)


def test_noise_settings_are_refused_where_they_do_not_fit():
  import dpmuon_jax as dm

  with pytest.raises(ValueError, match="needs bands=b and steps=T"):
    dm.dp_muon(0.02, 1.0, 1.0, 8.0, noise="bandmf", bands=4)
  with pytest.raises(ValueError, match="noise='iid'"):
    dm.dp_sgd(0.1, 1.0, 1.0, 8.0, bands=4)
  with pytest.raises(ValueError, match="noise must be one of"):
    dm.dp_adam(1e-3, 1.0, 1.0, 8.0, noise="blt-typo")
  with pytest.raises(ValueError, match="must not exceed dataset_size"):
    make_private(target_epsilon=4, target_delta=1e-5, dataset_size=1000, expected_batch_size=300,
                 l2_clip_norm=1.0, steps=10, noise="bandmf", bands=4)
  with pytest.raises(ValueError, match="--bands goes with --noise bandmf"):
    TrainConfig(noise="bandmf")


def test_make_private_calibrates_sigma_for_the_participations_of_cyclic_sampling():
  """σ must reach ε over ⌈T/b⌉ compositions at the within-group rate b·B/N (an independent
  dp_accounting RDP computation), and the sampler's expected batch stays B."""
  n, batch, bands, delta = 45_000, 256, 4, 1e-5
  setup = make_private(target_epsilon=4.0, target_delta=delta, dataset_size=n,
                       expected_batch_size=batch, l2_clip_norm=1.0, epochs=6, key=0,
                       noise="bandmf", bands=bands)
  assert setup.sampler.cycle_length == bands
  assert setup.sampler.expected_batch_size == pytest.approx(batch)
  assert setup.release.release.bands == bands
  compositions = math.ceil(setup.steps / bands)
  event = dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(
      bands * batch / n, dp_accounting.GaussianDpEvent(setup.noise_multiplier)), compositions)
  accountant = dp_accounting.rdp.RdpAccountant()
  accountant.compose(event)
  epsilon = accountant.get_epsilon(delta)
  assert 3.99 <= epsilon <= 4.0
  assert setup.ledger.epsilon_after(setup.steps) == pytest.approx(epsilon, rel=1e-6)
  assert participations(setup.steps, bands) == compositions
  # Accounted as plain Poisson at rate B/N over T compositions, this σ would spend more.
  iid = make_private(target_epsilon=4.0, target_delta=delta, dataset_size=n,
                     expected_batch_size=batch, l2_clip_norm=1.0, epochs=6, key=0)
  assert iid.noise_multiplier < setup.noise_multiplier


def test_dpmuon_account_gives_make_privates_sigma(capsys):
  from dpmuon_jax.cli import main

  setup = make_private(target_epsilon=4.0, target_delta=1e-5, dataset_size=45_000,
                       expected_batch_size=256, l2_clip_norm=1.0, steps=1055, key=0,
                       noise="bandmf", bands=4)
  assert main(["account", "--epsilon", "4", "--sampling-rate", str(256 / 45_000), "--steps",
               "1055", "--noise", "bandmf", "--bands", "4"]) == 0
  printed = json.loads(capsys.readouterr().out)
  assert printed["sigma"] == pytest.approx(setup.noise_multiplier, rel=1e-4)
  assert printed["participations"] == 264 and printed["noise"] == "bandmf"


def test_make_private_builds_blt_for_one_participation_per_epoch_and_no_amplification():
  """noise="blt": ⌊N/B⌋ groups (each sampled at rate ≤ 1, expected batch still B), the
  k-buffer BLT for T releases that far apart, and σ for ONE Gaussian mechanism of σ/Δ_T
  (dp_accounting directly). Accounted with Poisson amplification at the within-group rate,
  this σ would claim a far smaller ε: the test fails if amplification were applied."""
  from dpmuon_jax.privacy.accounting import compute_epsilon
  from dpmuon_jax.privacy.correlated import BLTStrategy, blt_sensitivity, blt_strategy

  n, batch, delta = 4_500, 64, 1e-5
  setup = make_private(target_epsilon=4.0, target_delta=delta, dataset_size=n,
                       expected_batch_size=batch, l2_clip_norm=1.0, steps=300, key=0,
                       noise="blt", buffers=3)
  groups = n // batch  # 70
  assert setup.sampler.cycle_length == groups
  assert setup.sampler.expected_batch_size == pytest.approx(batch)
  strategy = setup.release_kwargs["noise"]
  assert isinstance(strategy, BLTStrategy)
  assert (strategy.steps, strategy.buffers, strategy.min_sep) == (300, 3, groups)
  chex.assert_trees_all_equal(tuple(strategy), tuple(blt_strategy(300, 3, groups)))
  accountant = dp_accounting.rdp.RdpAccountant()
  accountant.compose(dp_accounting.GaussianDpEvent(
      setup.noise_multiplier / blt_sensitivity(strategy, 300, groups)))
  epsilon = accountant.get_epsilon(delta)
  assert 3.99 <= epsilon <= 4.0
  assert setup.ledger.epsilon_after(300) == pytest.approx(epsilon, rel=1e-9)
  amplified = compute_epsilon(setup.noise_multiplier, groups * batch / n,
                              participations(300, groups), delta)
  assert amplified < 0.5 * epsilon
  optimizer = registry.build("dp_muon", None, setup.release_kwargs)
  assert optimizer.release.buffers == 3 and optimizer.release.blt_min_sep == groups
  setup.ledger.check(setup.sampler, optimizer)


def test_named_blt_noise_is_refused_where_it_does_not_fit():
  import dpmuon_jax as dm

  common = dict(target_epsilon=4, target_delta=1e-5, dataset_size=1000,
                expected_batch_size=100, l2_clip_norm=1.0, steps=10)
  with pytest.raises(ValueError, match="noise='blt' needs buffers"):
    make_private(**common, noise="blt")
  with pytest.raises(ValueError, match="buffers goes with noise='blt'"):
    make_private(**common, buffers=4)
  with pytest.raises(ValueError, match="buffers must be an int in"):
    make_private(**common, noise="blt", buffers=16)
  with pytest.raises(ValueError, match="secure_noise"):
    make_private(**common, noise="blt", buffers=2, secure_noise=True)
  with pytest.raises(ValueError, match="blt_strategy"):  # a dp_* optimizer takes it built
    dm.dp_muon(0.02, 1.0, 1.0, 8.0, noise="blt")
  with pytest.raises(ValueError, match="--buffers goes with --noise blt"):
    TrainConfig(noise="blt")
  with pytest.raises(ValueError, match="at most 15"):
    TrainConfig(noise="blt", buffers=16)


def test_dpmuon_account_gives_make_privates_blt_sigma_and_its_epsilon(capsys):
  from dpmuon_jax.cli import main

  setup = make_private(target_epsilon=4.0, target_delta=1e-5, dataset_size=4_500,
                       expected_batch_size=64, l2_clip_norm=1.0, steps=300, key=0,
                       noise="blt", buffers=3)
  common = ["--sampling-rate", str(64 / 4_500), "--steps", "300", "--noise", "blt",
            "--buffers", "3"]
  printed = []
  for given in (["--epsilon", "4"], ["--sigma", str(setup.noise_multiplier)]):
    assert main(["account", *given, *common]) == 0
    printed.append(json.loads(capsys.readouterr().out))
  assert printed[0]["sigma"] == pytest.approx(setup.noise_multiplier, rel=1e-9)
  assert printed[1]["epsilon"] == pytest.approx(setup.ledger.epsilon_after(300), rel=1e-9)
  assert (printed[0]["noise"], printed[0]["buffers"], printed[0]["cycle_length"]) == (
      "blt", 3, 70)


def test_published_runs_compose_as_each_was_accounted():
  """``dpmuon compare``'s combined ε: an iid, a BandMF (b = 4) and a BLT run's ledgers compose
  to dp_accounting's composition of the three events written out by hand: T Poisson releases;
  ⌈T/b⌉ at the within-group rate; one Gaussian of σ/Δ_T. Composed as T Poisson releases of
  σ at the recorded rate each (what compare did before), BandMF and BLT runs would not."""
  from dpmuon_jax.privacy.accounting import PrivacyLedger, composed_ledgers_epsilon
  from dpmuon_jax.privacy.correlated import blt_sensitivity

  common = dict(target_epsilon=4.0, target_delta=1e-5, dataset_size=4_500,
                expected_batch_size=64, l2_clip_norm=1.0, steps=300)
  setups = [make_private(**common, key=0),
            make_private(**common, key=1, noise="bandmf", bands=4),
            make_private(**common, key=2, noise="blt", buffers=3)]  # the BLT above
  for setup in setups:
    setup.ledger.record(setup.sampler, setup.release, 300)
  iid, bandmf, blt = (s.noise_multiplier for s in setups)
  q = 64 / 4_500
  events = [
      dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(
          q, dp_accounting.GaussianDpEvent(iid)), 300),
      dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(
          4 * q, dp_accounting.GaussianDpEvent(bandmf)), 75),
      dp_accounting.GaussianDpEvent(
          blt / blt_sensitivity(setups[2].release_kwargs["noise"], 300, 70)),
  ]
  accountant = dp_accounting.rdp.RdpAccountant()
  accountant.compose(dp_accounting.ComposedDpEvent(events))
  ledgers = [PrivacyLedger.from_json(s.ledger.to_json()) for s in setups]
  combined = composed_ledgers_epsilon(ledgers, 1e-5)
  assert combined == pytest.approx(accountant.get_epsilon(1e-5), rel=1e-9)
  assert max(s.ledger.epsilon() for s in setups) < combined < 12.0
  as_poisson = dp_accounting.rdp.RdpAccountant()
  for setup in setups:
    as_poisson.compose(dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(
        setup.sampler.sampling_rate, dp_accounting.GaussianDpEvent(setup.noise_multiplier)),
        300))
  assert as_poisson.get_epsilon(1e-5) > 1.5 * combined


_RUN = dict(model="mlp", dataset="tiny", optimizer="dp_muon", epsilon=50.0, delta=1e-3,
            batch_size=16, epochs=4, seed=3, progress=False, plot=False, learning_rate=0.02,
            checkpoint_every=3)

_KILLABLE = """
import json, sys
import numpy as np
from dpmuon_jax.data.images import ImageDataset
from dpmuon_jax.training.trainer import TrainConfig, train
rng = np.random.default_rng(0)
x = rng.integers(0, 256, size=(80, 8, 8, 1), dtype=np.uint8)
y = rng.integers(0, 3, size=(80,))
data = ImageDataset(x[:64], y[:64], x[64:], y[64:], num_classes=3, name="tiny")
train(TrainConfig(**json.loads(sys.argv[1])), data)
"""


# (settings, the certificate's (noise, bands or buffers, groups, participations)): 64 examples,
# B = 16, 16 releases; BLT's groups are ⌊N/B⌋ = 4.
_NOISES = {"bandmf": ({"noise": "bandmf", "bands": 2}, ("bandmf", 2, 2, 8)),
           "blt": ({"noise": "blt", "buffers": 2}, ("blt", 2, 4, 4))}


@pytest.mark.parametrize("noise", sorted(_NOISES))
def test_a_sigkilled_correlated_noise_run_resumes_to_the_uninterrupted_parameters(
    tmp_path, tiny_data, noise):
  """DP-Muon over BandMF (b = 2) or BLT (k = 2) noise, killed after 7 releases (its last
  checkpoint at 6 or earlier): the resumed run, in a new process, rebuilds the same strategy,
  restores the noise buffers, replays the lost releases with their keys and ends on the
  uninterrupted run's parameters, bit for bit, with its certificate."""
  settings, (name, size, groups, participated) = _NOISES[noise]
  run = {**_RUN, **settings}
  whole = train(TrainConfig(**run, output_dir=str(tmp_path / "whole")), tiny_data)
  killed = str(tmp_path / "killed")
  journal = os.path.join(killed, JOURNAL_NAME)
  child = subprocess.Popen([sys.executable, "-c", _KILLABLE,
                            json.dumps({**run, "output_dir": killed})],
                           env={**os.environ, "JAX_PLATFORMS": "cpu"})
  try:
    deadline = time.time() + 240
    while len(read_journal(journal)) < 7 and child.poll() is None and time.time() < deadline:
      time.sleep(0.02)
  finally:
    child.send_signal(signal.SIGKILL)
    child.wait()
  made = len(read_journal(journal))
  assert 7 <= made < whole["releases"]
  resumed = train(TrainConfig(**run, output_dir=killed, resume=True), tiny_data)
  assert resumed["releases"] == whole["releases"] == 16
  assert resumed["epsilon_spent"] == pytest.approx(whole["epsilon_spent"], rel=1e-12)
  ours = load_exported(os.path.join(killed, "export"))
  theirs = load_exported(os.path.join(str(tmp_path / "whole"), "export"))
  chex.assert_trees_all_equal(ours.params, theirs.params)
  mechanism = ours.certificate["mechanism"]
  assert mechanism == theirs.certificate["mechanism"]
  assert (mechanism["noise"], mechanism.get("bands", mechanism.get("buffers")),
          mechanism["cycle_length"], mechanism["participations"]) == (
              name, size, groups, participated)
  assert mechanism["sampling"] == f"cyclic poisson over {groups} groups"


@pytest.mark.parametrize("noise", sorted(_NOISES))
def test_a_correlated_noise_run_never_goes_on_with_fresh_noise_after_a_lost_release(
    tmp_path, tiny_data, noise):
  """Its last checkpoint lost, a BandMF or BLT run resumed with a changed setting cannot
  replay release 4: with independent noise it would be charged and the run go on with fresh
  keys (tests/test_journal.py), but that second branch of releases is outside the cyclic,
  one-pass accounting, so the resume is refused. The export still charges the lost release."""
  from dpmuon_jax.training.export import export_run
  from dpmuon_jax.training.trainer import TrainingError

  settings, _ = _NOISES[noise]
  run = {**_RUN, **settings, "checkpoint_every": 1, "output_dir": str(tmp_path / "run")}
  train(TrainConfig(**run, max_steps=4), tiny_data)
  shutil.rmtree(tmp_path / "run" / "checkpoints" / "4")
  with pytest.raises(TrainingError, match="fresh noise"):
    train(TrainConfig(**{**run, "augment": True}, resume=True), tiny_data)
  certificate = load_exported(export_run(str(tmp_path / "run"))).certificate
  assert certificate["releases"] == 4 and certificate["releases_in_checkpoint"] == 3
