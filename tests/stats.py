"""Distribution quantiles for statistical tests (no scipy needed)."""

from statistics import NormalDist


def normal_quantile(p: float) -> float:
  return NormalDist().inv_cdf(p)


def chi2_quantile(p: float, dof: int) -> float:
  """Wilson–Hilferty approximation of the chi-square quantile (rel. error < 1e-3 for dof ≥ 30)."""
  z = normal_quantile(p)
  h = 2.0 / (9.0 * dof)
  return dof * (1.0 - h + z * h**0.5) ** 3


def std_interval(num_samples: int, std: float, alpha: float = 1e-6) -> tuple[float, float]:
  """Two-sided (1−alpha) acceptance interval for the empirical RMS of N(0, std²) samples.

  Σ z_i² / std² ~ χ²(n) when the mean is known to be 0.
  """
  lo = chi2_quantile(alpha / 2, num_samples)
  hi = chi2_quantile(1 - alpha / 2, num_samples)
  return std * (lo / num_samples) ** 0.5, std * (hi / num_samples) ** 0.5
