"""Exact discrete Gaussian noise from OS entropy, and what an accountant should be told.

**What it protects against.** A Gaussian release computed in floating point is
not the mechanism its privacy proof is about. Which doubles a sampler can
output near a value x depends on x, so the low-order bits of a noisy release
can reveal the value it was centred on (Mironov 2012, "On significance of the
least significant bits for differential privacy"), and the rounding of the
release or the time a sampler takes can do the same (Jin et al. 2022, "Are We
There Yet? Timing and Floating-Point Attacks on Differential Privacy
Systems"). The secure release therefore keeps floating point out of the
mechanism: each example's clipped vector is rounded to an integer grid, the
rounded vectors are summed exactly in integers, and integer noise from the
discrete Gaussian ::

    N_Z(0, σ²):   P[Y = y] = exp(−y²/(2σ²)) / Σ_{z ∈ Z} exp(−z²/(2σ²)),   y ∈ Z,

is added (Canonne, Kamath and Steinke 2020, "The Discrete Gaussian for
Differential Privacy", below CKS). :func:`sample_discrete_gaussian` draws it
EXACTLY from a byte source (default ``os.urandom``) with CKS Algorithms 1–3:
every decision compares a uniform integer, drawn by rejection from random
bytes, with an integer. Its running time depends on the noise drawn (rejection
loops), never on the data: draw the noise before the data are touched, so the
timing of the release reveals nothing about it.

**Accounting.** Let q map a dataset to Z^d with ‖q(x) − q(x')‖₂ ≤ Δ₂ for
neighbours x, x' (for the release: the L2 sensitivity of the rounded, summed
vectors, in grid units). Adding one N_Z(0, σ²) to each coordinate satisfies
½(Δ₂/σ)²-concentrated DP (CKS, on the multivariate discrete
Gaussian): its Rényi divergence of every order α is at most αΔ₂²/(2σ²), the
RDP curve of the continuous Gaussian mechanism with noise multiplier σ/Δ₂.
When a coordinate's noise is instead the sum of n independent N_Z(0, σ²)
(e.g. shares drawn on n hosts), the sum is not a discrete Gaussian. Kairouz,
Liu and Steinke 2021 ("The Distributed Discrete Gaussian Mechanism for
Federated Learning with Secure Aggregation", below KLS) bound
its RDP of order α, for σ ≥ ½, by min{αΔ₂²/(2nσ²) + τd, (α/2)(Δ₂/(√n σ) + τ√d)²}, with ::

    τ = 10 · Σ_{k=1}^{n−1} exp(−2π²σ² · k/(k+1)),

so for α ≥ 1 it is at most αε²/2 (½ε²-concentrated DP) with ::

    ε = min{ sqrt(Δ₂²/(nσ²) + 2τd),  Δ₂/(√n σ) + τ√d },

i.e. ε = Δ₂/σ for n = 1. :func:`discrete_gaussian_noise_multiplier` returns
1/ε, the multiplier at which the continuous Gaussian's RDP curve dominates
the discrete mechanism's.

**Assumption (not a theorem of ours).** Poisson subsampling is then accounted
by giving the continuous subsampled-Gaussian RDP bound (dp-accounting's
``PoissonSampledDpEvent(q, GaussianDpEvent(1/ε))``) the multiplier 1/ε.
Dominating the unsampled RDP curve does not by itself imply dominating the
subsampled one: the tight subsampled-Gaussian bound is computed from the
continuous Gaussian's densities. So this ASSUMES that the subsampled discrete
mechanism is no less private than the subsampled continuous Gaussian at
multiplier 1/ε. The distributed discrete Gaussian literature accounts the
discrete Gaussian through this continuous-Gaussian RDP curve; KLS amplify it
by subsampling with a generic RDP subsampling theorem (Zhu and Wang 2019,
"Poisson Subsampled Rényi Differential Privacy") applied to the curve, which
needs no assumption but gives a larger ε.

**Cost.** A draw takes on average 1.3 rejection trials of CKS Algorithm 3
(each a discrete Laplace draw and an exact Bernoulli(exp(−γ))), about 13
uniform integers and 70 bytes of entropy. All pending draws run in lockstep
over numpy int64 arrays, one ``random_bytes`` call per vectorised round: about
10⁶ samples/s for σ ≈ 10⁵ on one CPU core, against ~10⁸/s for float32
``jax.random.normal``. Values that could overflow int64 (σ² ≳ 2⁵⁸, or
astronomically rare tails) are handled exactly with Python integers, ~4×
slower.
"""

from __future__ import annotations

import math
import numbers
import os
from collections.abc import Callable, Sequence

import numpy as np

RandomBytes = Callable[[int], bytes]

_INT64_SAFE = 2**62
"""Bound below which every intermediate of the int64 code path stays (headroom for one add)."""

_MAX_SIGMA_SQUARED = 2**100
"""Largest σ² accepted: σ ≤ 2⁵⁰, so a sample overflows int64 only beyond 2¹³σ (P < e^{−2²⁵})."""

_TAU_HEAD_TERMS = 64
"""Terms of τ summed exactly; the rest are bounded by the first of them (they decrease)."""


# -- uniform integers by rejection -----------------------------------------------------------


def _take_bytes(random_bytes: RandomBytes, n: int) -> bytes:
  buf = random_bytes(n)
  if len(buf) != n:
    raise ValueError(f"random_bytes({n}) returned {len(buf)} bytes")
  return buf


def _byte_width(max_value: int) -> int:
  """Bytes per word (1, 2, 4 or 8) holding every integer in [0, max_value], max_value < 2⁶³."""
  bits = max_value.bit_length()
  return 1 if bits <= 8 else 2 if bits <= 16 else 4 if bits <= 32 else 8


def _random_words(count: int, width: int, random_bytes: RandomBytes) -> np.ndarray:
  """``count`` uniform words of ``width`` bytes from one call of ``random_bytes`` (uint)."""
  return np.frombuffer(_take_bytes(random_bytes, count * width), dtype=f"<u{width}")


def _bit_mask(bound: np.ndarray) -> np.ndarray:
  """2^bitlen(bound − 1) − 1 elementwise, for int64 ``bound`` ≥ 1 (bit smearing, no floats)."""
  m = bound - 1
  for shift in (1, 2, 4, 8, 16, 32):
    m |= m >> shift
  return m


def _uniform_int64(bound: int | np.ndarray, count: int, random_bytes: RandomBytes) -> np.ndarray:
  """Uniform integers U_i ∈ [0, bound_i), int64, for 1 ≤ bound ≤ 2⁶².

  A word of random bytes is masked to the bit length of bound − 1 and rejected
  when ≥ bound (acceptance ≥ ½ per word); rejected entries are redrawn, all
  of them with one call of ``random_bytes`` per round.
  """
  scalar = isinstance(bound, int)
  if scalar:
    mask = np.int64((1 << (bound - 1).bit_length()) - 1)
    width = _byte_width(int(mask))
  else:
    mask = _bit_mask(bound)
    width = _byte_width(int(mask.max(initial=0)))
  out = np.empty(count, np.int64)
  todo = np.arange(count)
  while todo.size:
    words = _random_words(todo.size, width, random_bytes)
    if width == 8:
      words = words.view(np.int64)  # masking below clears the sign bit
    x = words.astype(np.int64) & (mask if scalar else mask[todo])  # pyright: ignore[reportIndexIssue]
    ok = x < (bound if scalar else bound[todo])
    out[todo[ok]] = x[ok]
    todo = todo[~ok]
  return out


def _uniform_object(bound: int | np.ndarray, count: int, random_bytes: RandomBytes) -> np.ndarray:
  """As :func:`_uniform_int64` for arbitrary positive Python ints (object array, per element)."""
  bounds = [bound] * count if isinstance(bound, int) else [int(b) for b in bound]
  out = np.empty(count, object)
  todo = list(range(count))
  while todo:
    widths = [((bounds[i] - 1).bit_length() + 7) // 8 for i in todo]
    buf = _take_bytes(random_bytes, sum(widths))
    retry, start = [], 0
    for i, w in zip(todo, widths):
      x = int.from_bytes(buf[start:start + w], "little") & ((1 << (bounds[i] - 1).bit_length()) - 1)
      start += w
      if x < bounds[i]:
        out[i] = x
      else:
        retry.append(i)
    todo = retry
  return out


def _uniform(bound: int | np.ndarray, count: int, random_bytes: RandomBytes) -> np.ndarray:
  """Uniform integers in [0, bound) (elementwise if ``bound`` is an array): int64 or object."""
  if isinstance(bound, np.ndarray) and bound.dtype == object:
    return _uniform_object(bound, count, random_bytes)
  if isinstance(bound, int) and bound > _INT64_SAFE:
    return _uniform_object(bound, count, random_bytes)
  return _uniform_int64(bound, count, random_bytes)


def _coin(count: int, random_bytes: RandomBytes) -> np.ndarray:
  """``count`` fair bits (bool), eight per random byte."""
  buf = np.frombuffer(_take_bytes(random_bytes, (count + 7) // 8), np.uint8)
  return np.unpackbits(buf, count=count).astype(bool)


# -- CKS Algorithm 1: Bernoulli(exp(−γ)) -----------------------------------------------------

Factor = tuple[np.ndarray, int | np.ndarray]


def _bernoulli_exp(factors: Sequence[Factor], count: int, random_bytes: RandomBytes) -> np.ndarray:
  """Exact Bernoulli(exp(−γ_i)) for γ_i = Π_j num_ij/den_ij ∈ [0, 1] (each num ≤ den).

  CKS Algorithm 1: K = 1, 2, …; draw A ~ Bernoulli(γ/K) until A = 0; return
  1 iff the final K is odd, since P[K > k] = γ^k/k!. Here Bernoulli(γ/K) is
  the AND of independent Bernoulli(1/K) and Bernoulli(num_j/den_j), each a
  uniform integer compared with an integer, so no denominator grows with K.
  All entries run in lockstep (entry i at round K is still drawing); ``factors``
  is empty for γ = 1.
  """
  out = np.empty(count, bool)
  idx = np.arange(count)
  factors = list(factors)
  k = 1
  while idx.size:
    a = np.ones(idx.size, bool) if k == 1 else _uniform_int64(k, idx.size, random_bytes) == 0
    for num, den in factors:
      sel = np.flatnonzero(a)
      d = den if isinstance(den, int) else den[sel]
      a[sel] = _uniform(d, sel.size, random_bytes) < num[sel]
    out[idx[~a]] = k % 2 == 1
    idx = idx[a]
    factors = [(num[a], den if isinstance(den, int) else den[a]) for num, den in factors]
    k += 1
  return out


def _geometric_exp1(count: int, random_bytes: RandomBytes) -> np.ndarray:
  """V ~ Geometric with P[V ≥ v] = e^{−v}: Bernoulli(exp(−1)) successes before the first failure."""
  v = np.zeros(count, np.int64)
  idx = np.arange(count)
  while idx.size:
    idx = idx[_bernoulli_exp((), idx.size, random_bytes)]
    v[idx] += 1
  return v


# -- CKS Algorithm 2: discrete Laplace --------------------------------------------------------


def _discrete_laplace(count: int, t: int, random_bytes: RandomBytes) -> np.ndarray:
  """Exact Lap_Z(t): P[Y = y] ∝ exp(−abs(y)/t), integer t ≥ 1 (CKS Algorithm 2 with s = 1).

  U ~ Uniform{0, …, t−1}, accepted with probability exp(−U/t); V geometric as
  above; Y = ±(U + tV) with a fair sign, rejecting (−, 0). int64 unless a
  value could overflow, then an object array of Python ints.
  """
  chunks, filled = [], 0
  while filled < count:
    m = count - filled
    u = _uniform(t, m, random_bytes)
    u = u[_bernoulli_exp([(u, t)], m, random_bytes)]
    v = _geometric_exp1(u.size, random_bytes)
    if u.dtype == object or int(v.max(initial=0)) >= _INT64_SAFE // t - 1:
      y = u.astype(object) + t * v.astype(object)
    else:
      y = u + t * v
    negative = _coin(y.size, random_bytes)
    keep = ~(negative & (y == 0))
    y = np.where(negative, -y, y)[keep]
    chunks.append(y)
    filled += y.size
  return np.concatenate(chunks)[:count] if chunks else np.empty(0, np.int64)


# -- CKS Algorithm 3: discrete Gaussian -------------------------------------------------------


def _gaussian_accept(y: np.ndarray, sigma_squared: int, t: int,
                     random_bytes: RandomBytes) -> np.ndarray:
  """Exact Bernoulli(exp(−γ)), γ = (abs(y) − σ²/t)²/(2σ²) = a²/(2σ²t²), a = abs(y)·t − σ².

  The numerator a² overflows int64 for σ ≳ 2¹⁵, so γ is split without big
  integers: with n₁ = ⌈abs(a)/σ²⌉ and n₂ = ⌈abs(a)/(2t²)⌉, ::

      γ / (n₁n₂) = (|a|/(σ²n₁)) · (|a|/(2t²n₂)),   both factors in [0, 1],

  and exp(−γ) = exp(−γ/(n₁n₂))^{n₁n₂}: the AND of n₁n₂ independent
  Bernoulli(exp(−γ/(n₁n₂))) (CKS Algorithm 1 on the product), evaluated
  until the first failure. n₁n₂ = 1 for most candidates: those with abs(y) ≤ 2σ²/t ≈ 2σ.
  """
  abs_y = np.abs(y)
  two_t2 = 2 * t * t
  if y.dtype == object or int(abs_y.max(initial=0)) * t + 2 * sigma_squared + two_t2 >= _INT64_SAFE:
    abs_y = abs_y.astype(object)
  a = np.abs(abs_y * t - sigma_squared)
  n1 = (a + (sigma_squared - 1)) // sigma_squared
  n2 = (a + (two_t2 - 1)) // two_t2
  den1, den2, copies = n1 * sigma_squared, n2 * two_t2, n1 * n2
  alive = np.ones(y.size, bool)
  active = np.flatnonzero(copies > 0)
  done = 0
  while active.size:
    ok = _bernoulli_exp([(a[active], den1[active]), (a[active], den2[active])], active.size,
                        random_bytes)
    alive[active[~ok]] = False
    done += 1
    active = active[ok]
    active = active[copies[active] > done]
  return alive


def _check_positive(name: str, value: float) -> float:
  value = float(value)
  if not (math.isfinite(value) and value > 0):
    raise ValueError(f"{name} must be positive and finite, got {value}")
  return value


def _check_count(name: str, value: int, upper: int | None = None) -> int:
  """``value`` as a Python int if it is an integer in [1, upper], else ValueError."""
  if (isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1
      or (upper is not None and value > upper)):
    bound = "" if upper is None else f" at most {upper:.3g}"
    raise ValueError(f"{name} must be a positive integer{bound}, got {value!r}")
  return int(value)


def sample_discrete_gaussian(shape: int | Sequence[int], sigma_squared: int,
                             random_bytes: RandomBytes = os.urandom) -> np.ndarray:
  """Exact i.i.d. samples of the discrete Gaussian N_Z(0, σ²), from a byte source.

  CKS Algorithm 3: with t = ⌊σ⌋ + 1, draw Y ~ Lap_Z(t) (Algorithm 2) and
  accept it with probability exp(−(abs(Y) − σ²/t)²/(2σ²)) (Algorithm 1); then ::

      P[Y = y] = exp(−y²/(2σ²)) / Σ_{z ∈ Z} exp(−z²/(2σ²)).

  Exact: every decision compares a uniform integer (drawn by rejection from
  ``random_bytes``) with an integer; there is no floating point. All pending
  samples run their rejection loops in lockstep over numpy int64 arrays; each
  round takes its bytes from one call of ``random_bytes``. The variance is
  slightly below σ² for small σ and equals σ² to double precision for σ ≳ 3.

  Args:
    shape: output shape.
    sigma_squared: the variance parameter σ², a positive integer (≤ 2¹⁰⁰).
    random_bytes: ``n ↦ n`` uniformly random bytes. Default ``os.urandom``
      (OS entropy); a seeded source such as ``np.random.default_rng(0).bytes``
      makes the draw reproducible (and predictable: only for tests).

  Returns:
    int64 array of ``shape``.

  Raises:
    ValueError: ``sigma_squared`` is not an integer in [1, 2¹⁰⁰], or
      ``random_bytes`` returned the wrong number of bytes.
    OverflowError: a sample does not fit in int64 (probability below
      exp(−2²⁵) for any allowed σ²).
  """
  sigma_squared = _check_count("sigma_squared", sigma_squared, _MAX_SIGMA_SQUARED)
  out = np.empty(shape, np.int64)
  count = out.size
  t = math.isqrt(sigma_squared) + 1
  chunks, filled = [], 0
  while filled < count:
    y = _discrete_laplace(count - filled, t, random_bytes)
    y = y[_gaussian_accept(y, sigma_squared, t, random_bytes)]
    chunks.append(y)
    filled += y.size
  if count:
    samples = np.concatenate(chunks)
    if samples.dtype == object and not all(-(2**63) <= s < 2**63 for s in samples):
      raise OverflowError("a discrete Gaussian sample does not fit in int64")
    out.reshape(-1)[:] = samples.astype(np.int64)
  return out


# -- accounting -------------------------------------------------------------------------------


def discrete_gaussian_tau(sigma: float, num_summands: int) -> float:
  """Upper bound on KLS's τ for a sum of ``num_summands`` independent N_Z(0, σ²).

  ::

      τ = 10 · Σ_{k=1}^{n−1} exp(−2π²σ² · k/(k+1))

  (Kairouz, Liu and Steinke 2021, "The Distributed Discrete Gaussian Mechanism
  for Federated Learning with Secure Aggregation", the τ bound). τ = 0 for
  n = 1: one discrete Gaussian needs no correction. The terms decrease in k,
  so the first 64 are summed exactly and each later one is bounded by the
  65th; the result is an upper bound, tight to a factor exp(2π²σ²/66) on the
  tail. It is computed as 10·e^{−π²σ²}·Σ_k exp(−2π²σ²(k/(k+1) − ½)), whose
  sum has terms in (0, 1], so nothing overflows; for σ > 8.7 the prefactor
  underflows to 0.0, where τ√d is far below double precision of Δ₂/σ
  anyway (τ ≤ 10·(n−1)·e^{−π²σ²} always).

  Args:
    sigma: σ of each summand (grid units), positive and finite.
    num_summands: n ≥ 1.

  Returns:
    The upper bound on τ, a float ≥ 0.
  """
  sigma = _check_positive("sigma", sigma)
  n = _check_count("num_summands", num_summands)
  if n == 1:
    return 0.0
  c = 2.0 * math.pi**2 * sigma**2
  head = min(n - 1, _TAU_HEAD_TERMS)
  k = np.arange(1, head + 1, dtype=np.float64)
  total = float(np.sum(np.exp(-c * (k / (k + 1) - 0.5))))
  tail_terms = n - 1 - head
  if tail_terms:
    total += tail_terms * math.exp(-c * ((head + 1) / (head + 2) - 0.5))
  return 10.0 * math.exp(-c / 2) * total


def discrete_gaussian_noise_multiplier(sigma: float, l2_sensitivity: float, dim: int,
                                       num_summands: int = 1) -> float:
  """Noise multiplier 1/ε to give a continuous-Gaussian RDP accountant.

  Adding to an integer-valued query of L2 sensitivity Δ₂ in Z^d the sum of n
  independent N_Z(0, σ²) per coordinate satisfies ½ε²-concentrated DP with ::

      ε = min{ sqrt(Δ₂²/(nσ²) + 2τd),  Δ₂/(√n σ) + τ√d }

  (KLS 2021, which needs σ ≥ ½ when n > 1; τ from
  :func:`discrete_gaussian_tau`). For n = 1, τ = 0 and ε = Δ₂/σ exactly (CKS
  2020, the multivariate discrete Gaussian: it is as private as the
  continuous one), so the multiplier is σ/Δ₂.
  ½ε²-concentrated DP means RDP α·ε²/2 at every order α, the RDP of the
  continuous Gaussian mechanism with multiplier 1/ε; Poisson subsampling is
  then accounted at that multiplier, an assumption stated in the module
  docstring.

  Args:
    sigma: σ of each summand, in the units of the integer grid.
    l2_sensitivity: Δ₂ of the integer-valued query, in the same units.
    dim: d, the number of coordinates.
    num_summands: n, independent discrete Gaussians summed per coordinate.

  Returns:
    1/ε; at most √n·σ/Δ₂, equal to it up to τ.

  Raises:
    ValueError: an argument is not positive (and finite, or an integer), or
      n > 1 with σ < ½.
  """
  sigma = _check_positive("sigma", sigma)
  l2_sensitivity = _check_positive("l2_sensitivity", l2_sensitivity)
  d = _check_count("dim", dim)
  n = _check_count("num_summands", num_summands)
  if n > 1 and sigma < 0.5:
    raise ValueError(f"sigma must be at least 1/2 for a sum of discrete Gaussians, got {sigma}")
  tau = discrete_gaussian_tau(sigma, n)
  ratio = l2_sensitivity / (math.sqrt(n) * sigma)
  eps = min(math.sqrt(ratio**2 + 2.0 * tau * d), ratio + tau * math.sqrt(d))
  return 1.0 / eps
