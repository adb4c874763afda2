"""Publishing a trained model: its parameters and a privacy certificate, no secrets.

A checkpoint is secret (it holds the root key and the release's noise key); an
export is public by design. :func:`export_model` writes two ordinary (0644)
files and nothing else:

* ``params.msgpack``: the parameters (``flax.serialization.to_bytes`` of a
  nested dict of numpy arrays), loadable by the trainer's ``--init-weights``;
* ``privacy_certificate.json``: ε, δ, σ, q, the number of releases, the
  accountant, the adjacency, the clipping rule and the scope of the guarantee
  (:func:`privacy_certificate`), plus the SHA-256 digest of the parameters.

No PRNG key, optimizer state or sampling information is written: the export
refuses a certificate with key-like entries or uint32 arrays, and parameters
with uint32 or PRNG-key leaves. :func:`export_run` exports a training run
directory (``dpmuon export RUN_DIR``).

A run made in a search (``dpmuon tune``) holds the search's record in its
folder (:data:`SEARCH_FILE`, written before its first release) and in every
checkpoint. Its parameters are the output of the whole search, so its
certificate, ``results.json`` and history state the search's ε
(:func:`certified`, the one rule for all of them), and a run whose record is
missing or changed is neither exported nor resumed (:func:`read_search`).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import tempfile
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import numpy as np
from flax import serialization

from dpmuon_jax.privacy.accounting import LedgerConfig, PrivacyLedger, participations
from dpmuon_jax.training.checkpoint import restore_untyped
from dpmuon_jax.training.journal import JOURNAL_NAME, read_records, releases_after

PyTree = Any

PARAMS_FILE = "params.msgpack"
CERTIFICATE_FILE = "privacy_certificate.json"
SEARCH_FILE = "search.json"
"""In a run's folder: the record of the search the run was made in (public)."""
PUBLIC_FILE_MODE = 0o644

KEY_LIKE_NAMES = ("key", "rng", "seed")
"""Certificate entries whose name contains one of these are refused (seeds are keys)..."""

ALLOWED_NAMES = frozenset({"seeded", "model_seed"})
"""...except these: a flag and the public initialisation seed, not key material."""

_ADJACENCY = {
    "add_remove": "add/remove-one-{unit}",
    "replace_one": "replace-one-{unit}",
}


class ExportedModel(NamedTuple):
  """What :func:`load_exported` returns."""

  params: PyTree
  certificate: dict


def _library_version() -> str:
  try:
    return importlib.metadata.version("dpmuon-jax")
  except importlib.metadata.PackageNotFoundError:
    return "unknown"


def guarantee(epsilon: float, delta: float, adjacency: str, seeded: bool,
              unit: str = "example") -> str:
  """The scope of a run's guarantee as one sentence (the certificate's and results.json's);
  ``unit="user"``: per user (all of one user's records)."""
  per_user = " per user (neighbouring training sets differ in all records of one user)"
  text = (
      f"({epsilon:.4g}, {delta:g})-differential privacy per run"
      f"{per_user if unit == 'user' else ''}, for "
      f"{_ADJACENCY.get(adjacency, adjacency).format(unit=unit)} adjacency of the training "
      "set; "
      "hyperparameter search across runs is not covered; "
      "non-private statistics (such as logged clipping fractions) are not covered"
  )
  if seeded:
    text += "; the noise came from a user seed, so it holds only while that seed stays secret"
  return text + "."


def search_guarantee(epsilon: float, delta: float, seeded: bool) -> str:
  """The scope of a tuning search's guarantee as one sentence (``dpmuon tune``'s, and that
  of every results.json and certificate of the run it selected)."""
  text = (f"({epsilon:.4g}, {delta:g})-differential privacy for the whole tuning "
          "procedure (add/remove one example of the training or the validation part), "
          "covering the chosen learning rate, its noisy score and selected_run/; the number of "
          "runs, the other runs and the running time are not covered and stay unpublished")
  if seeded:
    text += "; the randomness came from a user seed, so it holds only while that seed is secret"
  return text + "."


def _check_search(search: Any, path: str) -> None:
  if not isinstance(search, dict):
    raise ValueError(f"{path} is not a search record (a JSON object).")
  missing = [k for k in ("epsilon", "delta", "target_epsilon", "seeded", "tuning")
             if k not in search]
  if missing:
    raise ValueError(f"{path} is not a search record: it lacks {', '.join(missing)}.")


def write_search(run_dir: str, search: Mapping[str, Any]) -> None:
  """Writes the record of the search a run is made in to ``run_dir`` (:data:`SEARCH_FILE`).

  Write it before the run's first release: the run records it in its checkpoints,
  and :func:`certified` applies it to everything the run publishes.

  Args:
    run_dir: the run's ``output_dir``.
    search: public, JSON: ``epsilon`` and ``delta`` of the whole search, its
      ``target_epsilon``, ``seeded`` (its randomness came from a user seed) and
      ``tuning``, the settings that name it (grid, law of the number of runs, ...).
  """
  path = os.path.join(run_dir, SEARCH_FILE)
  _check_search(search, path)
  os.makedirs(run_dir, exist_ok=True)
  _write_public_file(path, (json.dumps(search, indent=2) + "\n").encode("utf-8"))


def read_search(run_dir: str, recorded: Mapping[str, Any] | None = None) -> dict | None:
  """The record of the search the run in ``run_dir`` was made in, or ``None`` (no search).

  Args:
    run_dir: the run's folder.
    recorded: the record the run's checkpoint holds (``None`` for a new run or one
      made in no search). The folder must still hold it unchanged: without it the
      run's own, smaller ε would be certified.

  Raises:
    ValueError: if the record is missing or differs from ``recorded``, or is not a record.
  """
  path = os.path.join(run_dir, SEARCH_FILE)
  try:
    with open(path) as f:
      search = json.load(f)
  except FileNotFoundError:
    search = None
  except ValueError as error:
    raise ValueError(f"{path} is not valid JSON ({error}).") from None
  if recorded is not None and search != recorded:
    problem = "is missing" if search is None else "differs from the one its checkpoints hold"
    raise ValueError(
        f"{run_dir} was trained in a tuning search (ε = {recorded['epsilon']:.4g}) but its "
        f"record {path} {problem}; restore it: without it the run's own, smaller ε would be "
        "certified."
    )
  if search is not None:
    _check_search(search, path)
  return search


def certified_epsilon(epsilon: float, search: Mapping[str, Any] | None) -> float:
  """The ε a run states, from its own ``epsilon``: the larger of it and its search's."""
  return epsilon if search is None else max(epsilon, search["epsilon"])


def certified(statement: Mapping[str, Any], search: Mapping[str, Any] | None,
              epsilon_key: str = "epsilon") -> dict:
  """What a run publishes about its privacy: ``statement`` with the search it was made in.

  The parameters of a run selected by a search are the output of the whole
  search, so the statement takes the larger ε and δ, the weaker caveat (seeded
  if either was), the search's target and guarantee, and names the search
  (``tuning``); the run's own ε stays as ``training_epsilon_per_run``.

  Args:
    statement: the run's own: its certificate (:func:`privacy_certificate`) or
      results.json's entries, with ``delta``, ``seeded`` and ε under ``epsilon_key``.
    search: the run's search record (:func:`read_search`); ``None``: no search.
    epsilon_key: where ``statement`` holds ε.

  Returns:
    A new dict; ``statement``'s copy without a search.
  """
  if search is None:
    return dict(statement)
  own = statement[epsilon_key]
  epsilon = certified_epsilon(own, search)
  delta = max(statement["delta"], search["delta"])
  seeded = bool(statement["seeded"] or search["seeded"])
  return {**statement, epsilon_key: epsilon, "training_epsilon_per_run": own, "delta": delta,
          "target_epsilon": search["target_epsilon"], "seeded": seeded,
          "guarantee": search_guarantee(epsilon, delta, seeded),
          "tuning": dict(search["tuning"])}


def noise_mechanism(config: LedgerConfig, releases: int) -> dict:
  """The noise, its strategy and the sampling the accountant assumed, for a certificate.

  Independent noise: Poisson sampling at rate q, T compositions. BandMF (b bands): b-cyclic
  Poisson sampling, q the rate within the group sampled at a release, and ⌈T/b⌉
  compositions (Choquette-Choo et al., "(Amplified) Banded Matrix Factorization", §4). BLT
  (k buffers): b-cyclic sampling for its separation, ONE Gaussian mechanism of σ/Δ_T
  accounted, no amplification (McMahan, Xu and Zhang, "A Hassle-free Algorithm for Private
  Learning in Practice", §3).
  """
  strategy = config.blt_strategy()
  if strategy is not None:
    return {
        "noise": "blt",
        "buffers": strategy.buffers,
        "strategy": (f"{strategy.buffers}-buffer lower-triangular Toeplitz C (BLT), optimised "
                     f"for {strategy.steps} releases {strategy.min_sep} apart (jax_privacy); "
                     "release t adds row t of σC·C⁻¹Z"),
        "buf_decay": [float(v) for v in strategy.buf_decay],
        "output_scale": [float(v) for v in strategy.output_scale],
        "sampling": f"cyclic poisson over {config.cycle_length} groups",
        "cycle_length": config.cycle_length,
        "participations": participations(releases, config.cycle_length),
        "accounting": "one Gaussian mechanism of noise multiplier σ/Δ_T, no amplification",
    }
  if config.bands == 1:
    return {"noise": "iid", "sampling": "poisson", "participations": releases}
  return {
      "noise": "bandmf",
      "bands": config.bands,
      "strategy": (f"column-normalised {config.bands}-banded lower-triangular Toeplitz C, "
                   "optimised for the run's planned releases (jax_privacy); release t adds "
                   "row t of σC·C⁻¹Z"),
      "sampling": f"cyclic poisson over {config.cycle_length} groups",
      "cycle_length": config.cycle_length,
      "participations": participations(releases, config.cycle_length),
  }


def privacy_certificate(
    ledger: PrivacyLedger,
    *,
    clipping: dict,
    seeded: bool,
    secure_noise: bool = False,
    model: dict | None = None,
    releases_after_checkpoint: int = 0,
) -> dict:
  """The public privacy record of a run, from its ledger.

  Args:
    ledger: the run's ledger (the releases actually made).
    clipping: the clipping rule, e.g. ``{"rule": "flat_clip", "l2_clip_norm": 1.0}``
      (:meth:`~dpmuon_jax.privacy.clipping.Clipping.describe`).
    seeded: whether the run's randomness came from a user seed (also true
      when the ledger says so).
    secure_noise: whether the noise came from a cryptographically secure generator.
    model: optional public description of the model (architecture, ...).
    releases_after_checkpoint: releases made after the exported state (a run
      that crashed after its checkpoint). The parameters do not depend on them,
      but they were made and may have been seen, so ε counts them.

  Returns:
    A JSON-able dict: ``epsilon`` spent, ``delta``, ``noise_multiplier`` σ of
    the release, ``accounting_noise_multiplier`` (σ as the accountant saw
    it), ``sampling_rate`` q, ``releases``, ``accountant``, ``adjacency``,
    ``denominator`` D, ``clipping``, ``seeded``, ``secure_noise``,
    ``library``, ``guarantee`` (the scope, as a sentence) and ``mechanism``
    (:func:`noise_mechanism`). ``releases``
    counts every release made (and ``epsilon`` is theirs);
    ``releases_in_checkpoint`` those the exported state's ledger had recorded.
  """
  c = ledger.config
  seeded = bool(seeded or ledger.seeded)
  epsilon = ledger.epsilon_after(releases_after_checkpoint) if releases_after_checkpoint else (
      ledger.epsilon())
  certificate = {
      "epsilon": epsilon,
      "delta": c.target_delta,
      "target_epsilon": c.target_epsilon,
      "noise_multiplier": c.noise_multiplier,
      "accounting_noise_multiplier": ledger.accounting_noise_multiplier,
      "sampling_rate": c.sampling_rate,
      "releases": ledger.count + releases_after_checkpoint,
      "releases_in_checkpoint": ledger.count,
      "accountant": c.accountant,
      "adjacency": c.neighbouring,
      "privacy_unit": c.privacy_unit,
      "denominator": c.denominator,
      "clipping": dict(clipping),
      "seeded": seeded,
      "secure_noise": bool(secure_noise),
      "library": {"name": "dpmuon-jax", "version": _library_version()},
      "guarantee": guarantee(epsilon, c.target_delta, c.neighbouring, seeded, c.privacy_unit),
      "mechanism": noise_mechanism(c, ledger.count + releases_after_checkpoint),
  }
  if model is not None:
    certificate["model"] = dict(model)
  return certificate


def _is_key_array(x: Any) -> bool:
  dtype = getattr(x, "dtype", None)
  if dtype is None:
    return False
  return dtype == np.uint32 or jax.dtypes.issubdtype(  # pyright: ignore[reportPrivateImportUsage]
      dtype, jax.dtypes.prng_key)


def _check_certificate(tree: Any, where: str = "certificate") -> None:
  """Raises ValueError at the first key-like entry or uint32 / PRNG-key array."""
  if _is_key_array(tree):
    raise ValueError(f"Refusing to export: {where} is a {tree.dtype} array (key material).")
  if isinstance(tree, Mapping):
    for name, value in tree.items():
      lowered = str(name).lower()
      if lowered not in ALLOWED_NAMES and any(k in lowered for k in KEY_LIKE_NAMES):
        raise ValueError(f"Refusing to export: {where}[{name!r}] looks like key material.")
      _check_certificate(value, f"{where}[{name!r}]")
  elif isinstance(tree, (list, tuple)):
    for i, value in enumerate(tree):
      _check_certificate(value, f"{where}[{i}]")


def _check_params(params: PyTree) -> None:
  for path, leaf in jax.tree_util.tree_leaves_with_path(params):
    if _is_key_array(leaf):
      raise ValueError(
          f"Refusing to export: parameter {jax.tree_util.keystr(path)} is a {leaf.dtype} "
          "array (key material, not a parameter)."
      )


def _json_default(value: Any) -> Any:
  if isinstance(value, (np.ndarray, np.generic, jax.Array)):
    return np.asarray(value).tolist()
  raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def _write_public_file(path: str, data: bytes) -> None:
  """Writes ``data`` atomically as an ordinary 0644 file."""
  directory, name = os.path.split(path)
  fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{name}.", suffix=".tmp")
  try:
    with os.fdopen(fd, "wb") as f:
      f.write(data)
      f.flush()
      os.fsync(f.fileno())
      os.fchmod(f.fileno(), PUBLIC_FILE_MODE)
    os.replace(tmp, path)
  except BaseException:
    if os.path.exists(tmp):
      os.unlink(tmp)
    raise


def export_model(directory: str, params: PyTree, certificate: dict) -> str:
  """Writes ``params.msgpack`` and ``privacy_certificate.json`` to ``directory``.

  The certificate gains ``params_sha256``, the digest of ``params.msgpack``.

  Returns:
    The absolute path of ``directory``.

  Raises:
    ValueError: if the certificate has an entry whose name contains "key",
      "rng" or "seed" (other than :data:`ALLOWED_NAMES`) or holds a uint32 or
      PRNG-key array, or if a parameter is such an array.
  """
  _check_certificate(certificate)
  _check_params(params)
  data = serialization.to_bytes(jax.tree.map(np.asarray, params))
  certificate = {**certificate, "params_sha256": hashlib.sha256(data).hexdigest()}
  try:
    text = json.dumps(certificate, indent=2, default=_json_default)
  except TypeError as error:
    raise ValueError(f"Refusing to export: the certificate is not JSON ({error}).") from None
  directory = os.path.abspath(directory)
  os.makedirs(directory, exist_ok=True)
  _write_public_file(os.path.join(directory, PARAMS_FILE), data)
  _write_public_file(os.path.join(directory, CERTIFICATE_FILE), (text + "\n").encode("utf-8"))
  return directory


def _read(path: str) -> bytes:
  try:
    with open(path, "rb") as f:
      return f.read()
  except FileNotFoundError:
    raise FileNotFoundError(f"{path} is missing: not a complete export.") from None


def load_exported(directory: str, like: PyTree | None = None) -> ExportedModel:
  """Reads an export: the parameters and the certificate.

  Args:
    directory: written by :func:`export_model`.
    like: optional parameters pytree to restore into (``flax.serialization.
      from_bytes``); without it, the parameters are a nested dict of numpy arrays.

  Raises:
    FileNotFoundError: if the directory or one of its two files is missing.
    ValueError: if the parameters do not match their digest or ``like``.
  """
  if not os.path.isdir(directory):
    raise FileNotFoundError(f"No exported model at {directory} (no such directory).")
  data = _read(os.path.join(directory, PARAMS_FILE))
  cert_path = os.path.join(directory, CERTIFICATE_FILE)
  try:
    certificate = json.loads(_read(cert_path))
  except ValueError as error:
    raise ValueError(f"{cert_path} is not valid JSON ({error}).") from None
  expected = certificate.get("params_sha256")
  if expected is not None and hashlib.sha256(data).hexdigest() != expected:
    raise ValueError(
        f"{os.path.join(directory, PARAMS_FILE)} does not match the digest in {cert_path}."
    )
  try:
    params = (
        serialization.msgpack_restore(data)
        if like is None
        else serialization.from_bytes(like, data)
    )
  except (ValueError, KeyError, TypeError) as error:
    message = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    raise ValueError(f"{directory}: the parameters do not match ({message}).") from None
  return ExportedModel(params, certificate)


def _public_dataset_name(dataset: str) -> str:
  """A dataset's name, without the local directories of a file path."""
  return os.path.basename(dataset) if os.sep in dataset else dataset


def _model_from_config(config: dict) -> dict:
  """The model's description read from a run's settings (checkpoints that predate the
  recorded ``model``)."""
  model: dict[str, Any] = {}
  if "model" in config:
    model["architecture"] = config["model"]
    model["overrides"] = config.get("model_overrides") or {}
  if "init_weights" in config:
    model["pretrained_initialisation"] = config["init_weights"] is not None
  return model


def export_run(run_dir: str, out_dir: str | None = None) -> str:
  """Exports the newest intact checkpoint of a training run directory.

  Reads only the parameters and the metadata of ``run_dir/checkpoints``
  (never the optimizer state) and writes them with their certificate to
  ``out_dir`` (default ``run_dir/export``). A run made in a search
  (:data:`SEARCH_FILE`) is certified with the search's ε (:func:`certified`).

  Returns:
    The absolute path of the export.

  Raises:
    FileNotFoundError: if ``run_dir`` is missing or holds no checkpoint.
    DamagedCheckpointError: if no intact checkpoint is left.
    ValueError: if the run was made in a search whose record is missing or changed.
  """
  if not os.path.isdir(run_dir):
    raise FileNotFoundError(f"No training run at {run_dir} (no such directory).")
  ckpt_dir = os.path.join(run_dir, "checkpoints")
  if not os.path.isdir(ckpt_dir):
    raise FileNotFoundError(f"No training run at {run_dir} (no checkpoints directory).")
  checkpoint = restore_untyped(ckpt_dir)
  metadata = checkpoint.metadata
  ledger = PrivacyLedger.from_json(metadata["ledger"])
  config = metadata.get("config") or {}
  clipping = metadata.get("clipping") or {
      "rule": "flat_clip",
      "l2_clip_norm": config.get("clip", ledger.config.l2_clip_norm),
  }
  model: dict[str, Any] = {"step": checkpoint.step,
                           **(metadata.get("model") or _model_from_config(config))}
  if "dataset" in config:
    model["dataset"] = _public_dataset_name(str(config["dataset"]))
  records = read_records(os.path.join(run_dir, JOURNAL_NAME))
  certificate = certified(privacy_certificate(
      ledger,
      clipping=clipping,
      seeded=bool(metadata.get("seeded", ledger.seeded)),
      secure_noise=bool(metadata.get("secure_noise", False)),
      model=model,
      releases_after_checkpoint=releases_after(records, metadata.get("key_index", ledger.count)),
  ), read_search(run_dir, metadata.get("search")))
  out_dir = os.path.join(run_dir, "export") if out_dir is None else out_dir
  _refuse_folder_holding_secrets(out_dir, run_dir)
  return export_model(out_dir, checkpoint.params, certificate)


def _refuse_folder_holding_secrets(out_dir: str, run_dir: str) -> None:
  """An export is published as a folder; the run's folder or one above it holds the secrets."""
  out, run = os.path.realpath(out_dir), os.path.realpath(run_dir)
  if os.path.commonpath([out, run]) == out:
    raise ValueError(
        f"Refusing to export to {out_dir}: it holds the run {run_dir}, whose checkpoints and "
        "release journal are secret, so publishing it would publish them. Export to a folder "
        "of its own (default RUN_DIR/export)."
    )
