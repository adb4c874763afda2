"""The BandMF and BLT releases: C⁻¹-correlated noise, cyclic Poisson sampling and their
accounting."""

import dataclasses
import itertools

import dp_accounting
import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("jax_privacy")

from dpmuon_jax.privacy.accounting import (  # noqa: E402
    RDP_ORDERS,
    PrivacyLedger,
    calibrate_blt_noise_multiplier,
    participations,
)
from dpmuon_jax.privacy.correlated import (  # noqa: E402
    bandmf_strategy,
    blt_sensitivity,
    blt_strategy,
    dp_bandmf_release,
    dp_blt_release,
    strategy_matrix,
)
from dpmuon_jax.privacy.release import dp_release, noise_counter, with_noise_counter  # noqa: E402
from dpmuon_jax.privacy.sampling import PoissonSampler  # noqa: E402

C, SIGMA, D = 1.0, 1.3, 8.0


def _noise_of_releases(release, steps: int, dim: int) -> np.ndarray:
  """The noise of ``steps`` releases of a zero sum, on the sum's scale (released·D): T × dim."""
  params = {"w": jnp.zeros((dim,))}
  zeros = {"w": jnp.zeros((4, dim))}  # four examples whose queries are all zero
  state = release.init(params)
  update = jax.jit(release.update)
  rows = []
  for _ in range(steps):
    released, state = update(zeros, state, params)
    rows.append(np.asarray(released["w"], np.float64) * D)
  return np.stack(rows)


def test_the_strategy_is_banded_lower_triangular_with_unit_columns():
  matrix = strategy_matrix(bandmf_strategy(12, 3))
  np.testing.assert_allclose(np.linalg.norm(matrix, axis=0), 1.0, rtol=1e-5)
  rows, cols = np.indices(matrix.shape)
  assert np.all(matrix[(rows < cols) | (rows - cols >= 3)] == 0)
  assert np.all(np.diag(matrix) > 0)


def test_one_band_is_dp_release_bit_for_bit():
  ours = _noise_of_releases(dp_bandmf_release(C, SIGMA, D, bandmf_strategy(5, 1), key=3), 5, 64)
  iid = _noise_of_releases(dp_release(C, SIGMA, D, key=3), 5, 64)
  np.testing.assert_array_equal(ours, iid)


def test_the_noise_is_c_inverse_applied_to_the_iid_draws_of_the_same_keys():
  """Release t's noise is row t of σC·C⁻¹Z, Z the draws dp_release makes from the same key."""
  strategy = bandmf_strategy(6, 3)
  ours = _noise_of_releases(dp_bandmf_release(C, SIGMA, D, strategy, key=5), 6, 32)
  draws = _noise_of_releases(dp_release(C, SIGMA, D, key=5), 6, 32)  # σC·z_t
  expected = np.linalg.solve(strategy_matrix(strategy), draws)
  np.testing.assert_allclose(ours, expected, rtol=1e-4, atol=1e-5)
  assert not np.allclose(ours, draws, atol=1e-2)  # correlated, not the iid draws


def test_the_noise_covariance_over_releases_is_sigma_c_squared_c_inverse_c_inverse_t():
  """Each of d coordinates is an independent draw of the T-vector of noise, whose covariance
  is σ²C²·C⁻¹C⁻ᵀ. Each sample covariance entry has standard error √((Σ_ii Σ_jj + Σ_ij²)/d);
  every entry must lie within 5 of them (false alarm < 16 × 6e-7)."""
  steps, dim = 4, 40_000
  strategy = bandmf_strategy(steps, 2)
  noise = _noise_of_releases(dp_bandmf_release(C, SIGMA, D, strategy, key=11), steps, dim)
  inverse = np.linalg.inv(strategy_matrix(strategy))
  true = (SIGMA * C) ** 2 * inverse @ inverse.T
  sample = noise @ noise.T / dim
  se = np.sqrt((np.outer(np.diag(true), np.diag(true)) + true**2) / dim)
  assert np.all(np.abs(sample - true) <= 5 * se), (sample, true)
  assert abs(true[1, 0]) > 10 * se[1, 0]  # the check sees correlation: C⁻¹ is not diagonal


def test_a_release_past_the_strategy_is_nan():
  noise = _noise_of_releases(dp_bandmf_release(C, SIGMA, D, bandmf_strategy(2, 2), key=0), 3, 4)
  assert np.all(np.isfinite(noise[:2])) and np.all(np.isnan(noise[2]))


def test_cyclic_sampling_keeps_each_example_in_one_residue_class():
  n, q, b, steps = 2000, 0.2, 4, 40
  sampler = PoissonSampler(n, q, key=1, cycle_length=b)
  seen = [[] for _ in range(n)]
  sizes = []
  for t in range(steps):
    indices = sampler.sample_indices(t)
    sizes.append(len(indices))
    for i in indices:
      seen[i].append(t % b)
  assert all(len(set(residues)) <= 1 for residues in seen)
  assert sum(bool(r) for r in seen) > 0.8 * n  # most examples took part
  # Each step's size is Binomial(N, q/b): mean 100, sd ≈ 9.7; the mean of 40 within 5 SE.
  mean, sd = n * q / b, np.sqrt(n * q / b * (1 - q / b))
  assert abs(np.mean(sizes) - mean) < 5 * sd / np.sqrt(steps)
  assert sampler.expected_batch_size == mean


def test_epsilon_is_that_of_the_participations_by_dp_accounting():
  n, q, b, steps = 1000, 0.1, 4, 10
  sampler = PoissonSampler(n, q, key=1, cycle_length=b)
  release = dp_bandmf_release(C, SIGMA, D, bandmf_strategy(steps, b), key=1)
  ledger = PrivacyLedger(sampler, release, 1e-5)
  for _ in range(steps):
    ledger.record(sampler, release)
  accountant = dp_accounting.rdp.RdpAccountant()
  accountant.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(
      SIGMA)), 3)  # ⌈10/4⌉ participations
  np.testing.assert_allclose(ledger.epsilon(), accountant.get_epsilon(1e-5), rtol=1e-9)
  assert participations(steps, b) == 3


def test_max_steps_counts_whole_cycles():
  sampler = PoissonSampler(1000, 0.1, key=1, cycle_length=4)
  release = dp_bandmf_release(C, SIGMA, D, bandmf_strategy(40, 4), key=1)
  ledger = PrivacyLedger(sampler, release, 1e-5, target_epsilon=1.0)
  plain = PrivacyLedger(PoissonSampler(1000, 0.1, key=1), dp_release(C, SIGMA, D, key=1), 1e-5,
                        target_epsilon=1.0)
  assert ledger.max_steps() == 4 * plain.max_steps()


@pytest.mark.parametrize("cycle_length", [1, 2])
def test_bandmf_without_enough_groups_is_refused(cycle_length):
  release = dp_bandmf_release(C, SIGMA, D, bandmf_strategy(10, 4), key=1)
  with pytest.raises(ValueError, match="cyclic Poisson sampling with at least 4 groups"):
    PrivacyLedger(PoissonSampler(1000, 0.1, key=1, cycle_length=cycle_length), release, 1e-5)


def test_the_noise_counter_of_bandmf_cannot_skip_releases():
  release = dp_bandmf_release(C, SIGMA, D, bandmf_strategy(10, 2), key=1)
  state = release.init({"w": jnp.zeros(3)})
  assert noise_counter(state) == 0
  assert noise_counter(with_noise_counter(state, 0)) == 0
  with pytest.raises(ValueError, match="cannot skip"):
    with_noise_counter(state, 2)


def test_dp_muon_post_processing_runs_on_a_bandmf_release():
  from dpmuon_jax.optimizers.muon import muon
  from dpmuon_jax.optimizers.private import private

  optimizer = private(dp_bandmf_release(C, SIGMA, D, bandmf_strategy(3, 2), key=0), muon(0.02))
  assert optimizer.release.bands == 2  # what the ledger reads
  params = {"w": jnp.ones((8, 4))}
  state = optimizer.init(params)
  per_example = {"w": jnp.ones((4, 8, 4))}
  for _ in range(3):
    updates, state = optimizer.update(per_example, state, params)
    assert np.all(np.isfinite(np.asarray(updates["w"])))


# The BLT release. One strategy (T = 8, k = 2 buffers, b = 2) serves every test: its
# optimisation takes seconds and is cached.
BLT_STEPS, BLT_BUFFERS, BLT_SEP = 8, 2, 2


def _blt():
  return blt_strategy(BLT_STEPS, BLT_BUFFERS, BLT_SEP)


def _blt_matrix(strategy, steps=None) -> np.ndarray:
  """C from the strategy's parameters: c_0 = 1, c_j = Σ_i ω_i θ_i^(j−1), lower-triangular."""
  steps = strategy.steps if steps is None else steps
  coefficients = np.concatenate([[1.0], [
      np.sum(strategy.output_scale * strategy.buf_decay ** (j - 1)) for j in range(1, steps)]])
  rows, cols = np.indices((steps, steps))
  return np.where(rows >= cols, coefficients[np.abs(rows - cols)], 0.0)


def _brute_force_sensitivity(matrix: np.ndarray, separation: int) -> float:
  """max ‖C u‖ over every 0/1 vector u whose ones are at least ``separation`` apart."""
  steps = len(matrix)
  best = 0.0
  for u in itertools.product([0.0, 1.0], repeat=steps):
    ones = np.flatnonzero(u)
    if np.all(np.diff(ones) >= separation):
      best = max(best, float(np.linalg.norm(matrix @ np.asarray(u))))
  return best


def test_the_blt_strategy_is_toeplitz_with_non_increasing_positive_coefficients():
  strategy = _blt()
  assert strategy.buffers == BLT_BUFFERS
  matrix = strategy_matrix(strategy)
  np.testing.assert_allclose(matrix, _blt_matrix(strategy), rtol=1e-12)
  column = matrix[:, 0]
  assert column[0] == 1.0 and np.all(column > 0) and np.all(np.diff(column) <= 0)
  assert np.all(strategy.buf_decay.astype(np.float32) == strategy.buf_decay)  # float32 values


@pytest.mark.parametrize("steps, buffers, min_sep", [
    (0, 2, 2), (8, 0, 2), (8, 16, 2), (8, 2, 0), (8.0, 2, 2), (8, True, 2)])
def test_blt_strategy_refuses_bad_ints(steps, buffers, min_sep):
  with pytest.raises(ValueError, match="must be an int"):
    blt_strategy(steps, buffers, min_sep)


def test_the_blt_noise_is_c_inverse_applied_to_the_iid_draws_of_the_same_keys():
  """Release t's noise is row t of σC·C⁻¹Z, C built here from θ and ω, Z dp_release's draws."""
  strategy = _blt()
  ours = _noise_of_releases(dp_blt_release(C, SIGMA, D, strategy, key=5), BLT_STEPS, 32)
  draws = _noise_of_releases(dp_release(C, SIGMA, D, key=5), BLT_STEPS, 32)  # σC·z_t
  expected = np.linalg.solve(_blt_matrix(strategy), draws)
  np.testing.assert_allclose(ours, expected, rtol=1e-4, atol=1e-5)
  assert not np.allclose(ours, draws, atol=1e-2)  # correlated, not the iid draws


def test_the_blt_noise_covariance_over_releases_is_sigma_c_squared_c_inverse_c_inverse_t():
  """As for BandMF: every entry of the sample covariance of the T-vectors of noise within 5
  standard errors of σ²C²·C⁻¹C⁻ᵀ (false alarm < 64 × 6e-7)."""
  dim = 40_000
  strategy = _blt()
  noise = _noise_of_releases(dp_blt_release(C, SIGMA, D, strategy, key=11), BLT_STEPS, dim)
  inverse = np.linalg.inv(_blt_matrix(strategy))
  true = (SIGMA * C) ** 2 * inverse @ inverse.T
  sample = noise @ noise.T / dim
  se = np.sqrt((np.outer(np.diag(true), np.diag(true)) + true**2) / dim)
  assert np.all(np.abs(sample - true) <= 5 * se), (sample, true)
  assert abs(true[1, 0]) > 10 * se[1, 0]  # the check sees correlation: C⁻¹ is not diagonal


def test_a_blt_release_past_the_strategy_is_nan():
  noise = _noise_of_releases(dp_blt_release(C, SIGMA, D, _blt(), key=0), BLT_STEPS + 1, 4)
  assert np.all(np.isfinite(noise[:BLT_STEPS])) and np.all(np.isnan(noise[BLT_STEPS]))


def _privatizer_noise(noising_matrix, steps: int, dim: int) -> np.ndarray:
  """jax_privacy's privatizer's noise on ``steps`` zero sums: T × dim."""
  from jax_privacy import noise_addition

  privatizer = noise_addition.matrix_factorization_privatizer(
      noising_matrix, stddev=SIGMA * C, prng_key=jax.random.key(7))
  zeros = jnp.zeros((dim,))
  state = privatizer.init(zeros)
  rows = []
  for _ in range(steps):
    noisy, state = privatizer.update(zeros, state)
    rows.append(np.asarray(noisy, np.float64))
  return np.stack(rows)


def _jax_privacy_noising_matrices(kind: str, steps: int):
  """(C⁻¹, I) for jax_privacy's privatizer, built by jax_privacy from the strategy's
  parameters: a dense inverse of its banded C for BandMF, the streaming inverse BLT (its
  C⁻¹ as a BLT of its own, not the recursion the release runs) for BLT."""
  from jax_privacy.matrix_factorization import banded, buffered_toeplitz, streaming_matrix

  if kind == "bandmf":
    strategy = bandmf_strategy(steps, 3)
    dense = banded.ColumnNormalizedBanded.from_banded_toeplitz(
        steps, jnp.asarray(strategy.coefficients, jnp.float32)).materialize()
    inverse = jnp.asarray(np.linalg.inv(np.asarray(dense, np.float64)), jnp.float32)
    return strategy, dp_bandmf_release, inverse, jnp.eye(steps)
  strategy = _blt()
  with jax.enable_x64():
    inverse_blt = buffered_toeplitz.BufferedToeplitz.build(
        strategy.buf_decay, strategy.output_scale).inverse()
    parameters = np.asarray(inverse_blt.buf_decay), np.asarray(inverse_blt.output_scale)
  inverse = buffered_toeplitz.BufferedToeplitz.build(*parameters, dtype=jnp.float32)
  return strategy, dp_blt_release, inverse.as_streaming_matrix(), streaming_matrix.identity()


@pytest.mark.parametrize("kind", ["bandmf", "blt"])
def test_the_noise_is_jax_privacys_privatizer_map_applied_to_our_draws(kind):
  """jax_privacy's privatizer adds σC·C⁻¹Z' for draws Z' of its own keys; with the identity
  it adds σC·Z', so its map M = C⁻¹ is read off the two (least squares, T × T); our noise
  must be M applied to the draws of our keys."""
  steps, dim = BLT_STEPS, 64
  strategy, release, inverse, identity = _jax_privacy_noising_matrices(kind, steps)
  theirs = _privatizer_noise(inverse, steps, dim)
  their_draws = _privatizer_noise(identity, steps, dim)
  their_map = np.linalg.lstsq(their_draws.T, theirs.T, rcond=None)[0].T
  ours = _noise_of_releases(release(C, SIGMA, D, strategy, key=5), steps, dim)
  our_draws = _noise_of_releases(dp_release(C, SIGMA, D, key=5), steps, dim)
  np.testing.assert_allclose(ours, their_map @ our_draws, rtol=1e-4, atol=1e-4)
  assert not np.allclose(their_map, np.eye(steps), atol=1e-2)  # the map is not the identity


def test_blt_sensitivity_is_the_brute_force_maximum_over_participation_patterns():
  strategy = _blt()
  for releases, separation in [(BLT_STEPS, BLT_SEP), (5, BLT_SEP), (BLT_STEPS, 3), (3, 1)]:
    brute = _brute_force_sensitivity(_blt_matrix(strategy, releases), separation)
    np.testing.assert_allclose(blt_sensitivity(strategy, releases, separation), brute,
                               rtol=1e-9)


def _blt_ledger(sigma=SIGMA, target_epsilon=None, accountant="rdp"):
  sampler = PoissonSampler(1000, 0.1, key=1, cycle_length=BLT_SEP)
  release = dp_blt_release(C, sigma, D, _blt(), key=1)
  return sampler, release, PrivacyLedger(sampler, release, 1e-5, target_epsilon, accountant)


def _gaussian_epsilon(noise_multiplier: float) -> float:
  accountant = dp_accounting.rdp.RdpAccountant(RDP_ORDERS)
  accountant.compose(dp_accounting.GaussianDpEvent(noise_multiplier))
  return accountant.get_epsilon(1e-5)


def test_blt_epsilon_is_one_gaussian_mechanism_of_the_brute_force_sensitivity():
  """ε after t releases is that of GaussianDpEvent(σ/Δ_t), Δ_t brute-forced on C's t × t
  block for participations b apart: no amplification by sampling."""
  sampler, release, ledger = _blt_ledger()
  assert ledger.epsilon() == 0.0
  for recorded in (5, BLT_STEPS):
    ledger.record(sampler, release, recorded - ledger.count)
    sensitivity = _brute_force_sensitivity(_blt_matrix(_blt(), recorded), BLT_SEP)
    np.testing.assert_allclose(ledger.epsilon(), _gaussian_epsilon(SIGMA / sensitivity),
                               rtol=1e-9)
    assert ledger.event() == dp_accounting.GaussianDpEvent(
        pytest.approx(SIGMA / sensitivity, rel=1e-9))
  # Releases past T are NaN (no data): they spend nothing more.
  assert ledger.epsilon_after(3) == ledger.epsilon()


def test_a_blt_ledger_survives_json_and_compares_the_strategy():
  sampler, release, ledger = _blt_ledger()
  ledger.record(sampler, release, 3)
  loaded = PrivacyLedger.from_json(ledger.to_json())
  loaded.check_compatible(ledger)
  assert loaded.epsilon() == ledger.epsilon()
  other = dataclasses.replace(release.release, blt_output_scale=(0.1, 0.1))
  with pytest.raises(ValueError, match="blt_output_scale"):
    loaded.check(sampler, other)


def test_blt_max_steps_is_the_last_release_within_budget_and_at_most_t():
  sampler, release, ledger = _blt_ledger(sigma=8.0, target_epsilon=1.0)
  t = ledger.max_steps()
  assert 0 < t < BLT_STEPS
  assert ledger.epsilon_after(t) <= 1.0 < ledger.epsilon_after(t + 1)
  ledger.record(sampler, release, t)
  assert not ledger.can_release()
  _, _, generous = _blt_ledger(sigma=100.0, target_epsilon=1.0)
  assert generous.max_steps() == BLT_STEPS  # the strategy releases no more


@pytest.mark.parametrize("accountant", ["rdp", "pld"])
def test_calibrate_blt_noise_multiplier_meets_the_target(accountant):
  sigma = calibrate_blt_noise_multiplier(2.0, 1e-5, _blt(), accountant)
  sampler, release, ledger = _blt_ledger(sigma, accountant=accountant)
  ledger.record(sampler, release, BLT_STEPS)
  assert 2.0 * (1 - 1e-3) <= ledger.epsilon() <= 2.0


@pytest.mark.parametrize("cycle_length", [1, BLT_SEP - 1])
def test_blt_without_enough_groups_is_refused(cycle_length):
  release = dp_blt_release(C, SIGMA, D, blt_strategy(BLT_STEPS, BLT_BUFFERS, 3), key=1)
  with pytest.raises(ValueError, match="cyclic Poisson sampling with at least 3 groups"):
    PrivacyLedger(PoissonSampler(1000, 0.1, key=1, cycle_length=cycle_length), release, 1e-5)


def test_the_noise_counter_of_blt_cannot_skip_releases():
  release = dp_blt_release(C, SIGMA, D, _blt(), key=1)
  assert release.release.buffers == BLT_BUFFERS
  state = release.init({"w": jnp.zeros(3)})
  assert jax.tree.leaves(state.buffers)[0].shape == (BLT_BUFFERS, 3)  # k copies
  with pytest.raises(ValueError, match="cannot skip"):
    with_noise_counter(state, 2)
