"""User-level DP: one clipped vector per user, users sampled and counted by the accountant."""

import dp_accounting
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dpmuon_jax.data.users import group_by_user
from dpmuon_jax.privacy.clipping import Clipping
from dpmuon_jax.privacy.query import RECORD_MASK, clip_and_sum, clipped_sum, gradient_query
from dpmuon_jax.privacy.release import dp_release
from dpmuon_jax.privacy.setup import make_private
from dpmuon_jax.training.export import guarantee

C = 1.0
DIM = 6


def _loss(params, batch):
  """Squared error of a linear model: per-record gradients of norm ≫ C for these records."""
  pred = batch["x"] @ params["w"]
  return jnp.mean((pred - batch["y"]) ** 2)


def _records(n: int, seed: int) -> dict[str, np.ndarray]:
  rng = np.random.default_rng(seed)
  return {"x": rng.normal(size=(n, DIM)).astype(np.float32) * 10,
          "y": rng.normal(size=(n,)).astype(np.float32) * 50}


def _user_sum(records: dict, users: np.ndarray, max_records: int, microbatch=None) -> np.ndarray:
  groups = group_by_user(records, users, max_records)
  params = {"w": jnp.zeros(DIM)}
  total = clipped_sum(gradient_query(_loss), params, groups.arrays, None,
                      Clipping(C, unit="user"), microbatch).total
  return np.asarray(total["w"])


@pytest.mark.parametrize("microbatch", [None, 2])
def test_a_user_with_fifty_records_moves_the_sum_by_at_most_c(microbatch):
  """Neighbouring datasets: with and without user 7 and all 50 of its records. Each record's
  gradient alone has norm ≫ C and they point the same way, so any per-record clipping would
  move the sum by up to 50·C."""
  others = _records(30, 0)
  other_users = np.repeat(np.arange(10), 3)
  x = np.tile(np.ones((1, DIM), np.float32), (50, 1)) * 10
  mine = {"x": x, "y": np.full((50,), 500.0, np.float32)}
  with_user = {k: np.concatenate([others[k], mine[k]]) for k in others}
  users = np.concatenate([other_users, np.full(50, 7 + 100)])
  grads = jax.vmap(jax.grad(_loss), in_axes=(None, 0))(
      {"w": jnp.zeros(DIM)}, {k: jnp.asarray(v)[:, None] for k, v in mine.items()})
  assert float(jnp.min(jnp.linalg.norm(grads["w"], axis=1))) > 100 * C
  change = _user_sum(with_user, users, 50, microbatch) - _user_sum(others, other_users, 50,
                                                                   microbatch)
  assert np.linalg.norm(change) <= C * (1 + 1e-5)
  assert np.linalg.norm(change) > 0.99 * C  # the user's one vector is there, clipped to C


def test_a_users_vector_is_the_clipped_mean_of_its_kept_records():
  records = _records(7, 1)
  users = np.array(["a", "b", "a", "a", "b", "a", "c"])
  groups = group_by_user(records, users, max_records=3)
  assert groups.records_kept == 6 and groups.records_dropped == 1  # a's 4th record (row 5)
  params = {"w": jnp.zeros(DIM)}
  total = clipped_sum(gradient_query(_loss), params, groups.arrays, None,
                      Clipping(C, unit="user")).total["w"]
  grad = lambda i: jax.grad(_loss)(params, {k: jnp.asarray(v[i:i + 1]) for k, v in
                                            records.items()})["w"]
  expected = 0
  for rows in ([0, 2, 3], [1, 4], [6]):  # the first 3 records of each user, data order
    mean = sum(grad(i) for i in rows) / len(rows)
    expected = expected + mean * min(1.0, C / float(jnp.linalg.norm(mean)))
  np.testing.assert_allclose(total, expected, rtol=2e-5, atol=1e-6)


def test_a_user_level_release_refuses_per_record_queries_and_sums():
  params = {"w": jnp.zeros(DIM)}
  records = _records(4, 2)
  release = dp_release(C, 1.0, 4.0, key=0, clipping=Clipping(C, unit="user"))
  state = release.init(params)
  per_record = jax.vmap(jax.grad(_loss), in_axes=(None, 0))(
      params, {k: jnp.asarray(v)[:, None] for k, v in records.items()})
  with pytest.raises(ValueError, match="user-level"):
    release.update(per_record, state, params)
  example_sum = clip_and_sum(per_record, None, C)  # clipped per record: sensitivity per record
  with pytest.raises(ValueError):
    release.update(example_sum, state, params)
  with pytest.raises(ValueError, match="user-level"):
    clip_and_sum(per_record, None, Clipping(C, unit="user"))


def test_epsilon_per_user_is_dp_accountings_with_q_over_users():
  users, expected_users, steps = 2_000, 50, 120
  setup = make_private(target_epsilon=3.0, target_delta=1e-5, dataset_size=users,
                       expected_batch_size=expected_users, l2_clip_norm=C, steps=steps, key=0,
                       privacy_unit="user")
  setup.ledger.record(setup.sampler, setup.release, count=steps)
  q = expected_users / users
  event = dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(
      q, dp_accounting.GaussianDpEvent(setup.noise_multiplier)), steps)
  independent = dp_accounting.rdp.RdpAccountant().compose(event).get_epsilon(1e-5)
  assert setup.ledger.epsilon() == pytest.approx(independent, rel=1e-9)
  assert setup.ledger.config.privacy_unit == "user" and setup.ledger.config.dataset_size == users
  assert setup.release.release.clipping.describe()["privacy_unit"] == "user"
  assert "per user" in guarantee(3.0, 1e-5, "add_remove", False, "user")
  assert "add/remove-one-user" in guarantee(3.0, 1e-5, "add_remove", False, "user")


def test_grouping_refuses_records_without_a_user():
  records = _records(3, 3)
  with pytest.raises(ValueError, match="record 1 has no user"):
    group_by_user(records, np.array(["a", " ", "b"]), 2)
  with pytest.raises(ValueError, match="record 2 has no user"):
    group_by_user(records, np.array([1.0, 2.0, np.nan]), 2)
  with pytest.raises(ValueError, match="3 ids"):
    group_by_user({"x": records["x"][:2]}, np.array(["a", "b", "c"]), 2)


def test_masked_records_add_nothing_even_where_their_query_is_not_finite():
  """A padded slot's query may be NaN (a text with no scored token); the user's mean must
  not become NaN (which would zero the user)."""
  def nan_loss(params, batch):
    return jnp.sum(batch["x"] @ params["w"]) / jnp.sum(batch["n"])

  params = {"w": jnp.ones(DIM)}
  batch = {"x": jnp.ones((1, 2, DIM)), "n": jnp.asarray([[1.0, 0.0]]),
           RECORD_MASK: jnp.asarray([[True, False]])}
  total = clipped_sum(gradient_query(nan_loss), params, batch, None,
                      Clipping(10.0, unit="user")).total["w"]
  np.testing.assert_allclose(total, np.ones(DIM), rtol=1e-6)


def test_the_image_trainer_samples_users_and_certifies_per_user(tmp_path, tiny_data):
  """64 training images of 16 users (4 each): N = 16 in the accounting, --batch-size counts
  users, and the results and certificate say per user."""
  import dataclasses

  from dpmuon_jax.training.export import load_exported
  from dpmuon_jax.training.trainer import TrainConfig, TrainingError, train

  data = dataclasses.replace(tiny_data, user_train=np.repeat(np.arange(16), 4))
  config = TrainConfig(model="mlp", dataset="tiny", optimizer="dp_sgd", epsilon=3.0,
                       delta=1e-3, batch_size=4, epochs=1, seed=3, progress=False, plot=False,
                       output_dir=str(tmp_path / "run"), privacy_unit="user",
                       max_examples_per_user=3, microbatch_size=2, learning_rate=0.1)
  results = train(config, data)
  assert results["privacy_unit"] == "user" and results["sampling_rate"] == 4 / 16
  assert results["releases"] == 4 and results["epsilon_spent"] <= 3.0
  certificate = load_exported(str(tmp_path / "run" / "export")).certificate
  assert certificate["privacy_unit"] == "user" and "per user" in certificate["guarantee"]
  with pytest.raises(TrainingError, match="user_train"):
    train(dataclasses.replace(config, output_dir=str(tmp_path / "other")), tiny_data)
  with pytest.raises(TrainingError, match=r"\[1, 16\] \(the training set's users\)"):
    train(dataclasses.replace(config, batch_size=17, output_dir=str(tmp_path / "big")), data)


@pytest.fixture(scope="module")
def audited_people():
  """One-run audits (10⁴ white-box canaries, ε = 2) where every canary is a person with 8
  records: at user level (each a user of 8 records) and at example level (8 examples)."""
  from dpmuon_jax.audit.run_audit import AuditConfig, audit

  def run(unit):
    return audit(AuditConfig(num_canaries=10_000, epsilon=2.0, steps=1, seed=1, audit_seed=2,
                             privacy_unit=unit, records_per_canary=8))

  return {unit: run(unit) for unit in ("user", "example")}


def test_canaries_as_users_pass_the_user_level_audit(audited_people):
  result = audited_people["user"]
  assert result["epsilon_per"] == "user"
  assert result["epsilon_hat"] <= result["epsilon_accountant"]
  np.testing.assert_allclose(result["epsilon_accountant"], 2.0, rtol=2e-3)


def test_example_level_dp_leaks_more_than_epsilon_about_an_eight_record_person(audited_people):
  """The audit has the power to see the difference: per-record clipping lets a person move
  the sum by 8·C, a true ε per person far above the accountant's per-example 2."""
  result = audited_people["example"]
  assert result["epsilon_per"] == "example"
  assert result["epsilon_hat"] > result["epsilon_accountant"]


def test_an_e2e_user_is_a_restaurant_or_a_table():
  from types import SimpleNamespace

  from dpmuon_jax.text.train import _pair_user

  pair = SimpleNamespace(source="name : The Eagle | Type : coffee shop")
  user = lambda field, dataset="e2e": _pair_user(SimpleNamespace(dataset=dataset,
                                                                 user_field=field), pair)
  assert user("name") == "The Eagle"
  assert user("source") == pair.source  # every reference written for this one table
  for field, dataset in (("author", "e2e"), ("name", "dart")):
    with pytest.raises(ValueError, match="--user-field name"):
      user(field, dataset)
