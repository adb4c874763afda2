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
}
