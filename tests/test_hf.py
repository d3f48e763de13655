"""Hugging Face Llama checkpoints (the other families: test_hf_families.py):
meshtrain's Llama computes transformers' logits from imported weights, on one
device and sharded; export loads back into transformers; import then export
gives the same tensors bit for bit."""

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy
import tokenizers
import torch
import transformers
from flax import nnx

from conftest import REPO, micro_config
from meshtrain import workdir as saved_run
from meshtrain.data import make_iterator
from meshtrain.errors import ConfigError
from meshtrain.hf import config as hf_config
from meshtrain.hf.exporter import export_hf
from meshtrain.hf.load import load_params
from meshtrain.hf.weights import hf_weights
from meshtrain.hf_import import import_hf
from meshtrain.models.patterns import path_string
from meshtrain.train.loop import train
from meshtrain.train.parallelize import from_stage_slots
from meshtrain.train.relayout import read_weights
from meshtrain.train.resume import start_state
from meshtrain.train.setup import build

# Small Llamas covering grouped-query attention (kv heads split and whole under
# tensor=2), tied and untied embeddings, and Llama 3's and YaRN's RoPE scaling
# (a short original context, so that positions 0..31 reach the scaled
# frequencies; YaRN's band between whole dimensions, and cos and sin scaled by
# DeepSeek's ratio of two mscales).
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8,
        "beta_fast": 4.0, "beta_slow": 0.25, "mscale": 1.5, "mscale_all_dim": 0.5,
        "truncate": False}
CASES = {
    "untied_gqa": dict(num_key_value_heads=2, tie_word_embeddings=False),
    "tied_llama3_rope": dict(
        num_key_value_heads=1, tie_word_embeddings=True, rope_theta=500_000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
    "yarn_rope": dict(num_key_value_heads=2, rope_theta=1000.0, rope_scaling=YARN),
}


def save_tokenizer(directory):
  """A word-level tokenizer of the models' 64 ids, as Hugging Face files."""
  words = ["<s>", "</s>"] + [f"w{i}" for i in range(62)]
  tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(
      {word: i for i, word in enumerate(words)}, unk_token="w0"))
  tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
  tokenizer.save(str(directory / "tokenizer.json"))
  (directory / "tokenizer_config.json").write_text(json.dumps(
      {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>"}))


def save_hf_llama(directory, seed=0, **changes):
  """A random LlamaForCausalLM written by transformers' save_pretrained, with a tokenizer."""
  torch.manual_seed(seed)
  cfg = transformers.LlamaConfig(**{
      **dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
             head_dim=8, intermediate_size=64, rms_norm_eps=1e-5, initializer_range=0.2),
      **changes})
  model = transformers.LlamaForCausalLM(cfg).eval()
  model.save_pretrained(directory)
  save_tokenizer(Path(directory))
  return model


def hf_logits(model, tokens):
  with torch.no_grad():
    return model(torch.as_tensor(np.asarray(tokens), dtype=torch.long)).logits.numpy()


@pytest.fixture(scope="module", params=list(CASES))
def hf_model(request, tmp_path_factory):
  directory = tmp_path_factory.mktemp(request.param)
  return directory, save_hf_llama(directory, **CASES[request.param])


def imported_config(directory, **mesh):
  cfg = micro_config(**{f"mesh.{axis}": size for axis, size in mesh.items()})
  cfg.model.update(hf_config.model_keys(hf_config.read(directory, key="--from")))
  return cfg


def meshtrain_logits(cfg, params, tokens, setup, model_state=None):
  """The logits of `params` on `setup`'s mesh (an MoE model with `model_state`,
  by default its fresh router biases)."""
  state = setup.spec.init_model_state() if model_state is None else model_state
  weights = (params,) if state is None else (params, state)
  with jax.set_mesh(setup.mesh), nnx.logical_axis_rules(setup.rules.params):
    return np.asarray(jax.jit(lambda w, t: nnx.merge(setup.spec.graphdef, *w)(t))(weights, tokens))


def tokens(batch=2, length=32, seed=1):
  return np.random.default_rng(seed).integers(0, 64, (batch, length), dtype=np.int32)


@pytest.mark.parametrize("mesh", [dict(data=1), dict(data=1, fsdp=4, tensor=2)],
                         ids=["one_device", "fsdp4_tensor2"])
def test_imported_model_computes_transformers_logits(hf_model, mesh):
  directory, model = hf_model
  cfg = imported_config(directory, **mesh)
  devices = jax.devices()[:1] if mesh == dict(data=1) else jax.devices()
  setup = build(cfg, devices)
  params = load_params(directory, setup.spec.abstract_params, setup.shardings.params, key="--from")
  x = tokens()
  expected = hf_logits(model, x)
  got = meshtrain_logits(cfg, params, x, setup)
  scale = np.abs(expected).max()
  assert np.abs(got - expected).max() <= 1e-4 * scale, (np.abs(got - expected).max(), scale)



@pytest.mark.parametrize("rope", [YARN, {"rope_type": "yarn", "factor": 40.0, "mscale": 1.0,
                                         "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1,
                                         "original_max_position_embeddings": 4096},
                                  {"rope_type": "yarn", "factor": 4.0,
                                   "original_max_position_embeddings": 32768}],
                         ids=["test model", "DeepSeek-V3", "Qwen3 long context"])
def test_yarn_frequencies_and_their_export_are_transformers(rope):
  """YaRN's frequencies and cos/sin factor equal transformers' for the test
  model's, DeepSeek-V3's and Qwen3's settings (head size 64), and the
  exported config reads back to the same model keys."""
  from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
  from meshtrain.models import rope as meshtrain_rope
  from meshtrain.models.llama import LlamaConfig
  hf = transformers.LlamaConfig(hidden_size=256, num_attention_heads=4, head_dim=64,
                                rope_theta=10_000.0, rope_scaling=rope).to_dict()
  keys = hf_config.model_keys(hf)
  model = LlamaConfig(**{**keys, "moe": None})
  expected_freq, expected_factor = ROPE_INIT_FUNCTIONS["yarn"](transformers.LlamaConfig(**hf))
  np.testing.assert_allclose(meshtrain_rope.frequencies(64, model.rope_theta, model.rope_scaling),
                             expected_freq.numpy(), rtol=1e-6)
  assert model.rope_scaling.cos_sin_factor == pytest.approx(expected_factor, rel=1e-12)
  exported = micro_config()
  exported.model.update(keys)
  assert hf_config.model_keys(hf_config.to_hf(exported.model, "float32")) == keys


def finetune_config(source, workdir, **changes):
  """configs/finetune_hf.py:SOURCE, made micro: float32, short sequences, one step."""
  spec = importlib.util.spec_from_file_location("finetune_hf", REPO / "configs/finetune_hf.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  cfg = module.get_config(str(source))
  cfg.update(dict(seq_len=16, global_batch=16, steps=1, log_every=1, compute_dtype="float32",
                  param_dtype="float32", remat="none", workdir=str(workdir), **changes))
  return cfg


def hf_loss(model, batch):
  logits = torch.as_tensor(hf_logits(model, batch["inputs"]))
  targets = torch.as_tensor(batch["targets"]).long()
  return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten()).item()


def test_fine_tuning_an_imported_workdir_starts_at_the_models_loss(tmp_path):
  source = tmp_path / "hf"
  model = save_hf_llama(source, **CASES["untied_gqa"])
  imported = import_hf(micro_config(), source, tmp_path / "imported")
  saved = json.loads((imported / "config.json").read_text())
  assert saved["model"]["num_kv_heads"] == 2 and (imported / "checkpoints/0").is_dir()
  cfg = finetune_config(imported, imported)
  first_batch = next(make_iterator(cfg.data, seq_len=16, global_batch=16, vocab_size=64,
                                   seed=cfg.seed))
  records = train(cfg)
  assert records[0]["step"] == 1
  assert records[0]["loss"] == pytest.approx(hf_loss(model, first_batch), rel=1e-5)


def hf_tensors_of(params):
  """meshtrain's parameters as Hugging Face tensors (by the name mapping)."""
  tensors, weights = {}, hf_weights("llama")
  for path, leaf in jax.tree_util.tree_flatten_with_path(jax.device_get(params))[0]:
    weight = weights[path_string(path)]
    tensors.update((name, weight.to_hf(leaf[lead])) for lead, name in weight.names(leaf.shape))
  return tensors


def test_init_from_starts_a_run_from_the_hf_weights_bit_for_bit(tmp_path):
  source = tmp_path / "hf"
  save_hf_llama(source, **CASES["tied_llama3_rope"])
  cfg = finetune_config(source, tmp_path / "run")
  assert cfg.init_from == f"hf:{source}"
  setup = build(cfg)
  state, checkpoints, origin = start_state(setup, batches=None)
  checkpoints.close()
  assert origin == f"initialized from hf:{source}" and int(state.step) == 0
  expected = safetensors.numpy.load_file(source / "model.safetensors")
  got = hf_tensors_of(state.params)
  assert sorted(got) == sorted(expected)
  for name, tensor in expected.items():
    np.testing.assert_array_equal(got[name], tensor, err_msg=name)
  assert all(not np.any(x) for x in jax.tree.leaves(jax.device_get(state.opt_state))
             if np.ndim(x) > 0)  # fresh Adam moments


@pytest.mark.slow  # trains and exports, 6 s
def test_export_after_float8_training_is_the_master_weights_in_bfloat16(tmp_path):
  """Float8 training quantizes the GEMMs' operands as they run, never the
  weights it keeps: after two tensorwise steps the bfloat16 export is the
  float32 master weights of the last checkpoint, rounded to bfloat16."""
  source = tmp_path / "hf"
  before = save_hf_llama(source, **CASES["untied_gqa"]) and safetensors.numpy.load_file(
      source / "model.safetensors")
  imported = import_hf(micro_config(), source, tmp_path / "imported")
  cfg = finetune_config(imported, imported, float8="tensorwise")
  cfg.steps = 2
  train(cfg)
  setup = build(cfg)
  params = saved_run.load_params(imported, 2, setup.spec.abstract_params, setup.shardings.params)
  export_hf(cfg, params, imported, tmp_path / "exported", dtype="bfloat16")
  got = safetensors.numpy.load_file(tmp_path / "exported" / "model.safetensors")
  master = hf_tensors_of(params)
  assert sorted(got) == sorted(master) == sorted(before)
  for name, tensor in master.items():
    assert tensor.dtype == np.float32 and got[name].dtype == ml_dtypes.bfloat16, name
    np.testing.assert_array_equal(got[name], tensor.astype(ml_dtypes.bfloat16), err_msg=name)
  assert all(not np.array_equal(master[name], before[name]) for name in before
             if "norm" not in name)  # trained


def test_export_loads_in_transformers_and_round_trips_bit_for_bit(tmp_path):
  source = tmp_path / "hf"
  model = save_hf_llama(source, **CASES["tied_llama3_rope"])
  imported = import_hf(micro_config(**{"mesh.fsdp": 4, "mesh.tensor": 2, "mesh.data": 1}), source,
                       tmp_path / "imported")
  cfg = saved_run.load_config(imported, {"mesh.fsdp": 2, "mesh.tensor": 1, "mesh.data": 4})
  setup = build(cfg)
  params = saved_run.load_params(imported, 0, setup.spec.abstract_params, setup.shardings.params)
  out = tmp_path / "exported"
  files = export_hf(cfg, params, imported, out, max_shard_bytes=20_000)  # a few shards
  assert "model.safetensors.index.json" in files and len(list(out.glob("*.safetensors"))) > 1
  index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
  expected = safetensors.numpy.load_file(source / "model.safetensors")
  assert sorted(index) == sorted(expected)
  for name, tensor in expected.items():
    with safetensors.safe_open(out / index[name], "numpy") as f:
      np.testing.assert_array_equal(f.get_tensor(name), tensor, err_msg=name)
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
  x = tokens()
  np.testing.assert_array_equal(hf_logits(reloaded, x), hf_logits(model, x))
  text = "w1 w5 w61 w7"
  assert (transformers.AutoTokenizer.from_pretrained(out)(text)["input_ids"] ==
          transformers.AutoTokenizer.from_pretrained(source)(text)["input_ids"])
  with pytest.raises(ConfigError, match="already holds a model"):
    export_hf(cfg, params, imported, out)
  (tmp_path / "notes").mkdir()
  (tmp_path / "notes" / "tokenizer.json").write_text("mine")
  with pytest.raises(ConfigError, match="is not empty; give a new or empty directory"):
    export_hf(cfg, params, imported, tmp_path / "notes")
  assert [p.name for p in (tmp_path / "notes").iterdir()] == ["tokenizer.json"]
  assert (tmp_path / "notes" / "tokenizer.json").read_text() == "mine"


def _no_config(directory):
  (directory / "config.json").unlink()


def _not_llama(directory):
  hf = json.loads((directory / "config.json").read_text())
  (directory / "config.json").write_text(json.dumps({**hf, "model_type": "gpt2"}))


def _missing_shard(directory):
  tensors = safetensors.numpy.load_file(directory / "model.safetensors")
  (directory / "model.safetensors").unlink()
  safetensors.numpy.save_file(tensors, directory / "model-00001-of-00002.safetensors")
  (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
      name: f"model-0000{1 + (name == 'model.norm.weight')}-of-00002.safetensors"
      for name in tensors}}))


def _wrong_shape(directory):
  tensors = safetensors.numpy.load_file(directory / "model.safetensors")
  name = "model.layers.1.self_attn.k_proj.weight"
  tensors[name] = np.zeros((8, 32), np.float32)  # config.json implies [16, 32]
  safetensors.numpy.save_file(tensors, directory / "model.safetensors")


@pytest.fixture(scope="module")
def good_hf_dir(tmp_path_factory):
  directory = tmp_path_factory.mktemp("good")
  save_hf_llama(directory, **CASES["untied_gqa"])
  return directory


@pytest.mark.parametrize("breakage, message", [
    (_no_config, "has no config.json"), (_not_llama, "model_type 'gpt2'"),
    (_missing_shard, "model-00002-of-00002.safetensors is missing"),
    (_wrong_shape, r"k_proj.weight is \[8, 32\] .* implies \[16, 32\]")])
def test_bad_model_directories_are_refused_before_anything_is_written(breakage, message,
                                                                      good_hf_dir, tmp_path):
  source = tmp_path / "hf"
  shutil.copytree(good_hf_dir, source)
  breakage(source)
  with pytest.raises(ConfigError, match=message) as error:
    import_hf(micro_config(), source, tmp_path / "imported")
  assert error.value.key == "--from"
  assert not (tmp_path / "imported").exists()


def test_import_into_a_directory_that_holds_other_files_is_refused(good_hf_dir, tmp_path):
  (tmp_path / "corpus").mkdir()
  (tmp_path / "corpus" / "meta.json").write_text("{}")
  with pytest.raises(ConfigError, match="corpus is not empty; give a new or empty directory"):
    import_hf(micro_config(), good_hf_dir, tmp_path / "corpus")
  assert [p.name for p in (tmp_path / "corpus").iterdir()] == ["meta.json"]


def meshtrain(command, *args, cwd):
  return subprocess.run([sys.executable, "-m", "meshtrain.cli", command, *args],
                        capture_output=True, text=True, timeout=300, cwd=cwd)


@pytest.mark.slow
def test_uneven_stages_import_and_export_bit_for_bit(tmp_path):
  """Three layers on two stages, "2,1" (the layers in the pipeline's slots):
  the import puts each HF layer in its slot and zeros in the empty one; the
  export of that checkpoint, read on its own layout, on another and on no
  pipeline, gives the HF tensors back bit for bit."""
  source = tmp_path / "hf"
  save_hf_llama(source, num_hidden_layers=3, **CASES["untied_gqa"])
  uneven = {"mesh.data": 4, "mesh.pipeline": 2, "pipeline.stage_layers": "2,1"}
  imported = import_hf(micro_config(**uneven, **{"model.num_layers": 3}), source,
                       tmp_path / "imported")
  expected = safetensors.numpy.load_file(source / "model.safetensors")
  for layout in (uneven, {"mesh.data": 4, "mesh.pipeline": 2, "pipeline.stage_layers": "1,2"},
                 {"mesh.data": 8, "mesh.pipeline": 1, "pipeline.stage_layers": ""}):
    cfg = saved_run.load_config(imported, layout)
    setup = build(cfg)
    slotted = read_weights(imported, 0, setup)[0]
    if layout is uneven:  # slots [stage 0: layers 0, 1 | stage 1: layer 2, empty]
      assert not any(np.any(np.asarray(x)[3]) for x in jax.tree.leaves(slotted["layers"]))
    params = from_stage_slots(setup.run.layout, slotted)
    out = tmp_path / f"exported{cfg.pipeline.stage_layers}"
    export_hf(cfg, params, imported, out)
    got = safetensors.numpy.load_file(out / "model.safetensors")
    assert sorted(got) == sorted(expected)
    for name, tensor in expected.items():
      np.testing.assert_array_equal(got[name], tensor, err_msg=name)


@pytest.mark.slow  # two processes, then a third
def test_import_and_export_commands(good_hf_dir, tmp_path):
  """Import on two processes of four devices (each reads only its devices'
  blocks), export from one: the tensors come back bit for bit."""
  micro = [f"--config.{k}={v}" for k, v in dict(seq_len=16, global_batch=16).items()]
  imported = meshtrain("launch", "--num_processes=2", "--devices_per_process=4", "--",
                       "import-hf", f"--from={good_hf_dir}", "--to=imported",
                       "--config.mesh.data=1", "--config.mesh.fsdp=8", "--config.mesh.across_hosts=fsdp",
                       *micro, cwd=tmp_path)
  assert imported.returncode == 0, imported.stderr
  exported = meshtrain("export-hf", "--workdir=imported", "--to=exported", "--max_shard_mb=1",
                       "--config.mesh.data=2", "--config.mesh.fsdp=1", "--config.mesh.tensor=4",
                       cwd=tmp_path)
  assert exported.returncode == 0, exported.stderr
  assert (tmp_path / "exported/model.safetensors").is_file()  # 1 MB holds this model
  for tensor in safetensors.numpy.load_file(good_hf_dir / "model.safetensors").items():
    with safetensors.safe_open(tmp_path / "exported/model.safetensors", "numpy") as f:
      np.testing.assert_array_equal(f.get_tensor(tensor[0]), tensor[1])
  again = meshtrain("export-hf", "--workdir=imported", "--to=exported", cwd=tmp_path)
  assert again.returncode == 2 and again.stderr.strip().splitlines() == [
      "error: --to: exported already holds a model; give a new or empty directory"]


def test_bfloat16_checkpoint_round_trips_bit_for_bit_through_float32_master_weights(tmp_path):
  source = tmp_path / "hf"
  save_hf_llama(source, **CASES["untied_gqa"]).to(torch.bfloat16).save_pretrained(source)
  imported = import_hf(micro_config(), source, tmp_path / "imported")
  cfg = saved_run.load_config(imported, {})
  setup = build(cfg)
  params = saved_run.load_params(imported, 0, setup.spec.abstract_params, setup.shardings.params)
  export_hf(cfg, params, imported, tmp_path / "exported")  # in the source's dtype
  expected = safetensors.numpy.load_file(source / "model.safetensors")
  got = safetensors.numpy.load_file(tmp_path / "exported/model.safetensors")
  assert {t.dtype.name for t in got.values()} == {"bfloat16"}
  assert sorted(got) == sorted(expected)
  for name, tensor in expected.items():
    np.testing.assert_array_equal(got[name].view(np.uint16), tensor.view(np.uint16), err_msg=name)
