"""Private optimizers: ONE Gaussian release over the whole tree, then post-processing.

* :mod:`~dpmuon_jax.optimizers.options`: the option groups
  (:class:`NewtonSchulz`, :class:`Fallback`) and the mode names;
* :mod:`~dpmuon_jax.optimizers.private`: :class:`ReleaseSettings` and
  :func:`private`, how every ``dp_*`` optimizer is built;
* :mod:`~dpmuon_jax.optimizers.classic`: DP-SGD, DP-Adam, DP-AdamW;
* :mod:`~dpmuon_jax.optimizers.muon`: Muon and Muon-S routed over the tree
  (plain Optax), DP-Muon and DP-Muon-S;
* :mod:`~dpmuon_jax.optimizers.filters`: DiSK and DOPPLER, with SGD or Muon;
* :mod:`~dpmuon_jax.optimizers.paper2`: DP-Muon-IM, DP-Muon-BC, DP-AdamBC;
* :mod:`~dpmuon_jax.optimizers.registry`: the optimizers known by name, with
  their presets per workload.
"""

from dpmuon_jax.optimizers.classic import dp_adam, dp_adamw, dp_sgd
from dpmuon_jax.optimizers.filters import (
    disk_muon,
    disk_query_spec,
    disk_sgd,
    doppler_muon,
    doppler_sgd,
    dp_disk_muon,
    dp_disk_sgd,
    dp_doppler_muon,
    dp_doppler_sgd,
)
from dpmuon_jax.optimizers.muon import (
    dp_muon,
    dp_muon_s,
    fallback_optimizer,
    muon,
    muon_s,
    routed_post_processing,
)
from dpmuon_jax.optimizers.options import Fallback, NewtonSchulz
from dpmuon_jax.optimizers.paper2 import (
    adam_bc,
    dp_adam_bc,
    dp_disk_muon_im,
    dp_muon_bc,
    dp_muon_im,
    inner_momentum_query,
    inner_momentum_spec,
    muon_bc,
    muon_group,
)
from dpmuon_jax.optimizers.private import ReleaseSettings, private

__all__ = [
    "Fallback", "NewtonSchulz", "ReleaseSettings", "adam_bc", "disk_muon", "disk_query_spec",
    "disk_sgd", "doppler_muon", "doppler_sgd", "dp_adam", "dp_adam_bc", "dp_adamw",
    "dp_disk_muon", "dp_disk_muon_im", "dp_disk_sgd", "dp_doppler_muon", "dp_doppler_sgd",
    "dp_muon", "dp_muon_bc",
    "dp_muon_im", "dp_muon_s", "dp_sgd", "fallback_optimizer", "inner_momentum_query",
    "inner_momentum_spec", "muon", "muon_bc", "muon_group", "muon_s", "private",
    "routed_post_processing",
]
