"""KV-cache generation: the same tokens as recomputing the whole prefix for every
new token, on one device and under tensor parallelism; the same greedy tokens as
transformers' `generate`; sampling draws from the distribution it claims."""

import json
import logging
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from conftest import REPO, micro_config
from meshtrain import generate, workdir as saved_run
from meshtrain.config import load
from meshtrain.errors import ConfigError
from meshtrain.hf import config as hf_config
from meshtrain.hf.load import load_params
from meshtrain.hf_import import import_hf
from meshtrain.train.setup import build
from test_hf import CASES, save_hf_llama
from test_mla import MLA

PROMPTS = [[5, 9, 2, 33, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9], [60, 11, 0]]  # lengths differ
GREEDY = generate.Sampling(temperature=0.0)


def recomputed_greedy(graphdef, weights, prompts, new_tokens):
  """Greedy decoding without a cache: the whole sequence through `Llama.__call__`
  for every new token, one prompt at a time, on one device. `weights`: the
  parameters, and an MoE model's state."""
  weights = jax.device_put(jax.device_get(weights), jax.devices()[0])
  longest = max(map(len, prompts)) + new_tokens
  logits_fn = jax.jit(lambda w, t: nnx.merge(graphdef, *w)(t))
  outputs = []
  for prompt in prompts:
    sequence = list(prompt)
    for _ in range(new_tokens):  # causal: padding on the right changes nothing before it
      window = np.array([sequence + [0] * (longest - len(sequence))], np.int32)
      sequence.append(int(np.argmax(logits_fn(weights, window)[0, len(sequence) - 1])))
    outputs.append(sequence[len(prompt):])
  return outputs


MOE = {"model.moe.num_experts": 4, "model.moe.experts_per_token": 2,
       "model.moe.first_dense_layers": 1}
SHARDED = {"mesh.data": 1, "mesh.fsdp": 4, "mesh.tensor": 2}


@pytest.mark.parametrize("changes", [
    dict(), {"mesh.data": 4, "mesh.tensor": 2}, MOE, {**MOE, **SHARDED}, MLA,
    {**MLA, **MOE, **SHARDED}],
    ids=["one_device", "data4_tensor2", "moe_one_device", "moe_experts_over_fsdp4_tensor2",
         "latent_attention_one_device", "latent_attention_moe_fsdp4_tensor2"])
def test_cached_greedy_equals_recomputing_the_prefix(changes, caplog):
  cfg = micro_config(**changes)
  setup = build(cfg, jax.devices() if "mesh.tensor" in changes else jax.devices()[:1])
  state = setup.init_state()
  model_state = jax.tree.map(  # router biases that change the choice of experts
      lambda b: b + jax.random.normal(jax.random.key(1), b.shape), state.model_state)
  generator = generate.Generator(setup.spec.graphdef, state.params, setup.mesh, setup.rules,
                                 model_state=model_state)
  with caplog.at_level(logging.WARNING), jax.log_compiles(True):
    got = generator(PROMPTS, 10, GREEDY)
  compiled = [m.split()[1] for m in caplog.messages if m.startswith("Compiling jit(")]
  assert compiled.count("jit(prefill)") == compiled.count("jit(decode)") == 1  # 9 decode steps
  assert got == recomputed_greedy(setup.spec.graphdef, generator.weights, PROMPTS, 10)
  assert len({tuple(tokens) for tokens in got}) == 3  # not a degenerate model


YARN = {"model.rope_scaling_type": "yarn", "model.rope_scaling_factor": 4.0,
        "model.rope_original_max_positions": 8, "model.rope_mscale": 1.0,
        "model.rope_mscale_all_dim": 0.7}


@pytest.mark.parametrize("changes", [
    {}, {"model.sliding_window": 4, **SHARDED}, MLA,
    {**MLA, **YARN, "model.mla.q_lora_rank": 0, "model.mla.v_head_dim": 16, **SHARDED}],
    ids=["grouped_query", "sliding_window_fsdp4_tensor2", "latent",
         "latent_yarn_no_query_latent_wide_values_fsdp4_tensor2"])
def test_the_cache_gives_the_forward_logits(changes):
  """The prefill (the prompt attending to itself) and each decode step give
  the logits of the whole sequence through `Llama.__call__`; MLA's cache
  holds each token's latent and rotated key (kv_lora_rank + rope_head_dim
  numbers a layer), read by its absorbed attention."""
  cfg = micro_config(**changes)
  setup = build(cfg, jax.devices() if "mesh.tensor" in changes else jax.devices()[:1])
  params = setup.init_state().params
  x_BxL = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (2, 12), dtype=np.int32)
  prompt = 7
  with jax.set_mesh(setup.mesh), nnx.logical_axis_rules(setup.rules.params):
    model = nnx.merge(setup.spec.graphdef, params)
    expected = np.asarray(jax.jit(lambda t: model(t))(x_BxL))
    shapes, _ = generate.cache_shapes(model.cfg, 2, 12)
    cache = tuple(jnp.zeros(shape) for shape in shapes)
    first_B = jnp.zeros(2, jnp.int32)
    step = jax.jit(lambda t, pos, c, start: generate.forward_with_cache(model, t, pos, c, start,
                                                                        first_B))
    logits, cache = step(x_BxL[:, :prompt], np.arange(prompt)[None].repeat(2, 0), cache, None)
    got = [np.asarray(logits)]
    for slot in range(prompt, 12):
      logits, cache = step(x_BxL[:, slot:slot + 1], np.full((2, 1), slot), cache, jnp.int32(slot))
      got.append(np.asarray(logits))
  m = cfg.model.mla
  width = ((m.kv_lora_rank,), (m.rope_head_dim,)) if m.kv_lora_rank else (
      (cfg.model.num_kv_heads, cfg.model.head_dim),) * 2
  assert [c.shape for c in cache] == [(cfg.model.num_layers, 2, 12, *w) for w in width]
  np.testing.assert_allclose(np.concatenate(got, axis=1), expected, rtol=1e-5,
                             atol=1e-5 * np.abs(expected).max())


def test_deepseek_v3s_cache_holds_576_numbers_a_token_and_layer():
  """The README's figure: the latent (512) and rotated key (64), against 2 x
  128 heads x 192 expanded."""
  model = load(str(REPO / "configs/deepseek_v3.py")).model
  shapes, _ = generate.cache_shapes(model, rows=1, slots=1)
  assert [shape[-1] for shape in shapes] == [512, 64]
  assert [shape[0] for shape in shapes] == [model.num_layers] * 2


def test_greedy_equals_transformers_generate_on_an_imported_model(tmp_path):
  model = save_hf_llama(tmp_path, **CASES["tied_llama3_rope"])
  cfg = micro_config(**{"mesh.data": 4, "mesh.tensor": 2})
  cfg.model.update(hf_config.model_keys(hf_config.read(tmp_path, key="--from")))
  setup = build(cfg)
  params = load_params(tmp_path, setup.spec.abstract_params, setup.shardings.params, key="--from")
  eos = model.generation_config.eos_token_id
  got = generate.Generator(setup.spec.graphdef, params, setup.mesh, setup.rules, eos_id=eos)(
      PROMPTS, 12, GREEDY)
  for prompt, tokens in zip(PROMPTS, got):
    with torch.no_grad():
      expected = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                                eos_token_id=eos, pad_token_id=eos)[0, len(prompt):].tolist()
    assert tokens == (expected[:expected.index(eos) + 1] if eos in expected else expected)


def test_sampling_draws_from_the_cut_distribution():
  probs = np.array([0.5, 0.3, 0.15, 0.05])
  logits_BxV = np.log(probs)[None].repeat(20_000, 0)

  def frequencies(sampling):
    draws = np.asarray(generate.sample(logits_BxV, jax.random.key(0), sampling))
    return np.bincount(draws, minlength=4) / len(draws)
  np.testing.assert_allclose(frequencies(generate.Sampling()), probs, atol=0.01)
  np.testing.assert_allclose(frequencies(generate.Sampling(top_k=2)), [0.625, 0.375, 0, 0],
                             atol=0.01)
  # top_p 0.7: 0.5 then 0.3 reach it; the rest is cut
  np.testing.assert_allclose(frequencies(generate.Sampling(top_p=0.7)), [0.625, 0.375, 0, 0],
                             atol=0.01)
  tempered = probs ** 2 / (probs ** 2).sum()  # temperature 0.5 squares the probabilities
  np.testing.assert_allclose(frequencies(generate.Sampling(temperature=0.5)), tempered, atol=0.01)
  assert (frequencies(generate.Sampling(temperature=0.0)) == [1, 0, 0, 0]).all()


def meshtrain_generate(*args, cwd):
  return subprocess.run([sys.executable, "-m", "meshtrain.cli", "generate", *args],
                        capture_output=True, text=True, timeout=300, cwd=cwd)


@pytest.mark.slow
def test_generate_command_prints_json_per_prompt_and_refuses_a_missing_workdir(tmp_path):
  save_hf_llama(tmp_path / "hf", **CASES["untied_gqa"])
  import_hf(micro_config(), tmp_path / "hf", tmp_path / "run")
  (tmp_path / "prompts.txt").write_text("w1 w2 w3\nw40 w41\n")
  result = meshtrain_generate("--workdir=run", "--prompts=prompts.txt", "--max_tokens=6",
                              "--temperature=0", "--json", "--config.mesh.tensor=2", cwd=tmp_path)
  assert result.returncode == 0, result.stderr
  lines = [json.loads(line) for line in result.stdout.splitlines()]
  assert [line["prompt_tokens"] for line in lines] == [[0, 3, 4, 5], [0, 42, 43]]  # <s> first
  for line in lines:
    assert 1 <= len(line["tokens"]) <= 6
    assert line["text"] == " ".join(f"w{t - 2}" for t in line["tokens"] if t > 1)
  missing = meshtrain_generate("--workdir=nowhere", "--prompt=w1", cwd=tmp_path)
  assert missing.returncode == 2
  assert missing.stderr.strip().splitlines() == [
      "error: --workdir: nowhere has no config.json; give a workdir that `meshtrain train` or "
      "`meshtrain import-hf` wrote"]


def test_a_workdir_without_the_checkpoint_asked_for_is_refused(tmp_path):
  (tmp_path / "config.json").write_text(json.dumps(micro_config().to_dict()))
  with pytest.raises(ConfigError, match="holds no checkpoint") as error:
    saved_run.checkpoint_step(tmp_path, None)
  assert error.value.key == "--workdir"
  (tmp_path / "checkpoints/5").mkdir(parents=True)
  assert saved_run.checkpoint_step(tmp_path, None) == 5
  with pytest.raises(ConfigError, match=r"no checkpoint of step 3; it has \[5\]") as error:
    saved_run.checkpoint_step(tmp_path, 3)
  assert error.value.key == "--step"
