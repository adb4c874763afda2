"""TensorBoard tracking: ``--log-dir`` writes the run's metrics, read back as TensorBoard does."""

import glob
import math
import os

import pytest

pytest.importorskip("tensorboardX")
pytest.importorskip("tensorboard")

from tensorboard.backend.event_processing import plugin_event_accumulator  # noqa: E402
from tensorboard.util import tensor_util  # noqa: E402
from text_folder import TEXT_DIR, needs_text_data  # noqa: E402

from dpmuon_jax import cli  # noqa: E402
from dpmuon_jax.training.tracking import (  # noqa: E402
    NONPRIVATE_DESCRIPTION,
    history_tags,
    tensorboard_writer,
)
from dpmuon_jax.training.trainer import TrainConfig, train  # noqa: E402


def _scalars(log_dir: str) -> dict[str, list[tuple[int, float]]]:
  """tag -> [(step, value)] with the accumulator TensorBoard's server uses."""
  acc = plugin_event_accumulator.EventAccumulator(log_dir)
  acc.Reload()
  return {tag: [(e.step, float(tensor_util.make_ndarray(e.tensor_proto))) for e in acc.Tensors(tag)]
          for tag in acc.Tags()["tensors"]}


def _description(log_dir: str, tag: str) -> str:
  acc = plugin_event_accumulator.EventAccumulator(log_dir)
  acc.Reload()
  return acc.SummaryMetadata(tag).summary_description


def test_cli_train_writes_the_metrics_under_clear_tags(tmp_path, capsys):
  log_dir = str(tmp_path / "tb")
  code = cli.main(["train", "--max-steps", "2", "--output-dir", str(tmp_path / "run"),
                   "--log-dir", log_dir, "--log-clip-stats", "--seed", "0", "--batch-size", "64",
                   "--no-progress", "--no-plot"])
  assert code == 0, capsys.readouterr().err
  scalars = _scalars(log_dir)
  assert set(scalars) == {"test/loss", "test/accuracy", "privacy/epsilon_spent",
                          "train/learning_rate", "train/epoch", "nonprivate/clip_fraction",
                          "nonprivate/mean_grad_norm"}
  # One evaluation, at the last step; the values are the run's own.
  assert all([step for step, _ in points] == [2] for points in scalars.values())
  (_, eps), = scalars["privacy/epsilon_spent"]
  (_, fraction), = scalars["nonprivate/clip_fraction"]
  (_, accuracy), = scalars["test/accuracy"]
  assert 0 < eps < 4.0 and 0 <= fraction <= 1 and 0 <= accuracy <= 1
  assert scalars["train/learning_rate"][0][1] > 0
  assert _description(log_dir, "nonprivate/clip_fraction") == NONPRIVATE_DESCRIPTION
  # Event files go where --log-dir says, nowhere else.
  events = glob.glob(str(tmp_path / "**" / "events.out.tfevents*"), recursive=True)
  assert events and all(path.startswith(log_dir + os.sep) for path in events)


def _config(tmp_path, **kw) -> TrainConfig:
  base = dict(model="mlp", dataset="tiny", optimizer="dp_sgd", epsilon=3.0, delta=1e-3,
              batch_size=16, epochs=2, seed=3, output_dir=str(tmp_path / "run"),
              progress=False, plot=False, learning_rate=0.1, eval_every=1)
  return TrainConfig(**{**base, **kw})


def test_epsilon_grows_step_by_step_and_a_resumed_run_continues_the_curve(tmp_path, tiny_data):
  log_dir = str(tmp_path / "tb")
  train(_config(tmp_path, epochs=1, max_steps=2, log_dir=log_dir), tiny_data)
  results = train(_config(tmp_path, epochs=1, resume=True, log_dir=log_dir), tiny_data)
  assert results["releases"] == 4
  scalars = _scalars(log_dir)
  eps = scalars["privacy/epsilon_spent"]
  assert [step for step, _ in eps] == list(range(1, 5))
  values = [value for _, value in eps]
  assert all(a < b for a, b in zip(values, values[1:]))
  assert values[-1] == pytest.approx(results["epsilon_spent"], rel=1e-6)
  assert [step for step, _ in scalars["test/accuracy"]] == list(range(1, 5))
  # No --log-clip-stats: no non-private statistic is written.
  assert not [tag for tag in scalars if tag.startswith("nonprivate/")]


def test_without_log_dir_there_is_no_writer():
  assert tensorboard_writer(None) is None


def test_history_tags_put_every_nonprivate_column_under_nonprivate():
  row = {"step": 4, "epsilon": 1.5, "test_loss": 0.3, "nonprivate_clip_fraction": 0.25,
         "nonprivate_new_statistic": 7.0, "unlisted": 1.0}
  tags = history_tags(row, {"epsilon": "privacy/epsilon_spent", "test_loss": "test/loss"})
  assert tags == {"privacy/epsilon_spent": 1.5, "test/loss": 0.3,
                  "nonprivate/clip_fraction": 0.25, "nonprivate/new_statistic": 7.0}


def test_non_finite_values_are_skipped(tmp_path):
  writer = tensorboard_writer(str(tmp_path))
  assert writer is not None
  writer.scalars(1, {"test/loss": math.nan, "privacy/epsilon_spent": 0.5})
  writer.close()
  assert _scalars(str(tmp_path)) == {"privacy/epsilon_spent": [(1, 0.5)]}


@needs_text_data
def test_the_gpt2_trainer_writes_nll_epsilon_and_learning_rates(tmp_path):
  from dpmuon_jax.text.train import LMTrainConfig, train_lm
  from experiments.text_sweep import TINY_MODEL

  log_dir = str(tmp_path / "tb")
  config = LMTrainConfig(
      data_dir=TEXT_DIR, output_dir=str(tmp_path / "run"), model="gpt2_tiny",
      model_overrides=TINY_MODEL, vocab_size=512, train_split="train", train_subset=64,
      sampling_rate=0.125, steps=2, denominator=8.0, epsilon=8.0, microbatch_size=8, seed=3,
      eval_pairs=16, eval_every=1, generate_splits=(), optimizer="dp_muon",
      learning_rate=0.02, fallback_learning_rate=0.003, log_dir=log_dir)
  results = train_lm(config)
  scalars = _scalars(log_dir)
  assert set(scalars) == {"valid/nll", "privacy/epsilon_spent", "train/learning_rate",
                          "train/fallback_learning_rate"}
  eps = scalars["privacy/epsilon_spent"]
  assert [step for step, _ in eps] == [1, 2] and eps[0][1] < eps[1][1]
  assert eps[1][1] == pytest.approx(results["epsilon_spent"], rel=1e-6)
  assert scalars["valid/nll"][-1][1] == pytest.approx(results["valid_nll"], rel=1e-5)
  assert scalars["train/fallback_learning_rate"] == [(1, pytest.approx(0.003)),
                                                     (2, pytest.approx(0.003))]
