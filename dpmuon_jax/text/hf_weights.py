"""Hugging Face ``gpt2`` checkpoints (safetensors) ↔ :class:`~dpmuon_jax.text.gpt2.GPT2` parameters.

Hugging Face stores GPT-2 as ``model.safetensors`` (+ ``config.json``) with
tensor names (optionally prefixed ``transformer.``) ::

    wte.weight (V, d)   wpe.weight (P, d)   ln_f.{weight,bias}
    h.<i>.ln_1.{weight,bias}   h.<i>.attn.c_attn.{weight (d, 3d), bias (3d)}
    h.<i>.attn.c_proj.{weight (d, d), bias}   h.<i>.ln_2.{weight,bias}
    h.<i>.mlp.c_fc.{weight (d, 4d), bias}   h.<i>.mlp.c_proj.{weight (4d, d), bias}

Its ``Conv1D`` weights are already (in, out), like a Flax ``kernel``; the
fused ``c_attn`` is split into ``query``, ``key``, ``value`` (columns
[0, d), [d, 2d), [2d, 3d)). ``lm_head.weight`` is the tied ``wte`` and the
causal-mask buffers ``attn.bias`` / ``attn.masked_bias`` of old checkpoints
are not parameters; all three are ignored on loading.

Nothing is ever downloaded: point :func:`load_hf_gpt2` at a local directory
(e.g. one made by ``huggingface-cli download gpt2 model.safetensors config.json``).
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from dpmuon_jax.extras import requires
from dpmuon_jax.text.gpt2 import GPT2Config

PyTree = Any

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
_IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias")


def config_from_hf(hf_config: dict[str, Any]) -> GPT2Config:
  """A :class:`GPT2Config` from the fields of a Hugging Face ``config.json``."""
  return GPT2Config(
      vocab_size=hf_config["vocab_size"],
      max_positions=hf_config["n_positions"],
      dim=hf_config["n_embd"],
      num_layers=hf_config["n_layer"],
      num_heads=hf_config["n_head"],
      layer_norm_eps=hf_config.get("layer_norm_epsilon", 1e-5),
  )


def _norm(weight: np.ndarray, bias: np.ndarray) -> dict[str, np.ndarray]:
  return {"scale": weight, "bias": bias}


def _dense(tensors: dict[str, np.ndarray], name: str) -> dict[str, np.ndarray]:
  return {"kernel": tensors.pop(f"{name}.weight"), "bias": tensors.pop(f"{name}.bias")}


def _qkv(weight: np.ndarray, bias: np.ndarray, j: int, d: int) -> dict[str, np.ndarray]:
  """Columns [j·d, (j+1)·d) of the fused ``c_attn``: j = 0, 1, 2 for q, k, v."""
  return {"kernel": weight[:, j * d:(j + 1) * d], "bias": bias[j * d:(j + 1) * d]}


def params_from_hf(tensors: dict[str, np.ndarray], config: GPT2Config) -> PyTree:
  """Maps Hugging Face tensor names to our parameter dict (numpy float32 leaves)."""
  t = {}
  for name, value in tensors.items():
    name = name.removeprefix("transformer.")
    if name == "lm_head.weight" or name.endswith(_IGNORED_SUFFIXES):
      continue
    t[name] = np.asarray(value, np.float32)
  d = config.dim
  blocks = {}
  for i in range(config.num_layers):
    p = f"h.{i}."
    qkv_w, qkv_b = t.pop(p + "attn.c_attn.weight"), t.pop(p + "attn.c_attn.bias")
    blocks[i] = {
        "norm1": _norm(t.pop(p + "ln_1.weight"), t.pop(p + "ln_1.bias")),
        "attn": {"query": _qkv(qkv_w, qkv_b, 0, d), "key": _qkv(qkv_w, qkv_b, 1, d),
                 "value": _qkv(qkv_w, qkv_b, 2, d),
                 "out": _dense(t, p + "attn.c_proj")},
        "norm2": _norm(t.pop(p + "ln_2.weight"), t.pop(p + "ln_2.bias")),
        "mlp": {"fc1": _dense(t, p + "mlp.c_fc"), "fc2": _dense(t, p + "mlp.c_proj")},
    }
  params = {
      "token_embed": {"embedding": t.pop("wte.weight")},
      "pos_embed": {"embedding": t.pop("wpe.weight")},
      "blocks": blocks,
      "norm": _norm(t.pop("ln_f.weight"), t.pop("ln_f.bias")),
  }
  if t:
    raise ValueError(f"Unexpected tensors in the checkpoint: {sorted(t)[:8]}")
  return params


def params_to_hf(params: PyTree, config: GPT2Config) -> dict[str, np.ndarray]:
  """Our parameter dict as Hugging Face tensors (inverse of :func:`params_from_hf`)."""
  a = lambda x: np.ascontiguousarray(np.asarray(x, np.float32))
  t = {
      "wte.weight": a(params["token_embed"]["embedding"]),
      "wpe.weight": a(params["pos_embed"]["embedding"]),
      "ln_f.weight": a(params["norm"]["scale"]),
      "ln_f.bias": a(params["norm"]["bias"]),
  }
  for i in range(config.num_layers):
    b, p = params["blocks"][i], f"h.{i}."
    att = b["attn"]
    t[p + "attn.c_attn.weight"] = a(np.concatenate(
        [np.asarray(att[k]["kernel"]) for k in ("query", "key", "value")], axis=1))
    t[p + "attn.c_attn.bias"] = a(np.concatenate(
        [np.asarray(att[k]["bias"]) for k in ("query", "key", "value")]))
    for name, leaf in (("ln_1", b["norm1"]), ("ln_2", b["norm2"])):
      t[p + name + ".weight"], t[p + name + ".bias"] = a(leaf["scale"]), a(leaf["bias"])
    for name, leaf in (("attn.c_proj", att["out"]), ("mlp.c_fc", b["mlp"]["fc1"]),
                       ("mlp.c_proj", b["mlp"]["fc2"])):
      t[p + name + ".weight"], t[p + name + ".bias"] = a(leaf["kernel"]), a(leaf["bias"])
  return t


def _hf_config(config: GPT2Config) -> dict[str, Any]:
  return {
      "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"],
      "vocab_size": config.vocab_size, "n_positions": config.max_positions,
      "n_embd": config.dim, "n_layer": config.num_layers, "n_head": config.num_heads,
      "layer_norm_epsilon": config.layer_norm_eps, "activation_function": "gelu_new",
      "tie_word_embeddings": True, "bos_token_id": 50256, "eos_token_id": 50256,
  }


def save_hf_gpt2(params: PyTree, config: GPT2Config, directory: str | os.PathLike) -> None:
  """Writes ``model.safetensors`` and ``config.json`` in the Hugging Face layout."""
  with requires("text", "Writing Hugging Face weights"):
    from safetensors.numpy import save_file

  os.makedirs(directory, exist_ok=True)
  save_file(params_to_hf(params, config), os.path.join(directory, WEIGHTS_FILE),
            metadata={"format": "pt"})
  with open(os.path.join(directory, CONFIG_FILE), "w") as f:
    json.dump(_hf_config(config), f, indent=2)


def load_hf_gpt2(directory: str | os.PathLike) -> tuple[PyTree, GPT2Config]:
  """Reads a local Hugging Face GPT-2 directory: ``(params, config)``.

  Raises:
    FileNotFoundError: ``model.safetensors`` or ``config.json`` is missing
      (nothing is downloaded; the message says how to get them).
  """
  weights = os.path.join(directory, WEIGHTS_FILE)
  config_path = os.path.join(directory, CONFIG_FILE)
  missing = [p for p in (weights, config_path) if not os.path.isfile(p)]
  if missing:
    raise FileNotFoundError(
        f"No Hugging Face GPT-2 checkpoint in {os.fspath(directory)!r}: missing "
        f"{', '.join(os.path.basename(p) for p in missing)}. This library never downloads "
        "weights; fetch them yourself (e.g. `huggingface-cli download gpt2 model.safetensors "
        "config.json --local-dir DIR`) and pass DIR."
    )
  with requires("text", "Reading Hugging Face weights"):
    from safetensors.numpy import load_file

  with open(config_path) as f:
    config = config_from_hf(json.load(f))
  return params_from_hf(load_file(weights), config), config
