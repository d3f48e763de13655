"""DeepSeek-V3's multi-token prediction modules (`model.mtp_layers`) through
Hugging Face: checkpoints laid out as the published one (each module the
layer after the last, `model.layers.{N+k}`) import and compute the logits of
transformers' own `MtpModel` loaded from the same files, on one device and
sharded; the export writes them back as that checkpoint has them (copies of
the embedding and head included), which `MtpModel` loads; float8 blocks
dequantize and quantize as the other layers'; and what a checkpoint or a
family lacks is refused in one line, before anything is written."""

import json

import jax
import numpy as np
import pytest
import safetensors.numpy
import safetensors.torch
import torch
import transformers
from flax import nnx
from transformers.modeling_layers import MtpModel

from conftest import micro_config, tiered
from test_float8 import quantize, write_reference
from test_hf import tokens
from test_hf_families import (FAMILIES, MADE_HERE, assert_logits_close, imported,
                              imported_weights, save_hf_model, saved_weights)
from meshtrain.errors import ConfigError
from meshtrain.hf import float8, importer
from meshtrain.hf.exporter import export_hf
from meshtrain.hf.load import check_model, layers_not_read, load_params
from meshtrain.hf_import import import_hf
from meshtrain.train.loss import mtp_batch
from meshtrain.train.setup import build

N = FAMILIES["deepseek_v3"]["num_hidden_layers"]  # the test model's layers; modules from N on
WIDTH = 32  # test_hf_families' hidden_size
LENGTH = 32  # the model's inputs; the tokens given are one more, the last only ahead


def save_mtp_model(directory, mtp_layers: int, seed=0):
  """test_hf_families' random DeepSeek-V3 with `mtp_layers` (1 or 2)
  multi-token prediction modules, as DeepSeek-V3's checkpoint holds its one:
  module k is layer N + k, its block a layer's tensors (here a second random
  model's MoE layer k + 1), beside them its enorm, hnorm, eh_proj [D, 2D] and
  shared_head.norm, and copies of the embedding and output head. Returns
  transformers' model and `MtpModel`, both loaded from the files."""
  donor_directory = directory.with_name(directory.name + "-donor")
  save_hf_model(directory, "deepseek_v3", seed)
  save_hf_model(donor_directory, "deepseek_v3", seed + 1)
  tensors = safetensors.numpy.load_file(directory / "model.safetensors")
  donor = safetensors.numpy.load_file(donor_directory / "model.safetensors")
  rng = np.random.default_rng(seed)
  for k in range(mtp_layers):
    block, module = f"model.layers.{k + 1}.", f"model.layers.{N + k}."
    tensors.update({module + name[len(block):]: tensor for name, tensor in donor.items()
                    if name.startswith(block)})
    tensors.update({f"{module}{norm}.weight": 1 + 0.2 * rng.normal(size=WIDTH).astype(np.float32)
                    for norm in ("enorm", "hnorm", "shared_head.norm")})
    tensors[module + "eh_proj.weight"] = 0.3 * rng.normal(size=(WIDTH, 2 * WIDTH)).astype(
        np.float32)
    tensors[module + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"]
    tensors[module + "shared_head.head.weight"] = tensors["lm_head.weight"]
  safetensors.numpy.save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
  hf = json.loads((directory / "config.json").read_text())
  (directory / "config.json").write_text(json.dumps({**hf, "num_nextn_predict_layers": mtp_layers}))
  return hf_mtp_model(directory)


def hf_mtp_model(directory):
  """transformers' model in `directory` and its `MtpModel`, read by
  `MtpModel.from_pretrained` (which raises on a missing weight); that finds
  the modules by the model's `_keys_to_ignore_on_load_unexpected`, DeepSeek-V3's
  layer 61, here the layers from `num_hidden_layers` on."""
  model = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
  first, count = model.config.num_hidden_layers, model.config.num_mtp_layers
  model._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{first + k}\."
                                              for k in range(count)]
  return model, MtpModel.from_pretrained(model).eval()


def hf_mtp_logits(model, mtp, x):
  """transformers' logits of the main model on `x[:, :LENGTH]`, then of each
  depth k (from 0) at positions 0..LENGTH - k - 1, as `generate` runs the
  modules: the normalised last hidden state (`hidden_states[-1]`) and the
  tokens one place ahead into module 0, each module's output and the tokens
  one further into the next, at those tokens' positions (meshtrain's, at the
  main model's, are the same: RoPE sees only their differences)."""
  x = torch.as_tensor(x, dtype=torch.long)
  with torch.no_grad():
    out = model(x[:, :LENGTH], output_hidden_states=True)
    h, logits = out.hidden_states[-1], [out.logits.numpy()]
    for k in range(mtp.num_mtp_layers):
      n = LENGTH - k
      h = mtp.forward_layer(k, h[:, :n], torch.arange(k + 1, k + 1 + n)[None], None,
                            input_ids=x[:, k + 1:k + 1 + n])
      logits.append(mtp.shared_head(h).numpy())
  return logits


def meshtrain_mtp_logits(setup, params, model_state, x):
  """`Llama.forward_mtp`'s logits on `x[:, :LENGTH]`, the main model's then
  each depth's, its tokens ahead as the training batch has them (`mtp_batch`),
  each depth k's cut to the positions transformers' covers."""
  batch = {"inputs": x[:, :LENGTH], "targets": x[:, 1:]}
  ahead = mtp_batch(batch, setup.cfg.model.mtp_layers)["mtp_inputs"]

  def forward(weights, inputs, ahead):
    logits, mtp_logits, _ = nnx.merge(setup.spec.graphdef, *weights).forward_mtp(inputs, ahead)
    return [logits, *mtp_logits]
  with jax.set_mesh(setup.mesh), nnx.logical_axis_rules(setup.rules.params):
    logits = jax.jit(forward)((params, model_state), batch["inputs"], ahead)
  return [np.asarray(logits[0])] + [np.asarray(l)[:, :LENGTH - k] for k, l in enumerate(logits[1:])]


def assert_same_mtp_logits(got, expected):
  assert len(got) == len(expected)
  for g, e in zip(got, expected):
    assert_logits_close(g, e)


@pytest.fixture(scope="module", params=[1, 2], ids=["one module", "two modules"])
def mtp_model(request, tmp_path_factory):
  directory = tmp_path_factory.mktemp(f"mtp{request.param}")
  return request.param, directory, *save_mtp_model(directory, request.param)


@pytest.mark.parametrize("mesh", tiered(["one device", "fsdp=4 tensor=2"], ("one device",)))
def test_imported_modules_compute_transformers_mtp_logits(mtp_model, mesh):
  mtp_layers, directory, model, mtp = mtp_model
  sharded = mesh != "one device"
  cfg = imported(directory, **{"model.mtp_layers": mtp_layers},
                 **({"mesh.data": 1, "mesh.fsdp": 4, "mesh.tensor": 2} if sharded else {}))
  setup = build(cfg, jax.devices() if sharded else jax.devices()[:1])
  params, state = imported_weights(directory, setup)
  x = tokens(length=LENGTH + 1)
  assert_same_mtp_logits(meshtrain_mtp_logits(setup, params, state, x),
                         hf_mtp_logits(model, mtp, x))


def test_the_note_names_the_modules_the_config_leaves_out(mtp_model):
  """With fewer modules than the checkpoint holds, the import leaves out the
  last ones and names them; with all, nothing."""
  mtp_layers, directory, *_ = mtp_model
  assert layers_not_read(directory, mtp_layers, key="--from") == []
  assert importer.left_out_note(directory, mtp_layers) is None
  assert layers_not_read(directory, key="--from") == list(range(N, N + mtp_layers))
  note = importer.left_out_note(directory, mtp_layers - 1)
  assert note.startswith(f"note: model.layers.{N + mtp_layers - 1}, beyond num_hidden_layers "
                         "(DeepSeek-V3's multi-token prediction), not imported: "
                         f"config.model.mtp_layers is {mtp_layers - 1}; set it to {mtp_layers}")


def test_import_then_export_gives_the_checkpoint_back_tensor_for_tensor(mtp_model, tmp_path):
  """The modules, their block's selection bias and the copies of the
  embedding and head, as the checkpoint holds them; the import reads no copy."""
  mtp_layers, directory, *_ = mtp_model
  workdir = import_hf(micro_config(**{"mesh.data": 2, "mesh.fsdp": 4,
                                      "model.mtp_layers": mtp_layers}),
                      directory, tmp_path / "imported")
  cfg, params, state = saved_weights(workdir)
  export_hf(cfg, params, workdir, tmp_path / "exported", model_state=state)
  expected = safetensors.numpy.load_file(directory / "model.safetensors")
  got = safetensors.numpy.load_file(tmp_path / "exported" / "model.safetensors")
  assert sorted(got) == sorted(expected)
  for name, tensor in expected.items():
    np.testing.assert_array_equal(got[name], tensor, err_msg=name)
  written = json.loads((tmp_path / "exported" / "config.json").read_text())
  assert written["num_nextn_predict_layers"] == mtp_layers


def test_a_model_made_here_exports_its_module_which_transformers_runs(tmp_path):
  """A DeepSeek-V3-shaped model trained here with one module: config.json
  counts it, the checkpoint holds it with copies of the embedding and head,
  and transformers' `MtpModel` loaded from it computes meshtrain's logits."""
  cfg = micro_config(**{"model.moe.num_experts": 4, "model.moe.mlp_dim": 24,
                        "workdir": str(tmp_path / "run"), **MADE_HERE["deepseek_v3"],
                        "model.mtp_layers": 1})
  setup = build(cfg, jax.devices()[:1])
  state = setup.init_state()
  params, model_state = jax.tree.map(  # norm scales off 1, selection biases off 0
      lambda w: w + 0.1 * jax.random.normal(jax.random.key(1), w.shape),
      (state.params, state.model_state))
  export_hf(cfg, params, tmp_path / "run", tmp_path / "exported", model_state=model_state)
  written = json.loads((tmp_path / "exported" / "config.json").read_text())
  assert (written["model_type"], written["num_nextn_predict_layers"]) == ("deepseek_v3", 1)
  tensors = safetensors.numpy.load_file(tmp_path / "exported" / "model.safetensors")
  n = cfg.model.num_layers
  for copy, original in (("embed_tokens", "model.embed_tokens"), ("shared_head.head", "lm_head")):
    np.testing.assert_array_equal(tensors[f"model.layers.{n}.{copy}.weight"],
                                  tensors[f"{original}.weight"])
  model, mtp = hf_mtp_model(tmp_path / "exported")
  x = tokens(length=LENGTH + 1)
  assert_same_mtp_logits(meshtrain_mtp_logits(setup, params, model_state, x),
                         hf_mtp_logits(model, mtp, x))


def test_a_float8_modules_block_imports_as_its_dequantized_values(tmp_path):
  """Each float8 projection of the module (its block's, and eh_proj were it
  float8) imports as torch's `Q * scale`, sharded, as the main layers' do."""
  save_mtp_model(tmp_path / "float", 1)
  expected = quantize(tmp_path / "float", tmp_path / "fp8", (4, 4))
  assert {f"model.layers.{N}.self_attn.q_a_proj.weight", f"model.layers.{N}.eh_proj.weight",
          f"model.layers.{N}.mlp.experts.0.down_proj.weight"} <= set(expected)
  write_reference(tmp_path, expected)
  cfg = imported(tmp_path / "float", **{"mesh.data": 1, "mesh.fsdp": 4, "mesh.tensor": 2,
                                        "model.mtp_layers": 1})
  setup = build(cfg)
  got, want, unquantized = (
      jax.device_get(load_params(tmp_path / d, setup.spec.abstract_params,
                                 setup.shardings.params, key="--from")["mtp"])
      for d in ("fp8", "reference", "float"))
  jax.tree.map(np.testing.assert_array_equal, got, want)
  moved = jax.tree.map(lambda a, b: np.abs(a - b).max(), got, unquantized)
  assert max(jax.tree.leaves(moved)) > 0  # the float8 rounding is there: the test sees it


def test_a_float8_export_quantizes_the_modules_block_as_the_checkpoint_does(tmp_path):
  """From a float8 checkpoint laid out as DeepSeek-V3's (its modules' block
  projections float8; eh_proj, the norms and the copies not), `export-hf
  --dtype float8` writes the same tensors quantized, and the same float8
  values back."""
  save_mtp_model(tmp_path / "float", 1)
  quantize(tmp_path / "float", tmp_path / "fp8", float8.EXPORT_BLOCK)
  source = safetensors.torch.load_file(tmp_path / "fp8" / "model.safetensors")
  eh_proj = f"model.layers.{N}.eh_proj.weight"
  source[eh_proj] = safetensors.torch.load_file(tmp_path / "float" / "model.safetensors")[eh_proj]
  del source[eh_proj + float8.SCALE_SUFFIX]
  safetensors.torch.save_file(source, tmp_path / "fp8" / "model.safetensors")
  workdir = import_hf(micro_config(**{"mesh.data": 2, "mesh.fsdp": 4, "model.mtp_layers": 1}),
                      tmp_path / "fp8", tmp_path / "imported")
  cfg, params, state = saved_weights(workdir)
  export_hf(cfg, params, workdir, tmp_path / "exported", model_state=state, dtype="float8")
  got = safetensors.torch.load_file(tmp_path / "exported" / "model.safetensors")
  assert sorted(got) == sorted(source)
  quantized = {name for name, tensor in source.items() if tensor.dtype == torch.float8_e4m3fn}
  assert {f"model.layers.{N}.self_attn.kv_b_proj.weight",
          f"model.layers.{N}.mlp.shared_experts.up_proj.weight"} <= quantized
  assert {name for name, t in got.items() if t.dtype == torch.float8_e4m3fn} == quantized
  for name in quantized:
    np.testing.assert_array_equal(got[name].view(torch.uint8).numpy(),
                                  source[name].view(torch.uint8).numpy(), err_msg=name)


def test_more_modules_than_the_checkpoint_holds_are_refused_before_writing(mtp_model, tmp_path):
  """`init_from=hf:` and `import-hf` alike, naming the config key."""
  mtp_layers, directory, *_ = mtp_model
  message = (rf"is {mtp_layers + 1} but the model in .* has {mtp_layers} multi-token "
             rf"prediction modules \(num_nextn_predict_layers\); set it to {mtp_layers} or less")
  cfg = imported(directory, **{"model.mtp_layers": mtp_layers + 1})
  with pytest.raises(ConfigError, match=message) as error:
    check_model(directory, cfg.model, key="config.init_from")
  assert error.value.key == "config.model.mtp_layers"
  with pytest.raises(ConfigError, match=message) as error:
    import_hf(micro_config(**{"model.mtp_layers": mtp_layers + 1}), directory,
              tmp_path / "imported")
  assert error.value.key == "config.model.mtp_layers"
  assert not (tmp_path / "imported").exists()


def test_modules_a_config_counts_but_the_files_lack_are_refused_before_writing(tmp_path):
  """transformers' save_pretrained writes DeepSeek-V3's config with
  num_nextn_predict_layers 1 and no module: asking for it names the key and
  what the files hold, not a missing tensor."""
  directory = tmp_path / "hf"
  save_hf_model(directory, "deepseek_v3")
  assert json.loads((directory / "config.json").read_text())["num_nextn_predict_layers"] == 1
  message = (rf"is 1 but the model in .* holds the tensors of 0 multi-token prediction modules "
             rf"\(model.layers.{N} on\), though its config.json counts 1 .*; set it to 0$")
  with pytest.raises(ConfigError, match=message) as error:
    import_hf(micro_config(**{"model.mtp_layers": 1}), directory, tmp_path / "imported")
  assert error.value.key == "config.model.mtp_layers"
  assert not (tmp_path / "imported").exists()


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_a_model_with_modules_exports_as_no_other_family(tmp_path, family):
  cfg = micro_config(**{"model.mtp_layers": 1, "workdir": str(tmp_path / "run"),
                        **({"model.moe.num_experts": 4, **MADE_HERE[family]}
                           if family in MADE_HERE else {})})
  setup = build(cfg, jax.devices()[:1])
  with pytest.raises(ConfigError, match=r"model.mtp_layers=1 \(multi-token prediction: only "
                                        r"DeepSeek-V3's family has it\)") as error:
    export_hf(cfg, setup.spec.abstract_params, tmp_path / "run", tmp_path / "exported")
  assert error.value.key == "config.model"
  assert not (tmp_path / "exported").exists()
