"""Fine-grained float8 checkpoints (DeepSeek-V3's and the Qwen3 "-FP8" models'
`quantization_config`) import as the weights they stand for: logits equal
transformers' own dequantization of the same files, blocks cut at a matrix's
edge and at a shard's equal torch's block arithmetic, the export (float, or
float8 blocks again) is what transformers and the import read, and what is not
fine-grained float8 is refused before anything is written."""

import json

import jax
import ml_dtypes
import numpy as np
import pytest
import safetensors.torch
import torch
import transformers

from conftest import REPO, micro_config, tiered
from test_hf import hf_logits, tokens
from test_hf_families import (assert_import_computes_logits, assert_logits_close, imported,
                              save_hf_model, saved_weights)
from meshtrain.config import load
from meshtrain.errors import ConfigError
from meshtrain.hf import float8, load as hf_load
from meshtrain.hf.exporter import export_hf
from meshtrain.hf.load import check_model
from meshtrain.hf_import import import_hf
from meshtrain.train.setup import build

E4M3_MAX = 448.0
# deepseek-ai/DeepSeek-V3's config.json as published (its float8 blocks included)
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False,
    "attention_dropout": 0.0, "aux_loss_alpha": 0.001, "bos_token_id": 0, "eos_token_id": 1,
    "ep_size": 1, "first_k_dense_replace": 3, "hidden_act": "silu", "hidden_size": 7168,
    "initializer_range": 0.02, "intermediate_size": 18432, "kv_lora_rank": 512,
    "max_position_embeddings": 163840, "model_type": "deepseek_v3", "moe_intermediate_size": 2048,
    "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1,
    "norm_topk_prob": True, "num_attention_heads": 128, "num_experts_per_tok": 8,
    "num_hidden_layers": 61, "num_key_value_heads": 128, "num_nextn_predict_layers": 1,
    "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
    "rms_norm_eps": 1e-06, "rope_scaling": {
        "beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "seq_aux": True,
    "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16", "transformers_version": "4.33.1", "use_cache": True,
    "v_head_dim": 128, "vocab_size": 129280}


def _quantized(name: str) -> bool:
  """The tensors DeepSeek-V3's checkpoint stores in float8: every projection's
  matrix, not the embeddings, the output head, norms or routers."""
  return "_proj" in name and name.endswith(".weight")


def block_scales(weight: torch.Tensor, block) -> torch.Tensor:
  """A scale grid expanded by torch to one scale per element of each block."""
  return weight.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)


SCALE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16,  # Qwen3's -FP8 models
                "ue8m0": torch.float8_e8m0fnu}  # power-of-two bytes


def write_reference(tmp_path, expected: dict, source=None) -> None:
  """`tmp_path / "reference"`: the float checkpoint in `source` (default
  `tmp_path / "float"`) with `expected` (torch's dequantized tensors) in
  place of its own."""
  source = source or tmp_path / "float"
  reference = safetensors.torch.load_file(source / "model.safetensors")
  (tmp_path / "reference").mkdir()
  safetensors.torch.save_file({**reference, **expected},
                              tmp_path / "reference" / "model.safetensors")
  (tmp_path / "reference" / "config.json").write_bytes((source / "config.json").read_bytes())


def quantize(source, out, block=(4, 4), values=torch.float8_e4m3fn, scales="float32"):
  """`source`'s model as a fine-grained float8 checkpoint in `out`, written
  with torch, its scales in `scales` (SCALE_DTYPES). Returns each quantized
  tensor's float32 value after the round trip (torch's dequantization, the
  reference)."""
  tensors = safetensors.torch.load_file(source / "model.safetensors")
  stored, expected = {}, {}
  for name, weight in tensors.items():
    if not _quantized(name):
      stored[name] = weight
      continue
    rows, cols = weight.shape
    grid = (-(-rows // block[0]), -(-cols // block[1]))
    padded = torch.zeros(grid[0] * block[0], grid[1] * block[1])
    padded[:rows, :cols] = weight
    amax = padded.reshape(grid[0], block[0], grid[1], block[1]).abs().amax((1, 3))
    scale = amax / E4M3_MAX
    if scales == "ue8m0":  # the next power of two, as UE8M0 stores it
      scale = torch.exp2(torch.ceil(torch.log2(scale)))
    scale = scale.to(SCALE_DTYPES[scales])
    per_element = block_scales(scale.float(), block)[:rows, :cols]
    stored[name] = (weight / per_element).to(values)
    stored[name + "_scale_inv"] = scale
    expected[name] = stored[name].float() * per_element
  out.mkdir()
  safetensors.torch.save_file(stored, out / "model.safetensors", metadata={"format": "pt"})
  hf = json.loads((source / "config.json").read_text())
  hf["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme":
                               "dynamic", "weight_block_size": list(block),
                               "scale_fmt": "ue8m0" if scales == "ue8m0" else "float"}
  (out / "config.json").write_text(json.dumps(hf))
  for other in source.glob("tokenizer*"):
    (out / other.name).write_bytes(other.read_bytes())
  return expected


@pytest.fixture(scope="module", params=["deepseek_v3", "qwen3_moe"])
def float8_model(request, tmp_path_factory):
  """(family, float8 directory, transformers' model loaded from it: on a
  machine without a GPU transformers dequantizes it, here to float32)."""
  directory = tmp_path_factory.mktemp(request.param)
  save_hf_model(directory / "float", request.param)
  quantize(directory / "float", directory / "fp8")
  model = transformers.AutoModelForCausalLM.from_pretrained(directory / "fp8",
                                                            dtype=torch.float32).eval()
  return request.param, directory / "fp8", model


@pytest.mark.parametrize("mesh", tiered(["one device", "fsdp=4 tensor=2"], ("fsdp=4 tensor=2",)))
def test_float8_import_computes_transformers_dequantized_logits(float8_model, mesh):
  _, directory, model = float8_model
  assert_import_computes_logits(directory, model, mesh)


READ_BYTES = 40  # 1 to 3 rows of the test model a read


@pytest.fixture(scope="module")
def deepseek_v3_float(tmp_path_factory):
  """(directory, setup on fsdp=4 x tensor=2, weights as imported) of a float
  DeepSeek-V3 test model, read READ_BYTES at a time: the checkpoint every
  block layout below is quantized from, written and read once."""
  directory = tmp_path_factory.mktemp("deepseek_v3") / "float"
  save_hf_model(directory, "deepseek_v3")
  setup = build(imported(directory, **{"mesh.data": 1, "mesh.fsdp": 4, "mesh.tensor": 2}))
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(hf_load, "READ_BYTES", READ_BYTES)
    params = jax.device_get(hf_load.load_params(directory, setup.spec.abstract_params,
                                                setup.shardings.params, key="--from"))
  return directory, setup, params


@pytest.mark.parametrize("block, values, scales", [
    ((8, 16), torch.float8_e4m3fn, "float32"),  # blocks the matrices' sizes do not divide
    ((16, 8), torch.float8_e5m2, "ue8m0"),  # UE8M0 scales, e5m2 values
    ((8, 8), torch.float8_e4m3fn, "bfloat16"),
    (None, torch.float8_e4m3fn, "float32")])  # one scale per matrix
def test_partial_blocks_dequantize_as_torch_does(tmp_path, monkeypatch, deepseek_v3_float,
                                                 block, values, scales):
  """Every imported weight equals torch's `Q * scale` to the bit, on a mesh
  whose shards, and runs of rows read at once, cut blocks in the middle;
  `transformers` refuses blocks that do not divide a matrix, so torch's
  arithmetic is the reference here."""
  source, setup, float_params = deepseek_v3_float
  monkeypatch.setattr(hf_load, "READ_BYTES", READ_BYTES)
  grid_block = block or (128, 128)  # one block covering each of the test model's matrices
  expected = quantize(source, tmp_path / "fp8", grid_block, values, scales)
  if block is None:  # one scale per matrix: written as a [1] vector, config says null
    hf = json.loads((tmp_path / "fp8" / "config.json").read_text())
    hf["quantization_config"]["weight_block_size"] = None
    (tmp_path / "fp8" / "config.json").write_text(json.dumps(hf))
    tensors = safetensors.torch.load_file(tmp_path / "fp8" / "model.safetensors")
    safetensors.torch.save_file({name: t.reshape(1) if name.endswith("_scale_inv") else t
                                 for name, t in tensors.items()},
                                tmp_path / "fp8" / "model.safetensors")
  write_reference(tmp_path, expected, source)
  got, want = (jax.device_get(hf_load.load_params(tmp_path / d, setup.spec.abstract_params,
                                          setup.shardings.params, key="--from"))
               for d in ("fp8", "reference"))
  jax.tree.map(np.testing.assert_array_equal, got, want)
  moved = jax.tree.map(lambda a, b: np.abs(a - b).max(), got, float_params)
  assert max(jax.tree.leaves(moved)) > 0  # the float8 rounding is there: the test sees it


def test_fused_expert_scales_index_by_expert():
  """A leading dimension (transformers v5 fuses the experts into one tensor)
  indexes the scale grid as it does the values; the block edge is partial."""
  rng = np.random.default_rng(0)
  values = rng.normal(size=(3, 10, 12)).astype(np.float32)
  scales = rng.uniform(0.5, 2, size=(3, 3, 2)).astype(np.float32)
  whole = torch.as_tensor(values) * torch.stack(
      [block_scales(torch.as_tensor(s), (4, 8))[:10, :12] for s in scales])
  index = (slice(1, 3), slice(3, 9), slice(5, 12))
  np.testing.assert_array_equal(
      float8.dequantize(values[index], scales, (4, 8), values.shape, index),
      whole.numpy()[index])


def test_the_export_of_a_float8_import_is_a_float_checkpoint(tmp_path):
  save_hf_model(tmp_path / "float", "deepseek_v3")
  quantize(tmp_path / "float", tmp_path / "fp8")
  workdir = import_hf(micro_config(**{"mesh.data": 2, "mesh.fsdp": 4}), tmp_path / "fp8",
                      tmp_path / "imported")
  cfg, params, state = saved_weights(workdir)
  export_hf(cfg, params, workdir, tmp_path / "exported", model_state=state)
  assert "quantization_config" not in json.loads((tmp_path / "exported" / "config.json")
                                                 .read_text())
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "exported").eval()
  dequantized = transformers.AutoModelForCausalLM.from_pretrained(
      tmp_path / "fp8", dtype=torch.float32).eval()
  x = tokens()
  assert_logits_close(hf_logits(reloaded, x), hf_logits(dequantized, x))


def test_deepseek_v3s_published_config_is_the_preset(tmp_path):
  """DeepSeek-V3's config.json, float8 and all, is read (as `init_from=hf:`
  checks it) as exactly `configs/deepseek_v3.py`'s model."""
  (tmp_path / "config.json").write_text(json.dumps(DEEPSEEK_V3))
  assert float8.block_size(check_model(tmp_path, load(str(REPO / "configs/deepseek_v3.py")).model,
                                       key="--from")) == (128, 128)


def _rewrite(directory, edit):
  tensors = safetensors.torch.load_file(directory / "model.safetensors")
  edit(tensors)
  safetensors.torch.save_file(tensors, directory / "model.safetensors")


SCALE = "model.layers.0.self_attn.q_a_proj.weight_scale_inv"


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.pop(SCALE), "q_a_proj.weight is float8 but .* has no .*weight_scale_inv; "
                             "download every shard"),
    (lambda t: t.update({SCALE: t[SCALE].to(torch.float8_e4m3fn)}),
     "weight_scale_inv is F8_E4M3; block scales are float32, bfloat16 or UE8M0"),
    (lambda t: t[SCALE].__setitem__((0, 0), float("nan")), "scales that are not finite"),
    (lambda t: t.update({SCALE: t[SCALE][:1]}), r"weight_scale_inv is \[1, 8\], but .*"
                                                r"weight_block_size=\[4, 4\] has \[6, 8\]")])
def test_a_float8_weight_without_good_scales_is_refused_before_writing(tmp_path, edit, message):
  save_hf_model(tmp_path / "float", "deepseek_v3")
  quantize(tmp_path / "float", tmp_path / "fp8")
  _rewrite(tmp_path / "fp8", edit)
  with pytest.raises(ConfigError, match=message) as error:
    import_hf(micro_config(), tmp_path / "fp8", tmp_path / "imported")
  assert error.value.key == "--from"
  assert not (tmp_path / "imported").exists()


def test_quantized_blocks_keep_e4m3s_precision():
  """Each value comes back within half an e4m3 step: 1/16 of its magnitude,
  or 2**-10 of its block's scale below e4m3's smallest normal; an all-zero
  block stays zero; the block's largest magnitude is exactly 448 x scale."""
  rng = np.random.default_rng(0)
  matrix = rng.normal(size=(300, 200)).astype(np.float32) * rng.uniform(0.01, 10, (300, 1))
  matrix[:128, :128] = 0
  values, scales = float8.quantize(matrix)
  assert values.dtype == ml_dtypes.float8_e4m3fn and scales.shape == (3, 2)
  back = float8.dequantize(values, scales, (128, 128), matrix.shape, (slice(None), slice(None)))
  per_value = block_scales(torch.as_tensor(scales), (128, 128)).numpy()[:300, :200]
  assert np.all(np.abs(back - matrix) <= np.maximum(np.abs(matrix) / 16, per_value * 2**-10))
  assert not back[:128, :128].any()
  np.testing.assert_array_equal(np.abs(values.astype(np.float32)).max(), float8.E4M3_MAX)


@pytest.mark.parametrize("family", tiered(["deepseek_v3", "mixtral"], ("deepseek_v3",)))
def test_a_float8_export_is_what_transformers_and_the_import_read(tmp_path, family):
  """`export-hf --dtype float8` writes the projections as float8 blocks (the
  embedding, head and routers in bfloat16), in shards; transformers loads it
  and the import computes transformers' logits from it. From a float8 import
  it writes the same float8 values back."""
  save_hf_model(tmp_path / "float", family)
  source = tmp_path / "float"
  if family == "deepseek_v3":  # from float8 blocks as the export writes them
    quantize(tmp_path / "float", tmp_path / "fp8", float8.EXPORT_BLOCK)
    source = tmp_path / "fp8"
  workdir = import_hf(micro_config(**{"mesh.data": 2, "mesh.fsdp": 4}), source,
                      tmp_path / "imported")
  cfg, params, state = saved_weights(workdir)
  out = tmp_path / "exported"
  export_hf(cfg, params, workdir, out, model_state=state, dtype="float8",
            max_shard_bytes=40_000)
  written = json.loads((out / "config.json").read_text())
  assert written["quantization_config"] == float8.EXPORT_CONFIG
  index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
  assert len(set(index.values())) > 1
  tensors = {}
  for file in set(index.values()):
    tensors.update(safetensors.torch.load_file(out / file))
  assert sorted(tensors) == sorted(index)
  for name, tensor in tensors.items():
    quantized = name + "_scale_inv" in tensors
    assert tensor.dtype == (torch.float8_e4m3fn if quantized else torch.float32
                            if name.endswith("_scale_inv") else torch.bfloat16), name
    assert quantized == (_quantized(name) or name.endswith((".w1.weight", ".w2.weight",
                                                            ".w3.weight"))), name
  if family == "deepseek_v3":  # the float8 import's values, written back
    original = safetensors.torch.load_file(source / "model.safetensors")
    for name, tensor in original.items():
      if tensor.dtype == torch.float8_e4m3fn:
        np.testing.assert_array_equal(tensors[name].view(torch.uint8).numpy(),
                                      tensor.view(torch.uint8).numpy(), err_msg=name)
        np.testing.assert_allclose(tensors[name + "_scale_inv"].numpy(),
                                   original[name + "_scale_inv"].numpy(), rtol=1e-6)
  model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
  assert_import_computes_logits(out, model, "fsdp=4 tensor=2")
