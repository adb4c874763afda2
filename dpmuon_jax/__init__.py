"""dpmuon_jax: differentially private training with spectral optimizers in JAX/Optax."""

from dpmuon_jax.privacy.clipping import (
    Clipping,
    automatic_clipping,
    flat_clipping,
    per_layer_clipping,
)
from dpmuon_jax.privacy.keys import KeyStreams, root_key, split_streams
from dpmuon_jax.privacy.query import (
    ClippedSum,
    ClipStats,
    clip_and_sum,
    clipped_sum,
    gradient_query,
)
from dpmuon_jax.privacy.release import (
    GaussianReleaseSpec,
    GaussianReleaseState,
    PrivateTransformation,
    dp_release,
    privatize,
)
from dpmuon_jax.optimizers import dp_adam, dp_adamw, dp_sgd

__version__ = "0.1.0"
