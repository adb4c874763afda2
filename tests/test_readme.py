"""The README's Python examples run as written (scaled down where marked)."""

import pathlib
import re

import jax.numpy as jnp
import numpy as np

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_readme_examples_run():
  blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
  assert len(blocks) == 4
  ns: dict = {}
  exec(blocks[0], ns)
  batch = {"x": jnp.ones((8, 4)), "y": jnp.ones((8, 2))}
  params, _ = ns["step"](ns["params"], ns["state"], batch, jnp.arange(8) < 5)
  assert params["w"].shape == (4, 2)
  ns.update(batch=batch, mask=jnp.ones(8, bool))
  exec(blocks[1], ns)
  exec(blocks[2], ns)
  small = (
      blocks[3]
      .replace("dataset_size=50_000", "dataset_size=256")
      .replace("expected_batch_size=1024", "expected_batch_size=32")
      .replace("epochs=10", "epochs=0.25")
      .replace("microbatch_size=128", "microbatch_size=8")
  )
  rng = np.random.default_rng(0)
  ns.update(
      train_arrays={"x": rng.normal(size=(256, 4)).astype(np.float32),
                    "y": rng.normal(size=(256, 2)).astype(np.float32)},
      params={"w": jnp.zeros((4, 2))},
  )
  exec(small, ns)
  assert ns["setup"].ledger.count == 2
  assert 0 < ns["setup"].ledger.epsilon() <= 4.0


def test_the_names_the_readme_teaches_import_from_the_package():
  import dpmuon_jax

  text = README.read_text()
  taught = set(re.findall(r"\bdm\.([A-Za-z_][A-Za-z0-9_]*)", text))
  # The optimizer table and the list of post-processing pieces name them in backticks.
  prefixes = ("dp_", "scale_by_", "kalman", "low_pass", "partition", "newton",
              "muon_momentum", "selective")
  taught |= {n for n in re.findall(r"`([a-z_]+|[A-Z0-9_]+_PRESETS)`", text)
             if n != "dp_" and n.startswith(prefixes) or n.endswith("_PRESETS")}
  assert taught, "the README teaches no names?"
  missing = sorted(n for n in taught if n not in dpmuon_jax.__all__)
  assert missing == []
  assert all(hasattr(dpmuon_jax, n) for n in dpmuon_jax.__all__)
  assert len(dpmuon_jax.__all__) < 80  # curated: tens of names, the rest in subpackages
