"""A Hugging Face Llama `config.json` <-> meshtrain's `config.model`.

Reads both spellings of RoPE settings: `rope_theta` + `rope_scaling` (Llama
3.1/3.2 releases, transformers 4) and `rope_parameters` (transformers 5).
Writes the first, which both versions load.
"""

import json
from pathlib import Path

from meshtrain.config import get_config
from meshtrain.errors import ConfigError

CONFIG_FILE = "config.json"
# No RoPE scaling: the llama3 keys at their defaults.
LLAMA3_DEFAULTS = {key: get_config().model[key] for key in (
    "rope_scaling_factor", "rope_low_freq_factor", "rope_high_freq_factor",
    "rope_original_max_positions")}
# HF keys meshtrain writes itself on export; everything else of the source config is kept.
_WRITTEN = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "intermediate_size", "rms_norm_eps",
            "tie_word_embeddings", "rope_theta", "rope_scaling", "rope_parameters", "dtype",
            "torch_dtype")


def read(directory, *, key: str) -> dict:
  """DIR/config.json of a Llama that meshtrain can run; `key` names the flag for errors."""
  file = Path(directory) / CONFIG_FILE
  if not file.is_file():
    raise ConfigError(key, f"{directory} has no {CONFIG_FILE}; give a Hugging Face model directory "
                      "(config.json, *.safetensors, tokenizer files)")
  try:
    hf = json.loads(file.read_text())
  except ValueError as error:
    raise ConfigError(key, f"{file} is not JSON ({error})") from None
  if hf.get("model_type") != "llama":
    raise ConfigError(key, f"{file} has model_type {hf.get('model_type')!r}; meshtrain imports "
                      "Llama-architecture models (model_type 'llama') only")
  unsupported = [f"{name}={hf[name]!r}" for name, ok in
                 (("attention_bias", False), ("mlp_bias", False), ("hidden_act", "silu"))
                 if hf.get(name, ok) != ok]
  rope_type = _rope(hf).get("rope_type", _rope(hf).get("type", "default"))
  if rope_type not in ("default", "llama3"):
    unsupported.append(f"rope_type={rope_type!r}")
  if unsupported:
    raise ConfigError(key, f"{file} sets {', '.join(unsupported)}, which meshtrain's Llama does "
                      "not implement")
  return hf


def _rope(hf: dict) -> dict:
  return hf.get("rope_parameters") or hf.get("rope_scaling") or {}


def model_keys(hf: dict) -> dict:
  """The `config.model` values of a Hugging Face Llama config."""
  heads, rope = hf["num_attention_heads"], _rope(hf)
  keys = dict(
      vocab_size=hf["vocab_size"], embed_dim=hf["hidden_size"], num_layers=hf["num_hidden_layers"],
      num_heads=heads, num_kv_heads=hf.get("num_key_value_heads") or heads,
      head_dim=hf.get("head_dim") or hf["hidden_size"] // heads, mlp_dim=hf["intermediate_size"],
      rope_theta=float(hf.get("rope_theta", rope.get("rope_theta", 10_000.0))),
      norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
      tie_embeddings=bool(hf.get("tie_word_embeddings", False)), **LLAMA3_DEFAULTS)
  if rope.get("rope_type", rope.get("type")) == "llama3":
    keys.update(rope_scaling_factor=float(rope["factor"]),
                rope_low_freq_factor=float(rope["low_freq_factor"]),
                rope_high_freq_factor=float(rope["high_freq_factor"]),
                rope_original_max_positions=int(rope["original_max_position_embeddings"]))
  return keys


def to_hf(model, dtype: str, source: dict | None = None) -> dict:
  """The config.json of meshtrain's `config.model` with weights in `dtype`,
  keeping the other keys of `source` (the imported model's config, if any)."""
  hf = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "attention_bias": False, "mlp_bias": False,
        **{k: v for k, v in (source or {}).items() if k not in _WRITTEN}}
  hf.update(vocab_size=model.vocab_size, hidden_size=model.embed_dim,
            num_hidden_layers=model.num_layers, num_attention_heads=model.num_heads,
            num_key_value_heads=model.num_kv_heads, head_dim=model.head_dim,
            intermediate_size=model.mlp_dim, rms_norm_eps=model.norm_eps,
            tie_word_embeddings=model.tie_embeddings, rope_theta=model.rope_theta,
            torch_dtype=dtype)
  if model.rope_scaling_factor != 1:
    hf["rope_scaling"] = {"rope_type": "llama3", "factor": model.rope_scaling_factor,
                          "low_freq_factor": model.rope_low_freq_factor,
                          "high_freq_factor": model.rope_high_freq_factor,
                          "original_max_position_embeddings": model.rope_original_max_positions}
  return hf
