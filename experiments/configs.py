"""One config per table row of paper 1, full scale and CPU scale.

Paper 1 is "Spectral Gradient Orthogonalization Improves Differentially Private
Training at Scale"; its learning rates are its reported hyperparameters.

Protocol (paper 1): ε = 4, δ = 1e-5, σ recalibrated for every batch size B
at a fixed number of epochs, seeds 42–44, cosine learning rate with 5% warm-up,
random crop + flip, the ``paper1`` routing preset, best test accuracy over
epochs reported next to the final one. Every run's ε is in its row of the
CSV. Learning rates are paper 1's published (tuned) values, the presets of
each experiment's ``workload`` in :mod:`dpmuon_jax.optimizers.registry`: a
search across runs is NOT covered by the per-run guarantee.

Full-scale configs are for a GPU/TPU; CPU-scale configs say how they were
scaled down (``scaling``) and finish on a 2-core CPU in under 20 minutes.
"""

from __future__ import annotations

import dataclasses

from dpmuon_jax.optimizers import registry

SEEDS = (42, 43, 44)
MAIN_BATCH_SIZES = (256, 512, 1024, 2048, 4096)


@dataclasses.dataclass(frozen=True)
class Experiment:
  """A grid of private training runs: optimizers × batch sizes × seeds."""

  name: str
  table: str  # which table / figure of which paper
  dataset: str  # TFDS name or .npz path (relative paths: to --data-dir)
  model: str
  optimizers: tuple[str, ...]
  batch_sizes: tuple[int, ...]
  epochs: float
  seeds: tuple[int, ...] = SEEDS
  epsilon: float = 4.0
  delta: float = 1e-5
  workload: str = registry.CIFAR10  # whose learning rates (dpmuon_jax.optimizers.registry)
  augment: bool = True
  train_subset: int | None = None  # first n training examples (CPU scale)
  test_subset: int | None = None
  microbatch_size: int | None = None
  model_overrides: dict = dataclasses.field(default_factory=dict)
  scale: str = "full"  # "full" (GPU/TPU) or "cpu"
  scaling: str = ""  # how a CPU-scale config differs from the paper
  init_weights: str | None = None  # a local file of pretrained weights (ViT fine-tuning)

  def runs(self):
    for optimizer in self.optimizers:
      for batch_size in self.batch_sizes:
        for seed in self.seeds:
          yield optimizer, batch_size, seed

  def learning_rate(self, optimizer: str) -> float:
    """Paper 1's learning rate of ``optimizer`` on this experiment's workload."""
    return registry.preset(optimizer, self.workload).learning_rate


def _full(name, table, dataset, model, optimizers, batch_sizes, epochs=50, **kw) -> Experiment:
  return Experiment(name, table, dataset, model, tuple(optimizers), tuple(batch_sizes), epochs,
                    microbatch_size=kw.pop("microbatch_size", 256), **kw)


EXPERIMENTS: dict[str, Experiment] = {}


def _add(*experiments: Experiment) -> None:
  for e in experiments:
    EXPERIMENTS[e.name] = e


_add(
    # Paper 1, main table: CIFAR-10, WRN-16-4, ε = 4.
    _full("main_table", "paper 1 main table", "cifar10", "wrn16_4",
          ("dp_sgd", "dp_adam", "dp_muon", "dp_muon_s"), MAIN_BATCH_SIZES),
    # Architecture table.
    _full("architecture_resnet18", "paper 1 architecture table", "cifar10", "resnet18",
          ("dp_sgd", "dp_muon"), (256, 4096)),
    _full("architecture_wrn28_10", "paper 1 architecture table", "cifar10", "wrn28_10",
          ("dp_sgd", "dp_muon"), (512, 2048, 4096)),
    # Temporal ablation.
    _full("temporal_ablation", "paper 1 ablation table", "cifar10", "wrn16_4",
          ("dp_sgd", "dp_disk_sgd", "dp_doppler_sgd", "dp_muon", "dp_disk_muon",
           "dp_doppler_muon"), (256, 1024, 4096)),
    # CIFAR-100 crossover sweep (paper 1's tuned CIFAR-100 learning rates).
    _full("cifar100_crossover", "paper 1 CIFAR-100 crossover", "cifar100", "wrn16_4",
          ("dp_sgd", "dp_adam", "dp_muon", "dp_muon_s"), (256, 1024, 2048, 4096, 8192),
          workload=registry.CIFAR100),
    _full("svhn", "paper 1 SVHN runs", "svhn_cropped", "wrn16_4",
          ("dp_sgd", "dp_adam", "dp_muon", "dp_muon_s"), (256, 1024, 4096)),
    # ViT-Small fine-tuning on CIFAR-100: from `init_weights` when given; from
    # scratch otherwise (then it is NOT fine-tuning and is labelled so).
    _full("vit_small_cifar100", "paper 1 ViT-Small fine-tuning", "cifar100", "vit_small",
          ("dp_sgd", "dp_adam", "dp_muon"), (1024,), epochs=10, augment=False,
          workload=registry.VIT_SMALL),
)

_add(
    # The CPU-scale phase transition on real CIFAR-10.
    Experiment(
        "cpu_phase_transition", "paper 1 main table, CPU scale", "cifar10.npz", "cnn",
        ("dp_sgd", "dp_muon"), (128, 256, 512, 1024), epochs=3, augment=False,
        train_subset=10_000, test_subset=2_000, microbatch_size=128, scale="cpu",
        scaling="small CNN (156k params) instead of WRN-16-4; the first 10,000 CIFAR-10 "
        "training images (the npz is pre-shuffled) and the first 2,000 test images; 3 epochs "
        "instead of 50; no augmentation; batch sizes 128–1024 instead of 256–4096 "
        "(q = B/N from 1.3% to 10%; the paper: 0.5% to 8.2%).",
    ),
)

# CPU-scale versions of the other tables. Convolutional models use
# ``conv_impl="patches"`` (the same function as ``lax.conv``; per-example
# kernel gradients are matmuls, fast on XLA:CPU). Measured wall times (2 shared
# CPU cores, a fresh ``--compilation-cache``): experiments/results/README.md.
_CPU = dict(augment=False, microbatch_size=128, scale="cpu")
_CIFAR_SUBSET = ("the first {n:,} {data} training images and the first {m:,} test images; "
                 "{e} epochs instead of {full}; no augmentation")
_add(
    Experiment(
        "architecture_resnet18_cpu", "paper 1 architecture table, CPU scale", "cifar10.npz",
        "resnet18", ("dp_sgd", "dp_muon"), (64, 256), epochs=2, train_subset=2_000,
        test_subset=500, model_overrides={"width": 8, "conv_impl": "patches"}, **_CPU,
        scaling="ResNet-18 at 1/8 width (stage widths 8/16/32/64, 0.18M params instead of "
        "11.2M); " + _CIFAR_SUBSET.format(n=2_000, data="CIFAR-10", m=500, e=2, full=50)
        + "; batch sizes 64 and 256 (q = 3.2% and 12.8%; the paper: 256 and 4096, q = 0.5% "
        "and 8.2%).",
    ),
    Experiment(
        "architecture_wrn28_10_cpu", "paper 1 architecture table, CPU scale", "cifar10.npz",
        "wrn28_10", ("dp_sgd", "dp_muon"), (64, 256), epochs=2, train_subset=2_000,
        test_subset=500, model_overrides={"depth": 10, "width": 1, "conv_impl": "patches"},
        **_CPU,
        scaling="WRN-10-1 (one block per stage, widths 16/32/64, 78k params) instead of "
        "WRN-28-10 (36.5M); " + _CIFAR_SUBSET.format(n=2_000, data="CIFAR-10", m=500, e=2,
                                                     full=50)
        + "; batch sizes 64 and 256 (q = 3.2% and 12.8%; the paper: 512–4096, q = 1–8.2%).",
    ),
    Experiment(
        "temporal_ablation_cpu", "paper 1 ablation table, CPU scale", "cifar10.npz", "cnn",
        ("dp_sgd", "dp_disk_sgd", "dp_doppler_sgd", "dp_muon", "dp_disk_muon",
         "dp_doppler_muon"), (64, 256), epochs=2, train_subset=3_000, test_subset=1_000,
        **_CPU,
        scaling="small CNN (156k params) instead of WRN-16-4; "
        + _CIFAR_SUBSET.format(n=3_000, data="CIFAR-10", m=1_000, e=2, full=50)
        + "; batch sizes 64 and 256 (q = 2.1% and 8.5%) instead of 256, 1024, 4096.",
    ),
    Experiment(
        "cifar100_crossover_cpu", "paper 1 CIFAR-100 crossover, CPU scale", "cifar100", "cnn",
        ("dp_sgd", "dp_muon"), (64, 256), epochs=2, train_subset=5_000, test_subset=1_000,
        workload=registry.CIFAR100, **_CPU,
        scaling="small CNN (168k params with 100 classes) instead of WRN-16-4; "
        + _CIFAR_SUBSET.format(n=5_000, data="CIFAR-100", m=1_000, e=2, full=50)
        + "; DP-SGD and DP-Muon only (not DP-Adam, DP-Muon-S); batch sizes 64 and 256 "
        "(q = 1.3% and 5.1%) instead of 256–8192.",
    ),
    Experiment(
        "svhn_cpu", "paper 1 SVHN runs, CPU scale", "svhn_cropped", "cnn",
        ("dp_sgd", "dp_muon"), (64, 256), epochs=2, train_subset=5_000, test_subset=1_000,
        **_CPU,
        scaling="small CNN (156k params) instead of WRN-16-4; "
        + _CIFAR_SUBSET.format(n=5_000, data="SVHN (cropped digits)", m=1_000, e=2, full=50)
        + "; DP-SGD and DP-Muon only (not DP-Adam, DP-Muon-S); batch sizes 64 and 256 "
        "(q = 1.3% and 5.1%) instead of 256, 1024, 4096.",
    ),
    Experiment(
        "vit_small_cifar100_cpu", "paper 1 ViT-Small fine-tuning, CPU scale", "cifar100",
        "vit_small", ("dp_sgd", "dp_adam", "dp_muon"), (256,), epochs=2, train_subset=5_000,
        test_subset=1_000, workload=registry.VIT_SMALL,
        model_overrides={"dim": 64, "depth": 2, "num_heads": 4}, **_CPU,
        scaling="a tiny ViT (dim 64, 2 blocks, 4 heads, MLP 256, 4×4 patches; 0.11M params "
        "instead of ViT-Small's 21.3M) trained FROM SCRATCH, so NOT fine-tuning; "
        + _CIFAR_SUBSET.format(n=5_000, data="CIFAR-100", m=1_000, e=2, full=10)
        + "; batch size 256 (q = 5.1%) instead of 1024 (q = 2%).",
    ),
)
