"""The BandMF release: C⁻¹-correlated noise, cyclic Poisson sampling and its accounting."""

import dp_accounting
import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("jax_privacy")

from dpmuon_jax.privacy.accounting import PrivacyLedger, participations  # noqa: E402
from dpmuon_jax.privacy.correlated import (  # noqa: E402
    bandmf_strategy,
    dp_bandmf_release,
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
