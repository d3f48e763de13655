"""A Hugging Face `config.json` <-> meshtrain's `config.model`, for the
families meshtrain's one decoder covers (`FAMILIES`):

  llama      the base: RMSNorm, RoPE (default or Llama 3's scaling), GQA, SwiGLU
  mistral    + a sliding attention window (`sliding_window`, where it is set)
  qwen2      + biases on the q, k and v projections
  qwen3      + RMSNorm of each query and key head before RoPE
  mixtral    Mistral's attention, every MLP routed: softmax top-k, renormalised
  qwen3_moe  Qwen3's attention, routed MLPs (`norm_topk_prob` renormalises;
             `mlp_only_layers` leading dense layers)
  qwen2_moe  Qwen2's attention (`qkv_bias`), Qwen3-MoE's routing, and a shared
             expert on every token whose output a sigmoid gates per token
  deepseek_v2  Multi-head Latent Attention (`model.mla`, DeepSeek's
             interleaved RoPE pairs), softmax routing of unnormalised weights
             (V2-Lite's greedy, or V2's `group_limited_greedy`: groups scored
             by their best expert), shared experts, leading dense layers
             (`first_k_dense_replace`)
  deepseek_v3  the same attention and layers, sigmoid routing over expert
             groups with the selection bias (`e_score_correction_bias`, model
             state), and multi-token prediction modules
             (`num_nextn_predict_layers`; `mtp_layers`)

Anything else a config asks for (another `model_type`, a `rope_type` other
than default, llama3 or yarn, biases elsewhere, Qwen's per-layer sliding window,
router noise, a quantization other than fine-grained float8) is refused in one
line naming the key, before anything is written. Reads both spellings of RoPE
settings: `rope_theta` + `rope_scaling` (transformers 4) and `rope_parameters`
(transformers 5); writes the first, which both versions load.

An MoE checkpoint's load balancing (`balancing`) is how it was trained, not its
shape: an import takes it where the config holds meshtrain's defaults
(transformers' `router_aux_loss_coef` times k, as Hugging Face's loss is k
times meshtrain's, docs/moe.md; DeepSeek's `aux_loss_alpha`; DeepSeek-V3's
selection-bias step, which its config does not hold, from its report), and
says so in a note. Training DeepSeek-V3's multi-token prediction modules is a
choice too: `model.mtp_layers` stays as
configured, up to the number the checkpoint holds (`mtp_layers`), and the
export writes it as `num_nextn_predict_layers`.
"""

import json
from pathlib import Path

from meshtrain.config import get_config
from meshtrain.errors import ConfigError
from meshtrain.hf import float8

CONFIG_FILE = "config.json"
FAMILIES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
            "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
            "mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
            "qwen2_moe": "Qwen2MoeForCausalLM", "deepseek_v2": "DeepseekV2ForCausalLM",
            "deepseek_v3": "DeepseekV3ForCausalLM"}
DEEPSEEK = ("deepseek_v2", "deepseek_v3")
MTP_FAMILY = "deepseek_v3"  # the one family with multi-token prediction modules
TOPK_METHODS = ("greedy", "group_limited_greedy")  # DeepSeek-V2's, both in transformers
# No RoPE scaling: every scaling key at its default.
ROPE_DEFAULTS = {key: value for key, value in get_config().model.items()
                 if key.startswith("rope_") and key != "rope_theta"}
MLA_DEFAULTS = get_config().model.mla.to_dict()  # no latent attention
# YaRN's optional settings (transformers' names; None or 0 leaves each unset).
YARN_FLOATS = ("beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim")
# DeepSeek's own keys, which its export writes.
DEEPSEEK_KEYS = ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "kv_lora_rank",
                 "q_lora_rank", "rope_interleave", "n_routed_experts", "n_shared_experts",
                 "routed_scaling_factor", "n_group", "topk_group", "topk_method",
                 "first_k_dense_replace")
# HF keys meshtrain writes itself on export (or drops: its weights are not
# quantized); everything else of the source config is kept.
_WRITTEN = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "intermediate_size", "rms_norm_eps",
            "tie_word_embeddings", "rope_theta", "rope_scaling", "rope_parameters", "dtype",
            "torch_dtype", "model_type", "architectures", "sliding_window", "num_local_experts",
            "num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
            "mlp_only_layers", "decoder_sparse_step", "shared_expert_intermediate_size",
            "qkv_bias", "quantization_config", "num_nextn_predict_layers", "num_mtp_layers",
            *DEEPSEEK_KEYS)


def read(directory, *, key: str) -> dict:
  """DIR/config.json of a model that meshtrain can run; `key` names the flag for errors."""
  file = Path(directory) / CONFIG_FILE
  if not file.is_file():
    raise ConfigError(key, f"{directory} has no {CONFIG_FILE}; give a Hugging Face model directory "
                      "(config.json, *.safetensors, tokenizer files)")
  try:
    hf = json.loads(file.read_text())
  except (ValueError, RecursionError) as error:  # RecursionError: nested too deep
    raise ConfigError(key, f"{file} is not JSON ({error})") from None
  if not isinstance(hf, dict):
    raise ConfigError(key, f"{file} holds a JSON {type(hf).__name__}, not a model's config object")
  family = hf.get("model_type")
  if family not in FAMILIES:
    raise ConfigError(key, f"{file} has model_type {family!r}; meshtrain imports "
                      f"{', '.join(FAMILIES)}")
  unsupported = _unsupported(hf)
  if unsupported:
    raise ConfigError(key, f"{file} sets {', '.join(unsupported)}, which meshtrain's {family} "
                      "does not implement")
  try:
    model_keys(hf)
    mtp_layers(hf)
  except KeyError as error:
    raise ConfigError(key, f"{file} has no {error} field; a {family} config needs it") from None
  except (TypeError, ValueError, ArithmeticError) as error:
    raise ConfigError(key, f"{file} holds a field of the wrong type or value ({error})") from None
  return hf


def _unsupported(hf: dict) -> list[str]:
  """What of `hf` the decoder does not implement, as `key=value` strings."""
  family = hf["model_type"]
  expected = {"attention_bias": False, "mlp_bias": False, "hidden_act": "silu",
              "router_jitter_noise": 0.0, "use_sliding_window": False, "decoder_sparse_step": 1}
  bad = [f"{name}={hf[name]!r}" for name, ok in expected.items() if hf.get(name, ok) != ok]
  if hf.get("quantization_config"):  # DeepSeek-V3's published float8 blocks, GPTQ, AWQ, ...
    bad += float8.unsupported(hf["quantization_config"])
  rope_type = _rope(hf).get("rope_type", _rope(hf).get("type", "default"))
  if rope_type not in ("default", "llama3", "yarn"):
    bad.append(f"rope_type={rope_type!r}")
  if rope_type == "yarn" and _rope(hf).get("attention_factor") and _rope(hf).get("factor") == 1:
    bad.append("a YaRN attention_factor with factor 1")
  dense = hf.get("mlp_only_layers") or []
  if family in ("qwen3_moe", "qwen2_moe") and list(dense) != list(range(len(dense))):
    bad.append(f"mlp_only_layers={dense!r} (only leading dense layers)")
  if family == "deepseek_v2" and hf.get("topk_method", "greedy") not in TOPK_METHODS:
    bad.append(f"topk_method={hf['topk_method']!r}")
  if family == "qwen2_moe" and not hf.get("shared_expert_intermediate_size", 1):
    bad.append("shared_expert_intermediate_size=0 (an empty shared expert)")
  return bad


def _rope(hf: dict) -> dict:
  return hf.get("rope_parameters") or hf.get("rope_scaling") or {}


def _yarn_original(hf: dict) -> int:
  return int(_rope(hf).get("original_max_position_embeddings") or hf["max_position_embeddings"])


def _yarn_factor(hf: dict) -> float:
  """YaRN's factor; DeepSeek's configs may leave it to the two context
  lengths, as transformers then reads it."""
  return float(_rope(hf).get("factor") or hf["max_position_embeddings"] / _yarn_original(hf))


def model_keys(hf: dict) -> dict:
  """The `config.model` values of a Hugging Face config (`model.moe` nested)."""
  family, heads, rope = hf["model_type"], hf["num_attention_heads"], _rope(hf)
  keys = dict(
      vocab_size=hf["vocab_size"], embed_dim=hf["hidden_size"], num_layers=hf["num_hidden_layers"],
      num_heads=heads, num_kv_heads=hf.get("num_key_value_heads") or heads,
      head_dim=hf.get("head_dim") or hf["hidden_size"] // heads, mlp_dim=hf["intermediate_size"],
      rope_theta=float(hf.get("rope_theta", rope.get("rope_theta", 10_000.0))),
      norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
      tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
      qkv_bias=family == "qwen2" or family == "qwen2_moe" and bool(hf.get("qkv_bias", True)),
      qk_norm=family in ("qwen3", "qwen3_moe"),
      sliding_window=int(hf.get("sliding_window") or 0) if family in ("mistral", "mixtral") else 0,
      **ROPE_DEFAULTS, mla=MLA_DEFAULTS, moe={"num_experts": 0})
  rope_type = rope.get("rope_type", rope.get("type"))
  if rope_type == "llama3":
    keys.update(rope_scaling_factor=float(rope["factor"]),
                rope_low_freq_factor=float(rope["low_freq_factor"]),
                rope_high_freq_factor=float(rope["high_freq_factor"]),
                rope_original_max_positions=int(rope["original_max_position_embeddings"]))
  elif rope_type == "yarn" and _yarn_factor(hf) != 1:  # at 1, YaRN changes nothing
    keys.update(rope_scaling_type="yarn", rope_scaling_factor=_yarn_factor(hf),
                rope_original_max_positions=_yarn_original(hf),
                **{f"rope_{name}": float(rope[name]) for name in YARN_FLOATS if rope.get(name)},
                rope_truncate=bool(rope.get("truncate", True)))
  if family == "mixtral":
    keys["moe"] = dict(num_experts=hf["num_local_experts"],
                       experts_per_token=hf["num_experts_per_tok"],
                       mlp_dim=hf["intermediate_size"], router="softmax", normalize_top_k=True)
  elif family in ("qwen3_moe", "qwen2_moe"):
    keys["moe"] = dict(num_experts=hf.get("num_experts") or hf["num_local_experts"],
                       experts_per_token=hf["num_experts_per_tok"],
                       mlp_dim=hf["moe_intermediate_size"], router="softmax",
                       normalize_top_k=bool(hf.get("norm_topk_prob", False)),
                       first_dense_layers=len(hf.get("mlp_only_layers") or []))
    if family == "qwen2_moe":
      keys["moe"].update(shared_mlp_dim=hf["shared_expert_intermediate_size"], shared_gate=True)
  elif family in DEEPSEEK:
    # Its keys as save_pretrained and the published configs write them, each one present.
    keys.update(num_kv_heads=heads, head_dim=hf["qk_nope_head_dim"], mla=dict(
        MLA_DEFAULTS, kv_lora_rank=hf["kv_lora_rank"], q_lora_rank=hf["q_lora_rank"] or 0,
        rope_head_dim=hf["qk_rope_head_dim"], v_head_dim=hf["v_head_dim"],
        rope_interleave=bool(hf.get("rope_interleave", True))))
    width = hf["moe_intermediate_size"]
    keys["moe"] = dict(num_experts=hf["n_routed_experts"],
                       experts_per_token=hf["num_experts_per_tok"], mlp_dim=width,
                       shared_mlp_dim=(hf["n_shared_experts"] or 0) * width,
                       route_scale=float(hf["routed_scaling_factor"]),
                       first_dense_layers=hf["first_k_dense_replace"])
    # V2: softmax, its top-k weights never renormalised, groups (if any) scored
    # by their best expert; V3: sigmoid, groups scored by their best two.
    v2 = family == "deepseek_v2"
    grouped = not v2 or hf.get("topk_method") == "group_limited_greedy"
    groups = (hf["n_group"] or 1) if grouped else 1
    keys["moe"].update(router="softmax" if v2 else "sigmoid",
                       normalize_top_k=False if v2 else bool(hf["norm_topk_prob"]),
                       expert_groups=groups, groups_per_token=hf["topk_group"] if groups > 1 else 0,
                       **({"group_scored_by": 1 if v2 else 2} if groups > 1 else {}))
  return keys


# DeepSeek-V3's report: the selection bias moves by 1e-3 a step (gamma), and
# its sequence-wise balance loss weighs 1e-4 (alpha) where the config names none.
DEEPSEEK_V3_BIAS_RATE, DEEPSEEK_V3_ALPHA = 1e-3, 1e-4
_MOE_DEFAULTS = get_config().model.moe


def balancing(hf: dict) -> dict[str, tuple[float, str]]:
  """The checkpoint's load balancing as `model.moe` keys: key -> (value, where
  it comes from); {} for a dense model."""
  family = hf["model_type"]
  if family in ("mixtral", "qwen3_moe", "qwen2_moe") and "router_aux_loss_coef" in hf:
    coef, k = float(hf["router_aux_loss_coef"]), hf["num_experts_per_tok"]
    return {"aux_loss_coef": (coef * k, f"router_aux_loss_coef {coef:g} x k={k}")}
  if family not in DEEPSEEK:
    return {}
  keys = {}
  if hf.get("aux_loss_alpha") is not None:
    keys["aux_loss_coef"] = (float(hf["aux_loss_alpha"]), "aux_loss_alpha")
  if family == "deepseek_v3":
    keys.setdefault("aux_loss_coef", (DEEPSEEK_V3_ALPHA, "DeepSeek-V3's report"))
    keys["bias_update_rate"] = (DEEPSEEK_V3_BIAS_RATE, "DeepSeek-V3's report")
  return keys


def apply_balancing(hf: dict, moe) -> str | None:
  """Sets `moe`'s balancing keys to the checkpoint's where they hold meshtrain's
  defaults (a value given otherwise stays); returns a note of what the run
  uses, or None for a checkpoint that sets nothing."""
  settings = balancing(hf)
  if not settings:
    return None
  parts = []
  for key, (value, source) in settings.items():
    if moe[key] == _MOE_DEFAULTS[key]:
      moe[key] = value
    kept = "" if moe[key] == value else f", the config's own; the checkpoint's is {value:g}"
    parts.append(f"model.moe.{key}={moe[key]:g} ({source}{kept})")
  return (f"note: MoE load balancing as the checkpoint was trained: {', '.join(parts)}; "
          "give --config.model.moe.* to change it")


def mtp_layers(hf: dict) -> int:
  """How many multi-token prediction modules the checkpoint of config.json
  `hf` holds (DeepSeek-V3's `num_nextn_predict_layers`; none in the other
  families)."""
  return int(hf.get("num_nextn_predict_layers") or 0) if hf["model_type"] == MTP_FAMILY else 0


def family(model) -> str:
  """The Hugging Face `model_type` that writes `config.model`, or a
  ConfigError naming what no family has."""
  moe = model.moe
  if model.mla.kv_lora_rank:
    # DeepSeek-V3's router is the sigmoid; V2's the softmax, unnormalised, without groups or bias.
    name = "deepseek_v3" if moe.router == "sigmoid" else "deepseek_v2"
    width = moe.mlp_dim or model.mlp_dim
    plain = {"capacity_factor": 0.0, "shared_gate": False,
             **({} if name == "deepseek_v3" else {"normalize_top_k": False,
                                                  "bias_update_rate": 0.0}),
             **({"group_scored_by": 2 if name == "deepseek_v3" else 1}
                if moe.groups_per_token else {})}
    odd = [f"model.moe.{k}={moe[k]!r}" for k, value in plain.items() if moe[k] != value]
    if not moe.num_experts:
      odd.append("Multi-head Latent Attention without experts (DeepSeek's has both)")
    elif moe.shared_mlp_dim % width:
      odd.append(f"model.moe.shared_mlp_dim={moe.shared_mlp_dim} (DeepSeek's is a whole "
                 f"number of experts {width} wide)")
  elif moe.num_experts:
    # Qwen2-MoE's is the gated shared expert; Qwen3-MoE's the q/k norms.
    name = "qwen3_moe" if model.qk_norm else "qwen2_moe" if moe.shared_gate else "mixtral"
    # What these families' routers lack: DeepSeek-V3's sigmoid, selection
    # bias (bias_update_rate) and expert groups, exported with its latent
    # attention (model.mla) only.
    plain = {"router": "softmax", "route_scale": 1.0, "capacity_factor": 0.0,
             "bias_update_rate": 0.0, "groups_per_token": 0,
             **({} if name == "qwen2_moe" else {"shared_mlp_dim": 0})}
    odd = [f"model.moe.{k}={moe[k]!r}" for k, value in plain.items() if moe[k] != value]
    if name == "mixtral" and (moe.first_dense_layers or not moe.normalize_top_k):
      odd.append("leading dense layers or unnormalised weights (Qwen3-MoE's, with qk_norm)")
    if model.qkv_bias and name != "qwen2_moe":
      odd.append("model.qkv_bias=True (Qwen2-MoE's, with model.moe.shared_gate)")
  else:
    name = ("qwen2" if model.qkv_bias else "qwen3" if model.qk_norm
            else "mistral" if model.sliding_window else "llama")
    both = model.qkv_bias and model.qk_norm
    odd = ["model.qkv_bias=True with model.qk_norm=True"] if both else []
  if model.sliding_window and name not in ("mistral", "mixtral"):
    odd.append(f"model.sliding_window={model.sliding_window} (only Mistral's family has one)")
  if model.mtp_layers and name != MTP_FAMILY:
    odd.append(f"model.mtp_layers={model.mtp_layers} (multi-token prediction: only "
               "DeepSeek-V3's family has it)")
  if odd:
    raise ConfigError("config.model", f"{', '.join(odd)}: no Hugging Face family meshtrain "
                      f"writes has this model ({', '.join(FAMILIES)})")
  return name


def to_hf(model, dtype: str, source: dict | None = None) -> dict:
  """The config.json of meshtrain's `config.model` with weights in `dtype`,
  keeping the other keys of `source` (the imported model's config, if any,
  whose family it keeps)."""
  name = (source or {}).get("model_type") or family(model)
  hf = {"hidden_act": "silu", **({"attention_bias": False, "mlp_bias": False}
                                 if name == "llama" else {}),
        **{k: v for k, v in (source or {}).items() if k not in _WRITTEN},
        "architectures": [FAMILIES[name]], "model_type": name}
  hf.update(vocab_size=model.vocab_size, hidden_size=model.embed_dim,
            num_hidden_layers=model.num_layers, num_attention_heads=model.num_heads,
            num_key_value_heads=model.num_kv_heads, head_dim=model.head_dim,
            intermediate_size=model.mlp_dim, rms_norm_eps=model.norm_eps,
            tie_word_embeddings=model.tie_embeddings, rope_theta=model.rope_theta,
            torch_dtype=dtype)
  if name in ("mistral", "mixtral"):
    hf["sliding_window"] = model.sliding_window or None
  moe = model.moe
  if name == "mixtral":
    hf.update(num_local_experts=moe.num_experts, num_experts_per_tok=moe.experts_per_token,
              intermediate_size=moe.mlp_dim or model.mlp_dim)
  elif name in ("qwen3_moe", "qwen2_moe"):
    hf.update(num_experts=moe.num_experts, num_experts_per_tok=moe.experts_per_token,
              moe_intermediate_size=moe.mlp_dim or model.mlp_dim,
              norm_topk_prob=moe.normalize_top_k, decoder_sparse_step=1,
              mlp_only_layers=list(range(moe.first_dense_layers)))
    if name == "qwen2_moe":
      hf.update(shared_expert_intermediate_size=moe.shared_mlp_dim, qkv_bias=model.qkv_bias)
  elif name in DEEPSEEK:
    width = moe.mlp_dim or model.mlp_dim
    hf.update(num_key_value_heads=model.num_heads, head_dim=model.mla.rope_head_dim,
              qk_nope_head_dim=model.head_dim, qk_rope_head_dim=model.mla.rope_head_dim,
              v_head_dim=model.mla.v_head_dim, kv_lora_rank=model.mla.kv_lora_rank,
              q_lora_rank=model.mla.q_lora_rank or None, n_routed_experts=moe.num_experts,
              num_experts_per_tok=moe.experts_per_token, moe_intermediate_size=width,
              n_shared_experts=moe.shared_mlp_dim // width, routed_scaling_factor=moe.route_scale,
              norm_topk_prob=moe.normalize_top_k, first_k_dense_replace=moe.first_dense_layers)
    if name == "deepseek_v3":
      hf.update(rope_interleave=model.mla.rope_interleave, n_group=moe.expert_groups,
                topk_group=moe.groups_per_token or moe.expert_groups,
                num_nextn_predict_layers=model.mtp_layers)
    elif moe.groups_per_token:
      hf.update(topk_method="group_limited_greedy", n_group=moe.expert_groups,
                topk_group=moe.groups_per_token)
    else:
      hf.update(topk_method="greedy", n_group=None, topk_group=None)
  if model.rope_scaling_factor != 1 and model.rope_scaling_type == "yarn":
    hf["rope_scaling"] = {"rope_type": "yarn", "factor": model.rope_scaling_factor,
                          "original_max_position_embeddings": model.rope_original_max_positions,
                          "truncate": model.rope_truncate,
                          **{name: model[f"rope_{name}"] for name in YARN_FLOATS
                             if model[f"rope_{name}"]}}
  elif model.rope_scaling_factor != 1:
    hf["rope_scaling"] = {"rope_type": "llama3", "factor": model.rope_scaling_factor,
                          "low_freq_factor": model.rope_low_freq_factor,
                          "high_freq_factor": model.rope_high_freq_factor,
                          "original_max_position_embeddings": model.rope_original_max_positions}
  return hf
