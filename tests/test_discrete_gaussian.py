"""Exact discrete Gaussian sampler (CKS 2020 Algorithms 1–3) and its accounting."""

import inspect
import math
import os

import numpy as np
import pytest
from scipy import stats

from dpmuon_jax.privacy import discrete_gaussian as dg
from dpmuon_jax.privacy.discrete_gaussian import (
    discrete_gaussian_noise_multiplier,
    discrete_gaussian_tau,
    sample_discrete_gaussian,
)

N = 200_000
Z = 5.0  # acceptance half-width in standard errors: two-sided false alarm ≈ 6e-7 per check
ALPHA = 1e-6  # chi-square tests: false-alarm probability per test


def _bytes(seed: int):
  return np.random.default_rng(seed).bytes


def _pmf(sigma_squared: int) -> tuple[np.ndarray, np.ndarray]:
  """Support [−K, K], K = ⌈12σ⌉ + 2 (the rest has mass < e^{−72}), and the exact pmf on it."""
  k_max = math.ceil(12 * math.sqrt(sigma_squared)) + 2
  k = np.arange(-k_max, k_max + 1)
  w = np.exp(-(k.astype(np.float64) ** 2) / (2.0 * sigma_squared))
  return k, w / w.sum()


def _moments(sigma_squared: int) -> tuple[float, float]:
  """E X² = Σ k² e^{−k²/2σ²} / Σ e^{−k²/2σ²} and E X⁴ of N_Z(0, σ²), summed numerically."""
  k, p = _pmf(sigma_squared)
  k2 = k.astype(np.float64) ** 2
  return float(np.sum(k2 * p)), float(np.sum(k2**2 * p))


def _chi2_bound(dof: int) -> float:
  return float(stats.chi2.ppf(1 - ALPHA, dof))


# -- (a) mean and variance ---------------------------------------------------------------------


@pytest.mark.parametrize("sigma_squared", [1, 2, 10, 2**30])
def test_mean_and_variance(sigma_squared):
  x = sample_discrete_gaussian(N, sigma_squared, _bytes(sigma_squared)).astype(np.float64)
  m2, m4 = _moments(sigma_squared)
  # The discrete Gaussian's variance is below σ² by ≈ 8π²σ⁴e^{−2π²σ²} (2e-7 at σ² = 1), which
  # is below double precision for σ² ≥ 2.
  assert m2 < 1 - 1e-8 if sigma_squared == 1 else m2 == pytest.approx(sigma_squared, rel=1e-12)
  # The mean is 0 by symmetry, so S² = (1/n) Σ x_i² is unbiased for E X². It is a mean of n
  # i.i.d. copies of X², whose variance is E X⁴ − (E X²)², so by the CLT its standard error is
  # sqrt((E X⁴ − (E X²)²)/n); the sample mean's is sqrt(E X²/n).
  var_se = math.sqrt((m4 - m2**2) / N)
  assert abs(np.mean(x**2) - m2) <= Z * var_se
  assert abs(np.mean(x)) <= Z * math.sqrt(m2 / N)


def test_variance_beyond_int64_arithmetic():
  """σ² = 2⁷⁰: the acceptance test runs on Python ints; the variance is still σ²."""
  n, sigma_squared = 20_000, 2**70
  x = sample_discrete_gaussian(n, sigma_squared, _bytes(3)).astype(np.float64) / 2.0**35
  # Continuous limit (exact to double precision): E X² = 1, E X⁴ = 3 after scaling by σ.
  assert abs(np.mean(x**2) - 1.0) <= Z * math.sqrt(2.0 / n)
  assert abs(np.mean(x)) <= Z * math.sqrt(1.0 / n)


# -- (b) the pmf -------------------------------------------------------------------------------


def _chi2_exact(x: np.ndarray, sigma_squared: int) -> tuple[float, int]:
  """Pearson χ² against the exact pmf: a cell per k with ≥ 5 expected, the tails pooled."""
  k, p = _pmf(sigma_squared)
  expected = x.size * p
  inner = expected >= 5
  k_lo, k_hi = k[inner][0], k[inner][-1]
  observed_inner = np.bincount(x[(x >= k_lo) & (x <= k_hi)] - k_lo, minlength=k_hi - k_lo + 1)
  observed = np.concatenate([[np.sum(x < k_lo) + np.sum(x > k_hi)], observed_inner])
  expected = np.concatenate([[expected[~inner].sum()], expected[inner]])
  return float(np.sum((observed - expected) ** 2 / expected)), observed.size - 1


@pytest.mark.parametrize("sigma_squared", [1, 2, 10])
def test_pmf_matches_exact_pmf(sigma_squared):
  x = sample_discrete_gaussian(N, sigma_squared, _bytes(10 + sigma_squared))
  chi2, dof = _chi2_exact(x, sigma_squared)
  assert chi2 <= _chi2_bound(dof), (chi2, dof)


@pytest.mark.parametrize("sigma_squared", [1_000_003, 2**34 + 12345])
def test_binned_pmf_at_large_sigma(sigma_squared):
  """50 bins of ≈ equal mass with integer edges; expected counts from the exact pmf.

  σ² = 2³⁴ + … is the regime where the numerator of the acceptance exponent,
  (|Y|t − σ²)², no longer fits in int64.
  """
  x = sample_discrete_gaussian(N, sigma_squared, _bytes(20))
  k, p = _pmf(sigma_squared)
  sigma = math.sqrt(sigma_squared)
  edges = np.unique(np.round(sigma * stats.norm.ppf(np.arange(1, 50) / 50)).astype(np.int64))
  observed = np.bincount(np.searchsorted(edges, x, side="right"), minlength=edges.size + 1)
  expected = N * np.bincount(np.searchsorted(edges, k, side="right"), weights=p,
                             minlength=edges.size + 1)
  chi2 = float(np.sum((observed - expected) ** 2 / expected))
  assert chi2 <= _chi2_bound(edges.size), chi2


def test_python_int_path_matches_exact_pmf(monkeypatch):
  """With the int64 budget set to 0, every integer goes through the Python-int fallback."""
  monkeypatch.setattr(dg, "_INT64_SAFE", 0)
  x = sample_discrete_gaussian(20_000, 10, _bytes(4))
  chi2, dof = _chi2_exact(x, 10)
  assert chi2 <= _chi2_bound(dof), (chi2, dof)


# -- the exact building blocks ------------------------------------------------------------------


def test_bit_mask_is_exact():
  bounds = np.array([1, 2, 3, 4, 5, 255, 256, 257, 2**32, 2**32 + 1, 2**40 + 3, 2**62], np.int64)
  expected = [(1 << (int(b) - 1).bit_length()) - 1 for b in bounds]
  assert dg._bit_mask(bounds).tolist() == expected


@pytest.mark.parametrize("fallback", [False, True])
def test_uniform_integers_are_uniform(monkeypatch, fallback):
  dtype = object if fallback else np.int64
  if fallback:  # every bound above 0 takes the Python-int path
    monkeypatch.setattr(dg, "_INT64_SAFE", 0)
  n = 60_000
  # Small bound: χ² over the 6 values, with a scalar and an elementwise bound.
  for bound in (6, np.full(n, 6, dtype)):
    x = np.asarray(dg._uniform(bound, n, _bytes(1)), np.int64)
    observed = np.bincount(x, minlength=6)
    assert observed.size == 6
    assert np.sum((observed - n / 6) ** 2 / (n / 6)) <= _chi2_bound(5)
  # Large bound: the value stays below it and its low bits are uniform (a mask with holes
  # would fix some of them).
  bound = 3 * 2**40 + 5
  x = dg._uniform(np.full(n, bound, dtype), n, _bytes(2)).astype(object)
  assert all(0 <= v < bound for v in x)
  observed = np.bincount(np.array([v % 16 for v in x]), minlength=16)
  assert np.sum((observed - n / 16) ** 2 / (n / 16)) <= _chi2_bound(15)


@pytest.mark.parametrize(
    "fractions", [[], [(1, 3)], [(3, 7), (5, 11)], [(0, 5)], [(2**40, 2**40 + 1)]])
def test_bernoulli_exp_has_mean_exp_minus_gamma(fractions):
  """CKS Algorithm 1 with γ = Π num/den (γ = 1 for no factor): frequency within 5 SE of e^{−γ}."""
  n = N
  factors = [(np.full(n, num, np.int64), den) for num, den in fractions]
  p = math.exp(-math.prod(num / den for num, den in fractions))
  mean = float(np.mean(dg._bernoulli_exp(factors, n, _bytes(9))))
  assert abs(mean - p) <= Z * math.sqrt(p * (1 - p) / n) + 1e-12


# -- (c) randomness source ---------------------------------------------------------------------


def test_deterministic_for_a_fixed_byte_source():
  a = sample_discrete_gaussian((50, 40), 2**34, _bytes(7))
  b = sample_discrete_gaussian((50, 40), 2**34, _bytes(7))
  c = sample_discrete_gaussian((50, 40), 2**34, _bytes(8))
  np.testing.assert_array_equal(a, b)
  assert not np.array_equal(a, c)


def test_default_source_is_os_urandom():
  assert inspect.signature(sample_discrete_gaussian).parameters["random_bytes"].default is (
      os.urandom)
  assert not np.array_equal(sample_discrete_gaussian(1000, 2**20),
                            sample_discrete_gaussian(1000, 2**20))


def test_draws_bytes_in_blocks():
  calls = []
  source = _bytes(5)

  def counting(n):
    calls.append(n)
    return source(n)

  sample_discrete_gaussian(100_000, 2**34, counting)
  assert len(calls) < 10_000  # one call per vectorised round (≈ 5000), not per sample
  assert sum(calls) < 100 * 100_000


# -- (d) dtype and shape -----------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(), 7, (3, 4), (0,), (2, 0, 3)])
def test_dtype_and_shape(shape):
  x = sample_discrete_gaussian(shape, 5, _bytes(6))
  assert x.dtype == np.int64
  assert x.shape == np.empty(shape).shape


# -- (e) accounting ----------------------------------------------------------------------------


@pytest.mark.parametrize("sigma", [1e-3, 0.3, 1.0, 4.0, 65536.0])
@pytest.mark.parametrize("dim", [1, 10**6, 10**9])
def test_single_discrete_gaussian_multiplier_is_sigma_over_sensitivity(sigma, dim):
  """One N_Z(0, σ²) per coordinate is as private as the continuous Gaussian (CKS 2020)."""
  assert discrete_gaussian_tau(sigma, 1) == 0.0
  for l2 in (1.0, 3.5, 2.0**16):
    assert discrete_gaussian_noise_multiplier(sigma, l2, dim) == pytest.approx(
        sigma / l2, rel=1e-12)


@pytest.mark.parametrize("sigma", [4.0, 100.0, 65536.0])
def test_summed_discrete_gaussians_at_moderate_sigma(sigma):
  """n summands of N_Z(0, σ²) with σ ≥ 4: τ < e^{−150}, so 1/ε = √n σ/Δ₂ to 1e-12."""
  for n, dim in [(2, 10), (16, 10**6), (1000, 10**9)]:
    assert discrete_gaussian_noise_multiplier(sigma, 2.0, dim, n) == pytest.approx(
        math.sqrt(n) * sigma / 2.0, rel=1e-12)


@pytest.mark.parametrize("sigma", [0.5, 0.7, 1.0])
def test_summed_discrete_gaussians_at_small_sigma_are_more_conservative(sigma):
  for n, dim in [(2, 1), (10, 1000), (1000, 10**6)]:
    assert discrete_gaussian_noise_multiplier(sigma, 1.0, dim, n) < math.sqrt(n) * sigma


@pytest.mark.parametrize("sigma", [0.2, 0.5, 1.0, 2.0])
@pytest.mark.parametrize("n", [2, 10, 65, 66, 1000])
def test_tau_is_a_tight_upper_bound(sigma, n):
  c = 2 * math.pi**2 * sigma**2
  exact = 10 * math.fsum(math.exp(-c * k / (k + 1)) for k in range(1, n))
  tau = discrete_gaussian_tau(sigma, n)
  assert exact * (1 - 1e-12) <= tau <= exact * math.exp(c / 66) * (1 + 1e-12)
  assert tau <= 10 * (n - 1) * math.exp(-math.pi**2 * sigma**2) * (1 + 1e-12)


def test_tau_does_not_overflow_or_underflow_badly():
  assert discrete_gaussian_tau(1e-6, 10**12) == pytest.approx(10 * (10**12 - 1), rel=1e-6)
  assert discrete_gaussian_tau(1e3, 10**12) == 0.0  # below the smallest double
  assert 0 < discrete_gaussian_noise_multiplier(0.5, 1.0, 10**12, 10**12) < 1e-6


# -- (f) bad inputs ----------------------------------------------------------------------------


@pytest.mark.parametrize("sigma_squared", [0, -1, 2**100 + 1, 1.5, 4.0, True, "4", None])
def test_sampler_rejects_bad_sigma_squared(sigma_squared):
  with pytest.raises(ValueError, match="sigma_squared"):
    sample_discrete_gaussian(3, sigma_squared, _bytes(0))


def test_sampler_accepts_numpy_integers_and_huge_sigma_squared():
  assert sample_discrete_gaussian(3, np.int64(9), _bytes(0)).dtype == np.int64
  assert sample_discrete_gaussian(3, 2**100, _bytes(0)).dtype == np.int64


def test_sampler_rejects_a_short_byte_source():
  with pytest.raises(ValueError, match="random_bytes"):
    sample_discrete_gaussian(10, 4, lambda n: b"\0" * (n - 1))


@pytest.mark.parametrize("bad", [0.0, -1.0, math.nan, math.inf])
def test_accounting_rejects_bad_reals(bad):
  with pytest.raises(ValueError, match="sigma"):
    discrete_gaussian_noise_multiplier(bad, 1.0, 10)
  with pytest.raises(ValueError, match="l2_sensitivity"):
    discrete_gaussian_noise_multiplier(1.0, bad, 10)
  with pytest.raises(ValueError, match="sigma"):
    discrete_gaussian_tau(bad, 10)


def test_sum_of_discrete_gaussians_needs_sigma_at_least_half():
  assert discrete_gaussian_noise_multiplier(0.4, 1.0, 10) == pytest.approx(0.4)
  with pytest.raises(ValueError, match="sigma"):
    discrete_gaussian_noise_multiplier(0.4, 1.0, 10, num_summands=2)


@pytest.mark.parametrize("bad", [0, -3, 2.5, True])
def test_accounting_rejects_bad_counts(bad):
  with pytest.raises(ValueError, match="dim"):
    discrete_gaussian_noise_multiplier(1.0, 1.0, bad)
  with pytest.raises(ValueError, match="num_summands"):
    discrete_gaussian_noise_multiplier(1.0, 1.0, 10, bad)
  with pytest.raises(ValueError, match="num_summands"):
    discrete_gaussian_tau(1.0, bad)
