"""Accounting: dp-accounting reference values, calibration, the privacy ledger."""

import logging
import math
import warnings

import dp_accounting
import numpy as np
import pytest
from dp_accounting.rdp import rdp_privacy_accountant

import dpmuon_jax as dm
from dpmuon_jax.privacy import accounting as acc
from dpmuon_jax.privacy.accounting import (
    CALIBRATION_RTOL,
    RDP_ORDERS,
    PrivacyLedger,
    calibrate_noise_multiplier,
    compute_epsilon,
)
from dpmuon_jax.privacy.sampling import PoissonSampler

N, Q, SIGMA, C, DELTA = 10_000, 0.01, 1.1, 1.0, 1e-6


def _event(sigma, q):
  return dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma))


def _sampler(n=N, q=Q, key=0):
  return PoissonSampler(n, q, key=key)


def _release(sigma=SIGMA, clip=C, denominator=Q * N, neighbouring="add_remove", key=0):
  return dm.dp_release(clip, sigma, denominator, key=key, neighbouring=neighbouring)


def test_reference_value_of_dp_accounting():
  # dp-accounting's own test: sigma = 4.530877117 gives exactly (1, 1e-6)-DP for q = 1, T = 1
  # with the fine orders 1.000..99.999 (step 1e-3).
  fine = rdp_privacy_accountant.RdpAccountant([0.001 * i for i in range(1001, 100000)])
  fine.compose(_event(4.530877117, 1.0))
  assert fine.get_epsilon(1e-6) == pytest.approx(1.0, abs=1e-7)
  # Our default orders reach the same value to 1e-6 (never below the fine-grid optimum).
  ours = compute_epsilon(4.530877117, 1.0, 1, 1e-6)
  assert 1.0 - 1e-7 <= ours <= 1.0 + 1e-6
  assert compute_epsilon(4.530877117, 1.0, 1, 1e-6, "pld") == pytest.approx(1.0, rel=0.1)


def test_dense_orders_never_worse_than_dp_accounting_defaults():
  assert set(rdp_privacy_accountant.DEFAULT_RDP_ORDERS) <= set(RDP_ORDERS)
  default = rdp_privacy_accountant.RdpAccountant()
  default.compose(dp_accounting.SelfComposedDpEvent(_event(SIGMA, Q), 1000))
  assert compute_epsilon(SIGMA, Q, 1000, DELTA) <= default.get_epsilon(DELTA)


@pytest.mark.parametrize("sigma, q", [(0.6, 0.3), (1.1, 0.01), (3.0, 1.0)])
def test_rdp_epsilon_of_any_length_is_dp_accountings_for_that_many_releases(sigma, q):
  # compute_epsilon reuses one release's RDP curve for every T: it must be exactly what a
  # fresh RdpAccountant composing SelfComposed(event, T) gives, not an approximation.
  for steps in (1, 2, 7, 410, 100_000):
    fresh = rdp_privacy_accountant.RdpAccountant(RDP_ORDERS)
    fresh.compose(dp_accounting.SelfComposedDpEvent(_event(sigma, q), steps))
    assert compute_epsilon(sigma, q, steps, DELTA) == fresh.get_epsilon(DELTA), steps


def test_pld_is_tighter_than_rdp_on_the_same_events():
  rdp = compute_epsilon(SIGMA, Q, 1000, DELTA, "rdp")
  pld = compute_epsilon(SIGMA, Q, 1000, DELTA, "pld")
  assert 0.6 * rdp < pld < rdp


@pytest.mark.parametrize(
    "target, q, steps, accountant",
    [(1.0, 0.01, 1000, "rdp"), (8.0, 0.05, 300, "rdp"), (2.0, 0.02, 500, "pld")],
)
def test_calibration_meets_target_within_its_stated_tolerance(target, q, steps, accountant):
  sigma = calibrate_noise_multiplier(target, DELTA, q, steps, accountant)
  eps = compute_epsilon(sigma, q, steps, DELTA, accountant)
  assert (1 - CALIBRATION_RTOL) * target <= eps <= target  # 0.1 %, as documented
  assert compute_epsilon(0.98 * sigma, q, steps, DELTA, accountant) > eps


def test_epsilon_edge_cases():
  assert compute_epsilon(0.0, Q, 10, DELTA) == math.inf
  assert compute_epsilon(SIGMA, Q, 0, DELTA) == 0.0
  assert compute_epsilon(SIGMA, Q, 100, DELTA) < compute_epsilon(SIGMA, Q, 200, DELTA)
  assert compute_epsilon(2 * SIGMA, Q, 100, DELTA) < compute_epsilon(SIGMA, Q, 100, DELTA)


@pytest.mark.parametrize(
    "args",
    [
        (-1.0, Q, 10, DELTA),  # sigma < 0
        (SIGMA, 0.0, 10, DELTA),  # q = 0
        (SIGMA, 1.5, 10, DELTA),  # q > 1
        (SIGMA, Q, -1, DELTA),  # steps < 0
        (SIGMA, Q, 2.5, DELTA),  # steps not an int
        (SIGMA, Q, 10, 0.0),  # delta = 0
        (SIGMA, Q, 10, 1.0),  # delta = 1
    ],
)
def test_compute_epsilon_validates(args):
  with pytest.raises(ValueError):
    compute_epsilon(*args)
  with pytest.raises(ValueError, match="accountant"):
    compute_epsilon(SIGMA, Q, 10, DELTA, "moments")


@pytest.mark.parametrize(
    "args", [(0.0, DELTA, Q, 10), (-1.0, DELTA, Q, 10), (1.0, 0.0, Q, 10), (1.0, DELTA, Q, 0)]
)
def test_calibrate_validates(args):
  with pytest.raises(ValueError):
    calibrate_noise_multiplier(*args)


def test_large_delta_warns():
  with pytest.warns(UserWarning, match="1/N"):
    compute_epsilon(SIGMA, Q, 10, 1e-3, dataset_size=1000)
  with pytest.warns(UserWarning, match="1/N"):
    PrivacyLedger(_sampler(n=100, q=0.1), _release(denominator=10.0), 0.05)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    compute_epsilon(SIGMA, Q, 10, 1e-4, dataset_size=1000)
    PrivacyLedger(_sampler(), _release(), DELTA)


def test_no_dp_accounting_warnings_leak(caplog, recwarn, monkeypatch):
  # Large q and small sigma make dp-accounting's fractional orders fail to converge.
  q, sigma, steps = 0.9, 0.3, 7
  # Whatever earlier tests or imports did to absl's logger (level, propagation), the
  # control below must be able to see dp-accounting's records: pin both here.
  monkeypatch.setattr(logging.getLogger("absl"), "propagate", True)
  with caplog.at_level(logging.WARNING, logger="absl"), caplog.at_level(logging.WARNING):
    direct = rdp_privacy_accountant.RdpAccountant(RDP_ORDERS)
    direct.compose(dp_accounting.SelfComposedDpEvent(_event(sigma, q), steps))
    expected = direct.get_epsilon(DELTA)
  assert any("converge" in r.getMessage() for r in caplog.records)  # the control leaks
  caplog.clear()
  with caplog.at_level(logging.DEBUG, logger="absl"), caplog.at_level(logging.DEBUG):
    got = compute_epsilon(sigma, q, steps, DELTA)
    calibrate_noise_multiplier(50.0, DELTA, q, steps)
    compute_epsilon(sigma, q, steps, DELTA, "pld")
  assert got == expected
  assert not caplog.records
  assert not [w for w in recwarn if not issubclass(w.category, DeprecationWarning)]
  # The filter is removed afterwards: other absl warnings still reach the user.
  with caplog.at_level(logging.WARNING, logger="absl"), caplog.at_level(logging.WARNING):
    logging.getLogger("absl").warning("still visible")
  assert [r.getMessage() for r in caplog.records] == ["still visible"]


def test_ledger_reads_settings_from_the_objects():
  sampler, release = _sampler(), _release(denominator=123.0)
  ledger = PrivacyLedger(sampler, release, DELTA, target_epsilon=3.0)
  c = ledger.config
  assert (c.sampling_rate, c.dataset_size) == (sampler.sampling_rate, sampler.dataset_size)
  spec = release.release
  assert (c.noise_multiplier, c.l2_clip_norm, c.denominator, c.neighbouring) == (
      spec.noise_multiplier, spec.l2_clip_norm, spec.denominator, spec.neighbouring
  )
  assert ledger.count == 0 and ledger.epsilon() == 0.0 and ledger.seeded is True
  unseeded = PrivacyLedger(_sampler(key=None), _release(key=None), DELTA)
  assert unseeded.seeded is False


def test_ledger_epsilon_equals_a_fresh_accountant_on_the_same_history():
  sampler, release = _sampler(), _release()
  # PLD's self-composition (FFT) and one-at-a-time composition round differently.
  for accountant, rel in (("rdp", 1e-12), ("pld", 1e-6)):
    ledger = PrivacyLedger(sampler, release, DELTA, accountant=accountant)
    for _ in range(3):
      ledger.record(sampler, release)
    ledger.record(sampler, release, count=8)
    ledger.record(sampler, release)
    assert ledger.count == 12
    fresh = acc.make_accountant(accountant)
    for _ in range(12):  # one event per release, composed one at a time
      fresh.compose(_event(SIGMA, Q))
    assert ledger.epsilon() == pytest.approx(fresh.get_epsilon(DELTA), rel=rel)
  # Replace-one adjacency is accounted with sigma/2.
  replace = PrivacyLedger(sampler, _release(neighbouring="replace_one"), DELTA)
  replace.record(sampler, _release(neighbouring="replace_one"), count=12)
  assert replace.epsilon() == compute_epsilon(SIGMA / 2, Q, 12, DELTA)


@pytest.mark.parametrize(
    "sampler_kw, release_kw",
    [
        ({}, {"sigma": SIGMA * 1.01}),
        ({}, {"clip": 2.0}),
        ({}, {"denominator": Q * N + 1}),
        ({}, {"neighbouring": "replace_one"}),
        ({"q": Q * 1.01}, {}),
        ({"n": N + 1}, {}),
    ],
)
def test_ledger_refuses_a_release_under_other_settings(sampler_kw, release_kw):
  ledger = PrivacyLedger(_sampler(), _release(), DELTA, target_epsilon=5.0)
  ledger.record(_sampler(), _release())
  with pytest.raises(ValueError, match="other privacy settings"):
    ledger.record(_sampler(**sampler_kw), _release(**release_kw))
  assert ledger.count == 1


def test_ledger_accepts_a_dp_optimizer_and_the_spec():
  ledger = PrivacyLedger(_sampler(), _release(), DELTA)
  ledger.record(_sampler(), dm.dp_sgd(0.1, C, SIGMA, Q * N, key=0))
  ledger.record(_sampler(), _release().release)
  assert ledger.count == 2
  with pytest.raises(TypeError):
    ledger.record(_sampler(), object())


def test_json_round_trip_and_compatibility():
  sampler, release = _sampler(key=None), _release(key=None)
  ledger = PrivacyLedger(sampler, release, DELTA, target_epsilon=2.0, accountant="pld")
  ledger.record(sampler, release, count=17)
  text = ledger.to_json()
  loaded = PrivacyLedger.from_json(text)
  assert loaded.config == ledger.config
  assert (loaded.count, loaded.seeded) == (17, False)
  assert loaded.epsilon() == ledger.epsilon()
  assert PrivacyLedger.from_json(ledger.to_dict()).config == ledger.config
  ledger.check_compatible(loaded)
  loaded.record(sampler, release)  # the loaded ledger still checks the objects
  assert loaded.count == 18
  with pytest.raises(ValueError, match="other privacy settings"):
    loaded.record(sampler, _release(sigma=2 * SIGMA))
  for other in (
      PrivacyLedger(sampler, release, 1e-7, target_epsilon=2.0, accountant="pld"),
      PrivacyLedger(sampler, release, DELTA, target_epsilon=3.0, accountant="pld"),
      PrivacyLedger(sampler, release, DELTA, target_epsilon=2.0, accountant="rdp"),
      PrivacyLedger(sampler, _release(clip=0.5), DELTA, target_epsilon=2.0, accountant="pld"),
  ):
    with pytest.raises(ValueError, match="changed privacy configuration"):
      ledger.check_compatible(other)


def test_max_steps_and_can_release_agree_with_compute_epsilon():
  sampler, release = _sampler(), _release()
  target = 1.5
  ledger = PrivacyLedger(sampler, release, DELTA, target_epsilon=target)
  m = ledger.max_steps()
  assert m > 0
  assert compute_epsilon(SIGMA, Q, m, DELTA) <= target < compute_epsilon(SIGMA, Q, m + 1, DELTA)
  assert ledger.can_release(m) and not ledger.can_release(m + 1)
  ledger.record(sampler, release, count=m - 1)
  assert ledger.can_release() and not ledger.can_release(2)
  assert ledger.epsilon_after(1) <= target < ledger.epsilon_after(2)
  ledger.record(sampler, release)
  assert not ledger.can_release()
  ledger.record(sampler, release)  # a release that happened is always counted
  assert ledger.count == m + 1 and ledger.epsilon() > target
  with pytest.raises(ValueError, match="target_epsilon"):
    PrivacyLedger(sampler, release, DELTA).max_steps()


def test_max_steps_zero_when_one_release_is_too_many():
  ledger = PrivacyLedger(_sampler(), _release(sigma=0.3), DELTA, target_epsilon=0.01)
  assert ledger.max_steps() == 0 and not ledger.can_release()
  with pytest.warns(UserWarning, match="NO differential privacy"):
    no_noise = _release(sigma=0.0)
  silent = PrivacyLedger(_sampler(), no_noise, DELTA, target_epsilon=10.0)
  assert silent.max_steps() == 0
  assert silent.epsilon_after(1) == math.inf


def test_ledger_validates():
  with pytest.raises(ValueError):
    PrivacyLedger(_sampler(), _release(), 0.0)
  with pytest.raises(ValueError):
    PrivacyLedger(_sampler(), _release(), DELTA, target_epsilon=-1.0)
  with pytest.raises(ValueError):
    PrivacyLedger(_sampler(), _release(), DELTA, accountant="moments")
  with pytest.raises(ValueError):
    PrivacyLedger(_sampler(), _release(), DELTA).record(_sampler(), _release(), count=-1)


def test_event_matches_recorded_history():
  ledger = PrivacyLedger(_sampler(), _release(), DELTA)
  assert isinstance(ledger.event(), dp_accounting.NoOpDpEvent)
  ledger.record(_sampler(), _release(), count=3)
  assert ledger.event() == dp_accounting.SelfComposedDpEvent(_event(SIGMA, Q), 3)
  np.testing.assert_allclose(
      acc.make_accountant().compose(ledger.event()).get_epsilon(DELTA), ledger.epsilon()
  )
