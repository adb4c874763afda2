"""The private optimizers the trainer and the CLI know by name, with paper 1's presets.

Learning rates are those paper 1 ("Spectral Gradient Orthogonalization Improves
Differentially Private Training at Scale") reports for CIFAR-10, WRN-16-4:
they are where a search should start, not tuned values for every model.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import optax

from dpmuon_jax.optimizers import dp_adam, dp_adamw, dp_sgd
from dpmuon_jax.optimizers_filters import (
    dp_disk_muon,
    dp_disk_sgd,
    dp_doppler_muon,
    dp_doppler_sgd,
)
from dpmuon_jax.optimizers_im import dp_adam_bc, dp_muon_bc, dp_muon_im
from dpmuon_jax.optimizers_muon import dp_muon, dp_muon_s
from dpmuon_jax.privacy.release import PrivateTransformation


class OptimizerPreset(NamedTuple):
  make: Callable[..., PrivateTransformation]
  learning_rate: float
  kwargs: dict[str, Any]
  summary: str


OPTIMIZERS: dict[str, OptimizerPreset] = {
    "dp_sgd": OptimizerPreset(dp_sgd, 0.3, {"momentum": 0.9}, "DP-SGD with heavy-ball momentum"),
    "dp_adam": OptimizerPreset(dp_adam, 1e-3, {}, "DP-Adam"),
    "dp_adamw": OptimizerPreset(dp_adamw, 1e-3, {}, "DP-AdamW"),
    "dp_muon": OptimizerPreset(
        dp_muon, 0.02, {}, "DP-Muon: Nesterov EMA, Newton–Schulz, aspect scaling (paper 1)"
    ),
    "dp_muon_s": OptimizerPreset(
        dp_muon_s, 0.3, {}, "DP-Muon-S: σ₁-scaled orthogonalised momentum (paper 1)"
    ),
    "dp_disk_sgd": OptimizerPreset(
        dp_disk_sgd, 0.01, {"kappa": 1.5, "gamma": -1.0},
        "DiSK-SGD: Kalman κ=1.5, γ=−1 (paper 1; γ inferred from the DiSK code)",
    ),
    "dp_doppler_sgd": OptimizerPreset(
        dp_doppler_sgd, 3.0, {}, "DOPPLER-SGD: bias-corrected EMA(0.9) low-pass (paper 1)"
    ),
    "dp_disk_muon": OptimizerPreset(
        dp_disk_muon, 0.02, {"kappa": 1.5, "gamma": -1.0},
        "DiSK-Muon: Kalman filter feeding DP-Muon (paper 1; lr not printed, DP-Muon's)",
    ),
    "dp_doppler_muon": OptimizerPreset(
        dp_doppler_muon, 0.02, {},
        "DOPPLER-Muon: EMA(0.9) replacing Muon's momentum, NS₅ (paper 1)",
    ),
    "dp_muon_im": OptimizerPreset(
        dp_muon_im, 0.02, {"history": 1, "decay": 0.5},
        "DP-Muon-IM: inner-momentum query over K past states (paper 2)",
    ),
    "dp_muon_bc": OptimizerPreset(
        dp_muon_bc, 0.02, {},
        "DP-Muon-BC: heavy-ball DP-Muon, noise-bias-corrected Newton–Schulz (our estimator)",
    ),
    "dp_adam_bc": OptimizerPreset(
        dp_adam_bc, 1e-3, {}, "DP-AdamBC: Adam with the DP-noise variance removed (Tang et al.)"
    ),
}


def build(
    name: str, learning_rate: optax.ScalarOrSchedule, release_kwargs: dict[str, Any]
) -> PrivateTransformation:
  """The named private optimizer with the run's release settings."""
  if name not in OPTIMIZERS:
    raise ValueError(f"Unknown optimizer {name!r}; choose from {', '.join(OPTIMIZERS)}.")
  preset = OPTIMIZERS[name]
  return preset.make(learning_rate, **release_kwargs, **preset.kwargs)
