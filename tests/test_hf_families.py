"""Hugging Face families beyond Llama (Qwen2, Qwen3, Mistral, Mixtral, Qwen3-MoE,
Qwen2-MoE, DeepSeek-V2, DeepSeek-V3) against transformers on random models it
writes itself: imported logits on one device and sharded, greedy generation,
export that transformers loads back tensor for tensor, both expert layouts on
disk, fine-tuning from the weights, and the configs meshtrain refuses."""

import json
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
import safetensors.numpy
import torch
import transformers

from conftest import REPO, micro_config, tiered
from test_generate import GREEDY, PROMPTS
from test_hf import finetune_config, hf_logits, hf_loss, save_tokenizer, tokens
from meshtrain import generate, workdir as saved_run
from meshtrain.config import load
from meshtrain.data import make_iterator
from meshtrain.errors import ConfigError
from meshtrain.hf import config as hf_config, importer
from meshtrain.hf.exporter import export_hf
from meshtrain.hf.load import layers_not_read, load_model_state, load_params
from meshtrain.hf_import import import_hf
from meshtrain.train.loop import train
from meshtrain.train.setup import build
from test_hf import meshtrain_logits

# Each family's own options, on the shape every test model shares.
FAMILIES = {
    "qwen2": dict(),  # biases on q, k, v
    "qwen3": dict(tie_word_embeddings=True),  # q/k norms; tied like the small Qwen3s
    "mistral": dict(sliding_window=6),  # below the lengths tested: the window matters
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=24),
    "qwen3_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24,
                      norm_topk_prob=True, mlp_only_layers=[0], num_hidden_layers=3),
    # q/k/v biases, unnormalised top-k weights, a gated shared expert on every token
    "qwen2_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24,
                      shared_expert_intermediate_size=40),
    # latent attention without a query latent (V2-Lite's), YaRN as V2-Lite's,
    # unnormalised softmax weights scaled, from the best of 2 groups by their
    # best expert (V2's group_limited_greedy), two shared experts, a dense layer
    "deepseek_v2": dict(num_key_value_heads=4, head_dim=4, q_lora_rank=None, kv_lora_rank=16,
                        qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6,
                        n_routed_experts=8, num_experts_per_tok=2,
                        topk_method="group_limited_greedy", n_group=2, topk_group=1,
                        moe_intermediate_size=16, n_shared_experts=2, first_k_dense_replace=1,
                        routed_scaling_factor=1.5, num_hidden_layers=3,
                        max_position_embeddings=64,
                        rope_scaling={"type": "yarn", "factor": 4.0, "mscale": 0.707,
                                      "mscale_all_dim": 0.707, "beta_fast": 4, "beta_slow": 1,
                                      "original_max_position_embeddings": 8}),
    # latent attention (a query latent; values narrower than queries and keys),
    # sigmoid routing in 2 groups with the selection bias, two shared experts,
    # one leading dense layer
    "deepseek_v3": dict(num_key_value_heads=4, head_dim=4, q_lora_rank=24, kv_lora_rank=16,
                        qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6,
                        n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
                        moe_intermediate_size=16, n_shared_experts=2, first_k_dense_replace=1,
                        routed_scaling_factor=2.5, num_hidden_layers=3, rope_scaling=None),
}
SHAPE = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, intermediate_size=48, rms_norm_eps=1e-5)


def save_hf_model(directory, family, seed=0):
  """A random model of `family` written by transformers' save_pretrained (every
  weight drawn at random, biases and norm scales too), with a tokenizer."""
  torch.manual_seed(seed)
  cfg = transformers.AutoConfig.for_model(family, **{**SHAPE, **FAMILIES[family]})
  model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
  with torch.no_grad():
    for name, weight in model.named_parameters():
      weight.copy_(1 + 0.2 * torch.randn_like(weight) if "norm" in name
                   else 0.3 * torch.randn_like(weight))
    for name, buffer in model.named_buffers():
      if name.endswith("e_score_correction_bias"):  # DeepSeek-V3's selection bias, trained apart
        buffer.copy_(0.5 * torch.randn_like(buffer))
  model.save_pretrained(directory)
  save_tokenizer(directory)
  return model


@pytest.fixture(scope="module", params=list(FAMILIES))
def family_model(request, tmp_path_factory):
  directory = tmp_path_factory.mktemp(request.param)
  return request.param, directory, save_hf_model(directory, request.param)


def imported(directory, **changes):
  cfg = micro_config(**changes)
  cfg.model.update(hf_config.model_keys(hf_config.read(directory, key="--from")))
  return cfg


def imported_weights(directory, setup):
  """The model's weights and model state (DeepSeek-V3's selection biases, else
  None) on `setup`'s mesh."""
  params = load_params(directory, setup.spec.abstract_params, setup.shardings.params, key="--from")
  return params, load_model_state(directory, jax.eval_shape(setup.spec.init_model_state),
                                  setup.shardings.model_state, key="--from")


def saved_weights(workdir, overrides=None):
  """(config, params, model state) of the step-0 checkpoint in `workdir`, on
  its config's mesh with `overrides`."""
  cfg = saved_run.load_config(workdir, overrides or {})
  setup = build(cfg)
  params = saved_run.load_params(workdir, 0, setup.spec.abstract_params, setup.shardings.params)
  return cfg, params, saved_run.load_model_state(workdir, 0, setup.abstract_state().model_state,
                                                 setup.shardings.model_state)


def assert_logits_close(got, expected):
  scale = np.abs(expected).max()
  assert np.abs(got - expected).max() <= 1e-4 * scale, (np.abs(got - expected).max(), scale)


def assert_import_computes_logits(directory, model, mesh: str):
  """The model in `directory`, imported on `mesh` ("one device" or "fsdp=4
  tensor=2"), computes the logits of transformers' `model`."""
  sharded = mesh != "one device"
  cfg = imported(directory, **({"mesh.data": 1, "mesh.fsdp": 4, "mesh.tensor": 2}
                               if sharded else {}))
  setup = build(cfg, jax.devices() if sharded else jax.devices()[:1])
  params, state = imported_weights(directory, setup)
  x = tokens()
  assert_logits_close(meshtrain_logits(cfg, params, x, setup, state), hf_logits(model, x))


@pytest.mark.parametrize("mesh", tiered(["one device", "fsdp=4 tensor=2"], ("one device",)))
def test_imported_family_computes_transformers_logits(family_model, mesh):
  _, directory, model = family_model
  assert_import_computes_logits(directory, model, mesh)


@pytest.mark.parametrize("strategy", ["all_gather_kv", "ulysses"])
def test_the_sliding_window_splits_over_the_sequence_axis(tmp_path, strategy):
  model = save_hf_model(tmp_path, "mistral")
  cfg = imported(tmp_path, **{"mesh.data": 2, "mesh.sequence": 4,
                              "attention.sequence_strategy": strategy})
  setup = build(cfg)
  params = load_params(tmp_path, setup.spec.abstract_params, setup.shardings.params, key="--from")
  x = tokens(batch=2, length=32)
  assert_logits_close(meshtrain_logits(cfg, params, x, setup), hf_logits(model, x))


def test_the_ring_refuses_a_sliding_window(tmp_path):
  save_hf_model(tmp_path, "mistral")
  cfg = imported(tmp_path, **{"mesh.data": 2, "mesh.sequence": 4,
                              "attention.sequence_strategy": "ring"})
  with pytest.raises(ConfigError, match="the ring has no sliding window") as error:
    build(cfg)
  assert error.value.key == "config.attention.sequence_strategy"


def test_greedy_generation_equals_transformers(family_model):
  """Prompts of different lengths (left-padded together here, one at a time
  there, with an explicit attention mask); Mistral's window is shorter than
  prompt plus answer."""
  family, directory, model = family_model
  cfg = imported(directory, **{"mesh.data": 1, "mesh.fsdp": 2, "mesh.tensor": 2})
  setup = build(cfg, jax.devices()[:4])
  params, state = imported_weights(directory, setup)
  eos = model.generation_config.eos_token_id  # the family's default, or None
  got = generate.Generator(setup.spec.graphdef, params, setup.mesh, setup.rules, eos_id=eos,
                           model_state=setup.init_state().model_state if state is None
                           else state)(PROMPTS, 10, GREEDY)
  for prompt, answer in zip(PROMPTS, got):
    ids = torch.tensor([prompt])
    with torch.no_grad():
      expected = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10,
                                do_sample=False, eos_token_id=eos,
                                pad_token_id=0)[0, len(prompt):].tolist()
    assert answer == expected, family


def test_export_loads_back_in_transformers_tensor_for_tensor(family_model, tmp_path):
  family, directory, model = family_model
  workdir = import_hf(micro_config(**{"mesh.data": 2, "mesh.fsdp": 4}), directory,
                      tmp_path / "imported")
  cfg, params, state = saved_weights(workdir, {"mesh.data": 8, "mesh.fsdp": 1})
  out = tmp_path / "exported"
  export_hf(cfg, params, workdir, out, model_state=state)
  expected = safetensors.numpy.load_file(directory / "model.safetensors")
  got = safetensors.numpy.load_file(out / "model.safetensors")
  assert sorted(got) == sorted(expected)
  for name, tensor in expected.items():
    np.testing.assert_array_equal(got[name], tensor, err_msg=name)
  written = json.loads((out / "config.json").read_text())
  assert written["model_type"] == family
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
  x = tokens()
  np.testing.assert_array_equal(hf_logits(reloaded, x), hf_logits(model, x))


def test_deepseek_v3s_multi_token_prediction_layer_is_left_out_and_said_so(tmp_path):
  """DeepSeek-V3's checkpoint holds its multi-token prediction module as one
  layer beyond num_hidden_layers; the import reads the model without it (as
  transformers' model does), names it, and the export says it has none."""
  model = save_hf_model(tmp_path / "hf", "deepseek_v3")
  assert importer.left_out_note(tmp_path / "hf") is None  # transformers saves no MTP layer
  tensors = safetensors.numpy.load_file(tmp_path / "hf" / "model.safetensors")
  last = "model.layers.2."  # the test model's 3 layers; DeepSeek-V3's MTP copies a layer's names
  tensors.update({"model.layers.3." + name[len(last):]: tensor for name, tensor in tensors.items()
                  if name.startswith(last)})
  tensors.update({f"model.layers.3.{norm}.weight": np.ones(32, np.float32)
                  for norm in ("enorm", "hnorm")})
  safetensors.numpy.save_file(tensors, tmp_path / "hf" / "model.safetensors")
  _edit(tmp_path / "hf", num_nextn_predict_layers=1)
  assert layers_not_read(tmp_path / "hf", key="--from") == [3]
  assert importer.left_out_note(tmp_path / "hf").startswith(
      "note: model.layers.3, beyond num_hidden_layers (DeepSeek-V3's multi-token prediction)")
  workdir = import_hf(micro_config(), tmp_path / "hf", tmp_path / "imported")
  cfg, params, state = saved_weights(workdir)
  export_hf(cfg, params, workdir, tmp_path / "exported", model_state=state)
  written = json.loads((tmp_path / "exported" / "config.json").read_text())
  assert written["num_nextn_predict_layers"] == 0
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "exported").eval()
  x = tokens()
  np.testing.assert_array_equal(hf_logits(reloaded, x), hf_logits(model, x))


MADE_HERE = {  # meshtrain options -> the family they export as
    "mixtral": dict(),
    "qwen3_moe": {"model.qk_norm": True, "model.moe.normalize_top_k": False,
                  "model.moe.first_dense_layers": 1},
    "qwen2_moe": {"model.qkv_bias": True, "model.moe.normalize_top_k": False,
                  "model.moe.shared_mlp_dim": 40, "model.moe.shared_gate": True},
    "deepseek_v2": {"model.num_kv_heads": 4, "model.mla.kv_lora_rank": 16,
                    "model.mla.q_lora_rank": 24, "model.mla.rope_head_dim": 4,
                    "model.mla.v_head_dim": 6, "model.moe.normalize_top_k": False,
                    "model.moe.shared_mlp_dim": 24, "model.moe.route_scale": 1.5,
                    "model.moe.first_dense_layers": 1},
    # queries straight from x (no query latent), values wider than queries and keys
    "deepseek_v3": {"model.num_kv_heads": 4, "model.mla.kv_lora_rank": 16,
                    "model.mla.rope_head_dim": 4, "model.mla.v_head_dim": 16,
                    "model.moe.router": "sigmoid", "model.moe.shared_mlp_dim": 48,
                    "model.moe.expert_groups": 2, "model.moe.groups_per_token": 1,
                    "model.moe.route_scale": 2.5, "model.moe.bias_update_rate": 1e-3,
                    "model.moe.first_dense_layers": 1},
}


@pytest.mark.parametrize("family", tiered(list(MADE_HERE), ("qwen2_moe", "deepseek_v3")))
def test_an_moe_model_made_here_exports_as_its_family_with_its_logits(tmp_path, family):
  """No imported config to copy: `to_hf` writes the family's keys itself,
  and transformers, loading what was written, computes meshtrain's logits."""
  cfg = micro_config(**{"model.moe.num_experts": 4, "model.moe.mlp_dim": 24,
                        "workdir": str(tmp_path / "run"), **MADE_HERE[family]})
  setup = build(cfg, jax.devices()[:1])
  state = setup.init_state()
  # A random norm scale (they start at 1), q/k/v bias and selection bias (at
  # 0; it moves only with a bias_update_rate) must land too.
  moved = (state.params, state.model_state if cfg.model.moe.bias_update_rate else None)
  params, model_state = jax.tree.map(
      lambda w: w + 0.1 * jax.random.normal(jax.random.key(1), w.shape), moved)
  export_hf(cfg, params, tmp_path / "run", tmp_path / "exported", model_state=model_state)
  written = json.loads((tmp_path / "exported" / "config.json").read_text())
  assert written["model_type"] == family
  model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "exported").eval()
  x = tokens()
  assert_logits_close(meshtrain_logits(cfg, params, x, setup, model_state), hf_logits(model, x))


def test_an_import_fine_tuned_with_routing_no_family_has_is_not_exported(tmp_path):
  """A Mixtral trained on with DeepSeek-V3's selection bias routes by a bias
  its config.json has no place for: refused, nothing written."""
  save_hf_model(tmp_path / "hf", "mixtral")
  workdir = import_hf(micro_config(), tmp_path / "hf", tmp_path / "imported")
  cfg = saved_run.load_config(workdir, {"model.moe.bias_update_rate": 1e-3})
  setup = build(cfg, jax.devices()[:1])
  params = saved_run.load_params(workdir, 0, setup.spec.abstract_params, setup.shardings.params)
  with pytest.raises(ConfigError, match="model.moe.bias_update_rate=0.001") as error:
    export_hf(cfg, params, workdir, tmp_path / "exported")
  assert error.value.key == "config.model"
  assert not (tmp_path / "exported").exists()


def fused(directory, out):
  """The model in transformers v5's in-memory layout: each layer's experts in
  one `mlp.experts.gate_up_proj` [E, 2F, D] and `mlp.experts.down_proj`
  [E, D, F], the router as `mlp.gate.weight`."""
  shutil.copytree(directory, out)
  tensors = safetensors.numpy.load_file(directory / "model.safetensors")
  hf = json.loads((directory / "config.json").read_text())
  mixtral = hf["model_type"] == "mixtral"
  names = ("block_sparse_moe.experts.{}.w1", "block_sparse_moe.experts.{}.w3",
           "block_sparse_moe.experts.{}.w2") if mixtral else (
      "mlp.experts.{}.gate_proj", "mlp.experts.{}.up_proj", "mlp.experts.{}.down_proj")
  experts = hf.get("num_local_experts") or hf["num_experts"]
  for layer in range(hf["num_hidden_layers"]):
    prefix = f"model.layers.{layer}."
    if f"{prefix}{names[0].format(0)}.weight" not in tensors:
      continue  # a dense layer
    gate, up, down = ([tensors.pop(f"{prefix}{n.format(e)}.weight") for e in range(experts)]
                      for n in names)
    tensors[prefix + "mlp.experts.gate_up_proj"] = np.stack(
        [np.concatenate([g, u]) for g, u in zip(gate, up)])
    tensors[prefix + "mlp.experts.down_proj"] = np.stack(down)
    router = prefix + ("block_sparse_moe.gate.weight" if mixtral else "mlp.gate.weight")
    tensors[prefix + "mlp.gate.weight"] = tensors.pop(router)
  safetensors.numpy.save_file(tensors, out / "model.safetensors")


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_fused_experts_import_the_same_weights(tmp_path, family):
  save_hf_model(tmp_path / "split", family)
  fused(tmp_path / "split", tmp_path / "fused")
  cfg = imported(tmp_path / "split", **{"mesh.data": 1, "mesh.fsdp": 4, "mesh.tensor": 2})
  setup = build(cfg)
  loaded = [jax.device_get(load_params(tmp_path / layout, setup.spec.abstract_params,
                                       setup.shardings.params, key="--from"))
            for layout in ("split", "fused")]
  jax.tree.map(np.testing.assert_array_equal, *loaded)


@pytest.mark.parametrize("family", tiered(list(FAMILIES), ("mixtral",)))
def test_fine_tuning_from_the_weights_starts_at_the_models_loss(tmp_path, family):
  model = save_hf_model(tmp_path / "hf", family)
  cfg = finetune_config(tmp_path / "hf", tmp_path / "run")  # fsdp over all 8 devices
  batch = next(make_iterator(cfg.data, seq_len=16, global_batch=16, vocab_size=64,
                             seed=cfg.seed))
  records = train(cfg)
  assert records[0]["loss"] == pytest.approx(hf_loss(model, batch), rel=1e-5)


def _edit(directory, **changes):
  hf = json.loads((directory / "config.json").read_text())
  (directory / "config.json").write_text(json.dumps({**hf, **changes}))


@pytest.mark.parametrize("family, changes, message", [
    ("qwen2", dict(use_sliding_window=True), "use_sliding_window=True"),
    ("qwen3", dict(rope_parameters={"rope_type": "longrope", "factor": 4.0, "rope_theta": 1e6}),
     "rope_type='longrope'"),
    ("qwen3", dict(attention_bias=True), "attention_bias=True"),
    ("qwen3_moe", dict(mlp_only_layers=[1]), r"mlp_only_layers=\[1\] \(only leading"),
    ("mixtral", dict(router_jitter_noise=0.1), "router_jitter_noise=0.1"),
    ("qwen2_moe", dict(shared_expert_intermediate_size=0), "shared_expert_intermediate_size=0"),
    ("deepseek_v3", dict(attention_bias=True), "attention_bias=True"),
    ("deepseek_v2", dict(topk_method="noaux_tc"), "topk_method='noaux_tc'"),
    ("qwen3", dict(quantization_config={"quant_method": "gptq", "bits": 4}),
     "quantization_config \\(quant_method='gptq'; meshtrain reads .* fine-grained float8"),
    ("deepseek_v3", dict(quantization_config={"quant_method": "fp8", "expert_dtype": "fp4"}),
     "quantization_config.expert_dtype='fp4' \\(packed float4 experts\\)"),
    ("deepseek_v3", dict(quantization_config={"quant_method": "fp8", "weight_block_size": [0, 1]}),
     "quantization_config.weight_block_size=\\[0, 1\\] \\(two positive integers"),
    ("qwen3_moe", dict(quantization_config={"quant_method": "fp8", "scale_fmt": "mx"}),
     "quantization_config.scale_fmt='mx'"),
    ("qwen3", dict(model_type="gemma3_text"), "model_type 'gemma3_text'; meshtrain imports "
                                              "llama, mistral, qwen2, qwen3, mixtral, qwen3_moe, "
                                              "qwen2_moe, deepseek_v2, deepseek_v3")])
def test_what_a_family_does_not_implement_is_refused_before_writing(tmp_path, family, changes,
                                                                     message):
  save_hf_model(tmp_path / "hf", family)
  _edit(tmp_path / "hf", **changes)
  with pytest.raises(ConfigError, match=message) as error:
    import_hf(micro_config(), tmp_path / "hf", tmp_path / "imported")
  assert error.value.key == "--from"
  assert not (tmp_path / "imported").exists()


@pytest.mark.parametrize("changes, message", [
    ({"model.qkv_bias": True, "model.qk_norm": True}, "qkv_bias=True with model.qk_norm=True"),
    # routing state or choices transformers' Mixtral and Qwen MoE routers lack
    ({"model.moe.num_experts": 4, "model.moe.bias_update_rate": 1e-3},
     "model.moe.bias_update_rate=0.001"),
    ({"model.moe.num_experts": 4, "model.moe.expert_groups": 2, "model.moe.groups_per_token": 1},
     "model.moe.groups_per_token=1"),
    ({"model.moe.num_experts": 4, "model.moe.shared_mlp_dim": 8}, "model.moe.shared_mlp_dim=8"),
    # DeepSeek-V3's router without its attention, its attention without experts
    ({"model.moe.num_experts": 4, "model.moe.router": "sigmoid"}, "model.moe.router='sigmoid'"),
    ({"model.num_kv_heads": 4, "model.mla.kv_lora_rank": 16},
     "Multi-head Latent Attention without experts"),
    ({"model.num_kv_heads": 4, "model.mla.kv_lora_rank": 16, "model.moe.num_experts": 4,
      "model.moe.mlp_dim": 24, "model.moe.shared_mlp_dim": 40}, "model.moe.shared_mlp_dim=40"),
    # DeepSeek-V2's softmax weights are never renormalised
    ({"model.num_kv_heads": 4, "model.mla.kv_lora_rank": 16, "model.moe.num_experts": 4},
     "model.moe.normalize_top_k=True")])
def test_a_model_no_family_has_is_not_exported(changes, message):
  cfg = micro_config(**changes)
  with pytest.raises(ConfigError, match=message) as error:
    hf_config.family(cfg.model)
  assert error.value.key == "config.model"


@pytest.mark.slow
def test_the_readme_walkthrough_fine_tunes_on_conversations_and_transformers_loads_it(tmp_path):
  """The README's commands, as written, in a scratch directory beside the repo's
  examples, configs and virtual environment."""
  readme = (REPO / "docs/huggingface.md").read_text()  # moved from the README
  block = readme.split("**Fine-tune on conversations**")[1].split("```bash\n")[1].split("```")[0]
  for name in ("examples", "configs"):
    (tmp_path / name).symlink_to(REPO / name)
  (tmp_path / ".venv").symlink_to(sys.prefix)
  env = {**os.environ, "PATH": f"{sys.prefix}/bin:{os.environ['PATH']}"}
  result = subprocess.run(["bash", "-ec", block], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  records = [json.loads(line) for line in
             (tmp_path / "runs/chat_ft/metrics.jsonl").read_text().splitlines()]
  evals = [r["eval_loss"] for r in records if "eval_loss" in r]
  assert len(evals) == 3 and evals[-1] < evals[0] - 1  # it learned the answers
  assert "<|im_start|>assistant" in result.stdout  # transformers rendered the prompt, generated
  assert json.loads((tmp_path / "hf/chat_ft/config.json").read_text())["model_type"] == "qwen2"


@pytest.mark.parametrize("preset, family", [
    ("mixtral_8x7b", "mixtral"), ("qwen3_30b_a3b", "qwen3_moe"), ("qwen1_5_moe_a2_7b", "qwen2_moe"),
    ("deepseek_v2_lite", "deepseek_v2"), ("deepseek_v3", "deepseek_v3"), ("qwen3_0_6b", "qwen3"),
    ("mistral_7b", "mistral"), ("qwen2_5_7b", "qwen2")])
def test_each_published_shape_exports_as_its_family(preset, family):
  assert hf_config.family(load(REPO / "configs" / f"{preset}.py").model) == family
