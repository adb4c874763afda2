"""Small problems shared by the query tests: gradients known in closed form."""

import jax
import jax.numpy as jnp
import numpy as np

from dpmuon_jax.transforms.history import param_history


def quadratic_loss(params, batch):
  """ℓ(θ; x) = ½‖θ − x‖² summed over leaves: ∇ℓ(θ; x) = θ − x."""
  return 0.5 * sum(jnp.sum(jnp.square(params[k] - batch[k][0])) for k in params)


def random_tree(seed, scale=1.0):
  """{"w": (3, 2), "b": (2,)} standard normal times ``scale``."""
  rng = np.random.default_rng(seed)
  return {"w": jnp.asarray(scale * rng.standard_normal((3, 2)), jnp.float32),
          "b": jnp.asarray(scale * rng.standard_normal(2), jnp.float32)}


def history_after(states, max_states):
  """The param_history state after seeing ``states`` (θ₀, θ₁, …) at update time."""
  transform = param_history(max_states)
  hist = transform.init(states[0])
  for theta in states:
    _, hist = transform.update(theta, hist, theta)
  return hist


def regression(n=64, d_in=40, d_out=50, seed=0):
  """(params, batch, loss) of a dense least-squares problem whose queries exceed C = 1."""
  rng = np.random.default_rng(seed)
  params = {"dense": {"kernel": jnp.asarray(rng.standard_normal((d_in, d_out)) * 0.1, jnp.float32),
                      "bias": jnp.zeros(d_out, jnp.float32)}}
  batch = {"x": jnp.asarray(rng.standard_normal((n, d_in)), jnp.float32),
           "y": jnp.asarray(rng.standard_normal((n, d_out)) * 5, jnp.float32)}

  def loss(p, b):
    pred = b["x"] @ p["dense"]["kernel"] + p["dense"]["bias"]
    return 0.5 * jnp.mean(jnp.sum(jnp.square(pred - b["y"]), -1))

  return params, batch, loss


def release_noise_rms(params, new_params, clipped_total, denominator):
  """RMS of D·(θ_t − θ_{t+1}) − S_t: the release's noise when the step is θ − G̃ (lr 1)."""
  noise = jax.tree.map(lambda p, q, s: denominator * (p - q) - s, params, new_params,
                       clipped_total)
  flat = np.concatenate([np.ravel(v) for v in jax.tree.leaves(noise)])
  return float(np.sqrt(np.mean(flat.astype(np.float64) ** 2)))
