"""The private optimizers known by name, with their presets per workload: the only such table.

Each :class:`Entry` says how to build the optimizer (its ``dp_*`` factory),
what it is in one line, which per-example query its release privatises, and
the learning rate (and options) it starts from on each workload it was run
on. The trainer, the CLI, the GPT-2 training and the experiment configs all
read this table; a new optimizer is one :func:`register` call (or one line
below) and then runs everywhere, the conformance suite included.

Workloads (:data:`WORKLOADS`):

* paper 1 ("Spectral Gradient Orthogonalization Improves Differentially
  Private Training at Scale"), its reported hyperparameters: CIFAR-10 on
  WRN-16-4 at ε = 4 (the default, also the other CIFAR-10/SVHN architectures
  of its tables), its tuned CIFAR-100 rates, and ViT-Small fine-tuning on
  CIFAR-100;
* paper 2 (the inner-momentum DP-Muon paper, appendix C): GPT-2 small
  fine-tuned on E2E and DART, the ``"paper2"`` routing with an AdamW group
  (learning rates 0.002 / 0.0035).

The learning rates are where a search should start, not tuned values for
every model; selecting among runs is not covered by the per-run guarantee.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, NamedTuple

import optax

from dpmuon_jax.optimizers.classic import dp_adam, dp_adamw, dp_sgd
from dpmuon_jax.optimizers.filters import dp_disk_muon, dp_disk_sgd, dp_doppler_muon, dp_doppler_sgd
from dpmuon_jax.optimizers.muon import dp_muon, dp_muon_s
from dpmuon_jax.optimizers.options import QUERY_KINDS, Fallback, QueryKind, keyword_options
from dpmuon_jax.optimizers.paper2 import dp_adam_bc, dp_disk_muon_im, dp_muon_bc, dp_muon_im
from dpmuon_jax.privacy.disk_query import DISK_PRESETS
from dpmuon_jax.privacy.release import PrivateTransformation

CIFAR10 = "cifar10_wrn16_4"
CIFAR100 = "cifar100_wrn16_4"
VIT_SMALL = "vit_small_cifar100"
GPT2 = "gpt2"

WORKLOADS: Mapping[str, str] = MappingProxyType({
    CIFAR10: "paper 1: CIFAR-10, WRN-16-4, ε = 4, 50 epochs, cosine decay with 5% warm-up",
    CIFAR100: "paper 1: CIFAR-100, WRN-16-4, its tuned learning rates",
    VIT_SMALL: "paper 1: ViT-Small fine-tuned on CIFAR-100",
    GPT2: "paper 2: GPT-2 small fine-tuned on E2E / DART, paper2 routing, AdamW group",
})
DEFAULT_WORKLOAD = CIFAR10


class Preset(NamedTuple):
  """Where an optimizer starts on one workload: its learning rate and options."""

  learning_rate: float
  kwargs: Mapping[str, Any] = MappingProxyType({})


@dataclasses.dataclass(frozen=True)
class Entry:
  """One private optimizer of the registry.

  Attributes:
    factory: ``factory(learning_rate, l2_clip_norm, noise_multiplier,
      denominator, key, clipping=..., **kwargs)`` -> PrivateTransformation,
      the signature of every ``dp_*``.
    summary: one line, for ``dpmuon train --help``: the optimizer's name as
      the papers write it, then ``": "`` and what it does (or the name alone).
    query: ``"gradient"``, ``"disk"``, ``"inner_momentum"`` or
      ``"disk_inner_momentum"``: the
      per-example query its release privatises (``optimizer.query``).
    presets: workload name -> :class:`Preset`.
    filters: for a temporal filter (DiSK, DOPPLER), the registered optimizer
      whose release it smooths, its baseline in the papers' ablations
      (DiSK-Muon filters DP-Muon, KF + IM DP-Muon-IM); ``""`` otherwise.
  """

  factory: Callable[..., PrivateTransformation]
  summary: str
  query: QueryKind = "gradient"
  presets: Mapping[str, Preset] = dataclasses.field(default_factory=dict)
  filters: str = ""

  @property
  def title(self) -> str:
    """The optimizer's name as the papers write it (``"DP-Muon-S"``): the summary up to ``":"``."""
    return self.summary.partition(":")[0]

  def __post_init__(self):
    if self.query not in QUERY_KINDS:
      raise ValueError(f"query must be one of {QUERY_KINDS}, got {self.query!r}.")
    unknown = sorted(set(self.presets) - set(WORKLOADS))
    if unknown:
      raise ValueError(f"Unknown workloads {unknown}; known: {', '.join(WORKLOADS)}.")


_MOMENTUM = {"momentum": 0.9}
_DP_SGD = {CIFAR10: 0.3, CIFAR100: 1.0, VIT_SMALL: 0.01}  # DP-SGD's preset rates, below


_DOPPLER_SGD = 3.0  # DOPPLER-SGD's CIFAR-10 rate (paper 1, Table 15)


def _fallback(workload: str) -> dict[str, Fallback]:
  """Paper 1's 1-D group, "standard DP-SGD with momentum": DP-SGD's rate and β′ = 0.9.

  Paper 1 (§Method) retains DP-SGD with momentum for the parameters Muon does
  not take (biases, norm scales); so every Muon-family preset gives that group
  the workload's DP-SGD learning rate (the trainer puts it on the run's
  schedule) and DP-SGD's momentum. DOPPLER-Muon is the exception, see
  :data:`_DOPPLER_FALLBACK`.
  """
  return {"fallback": Fallback(kind="sgd", learning_rate=_DP_SGD[workload], momentum=0.9)}


# DOPPLER-Muon's low-pass output replaces all momentum ("EMA + UVᵀ", paper 1's Table 15), so
# its 1-D group is DOPPLER-SGD on those leaves: no further momentum, DOPPLER-SGD's rate. (DP-SGD's
# heavy ball after the EMA would cascade two β = 0.9 filters; without it, DP-SGD's rate would be
# a 1/(1−β) = 10× shorter step.)
_DOPPLER_FALLBACK = {"fallback": Fallback(kind="sgd", learning_rate=_DOPPLER_SGD, momentum=0.0)}


# DiSK's (κ, γ), with their sources (DiSK: "Differentially Private Optimizer with Simplified
# Kalman Filter for Noise Reduction"; its authors' code is github.com/564612540/KalmanDP):
# * (1.5, −1): paper 1's Table 15 prints κ = 1.5 and no γ; 1.5 and γ = −1 are the defaults of
#   the authors' command line (KalmanDP ``init_utils.py``). White-noise variance gain
#   κ/(2−κ) = 3: the filter AMPLIFIES the release's noise.
# * (0.7, 0.5): the DiSK paper's defaults, also those of the authors' Opacus optimizer
#   (``KF_DPOptimizer(kappa=0.7, gamma=0.5)``) and of their GPT-2 script (``run.sh``:
#   ``--kf --kappa 0.7 --gamma 0.5``). Gain 0.54.
# * (0.5, 0.8): paper 2's KF baseline (appendix C). Gain 1/3.
# The presets keep paper 1's reading; the batch-size study selects κ among these on validation.
_DISK = DISK_PRESETS["paper1"]._asdict()  # κ = 1.5, γ = −1
_PAPER2 = {"routing": "paper2", "fallback": Fallback(kind="adamw", learning_rate=0.0035)}
_IM = {"history": 1, "decay": 0.5}

OPTIMIZERS: dict[str, Entry] = {
    "dp_sgd": Entry(dp_sgd, "DP-SGD: heavy-ball momentum", presets={
        w: Preset(lr, _MOMENTUM) for w, lr in _DP_SGD.items()}),
    "dp_adam": Entry(dp_adam, "DP-Adam", presets={
        CIFAR10: Preset(1e-3), CIFAR100: Preset(0.01), VIT_SMALL: Preset(3e-4)}),
    "dp_adamw": Entry(dp_adamw, "DP-AdamW", presets={CIFAR10: Preset(1e-3)}),
    "dp_muon": Entry(
        dp_muon, "DP-Muon: Nesterov EMA, Newton–Schulz, aspect scaling (paper 1)", presets={
            CIFAR10: Preset(0.02, _fallback(CIFAR10)), CIFAR100: Preset(0.1, _fallback(CIFAR100)),
            VIT_SMALL: Preset(0.002, _fallback(VIT_SMALL)), GPT2: Preset(0.002, _PAPER2)}),
    "dp_muon_s": Entry(
        dp_muon_s, "DP-Muon-S: σ₁-scaled orthogonalised momentum (paper 1)", presets={
            CIFAR10: Preset(0.3, _fallback(CIFAR10)), CIFAR100: Preset(0.5, _fallback(CIFAR100))}),
    # DiSK-SGD's η multiplies the filtered gradient (DiSK §3, θ ← θ − ηg_t; DC gain 1), so it
    # lives on plain SGD's scale. Paper 1's 0.01 equals the DiSK authors' CLI default, a step
    # LENGTH there: their KFOptimizer divides g_t by its global norm. Taken as η it left the
    # small CNN at chance test accuracy (docs/results.md, "DiSK-SGD's learning rate").
    "dp_disk_sgd": Entry(
        dp_disk_sgd, "DiSK-SGD: Kalman κ=1.5, γ=−1 (paper 1; γ from the DiSK code), SGD-scale η",
        "disk", {CIFAR10: Preset(1.0, _DISK)}, filters="dp_sgd"),
    "dp_doppler_sgd": Entry(
        dp_doppler_sgd, "DOPPLER-SGD: bias-corrected EMA(0.9) low-pass (paper 1)",
        presets={CIFAR10: Preset(_DOPPLER_SGD)}, filters="dp_sgd"),
    "dp_disk_muon": Entry(
        dp_disk_muon,
        "DiSK-Muon: Kalman filter feeding DP-Muon (paper 1; lr not printed, DP-Muon's)",
        "disk", {CIFAR10: Preset(0.02, {**_DISK, **_fallback(CIFAR10)}),
                 GPT2: Preset(0.002, _PAPER2)}, filters="dp_muon"),
    "dp_doppler_muon": Entry(
        dp_doppler_muon, "DOPPLER-Muon: EMA(0.9) replacing Muon's momentum, NS₅ (paper 1)",
        presets={CIFAR10: Preset(0.02, _DOPPLER_FALLBACK)}, filters="dp_muon"),
    "dp_muon_im": Entry(
        dp_muon_im, "DP-Muon-IM: inner-momentum query over K past states (paper 2)",
        "inner_momentum", {CIFAR10: Preset(0.02, {**_IM, **_fallback(CIFAR10)}),
                           GPT2: Preset(0.002, _PAPER2)}),
    "dp_disk_muon_im": Entry(
        dp_disk_muon_im, "KF + IM: DiSK's query inside inner momentum, then DiSK-Muon (paper 2 "
        "ablation; κ = 0.5, γ = 0.8)", "disk_inner_momentum",
        {CIFAR10: Preset(0.02, {**_IM, **_fallback(CIFAR10)}), GPT2: Preset(0.002, _PAPER2)},
        filters="dp_muon_im"),
    "dp_muon_bc": Entry(
        dp_muon_bc,
        "DP-Muon-BC: heavy-ball DP-Muon, Newton–Schulz minus its noise bias (a resampled estimate)",
        presets={CIFAR10: Preset(0.02, _fallback(CIFAR10)), GPT2: Preset(0.002, _PAPER2)}),
    "dp_adam_bc": Entry(
        dp_adam_bc, "DP-AdamBC: Adam with the DP-noise variance removed (Tang et al.)",
        presets={CIFAR10: Preset(1e-3)}),
}
"""Name -> :class:`Entry`; change it only through :func:`register` / :func:`unregister`."""


def register(name: str, entry: Entry) -> None:
  """Adds ``entry`` as ``name`` (refused if the name is taken)."""
  if name in OPTIMIZERS:
    raise ValueError(f"Optimizer {name!r} is already registered.")
  if not isinstance(entry, Entry):
    raise TypeError(f"register needs an Entry, got {type(entry).__name__}.")
  OPTIMIZERS[name] = entry


def unregister(name: str) -> Entry:
  """Removes ``name`` and returns its entry."""
  return OPTIMIZERS.pop(_known(name))


def _known(name: str) -> str:
  if name not in OPTIMIZERS:
    raise ValueError(f"Unknown optimizer {name!r}; choose from {', '.join(OPTIMIZERS)}.")
  return name


def names(workload: str | None = None) -> tuple[str, ...]:
  """The registered names, or those with a preset for ``workload``."""
  if workload is not None and workload not in WORKLOADS:
    raise ValueError(f"Unknown workload {workload!r}; choose from {', '.join(WORKLOADS)}.")
  return tuple(k for k, e in OPTIMIZERS.items() if workload is None or workload in e.presets)


def preset(name: str, workload: str = DEFAULT_WORKLOAD) -> Preset:
  """The learning rate and options ``name`` starts from on ``workload``."""
  presets = OPTIMIZERS[_known(name)].presets
  if workload not in presets:
    raise ValueError(
        f"Unknown optimizer {name!r} for workload {workload!r} (it has presets for "
        f"{', '.join(presets) or 'none'}); for {workload!r} choose from "
        f"{', '.join(names(workload))}."
    )
  return presets[workload]


RUN_SETTINGS: Mapping[str, str] = MappingProxyType({
    "learning_rate": "the learning rate (a setting of its own)",
    "l2_clip_norm": "a privacy setting (the clipping norm C)",
    "noise_multiplier": "a privacy setting (σ, calibrated to the target ε and δ)",
    "denominator": "a privacy setting (the release's public denominator D)",
    "key": "a privacy setting (the root key of the noise, from the seed)",
    "clipping": "a privacy setting (the clipping rule)",
    "neighbouring": "a privacy setting (the adjacency of the guarantee)",
    "noise": "a privacy setting (independent or correlated noise)",
    "bands": "a privacy setting (the bands of correlated BandMF noise)",
    "steps": "a privacy setting (the releases a BandMF strategy is built for)",
})
"""The arguments a run gives every factory itself (the learning rate and the fields of
:class:`~dpmuon_jax.optimizers.private.ReleaseSettings`): never options."""


def option_names(name: str) -> frozenset[str] | None:
  """The options ``name``'s factory takes (its own and those of the functions its
  ``**options`` reach), less :data:`RUN_SETTINGS`; ``None`` if they cannot be known
  (``**options`` passed on without :func:`~dpmuon_jax.optimizers.options.forwards_options`)."""
  names = keyword_options(OPTIMIZERS[_known(name)].factory)
  return None if names is None else names - set(RUN_SETTINGS)


def check_options(name: str, options: Mapping[str, Any], source: str = "options") -> None:
  """Refuses, in one line naming ``source``, an option :func:`build` cannot pass to ``name``.

  A :data:`RUN_SETTINGS` name comes from the run, never from options (the
  release's privacy settings above all); any other must be one
  :func:`option_names` lists. ``source``: how the caller's user spells the
  options (e.g. ``"optimizer_kwargs"``).
  """
  accepted = option_names(name)
  for option in options:
    if option in RUN_SETTINGS:
      raise ValueError(f"{source}: {option!r} is {RUN_SETTINGS[option]}, which the run "
                       f"sets: never an option of {name}.")
    if accepted is not None and option not in accepted:
      raise ValueError(f"{source}: {name} takes no option {option!r}; its options: "
                       f"{', '.join(sorted(accepted)) or 'none'}.")


def build(
    name: str,
    learning_rate: optax.ScalarOrSchedule | None,
    release_kwargs: Mapping[str, Any],
    workload: str = DEFAULT_WORKLOAD,
    **overrides: Any,
) -> PrivateTransformation:
  """The named private optimizer with the run's release settings and the workload's preset.

  Args:
    name: a registered name.
    learning_rate: η, float or optax schedule; ``None``: the preset's.
    release_kwargs: ``l2_clip_norm``, ``noise_multiplier``, ``denominator``,
      ``key``, ``clipping`` (``PrivateSetup.release_kwargs``).
    workload: whose preset options (and learning rate) to start from.
    **overrides: options that replace or extend the preset's (refused by
      :func:`check_options` where the factory would not take them).
  """
  start = preset(name, workload)
  check_options(name, overrides)
  lr = start.learning_rate if learning_rate is None else learning_rate
  return OPTIMIZERS[name].factory(lr, **release_kwargs, **{**start.kwargs, **overrides})
