"""The CPU-scale batch-size study of paper 1's claim, learning rates chosen per arm.

Paper 1 ("Spectral Gradient Orthogonalization Improves Differentially Private
Training at Scale", main table and recovery threshold) finds DP-Muon's
advantage over DP-SGD growing with the batch size B at a fixed number of
epochs. ``batch_size_study`` is designed to be able to see that on 2 CPU
cores: all 50,000 CIFAR-10 training images (the last 5,000 held out for
choosing learning rates; test accuracy on the 10,000 test images), ε = 4,
δ = 1e-5, σ calibrated for every arm, D = B, C = 1, 6 epochs at every B (66
releases at B = 4096), and the same B's at a fixed 66 releases so that "fewer
steps" and "bigger batches" are not confounded. The model is the small CNN
with GroupNorm(8) and the patch-conv kernels (156k parameters). One arm
(automatic per-layer clipping, paper 1's appendix) is compared with flat
clipping, and one arm selects its learning rate privately, so its ε covers
its tuning.
"""

from __future__ import annotations

import dataclasses

from dpmuon_jax.optimizers import registry
from experiments.study import Arm, PrivatelyTunedArm, Study

EPOCHS = 6
RELEASES = 66  # what 6 epochs give at B = 4096 on 45,000 training images
BATCH_SIZES = (4096, 1024, 256)


def _center(optimizer: str) -> float:
  """Every grid starts around the optimizer's CIFAR-10 preset rate."""
  return registry.preset(optimizer).learning_rate


def _arms(optimizer: str, **kw) -> list[Arm]:
  return [Arm(optimizer, b, _center(optimizer), **kw) for b in BATCH_SIZES]


def _main_arms() -> tuple[Arm, ...]:
  return tuple(_arms("dp_sgd", epochs=EPOCHS) + _arms("dp_muon", epochs=EPOCHS)
               + _arms("dp_muon_s", epochs=EPOCHS))


def _fixed_release_arms() -> tuple[Arm, ...]:
  fixed = dict(releases=RELEASES, label=f"T{RELEASES}")
  return tuple(a for a in _arms("dp_sgd", **fixed) + _arms("dp_muon", **fixed)
               if a.batch_size != BATCH_SIZES[0])  # at B = 4096, 6 epochs are 66 releases


# ---------------------------------------------------------------------------
# paper1_ablation: paper 1's whole ablation table, selection seed apart.

ABLATION_BATCH_SIZES = (256, 4096, 1024)  # in this order: the ends of the rule first
DECISION_BATCH_SIZES = (256, 4096, 1024, 2048)  # DP-SGD and DP-Muon
SELECTION_SEED = 41
REPORTED_SEEDS = (42, 43, 44)
MUON_FAMILY = ("dp_muon", "dp_muon_s", "dp_disk_muon", "dp_doppler_muon")

# DiSK's (κ, γ) tried (white-noise variance gain κ/(2−κ) in brackets): paper 2's KF baseline
# (0.5, 0.8) [1/3], the DiSK paper's and its authors' library default (0.7, 0.5) [0.54], and
# κ = 1, no filter and the plain gradient query [1] (DiSK-SGD: DP-SGD without momentum;
# DiSK-Muon: DP-Muon itself, so not run). Paper 1's κ = 1.5 [3] is the earlier study's.
DISK_SETTINGS = {0.5: 0.8, 0.7: 0.5, 1.0: 0.5}
DISK_SGD_KAPPAS = (0.5, 0.7, 1.0)
DISK_MUON_KAPPAS = (0.5, 0.7)
DISK_KAPPA_BATCH_SIZES = (1024, 4096)  # κ selected here; B = 256 runs the DiSK default 0.7
DISK_DEFAULT_KAPPA = 0.7


def _ablation_arm(optimizer: str, b: int, priority: int, **kw) -> Arm:
  """One arm; a Muon-family arm's 1-D group runs its SGD row's chosen rate (same B and length).

  That row is DP-SGD (paper 1: "standard DP-SGD with momentum is retained for 1D
  parameters"), except for DOPPLER-Muon, whose 1-D group is DOPPLER-SGD (its preset).
  """
  label = kw.get("label", "main")
  source = None
  if optimizer in MUON_FAMILY:
    row = "dp_doppler_sgd" if optimizer == "dp_doppler_muon" else "dp_sgd"
    source = Arm(row, b, 0.0, label=label).name
  return Arm(optimizer, b, _center(optimizer), fallback_lr_from=source, priority=priority, **kw)


def _disk_arms(optimizer: str, grid: tuple[float, ...], priority: int) -> list[Arm]:
  arms = []
  for b in ABLATION_BATCH_SIZES:
    kappas = grid if b in DISK_KAPPA_BATCH_SIZES else (DISK_DEFAULT_KAPPA,)
    for kappa in kappas:
      options = (("kappa", kappa), ("gamma", DISK_SETTINGS[kappa]))
      arms.append(_ablation_arm(optimizer, b, priority, epochs=EPOCHS, options=options,
                                variant=f"k{kappa:g}" if len(kappas) > 1 else ""))
  return arms


def _ablation_arms() -> tuple[Arm, ...]:
  """In priority order: what the decision rule reads, the other rows, the second view, DiSK."""
  decision = [_ablation_arm(o, b, 0, epochs=EPOCHS)
              for o in ("dp_sgd", "dp_muon") for b in DECISION_BATCH_SIZES]
  others = [_ablation_arm(o, b, 1, epochs=EPOCHS)
            for o in ("dp_muon_s", "dp_doppler_sgd", "dp_doppler_muon")
            for b in ABLATION_BATCH_SIZES]
  fixed = [_ablation_arm(o, b, 2, releases=RELEASES, label=f"T{RELEASES}")
           for o in ("dp_sgd", "dp_muon") for b in DECISION_BATCH_SIZES if b != 4096]
  disk = _disk_arms("dp_disk_sgd", DISK_SGD_KAPPAS, 3) + _disk_arms("dp_disk_muon",
                                                                 DISK_MUON_KAPPAS, 3)
  return tuple(decision + others + fixed + disk)


# ---------------------------------------------------------------------------
# paper1_dip: is paper1_ablation's dip of the gap from B = 256 to 1024 real?

DIP_SEEDS = (45, 46, 47)  # fresh: no run of paper1_ablation used them
DIP_BATCH_SIZES = (256, 1024)
DIP_LABEL = "replicate"
MIDDLE_BATCH_SIZE = 512
# The rates paper1_ablation chose on seed 41 (its summary.csv; a test checks them against
# its runs.csv), not selected again. A DP-Muon arm's 1-D group takes DP-SGD's at the same B.
PAPER1_ABLATION_RATES = {("dp_sgd", 256): 0.3, ("dp_sgd", 1024): 0.9,
                         ("dp_muon", 256): 0.02, ("dp_muon", 1024): 0.06}


def _dip_arms() -> tuple[Arm, ...]:
  """DP-SGD and DP-Muon at B = 256 and 1024 at paper1_ablation's rates on fresh seeds (what
  the rule reads, first), then both at B = 512 with their own selection on seed 41."""
  fixed = []
  for optimizer in ("dp_sgd", "dp_muon"):
    for b in DIP_BATCH_SIZES:
      arm = _ablation_arm(optimizer, b, 0, epochs=EPOCHS, label=DIP_LABEL)
      rate = PAPER1_ABLATION_RATES[(optimizer, b)]
      fixed.append(dataclasses.replace(arm, lr_center=rate, learning_rate=rate, seeds=DIP_SEEDS))
  middle = [_ablation_arm(o, MIDDLE_BATCH_SIZE, 1, epochs=EPOCHS) for o in ("dp_sgd", "dp_muon")]
  return tuple(fixed + middle)


# ---------------------------------------------------------------------------
# correlated_noise: does BandMF noise close DP-Muon's small-batch gap, and does it help
# DP-Muon as much as DP-SGD? (rule in experiments/results/README.md)

CORRELATED_BATCH_SIZES = (256, 1024)
CORRELATED_BANDS = (4, 16)  # the variants selected on seed 41, with the learning rate


def _correlated_arms() -> tuple[Arm, ...]:
  """(a) DP-SGD and DP-Muon with iid noise at paper1_ablation's chosen rates (no selection;
  seeds 42-44), then (b) both with BandMF noise, b in CORRELATED_BANDS as variants, each on
  the x3 grid around the iid arm's chosen rate, selected on seed 41. A DP-Muon arm's 1-D
  group runs DP-SGD's rate from the same noise and B."""
  iid, bandmf = [], []
  for optimizer in ("dp_sgd", "dp_muon"):
    for b in CORRELATED_BATCH_SIZES:
      rate = PAPER1_ABLATION_RATES[(optimizer, b)]
      arm = _ablation_arm(optimizer, b, 0, epochs=EPOCHS, label="iid")
      iid.append(dataclasses.replace(arm, lr_center=rate, learning_rate=rate))
      for bands in CORRELATED_BANDS:
        arm = _ablation_arm(optimizer, b, 1, epochs=EPOCHS, label="bandmf",
                            variant=f"b{bands}", noise="bandmf", bands=bands)
        source = (Arm("dp_sgd", b, 0.0, label="bandmf", variant=f"b{bands}").name
                  if optimizer == "dp_muon" else None)
        bandmf.append(dataclasses.replace(arm, lr_center=rate, fallback_lr_from=source))
  return tuple(iid + bandmf)


STUDIES: dict[str, Study] = {
    "batch_size_study": Study(
        "batch_size_study",
        "paper 1's batch-size effect at CPU scale, learning rates chosen on a validation split",
        arms=_main_arms() + _fixed_release_arms() + (
            Arm("dp_muon", 1024, _center("dp_muon"), epochs=EPOCHS,
                clipping="automatic_per_layer", label="autoclip"),
            *_arms("dp_disk_sgd", epochs=EPOCHS),
            PrivatelyTunedArm("dp_muon", 1024, _center("dp_muon"), epochs=EPOCHS,
                              label="private_tuning"),
        ),
        model_overrides=(("groups", 8), ("conv_impl", "patches")),
    ),
    "paper1_ablation": Study(
        "paper1_ablation",
        "paper 1's ablation table and batch-size effect at CPU scale: 1-D groups at DP-SGD's "
        "rate, DiSK's κ selected, selection seed never reported",
        arms=_ablation_arms(),
        model_overrides=(("groups", 8), ("conv_impl", "patches")),
        seeds=REPORTED_SEEDS,
        selection_seed=SELECTION_SEED,
    ),
    "paper1_dip": Study(
        "paper1_dip",
        "paper1_ablation's dip of DP-Muon − DP-SGD from B = 256 to 1024 on fresh seeds 45–47 "
        "at its chosen rates, and B = 512 with its own selection (seed 41; seeds 42–44)",
        arms=_dip_arms(),
        model_overrides=(("groups", 8), ("conv_impl", "patches")),
        seeds=REPORTED_SEEDS,
        selection_seed=SELECTION_SEED,
        gap_change_rule=(DIP_LABEL, *DIP_BATCH_SIZES),
        reference="paper1_ablation",
    ),
    "correlated_noise": Study(
        "correlated_noise",
        "BandMF noise (b = 4 or 16, chosen on seed 41 with the rate) for DP-SGD and DP-Muon "
        "at B = 256 and 1024, against iid noise at paper1_ablation's rates (seeds 42-44)",
        arms=_correlated_arms(),
        model_overrides=(("groups", 8), ("conv_impl", "patches")),
        seeds=REPORTED_SEEDS,
        selection_seed=SELECTION_SEED,
        reference="paper1_ablation",
    ),
}
