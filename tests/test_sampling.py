"""Poisson sampler: Binomial batch sizes, independent inclusions, no drops, dummy padding."""

import math

import numpy as np
import pytest
from stats import chi2_quantile

from dpmuon_jax.privacy.keys import RootKey, root_key, split_streams
from dpmuon_jax.privacy.sampling import PADDING_INDEX, PoissonSampler, default_capacity, gather


def _inclusions(sampler: PoissonSampler, steps: int) -> np.ndarray:
  """(steps, N) boolean matrix: example j sampled at step t."""
  out = np.zeros((steps, sampler.dataset_size), bool)
  for t in range(steps):
    out[t, sampler.sample_indices(t)] = True
  return out


def _binomial_pmf(n: int, p: float, k: int) -> float:
  return math.comb(n, k) * p**k * (1.0 - p) ** (n - k)


def _chi_square_binomial(sizes: np.ndarray, n: int, p: float) -> tuple[float, int]:
  """Pearson's statistic of ``sizes`` against Binomial(n, p); tails pooled to expected >= 5."""
  num = len(sizes)
  expected = np.array([num * _binomial_pmf(n, p, k) for k in range(n + 1)])
  observed = np.bincount(sizes, minlength=n + 1).astype(float)
  bins, exp_bin, obs_bin = [], 0.0, 0.0
  for e, o in zip(expected, observed, strict=True):  # pool from the left until expected >= 5
    exp_bin, obs_bin = exp_bin + e, obs_bin + o
    if exp_bin >= 5:
      bins.append([exp_bin, obs_bin])
      exp_bin, obs_bin = 0.0, 0.0
  bins[-1][0] += exp_bin  # right tail into the last bin
  bins[-1][1] += obs_bin
  exp_arr, obs_arr = np.array(bins).T
  return float(np.sum((obs_arr - exp_arr) ** 2 / exp_arr)), len(bins) - 1


def test_batch_sizes_follow_binomial():
  # Pearson chi-square goodness of fit over 4000 steps; the critical value is the
  # 1 - 1e-4 quantile of chi2(dof) by the Wilson–Hilferty approximation (tests/stats.py).
  n, q, steps = 200, 0.1, 4000
  sampler = PoissonSampler(n, q, key=0)
  sizes = np.array([len(sampler.sample_indices(t)) for t in range(steps)])
  stat, dof = _chi_square_binomial(sizes, n, q)
  assert dof >= 10
  assert stat < chi2_quantile(1 - 1e-4, dof), (stat, dof)
  # Power check: a fixed-size sampler with the same mean fails the same test.
  fixed, _ = _chi_square_binomial(np.full(steps, round(n * q)), n, q)
  assert fixed > chi2_quantile(1 - 1e-4, dof)


def test_inclusion_rate_and_pairwise_independence():
  n, q, steps = 60, 0.2, 3000
  x = _inclusions(PoissonSampler(n, q, key=1), steps).astype(float)
  # Per-example inclusion ~ Binomial(steps, q)/steps; 5-sigma bounds for each of the n examples.
  rate = x.mean(axis=0)
  assert np.all(np.abs(rate - q) < 5 * math.sqrt(q * (1 - q) / steps)), rate
  # Joint inclusion of each pair ~ Binomial(steps, q^2)/steps; 6 sigma over all n(n-1)/2 pairs.
  joint = (x.T @ x) / steps
  off = joint[~np.eye(n, dtype=bool)]
  p2 = q * q
  assert np.all(np.abs(off - p2) < 6 * math.sqrt(p2 * (1 - p2) / steps))
  # Power check: examples sampled in blocks of two (correlated) fail the pair test.
  blocks = np.repeat(x[:, : n // 2], 2, axis=1)
  joint_b = (blocks.T @ blocks) / steps
  assert np.any(np.abs(joint_b[~np.eye(n, dtype=bool)] - p2) > 6 * math.sqrt(p2 * (1 - p2) / steps))


def test_over_capacity_chunks_keep_every_index_once():
  sampler = PoissonSampler(100, 0.3, capacity=8, key=2)
  for step in range(5):
    sampled = sampler.sample_indices(step)
    assert len(sampled) > 8
    batches = sampler.sample(step)
    assert len(batches) == math.ceil(len(sampled) / 8)
    for b in batches:
      assert b.indices.shape == (8,) and b.mask.shape == (8,)
      assert b.indices.dtype == np.int32 and b.mask.dtype == bool
    real = np.concatenate([b.indices[b.mask] for b in batches])
    np.testing.assert_array_equal(np.sort(real), sampled)
    assert len(np.unique(real)) == len(real)


def test_over_capacity_raise_mode_says_what_to_change():
  sampler = PoissonSampler(100, 0.3, capacity=8, key=2, on_overflow="raise")
  with pytest.raises(ValueError, match="capacity"):
    sampler.sample(0)


def test_padding_is_a_dummy_never_a_real_example():
  n = 50
  sampler = PoissonSampler(n, 0.1, capacity=16, key=3)
  data = {"x": np.arange(1, n + 1, dtype=np.float32)[:, None] * np.ones((1, 3)), "y": np.arange(n)}
  for step in range(20):
    (batch,) = sampler.sample(step)
    pad = ~batch.mask
    assert pad.any()
    assert np.all(batch.indices[pad] == PADDING_INDEX)
    assert not np.isin(batch.indices[pad], np.arange(n)).any()
    got = gather(data, batch)
    assert got["x"].shape == (16, 3) and got["y"].shape == (16,)
    assert np.all(got["x"][pad] == 0) and np.all(got["y"][pad] == 0)
    np.testing.assert_array_equal(got["x"][batch.mask], data["x"][batch.indices[batch.mask]])
    np.testing.assert_array_equal(gather(data["y"], batch), got["y"])


def test_empty_sample_is_one_all_padding_batch():
  sampler = PoissonSampler(5, 0.01, capacity=8, key=4)
  step = next(t for t in range(100) if len(sampler.sample_indices(t)) == 0)
  (batch,) = sampler.sample(step)
  assert not batch.mask.any()
  assert np.all(batch.indices == PADDING_INDEX)


def test_same_key_and_step_reproduce_and_steps_differ():
  a, b = PoissonSampler(1000, 0.05, key=5), PoissonSampler(1000, 0.05, key=5)
  for step in (0, 7, 123456):
    np.testing.assert_array_equal(a.sample_indices(step), b.sample_indices(step))
  assert not np.array_equal(a.sample_indices(0), a.sample_indices(1))
  other = PoissonSampler(1000, 0.05, key=6)
  assert not np.array_equal(a.sample_indices(0), other.sample_indices(0))
  # A shared OS-entropy root (key=None drawn once) also reproduces across hosts.
  root = root_key(None)
  np.testing.assert_array_equal(
      PoissonSampler(1000, 0.05, key=root).sample_indices(3),
      PoissonSampler(1000, 0.05, key=root).sample_indices(3),
  )


def _documented_draw(stream_key, step, n, q):
  words = [int(w) for w in np.asarray(stream_key)]
  rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence(words, spawn_key=(step,))))
  return np.flatnonzero(rng.random(n) < q)


def test_sampling_uses_the_sampling_stream_not_the_noise_stream():
  streams, _ = split_streams(7)
  sampler = PoissonSampler(500, 0.1, key=7)
  got = sampler.sample_indices(11)
  np.testing.assert_array_equal(got, _documented_draw(streams.sampling, 11, 500, 0.1))
  assert not np.array_equal(got, _documented_draw(streams.noise, 11, 500, 0.1))
  assert not np.array_equal(np.asarray(streams.sampling), np.asarray(streams.noise))


def test_seeded_flag():
  assert PoissonSampler(10, 0.5).seeded is False
  assert PoissonSampler(10, 0.5, key=0).seeded is True
  assert PoissonSampler(10, 0.5, key=root_key(None)).seeded is False
  assert PoissonSampler(10, 0.5, key=RootKey(root_key(3).key, True)).seeded is True


def test_default_capacity_is_static_and_generous():
  sampler = PoissonSampler(50_000, 1024 / 50_000, key=0)
  assert sampler.expected_batch_size == pytest.approx(1024)
  assert sampler.capacity % 8 == 0
  mean, sd = 1024, math.sqrt(1024 * (1 - 1024 / 50_000))
  assert mean + 6 * sd <= sampler.capacity <= mean + 6 * sd + 10
  assert default_capacity(10, 0.9) == 16  # capped at N=10, rounded up to 8
  assert PoissonSampler(100, 0.1, capacity=13).capacity == 13
  assert default_capacity(1000, 0.1, multiple_of=32) % 32 == 0


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(dataset_size=0, sampling_rate=0.1),
        dict(dataset_size=10, sampling_rate=0.0),
        dict(dataset_size=10, sampling_rate=1.5),
        dict(dataset_size=10, sampling_rate=0.1, capacity=0),
        dict(dataset_size=10, sampling_rate=0.1, on_overflow="drop"),
    ],
)
def test_invalid_settings_raise(kwargs):
  with pytest.raises(ValueError):
    PoissonSampler(**kwargs)


def test_invalid_step_raises():
  with pytest.raises(ValueError, match="step"):
    PoissonSampler(10, 0.1, key=0).sample(-1)


def test_an_epoch_is_n_over_b_steps_under_cyclic_sampling_too():
  """b groups at the within-group rate bB/N: an epoch (each example once in expectation) is
  round(N/B) steps, not round(1/(bB/N)) = 1/b of it."""
  n, batch = 45_000, 256
  plain = PoissonSampler(n, batch / n, key=0)
  cyclic = PoissonSampler(n, 4 * batch / n, key=0, cycle_length=4)
  assert plain.steps_per_epoch == cyclic.steps_per_epoch == round(n / batch) == 176
  sizes = [len(cyclic.sample_indices(t)) for t in range(cyclic.steps_per_epoch)]
  assert abs(sum(sizes) - n) < 5 * math.sqrt(n)  # every example about once per epoch
