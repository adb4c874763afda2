"""Tests run on CPU; multi-device tests start their own subprocess."""

import atexit
import os
import shutil
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
# The suite compiles hundreds of small steps and runs each a few times, so XLA's compile
# time is most of its time: compile without LLVM optimisation (about 2x faster to compile).
# The program's semantics are unchanged; floats can differ in the last bits from a default
# build, and every comparison in the suite is between runs built with the same flags.
# (Not --xla_cpu_use_fusion_emitters=false as well: with optimisation level 0 it miscompiles
# Newton-Schulz in jaxlib 0.10, and test_attention_blocks.py fails.) Subprocesses inherit the
# flags; a user's own XLA_FLAGS come last and win.
FAST_COMPILE_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
os.environ["XLA_FLAGS"] = f"{FAST_COMPILE_FLAGS} {os.environ.get('XLA_FLAGS', '')}".strip()

# One persistent compilation cache for the whole run, its xdist workers and the subprocesses
# they start (all inherit the environment): the many small programs every test compiles
# again (parameter initialisers, key splits, metrics) are compiled once. Steps that hold a
# host callback (the release's key-use check) are never cached, so each test still compiles
# its own step. A cache the caller set is kept.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  _CACHE = tempfile.mkdtemp(prefix="dpmuon-jax-tests-xla-cache-")
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _CACHE
  atexit.register(shutil.rmtree, _CACHE, True)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import numpy as np  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tiny_data():
  """80 random 8×8 grey images in 3 classes: 64 to train on, 16 to test (trainer tests)."""
  from dpmuon_jax.data.images import ImageDataset

  rng = np.random.default_rng(0)
  x = rng.integers(0, 256, size=(80, 8, 8, 1), dtype=np.uint8)
  y = rng.integers(0, 3, size=(80,))
  return ImageDataset(x[:64], y[:64], x[64:], y[64:], num_classes=3, name="tiny")


@pytest.fixture(scope="session")
def text_data_dir():
  """The text data folder (see text_folder.py): skips the test without it, or fails it when
  DPMUON_REQUIRE_TEXT_DATA=1 (CI). Used through ``text_folder.needs_text_data``; session-wide,
  so it decides before a file's module fixtures (test_multihost_lm's runs) start."""
  from text_folder import TEXT_DIR, require_text_data

  require_text_data()
  return TEXT_DIR


@pytest.fixture(scope="module", autouse=True)
def _release_compiled_code():
  """After each test file, drop JAX's compiled executables and hand the freed heap back:
  a worker that runs many files otherwise keeps every file's compiled steps resident."""
  yield
  import ctypes
  import gc

  import jax

  jax.clear_caches()
  gc.collect()
  try:
    ctypes.CDLL("libc.so.6").malloc_trim(0)
  except (OSError, AttributeError):
    pass
