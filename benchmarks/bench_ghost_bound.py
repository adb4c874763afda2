"""How far above the exact norm ghost clipping's rounding-safe norm bound sits, GPT-2 on a CPU.

    python benchmarks/bench_ghost_bound.py            # 4 shapes, about a minute here
    python benchmarks/bench_ghost_bound.py --quick    # one tiny shape

Ghost clipping clips each example by an upper bound on its gradient norm: the
Gram form plus the worst-case float32 rounding of its dot products and sums
(:func:`~dpmuon_jax.privacy.ghost.factor_sq_norm`), so an example built to
make the Gram terms cancel cannot be clipped too little. The price is that
natural examples are clipped slightly harder than by the vmap path, which
clips the very vector it sums. For :class:`~dpmuon_jax.text.gpt2.GPT2` with a
tied embedding (vocabulary V, width, layers, T tokens per example, random
tokens, every position in the loss) this prints, per shape, the ratio
ghost norm / exact norm (``vmap(grad)``) over a batch: its minimum (≥ 1 is
the privacy side) and its maximum (the utility cost).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dpmuon_jax.models.taps import tapped
from dpmuon_jax.privacy.clipping import flat_norm
from dpmuon_jax.privacy.ghost import ghost_norms
from dpmuon_jax.privacy.query import gradient_query
from dpmuon_jax.text.gpt2 import GPT2, GPT2Config, gpt2_model, lm_loss

# (vocabulary, width, layers, tokens per example, examples)
SHAPES = [(4096, 128, 2, 64, 4), (4096, 64, 2, 128, 4), (50257, 128, 1, 64, 2),
          (50257, 128, 1, 128, 2)]
QUICK = [(256, 32, 1, 16, 2)]


def norm_ratios(vocab: int, width: int, layers: int, tokens: int, examples: int) -> np.ndarray:
  """Ghost norm / exact norm per example of one random-token batch."""
  config = GPT2Config(vocab_size=vocab, max_positions=tokens, dim=width, num_layers=layers,
                      num_heads=max(1, width // 64))
  apply, params = gpt2_model(tapped(GPT2(config, rngs=nnx.Rngs(0))))
  loss_fn = lm_loss(apply)
  batch = {"tokens": jax.random.randint(jax.random.key(1), (examples, tokens), 0, vocab),
           "loss_mask": jnp.ones((examples, tokens), jnp.int32)}
  ghost = jax.jit(lambda p: ghost_norms(loss_fn, p, batch))(params)
  per_example = jax.vmap(gradient_query(loss_fn), in_axes=(None, 0))
  exact = jax.jit(lambda p: jax.vmap(flat_norm)(per_example(p, batch)))(params)
  return np.asarray(ghost) / np.asarray(exact)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--quick", action="store_true", help="one tiny shape (a smoke run)")
  args = parser.parse_args()
  print(f"{'V':>6} {'width':>5} {'layers':>6} {'T':>4}  {'min ghost/exact':>15} "
        f"{'max ghost/exact':>15}")
  for shape in QUICK if args.quick else SHAPES:
    ratios = norm_ratios(*shape)
    print(f"{shape[0]:>6} {shape[1]:>5} {shape[2]:>6} {shape[3]:>4}  {ratios.min():>15.6f} "
          f"{ratios.max():>15.6f}")


if __name__ == "__main__":
  main()
