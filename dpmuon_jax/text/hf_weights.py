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

:func:`load_hf_gpt2` reads a local directory. :func:`resolve_weights` turns a
model NAME (``gpt2``, ``gpt2-medium``, ``gpt2-large``, ``gpt2-xl``,
``distilgpt2``) into one: it fetches the two files through ``huggingface_hub``
(the ``hub`` extra) into its cache, or reads that cache offline; a path that
exists is used as it is.
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
# Model names -> their Hugging Face repositories (the old bare names redirect there).
HUB_MODELS = {"gpt2": "openai-community/gpt2", "gpt2-medium": "openai-community/gpt2-medium",
              "gpt2-large": "openai-community/gpt2-large", "gpt2-xl": "openai-community/gpt2-xl",
              "distilgpt2": "distilbert/distilgpt2"}
_HF_FIELDS = ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head")  # required sizes


def config_from_hf(hf_config: dict[str, Any], source: str = CONFIG_FILE) -> GPT2Config:
  """A :class:`GPT2Config` from the fields of a Hugging Face ``config.json``.

  Raises:
    ValueError: ``hf_config`` is not a JSON object, lacks one of GPT-2's
      fields (``n_embd``, ...), or a size is not a positive integer; the one
      line names ``source``, the file it was read from.
  """
  if not isinstance(hf_config, dict):
    raise ValueError(f"{source} holds a JSON {type(hf_config).__name__}, not a GPT-2 config "
                     "object.")
  missing = [f for f in _HF_FIELDS if f not in hf_config]
  if missing:
    raise ValueError(f"{source} lacks GPT-2 field{'s' * (len(missing) > 1)} "
                     f"{', '.join(map(repr, missing))} (a Hugging Face GPT-2 config.json has "
                     f"{', '.join(_HF_FIELDS)}).")
  for field in _HF_FIELDS:
    value = hf_config[field]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise ValueError(f"{source} has {field!r} = {value!r}, not a positive integer.")
  if hf_config["n_embd"] % hf_config["n_head"]:
    raise ValueError(f"{source} has 'n_embd' = {hf_config['n_embd']}, not a multiple of "
                     f"'n_head' = {hf_config['n_head']}.")
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


def hf_shapes(config: GPT2Config) -> dict[str, tuple[int, ...]]:
  """The name and shape of every tensor of a Hugging Face GPT-2 of shape ``config``, in order."""
  d, h = config.dim, config.mlp_dim
  shapes: dict[str, tuple[int, ...]] = {"wte.weight": (config.vocab_size, d),
                                        "wpe.weight": (config.max_positions, d)}
  for i in range(config.num_layers):
    p = f"h.{i}."
    shapes.update({
        p + "ln_1.weight": (d,), p + "ln_1.bias": (d,),
        p + "attn.c_attn.weight": (d, 3 * d), p + "attn.c_attn.bias": (3 * d,),
        p + "attn.c_proj.weight": (d, d), p + "attn.c_proj.bias": (d,),
        p + "ln_2.weight": (d,), p + "ln_2.bias": (d,),
        p + "mlp.c_fc.weight": (d, h), p + "mlp.c_fc.bias": (h,),
        p + "mlp.c_proj.weight": (h, d), p + "mlp.c_proj.bias": (d,),
    })
  shapes.update({"ln_f.weight": (d,), "ln_f.bias": (d,)})
  return shapes


def _check_tensors(tensors: dict[str, np.ndarray], config: GPT2Config, source: str) -> None:
  """Refuses, in one line naming the first, a GPT-2 tensor missing or of another shape."""
  for name, shape in hf_shapes(config).items():
    if name not in tensors:
      raise ValueError(
          f"{source} lacks GPT-2 tensor {name!r}: expected the Hugging Face GPT-2 layout "
          "(wte.weight, wpe.weight, h.<i>.{ln_1,attn.c_attn,attn.c_proj,ln_2,mlp.c_fc,"
          "mlp.c_proj}.{weight,bias}, ln_f.{weight,bias}; 'transformer.' prefixes allowed).")
    if tuple(tensors[name].shape) != shape:
      raise ValueError(f"{source} has GPT-2 tensor {name!r} of shape "
                       f"{tuple(tensors[name].shape)}, not {shape} (config.json: {config.dim} "
                       f"wide, {config.num_layers} layers, {config.vocab_size} tokens, "
                       f"{config.max_positions} positions).")


def params_from_hf(tensors: dict[str, np.ndarray], config: GPT2Config,
                   source: str = WEIGHTS_FILE) -> PyTree:
  """Maps Hugging Face tensor names to our parameter dict (numpy float32 leaves).

  Raises:
    ValueError: a tensor of :func:`hf_shapes` is missing or of another shape,
      or a tensor is not GPT-2's; the one line names ``source``, the file the
      tensors were read from.
  """
  t = {}
  for name, value in tensors.items():
    name = name.removeprefix("transformer.")
    if name == "lm_head.weight" or name.endswith(_IGNORED_SUFFIXES):
      continue
    t[name] = np.asarray(value, np.float32)
  _check_tensors(t, config, source)
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
    raise ValueError(f"{source} has tensors GPT-2 does not: {sorted(t)[:8]}.")
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


def resolve_weights(name_or_dir: str) -> str:
  """The local directory of ``name_or_dir``: itself if it exists, else the fetched (or
  cached) ``model.safetensors`` and ``config.json`` of a :data:`HUB_MODELS` name.

  Raises:
    FileNotFoundError: neither a directory nor a known name, or the files cannot be had
      (offline, no cache), naming the layout to give instead.
  """
  if os.path.exists(name_or_dir) or name_or_dir not in HUB_MODELS:
    return name_or_dir
  with requires("hub", f"Fetching {name_or_dir!r} by name"):
    from huggingface_hub import snapshot_download

  try:
    return snapshot_download(HUB_MODELS[name_or_dir], allow_patterns=[WEIGHTS_FILE, CONFIG_FILE])
  except Exception as error:  # offline, hub down, no cache: huggingface_hub's own errors
    raise FileNotFoundError(
        f"Could not fetch {name_or_dir!r} from the Hugging Face hub ({type(error).__name__}). "
        f"Offline, pass a directory holding {WEIGHTS_FILE} and {CONFIG_FILE} of a GPT-2 "
        f"checkpoint (e.g. made online by `huggingface-cli download {HUB_MODELS[name_or_dir]} "
        f"{WEIGHTS_FILE} {CONFIG_FILE} --local-dir DIR`).") from None


def load_hf_gpt2(directory: str | os.PathLike) -> tuple[PyTree, GPT2Config]:
  """Reads a local Hugging Face GPT-2 directory: ``(params, config)``.

  Raises:
    FileNotFoundError: ``model.safetensors`` or ``config.json`` is missing
      (nothing is downloaded; the message says how to get them).
    ValueError: either file is not what GPT-2 needs (not JSON, not
      safetensors, a field or a tensor missing, a tensor of another shape),
      in one line that names it.
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
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

  with open(config_path, encoding="utf-8") as f:
    try:
      hf_config = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
      raise ValueError(f"{config_path} is not valid JSON ({error}).") from None
  config = config_from_hf(hf_config, config_path)
  try:
    tensors = load_file(weights)
  except SafetensorError as error:
    raise ValueError(f"{weights} is not a readable safetensors file ({error}).") from None
  return params_from_hf(tensors, config, weights), config
