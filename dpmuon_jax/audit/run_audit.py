"""``python -m dpmuon_jax.audit.run_audit``: a one-run audit of DP-SGD on real data.

::

    python -m dpmuon_jax.audit.run_audit                       # digits, white-box, ε = 2
    python -m dpmuon_jax.audit.run_audit --scoring black --canaries 1000
    python -m dpmuon_jax.audit.run_audit --noise-scale 0       # a broken release: no noise
    python -m dpmuon_jax.audit.run_audit --privacy-unit user --records-per-canary 8
    python -m dpmuon_jax.audit.run_audit --noise bandmf --bands 2 --steps 4

Trains ONE small MLP with the library's private step (Poisson sampler, clipping,
Gaussian release, SGD) on the training set plus the included canaries
(:mod:`dpmuon_jax.audit.canaries`), scores the canaries and prints the audit's
lower bound ε̂ (:func:`~dpmuon_jax.audit.one_run.epsilon_one_run`) next to the
accountant's ε for the same (σ, q, T, δ). ε̂ > ε means the implementation leaks
more than the accountant claims (at the chosen confidence). ``--noise-scale``
multiplies the σ of the release but not the σ given to the accountant, to show
that the audit catches such a bug when it is gross: with no noise ε̂ is far
above ε, while σ/2 (a true ε about twice the claimed one) stays below the
power of one run with 10⁴ canaries (ε̂ ≈ 1 against ε = 2).

``--records-per-canary R`` makes each canary a person with R records (the same
canary R times). Under ``--privacy-unit user`` every data record is a user of its
own, each canary a user of R records, and the run is user-level DP (each user's
mean query clipped once; :func:`~dpmuon_jax.privacy.query.per_user_query`): the
canaries are users, and ε̂ must stay below the per-user ε. Under the default
``example`` unit the same R-record canaries are each clipped record by record,
so a person moves the sum by up to R·C: ε̂ measured on them may exceed the
per-example ε, which is what example-level DP does not promise.

``--noise bandmf --bands b`` audits the BandMF release
(:mod:`~dpmuon_jax.privacy.correlated`) under its b-cyclic Poisson sampler: the rate is
the within-group rate (every example of the group at 1.0), σ is calibrated for ⌈T/b⌉
participations, and the white-box adversary, who knows every group, removes at each
release the clipped sum of the data in that release's group.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
import warnings
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.flatten_util import ravel_pytree

from dpmuon_jax import checks
from dpmuon_jax.audit.canaries import (
    NOT_A_CANARY,
    canary_coordinates,
    canary_labels,
    canary_membership,
    canary_query,
    split_scores,
    white_box_scores,
)
from dpmuon_jax.audit.one_run import epsilon_one_run
from dpmuon_jax.data.users import group_by_user
from dpmuon_jax.help_format import HelpFormatter
from dpmuon_jax.optimizers import dp_sgd
from dpmuon_jax.privacy.accounting import (
    calibrate_noise_multiplier,
    compute_epsilon,
    participations,
)
from dpmuon_jax.privacy.clipping import EXAMPLE, PRIVACY_UNITS, Clipping
from dpmuon_jax.privacy.correlated import BANDMF, IID
from dpmuon_jax.privacy.keys import root_key
from dpmuon_jax.privacy.sampling import PADDING_INDEX, PaddedBatch, PoissonSampler, gather
from dpmuon_jax.training.loop import LoopState, release
from dpmuon_jax.training.settings import one_of
from dpmuon_jax.training.step import make_private_step

PyTree = Any

WHITE_BOX = "white"
BLACK_BOX = "black"


@dataclasses.dataclass
class AuditConfig:
  """One audited run. ``seed``/``audit_seed`` None: OS entropy (the default)."""

  scoring: str = WHITE_BOX
  num_canaries: int = 10_000
  epsilon: float = 2.0
  delta: float = 1e-5
  sampling_rate: float = 1.0
  steps: int = 2
  clip: float = 1.0
  learning_rate: float = 0.5
  hidden: int = 160
  noise_scale: float = 1.0  # σ_release = noise_scale·σ; the accountant still sees σ
  significance: float = 0.05
  microbatch_size: int | None = 512
  data: str | None = None  # path to an .npz (x_train, y_train, ...); None: embedded digits
  seed: int | None = None
  audit_seed: int | None = None
  model_seed: int = 0
  privacy_unit: str = EXAMPLE  # "user": every canary and data record a user
  records_per_canary: int = 1  # R: each canary a person with R copies of its record
  noise: str = IID  # or "bandmf": the BandMF release over b-cyclic Poisson sampling
  bands: int | None = None  # b, with noise="bandmf" only

  @property
  def cycle_length(self) -> int:
    """b, the sampler's groups (1 for independent noise)."""
    return self.bands if self.noise == BANDMF and self.bands is not None else 1


def _load(path: str | None) -> tuple[np.ndarray, np.ndarray, int]:
  if path is None:
    from dpmuon_jax.data.embedded import load_embedded

    data = load_embedded()
    x, y, classes = data.x_train, data.y_train, cast(int, data.num_classes)  # set on init
  else:
    with np.load(path) as f:
      x, y = f["x_train"], f["y_train"]
    classes = int(y.max()) + 1
  x = x.reshape(len(x), -1).astype(np.float32) / 255.0
  x = (x - x.mean(0)) / (x.std(0) + 1e-3)
  return x, y.astype(np.int32), classes


def _mlp(num_inputs: int, hidden: int, classes: int, seed: int) -> PyTree:
  """A one-hidden-layer MLP, initialised from a public seed."""
  rng = np.random.default_rng(seed)
  return {
      "w1": jnp.asarray(rng.normal(size=(num_inputs, hidden)) / np.sqrt(num_inputs), jnp.float32),
      "b1": jnp.zeros((hidden,), jnp.float32),
      "w2": jnp.asarray(rng.normal(size=(hidden, classes)) / np.sqrt(hidden), jnp.float32),
      "b2": jnp.zeros((classes,), jnp.float32),
  }


def _per_example_loss(params: PyTree, batch: PyTree) -> jax.Array:
  h = jax.nn.relu(batch["image"] @ params["w1"] + params["b1"])
  logits = h @ params["w2"] + params["b2"]
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"])


def _loss(params: PyTree, batch: PyTree) -> jax.Array:
  return jnp.mean(_per_example_loss(params, batch))


def _canaries(config: AuditConfig, audit_key, x, y, classes, num_params):
  """Canary rows (all m) and how to score them."""
  m = config.num_canaries
  if config.scoring == WHITE_BOX:
    coords = canary_coordinates(audit_key, m, num_params)
    rows = {"image": np.zeros((m, x.shape[1]), np.float32), "label": np.zeros(m, np.int32),
            "coordinate": coords}
    return rows, lambda p0, p: white_box_scores(p0, p, coords)
  if config.scoring == BLACK_BOX:
    picks = np.random.default_rng(config.model_seed).integers(0, len(x), m)
    rows = {"image": x[picks], "label": canary_labels(audit_key, y[picks], classes),
            "coordinate": np.full(m, NOT_A_CANARY, np.int32)}
    data = {"image": jnp.asarray(rows["image"]), "label": jnp.asarray(rows["label"])}
    return rows, lambda p0, p: -np.asarray(jax.jit(_per_example_loss)(p, data))
  raise ValueError(f"scoring must be {WHITE_BOX!r} or {BLACK_BOX!r}, got {config.scoring!r}.")


def _with_canaries(x, y, rows: dict, included: np.ndarray) -> dict:
  """The training set: the data plus the canaries drawn into it."""
  return {
      "image": np.concatenate([x, rows["image"][included]]),
      "label": np.concatenate([y, rows["label"][included]]),
      "coordinate": np.concatenate(
          [np.full(len(x), NOT_A_CANARY, np.int32), rows["coordinate"][included]]
      ),
  }


def _as_people(train: dict, num_data: int, config: AuditConfig) -> dict:
  """Each included canary repeated R times; at user level one row per user.

  Data record i is user i; included canary j is user ``num_data + j`` with R records, so
  in :func:`~dpmuon_jax.data.users.group_by_user`'s sorted rows the data users come first.
  """
  r = config.records_per_canary
  repeats = np.where(np.arange(len(train["label"])) < num_data, 1, r)
  records = {k: np.repeat(v, repeats, axis=0) for k, v in train.items()}
  if config.privacy_unit == EXAMPLE:
    return records
  users = np.repeat(np.arange(len(repeats)), repeats)
  return group_by_user(records, users, r).arrays


def _data_rows(train: dict, num_data: int, multiple: int, groups: np.ndarray):
  """The (non-canary) data rows of ``train`` as one padded batch, and the groups of its
  rows (-1: padding)."""
  rows = -(-num_data // multiple) * multiple
  padded = PaddedBatch(np.where(np.arange(rows) < num_data, np.arange(rows), PADDING_INDEX),
                       np.arange(rows) < num_data)
  return gather(train, padded), np.where(padded.mask, np.resize(groups, rows), -1)


def check_config(config: AuditConfig) -> None:
  """Refuses a NaN, infinite or out-of-range setting in one line that names its flag."""
  checks.check_int("--canaries", config.num_canaries, 2)  # one included, one excluded at least
  checks.check_positive("--epsilon", config.epsilon)
  checks.check_in_range("--delta", config.delta, 0.0, 1.0, False, False)
  checks.check_in_range("--sampling-rate", config.sampling_rate, 0.0, 1.0, False, True)
  checks.check_positive_int("--steps", config.steps)
  checks.check_positive("--clip", config.clip)
  checks.check_positive("--learning-rate", config.learning_rate)  # the white-box residual
  # divides by it
  checks.check_positive_int("--hidden", config.hidden)
  checks.check_nonnegative("--noise-scale", config.noise_scale)
  checks.check_in_range("--significance", config.significance, 0.0, 1.0, False, False)
  if config.microbatch_size is not None:
    checks.check_positive_int("--microbatch-size", config.microbatch_size)
  for flag, seed in (("--seed", config.seed), ("--audit-seed", config.audit_seed)):
    if seed is not None:
      checks.check_int(flag, seed)
  checks.check_nonnegative_int("--model-seed", config.model_seed)
  one_of(PRIVACY_UNITS)("--privacy-unit", config.privacy_unit)
  checks.check_positive_int("--records-per-canary", config.records_per_canary)
  one_of((IID, BANDMF))("--noise", config.noise)
  if (config.noise == BANDMF) != (config.bands is not None):
    raise ValueError("--bands is the setting of --noise bandmf (it needs one; iid takes none).")
  if config.bands is not None:
    checks.check_positive_int("--bands", config.bands)


def _sampler_and_optimizer(config: AuditConfig, n: int, sigma: float, multiple: int):
  """The run's sampler and DP-SGD, both from ONE root key; the release's σ is
  ``noise_scale``·σ."""
  root = root_key(config.seed)
  capacity = -(-n // multiple) * multiple if config.sampling_rate == 1.0 else None
  sampler = PoissonSampler(n, config.sampling_rate, capacity, key=root, multiple_of=multiple,
                           cycle_length=config.cycle_length)
  bandmf = {"noise": BANDMF, "bands": config.bands, "steps": config.steps} if (
      config.noise == BANDMF) else {}
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # σ = 0 warns: the broken run is meant to be broken
    optimizer = dp_sgd(config.learning_rate, config.clip, config.noise_scale * sigma,
                       sampler.expected_batch_size, key=root,
                       clipping=Clipping(config.clip, unit=config.privacy_unit), **bandmf)
  return sampler, optimizer


def audit(config: AuditConfig) -> dict:
  """Runs one audited training run; returns ε̂, the accountant's ε and the settings."""
  check_config(config)
  started = time.perf_counter()
  audit_key = root_key(config.audit_seed)  # kept apart from the run's root key
  x, y, classes = _load(config.data)
  params = _mlp(x.shape[1], config.hidden, classes, config.model_seed)
  num_params = ravel_pytree(params)[0].shape[0]
  rows, score = _canaries(config, audit_key, x, y, classes, num_params)
  included = canary_membership(audit_key, config.num_canaries)
  train = _as_people(_with_canaries(x, y, rows, included), len(x), config)
  n = len(train["label"])  # records, or users at user level
  compositions = participations(config.steps, config.cycle_length)
  sigma = calibrate_noise_multiplier(
      config.epsilon, config.delta, config.sampling_rate, compositions
  )
  multiple = config.microbatch_size or 8
  sampler, optimizer = _sampler_and_optimizer(config, n, sigma, multiple)
  step = make_private_step(optimizer, query=canary_query(_loss, config.clip),
                           microbatch_size=config.microbatch_size)
  # With q = 1 the batch is public, so a white-box adversary who sees every
  # iterate and knows the data (and, under cyclic sampling, every group) removes the
  # clipped sum of the data in each release: what is left is Σ_t (canary queries + noise),
  # scored at the canaries.
  remove_data = config.scoring == WHITE_BOX and config.sampling_rate == 1.0
  data, data_groups = _data_rows(train, len(x), multiple, sampler.groups()[:len(x)])
  undo_step = sampler.expected_batch_size / config.learning_rate  # θ_{t+1} − θ_t = −(lr/D)·G̃
  to_chunks = lambda padded, _: [(gather(train, c), jnp.asarray(c.mask)) for c in padded]
  # The audit accounts itself (no ledger): a broken run is meant to overspend.
  state, residual = LoopState(params, optimizer.init(params), 0, 0), params
  while state.step < config.steps:
    released = release(step, state, sampler=sampler, to_chunks=to_chunks)
    if remove_data:
      data_mask = jnp.asarray(data_groups == state.step % config.cycle_length)
      data_sum = step.clipped_sum(state.params, state.opt_state, data, data_mask).total
      residual = jax.tree.map(lambda r, a, b, s: r + (b - a) * undo_step + s,
                              residual, state.params, released.state.params, data_sum)
    state = released.state
  final = residual if remove_data else state.params
  in_scores, out_scores = split_scores(score(params, final), included)
  epsilon_hat = epsilon_one_run(in_scores, out_scores, config.significance, config.delta)
  fields = dataclasses.asdict(config)
  return {
      "epsilon_hat": epsilon_hat,
      "epsilon_accountant": compute_epsilon(sigma, config.sampling_rate, compositions,
                                            config.delta),
      "confidence": 1 - config.significance,
      "noise_multiplier_accounted": sigma,
      "noise_multiplier_released": config.noise_scale * sigma,
      "num_params": num_params,
      "num_included": int(included.sum()),
      "epsilon_per": config.privacy_unit,
      "seconds": time.perf_counter() - started,
      "config": fields,
  }


_DESCRIPTION = """\
One-run empirical privacy audit (Steinke, Nasr & Jagielski 2023) of DP-SGD on real data.

Trains ONE small MLP with the library's private step (Poisson sampler, clipping, Gaussian
release, SGD) on the training set plus the included canaries, scores the canaries and
prints the audit's lower bound ε̂ next to the accountant's ε for the same (σ, q, T, δ).
ε̂ > ε means the implementation leaks more than the accountant claims (at the chosen
confidence). --noise-scale multiplies the σ of the release but not the σ given to the
accountant, to show that the audit catches such a bug.
"""


def _optional_int(text: str) -> int | None:
  return None if text.lower() == "none" else int(text)


def _parser(prog: str | None = None) -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog=prog or "python -m dpmuon_jax.audit.run_audit",
                              description=_DESCRIPTION, formatter_class=HelpFormatter)
  d = AuditConfig()
  p.add_argument("--scoring", choices=(WHITE_BOX, BLACK_BOX), default=d.scoring,
                 help="white: gradient canaries (C times a unit vector), scored by the "
                 "parameters' move along their coordinate; black: input canaries with wrong "
                 "labels, scored by the trained model's loss")
  p.add_argument("--canaries", dest="num_canaries", type=int, default=d.num_canaries,
                 help="m, the number of canaries (each included with probability 1/2)")
  p.add_argument("--epsilon", type=float, default=d.epsilon, help="ε the run is calibrated to")
  p.add_argument("--delta", type=float, default=d.delta, help="δ of the run and of ε̂")
  p.add_argument("--sampling-rate", type=float, default=d.sampling_rate,
                 help="Poisson sampling rate q")
  p.add_argument("--steps", type=int, default=d.steps, help="T, the number of releases")
  p.add_argument("--clip", type=float, default=d.clip, help="per-example L2 clipping norm C")
  p.add_argument("--learning-rate", "--lr", dest="learning_rate", type=float,
                 default=d.learning_rate, help="SGD learning rate")
  p.add_argument("--hidden", type=int, default=d.hidden, help="width of the MLP's hidden layer")
  p.add_argument("--noise-scale", type=float, default=d.noise_scale,
                 help="multiply the release's σ (not the accountant's): 0 or 0.5 simulate bugs")
  p.add_argument("--significance", type=float, default=d.significance,
                 help="ε̂ holds with confidence 1 - significance")
  p.add_argument("--dataset", "--data", dest="data", default=None,
                 help="an .npz with x_train, y_train, e.g. MNIST (default: the embedded digits)")
  p.add_argument("--seed", type=int, default=None, help="run seed (default: OS entropy)")
  p.add_argument("--audit-seed", dest="audit_seed", type=int, default=None,
                 help="canary seed, kept apart from the run's (default: OS entropy)")
  p.add_argument("--microbatch-size", type=_optional_int, default=d.microbatch_size,
                 help="accumulate the clipped sum in chunks of this many rows ('none': all)")
  p.add_argument("--model-seed", type=int, default=d.model_seed,
                 help="public initialisation seed (and the black-box canaries' picks)")
  p.add_argument("--privacy-unit", choices=PRIVACY_UNITS, default=d.privacy_unit,
                 help="example: each record clipped; user: each data record a user, each "
                 "canary a user of --records-per-canary records, one clipped mean per user")
  p.add_argument("--records-per-canary", type=int, default=d.records_per_canary,
                 help="R: each canary a person with R copies of its record")
  p.add_argument("--noise", choices=(IID, BANDMF), default=d.noise,
                 help="iid: independent noise; bandmf: the BandMF release (needs --bands) "
                 "over b-cyclic Poisson sampling, --sampling-rate the within-group rate")
  p.add_argument("--bands", type=int, default=d.bands,
                 help="b, BandMF's bands and the sampler's groups (--noise bandmf only)")
  return p


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
  """Exit status 2 with one line on stderr when the audit cannot run, as for bad arguments."""
  parser = _parser(prog)
  config = AuditConfig(**vars(parser.parse_args(argv)))
  try:
    result = audit(config)
  except (ValueError, OSError, KeyError) as error:
    message = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    print(f"{parser.prog}: error: {message}", file=sys.stderr)
    return 2
  print(
      f"one-run audit ({result['config']['scoring']}-box, m = {result['config']['num_canaries']}): "
      f"ε̂ = {result['epsilon_hat']:.3f} (lower bound, {result['confidence']:.0%} confidence) vs "
      f"accountant ε = {result['epsilon_accountant']:.3f} at δ = {result['config']['delta']:g}"
  )
  print(json.dumps(result))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
