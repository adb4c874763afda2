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
with GroupNorm(8) and the patch-conv kernels (156k parameters).
"""

from __future__ import annotations

from experiments.study import Arm, Study

EPOCHS = 6
RELEASES = 66  # what 6 epochs give at B = 4096 on 45,000 training images
BATCH_SIZES = (4096, 1024, 256)
LR_CENTERS = {"dp_sgd": 0.3, "dp_muon": 0.02, "dp_muon_s": 0.3}


def _main_arms() -> tuple[Arm, ...]:
  arms = [Arm(opt, b, LR_CENTERS[opt], epochs=EPOCHS)
          for opt in ("dp_sgd", "dp_muon") for b in BATCH_SIZES]
  arms += [Arm("dp_muon_s", b, LR_CENTERS["dp_muon_s"], epochs=EPOCHS) for b in BATCH_SIZES]
  return tuple(arms)


def _fixed_release_arms() -> tuple[Arm, ...]:
  return tuple(Arm(opt, b, LR_CENTERS[opt], releases=RELEASES, label=f"T{RELEASES}")
               for opt in ("dp_sgd", "dp_muon") for b in BATCH_SIZES[1:])


STUDIES: dict[str, Study] = {
    "batch_size_study": Study(
        "batch_size_study",
        "paper 1's batch-size effect at CPU scale, learning rates chosen on a validation split",
        arms=_main_arms() + _fixed_release_arms() + (
            Arm("dp_muon", 1024, LR_CENTERS["dp_muon"], epochs=EPOCHS,
                clipping="automatic_per_layer", label="autoclip"),
        ),
        model_overrides=(("groups", 8), ("conv_impl", "patches")),
    ),
}
