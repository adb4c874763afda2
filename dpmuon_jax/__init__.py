"""dpmuon_jax: differentially private training with spectral (Muon-style) optimizers.

The names below are the ones the README teaches: the release, the private
optimizers, the post-processing transforms they are built from, the private
step and the trainer. Everything else lives in its subpackage:

* ``dpmuon_jax.privacy``: keys, clipping, per-example queries, the release,
  Poisson sampling, accounting and the ledger (the bottom layer);
* ``dpmuon_jax.linalg``: Newton–Schulz, power iteration, matrix views;
* ``dpmuon_jax.transforms``: plain Optax post-processing;
* ``dpmuon_jax.optimizers``: the ``dp_*`` optimizers, their option groups and the registry;
* ``dpmuon_jax.models``, ``dpmuon_jax.data``, ``dpmuon_jax.text``: Flax models and data;
* ``dpmuon_jax.distributed``, ``dpmuon_jax.training``: mesh, step, loop, trainer,
  checkpoints, journal, export;
* ``dpmuon_jax.analysis`` (non-private diagnostics) and ``dpmuon_jax.audit``.
"""

from dpmuon_jax.distributed.mesh import data_mesh, shard_batch
from dpmuon_jax.linalg.newton_schulz import newton_schulz
from dpmuon_jax.optimizers.classic import dp_adam, dp_adamw, dp_sgd
from dpmuon_jax.optimizers.filters import (
    disk_muon,
    disk_sgd,
    doppler_muon,
    doppler_sgd,
    dp_disk_muon,
    dp_disk_sgd,
    dp_doppler_muon,
    dp_doppler_sgd,
)
from dpmuon_jax.optimizers.muon import dp_muon, dp_muon_s, muon, muon_s
from dpmuon_jax.optimizers.options import Fallback, NewtonSchulz
from dpmuon_jax.optimizers.paper2 import (
    adam_bc,
    dp_adam_bc,
    dp_disk_muon_im,
    dp_muon_bc,
    dp_muon_im,
    muon_bc,
)
from dpmuon_jax.privacy.accounting import (
    PrivacyLedger,
    calibrate_noise_multiplier,
    compute_epsilon,
)
from dpmuon_jax.privacy.clipping import (
    Clipping,
    automatic_clipping,
    flat_clipping,
    per_layer_clipping,
)
from dpmuon_jax.privacy.disk_query import DISK_PRESETS
from dpmuon_jax.privacy.inner_momentum import PAPER2_PRESETS
from dpmuon_jax.privacy.query import ClippedSum, clip_and_sum, clipped_sum, gradient_query
from dpmuon_jax.privacy.release import PrivateTransformation, dp_release, privatize
from dpmuon_jax.privacy.sampling import PoissonSampler, gather
from dpmuon_jax.privacy.setup import PrivateSetup, make_private
from dpmuon_jax.training.export import export_run, load_exported
from dpmuon_jax.training.step import make_private_step
from dpmuon_jax.training.trainer import TrainConfig, train
from dpmuon_jax.transforms.bias_correction import scale_by_adam_bc
from dpmuon_jax.transforms.filters import kalman_filter, low_pass_filter
from dpmuon_jax.transforms.momentum import muon_momentum
from dpmuon_jax.transforms.muon import scale_by_muon, scale_by_muon_s
from dpmuon_jax.transforms.routing import partition_muon
from dpmuon_jax.transforms.selective import selective_orthogonalization
from dpmuon_jax.transforms.shrinkage import scale_by_singular_value_shrinkage

# The one place the version is written: setuptools reads it into the package metadata.
__version__ = "0.1.0"

__all__ = [
    # The release and its setup.
    "ClippedSum",
    "Clipping",
    "PoissonSampler",
    "PrivacyLedger",
    "PrivateSetup",
    "PrivateTransformation",
    "automatic_clipping",
    "calibrate_noise_multiplier",
    "clip_and_sum",
    "clipped_sum",
    "compute_epsilon",
    "dp_release",
    "flat_clipping",
    "gather",
    "gradient_query",
    "make_private",
    "per_layer_clipping",
    "privatize",
    # Private optimizers: one release + post-processing.
    "DISK_PRESETS",
    "PAPER2_PRESETS",
    "dp_adam",
    "dp_adam_bc",
    "dp_adamw",
    "dp_disk_muon",
    "dp_disk_muon_im",
    "dp_disk_sgd",
    "dp_doppler_muon",
    "dp_doppler_sgd",
    "dp_muon",
    "dp_muon_bc",
    "dp_muon_im",
    "dp_muon_s",
    "dp_sgd",
    # The same optimizers without privacy (plain Optax), and their option groups.
    "Fallback",
    "NewtonSchulz",
    "adam_bc",
    "disk_muon",
    "disk_sgd",
    "doppler_muon",
    "doppler_sgd",
    "muon",
    "muon_bc",
    "muon_s",
    # Post-processing pieces (no privacy cost).
    "kalman_filter",
    "low_pass_filter",
    "muon_momentum",
    "newton_schulz",
    "partition_muon",
    "scale_by_adam_bc",
    "scale_by_muon",
    "scale_by_muon_s",
    "scale_by_singular_value_shrinkage",
    "selective_orthogonalization",
    # Training.
    "TrainConfig",
    "data_mesh",
    "export_run",
    "load_exported",
    "make_private_step",
    "shard_batch",
    "train",
]
