"""Sampling from a meshtrain Llama with a KV cache: one compiled prefill, one compiled decode step.

Prompts of different lengths share a batch right-aligned: row b starts with
`pad_b` padding slots that no query attends to, and its positions count from
its first real token, so each row decodes as it would alone. The cache holds
every layer's keys and values for all `prompt + max_tokens` slots; the decode
step writes one slot and attends over the cache, so a new token costs one
token's forward pass, not the prefix's. Under Multi-head Latent Attention the
cache holds each token's latent and shared rotated key instead (576 numbers a
token and layer for DeepSeek-V3, against 2 x 128 heads x 192 expanded), and
a decode step attends with the up-projections absorbed
(`LatentAttention.absorbed_attention`). The prefill attends among the
prompt's tokens only, not over the empty slots after them.

The layers run the model's own modules (norms, q/k/v projection, RoPE, MLP,
head); only attention differs from `Llama.__call__`: it reads the cache.
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from tqdm import tqdm

from meshtrain import rules as r
from meshtrain.data import tokenizer as tokenizers
from meshtrain.errors import ConfigError
from meshtrain.models.llama import LatentAttention, Llama
from meshtrain.train.relayout import read_weights
from meshtrain.train.setup import Setup

CACHE_NAMES = (r.LAYERS, r.BATCH, None, r.ACT_KV_HEADS, r.HEAD_DIM)  # [layer, B, T, K, H]
LATENT_CACHE_NAMES = (r.LAYERS, r.BATCH, None, None)  # [layer, B, T, latent or rotated key]


@dataclasses.dataclass(frozen=True)
class Sampling:
  temperature: float = 1.0  # 0: greedy (argmax)
  top_k: int = 0            # keep the k likeliest tokens (0: all)
  top_p: float = 1.0        # keep the smallest set of likeliest tokens holding p of the mass

  def check(self, vocab_size: int) -> None:
    for flag, bad, rule in (
        ("--temperature", not (math.isfinite(self.temperature) and self.temperature >= 0),
         "must be a number >= 0 (0: greedy)"),
        ("--top_k", not 0 <= self.top_k <= vocab_size,
         f"must be in [0, {vocab_size}], the model's vocabulary (0: all tokens)"),
        ("--top_p", not 0 < self.top_p <= 1, "must be in (0, 1]")):
      if bad:
        raise ConfigError(flag, f"{getattr(self, flag[2:])} {rule}")


def sample(logits_BxV: jax.Array, key: jax.Array, sampling: Sampling) -> jax.Array:
  """The next token of each row: argmax at temperature 0, else a draw from the
  tempered distribution cut to its top-k and top-p tokens."""
  if sampling.temperature == 0:
    return jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32)
  logits_BxV = logits_BxV / sampling.temperature
  if sampling.top_k:
    kth_Bx1 = jax.lax.top_k(logits_BxV, sampling.top_k)[0][:, -1:]
    logits_BxV = jnp.where(logits_BxV < kth_Bx1, -jnp.inf, logits_BxV)
  if sampling.top_p < 1:
    sorted_BxV = jnp.sort(logits_BxV, axis=-1)[:, ::-1]
    probs_BxV = jax.nn.softmax(sorted_BxV, axis=-1)
    mass_before_BxV = jnp.cumsum(probs_BxV, axis=-1) - probs_BxV
    kept = jnp.where(mass_before_BxV < sampling.top_p, sorted_BxV, jnp.inf)
    logits_BxV = jnp.where(logits_BxV < kept.min(axis=-1, keepdims=True), -jnp.inf, logits_BxV)
  return jax.random.categorical(key, logits_BxV).astype(jnp.int32)


def forward_with_cache(model: Llama, tokens_BxS: jax.Array, positions_BxS: jax.Array,
                       cache: tuple[jax.Array, jax.Array], start: jax.Array | None,
                       first_B: jax.Array):
  """Logits of `tokens` written into cache slots [start, start + S), attending
  to slots from each row's first real one (`first_B`) up to their own (of
  them the last `sliding_window`, where the model has one). `start` None is
  the prefill: slots [0, S), where the tokens attend to each other only, not
  to the empty slots after them (and MLA in its expanded form, which does a
  third of the absorbed form's arithmetic on a prompt).
  The cache holds every layer's keys and values (MLA: latents and rotated
  keys), an MoE model's leading dense layers first. Returns (float32 logits
  [B, S, V], updated cache)."""
  cfg, (length, slots) = model.cfg, (tokens_BxS.shape[1], cache[0].shape[2])
  slot_S = (0 if start is None else start) + jnp.arange(length)
  slot_T = jnp.arange(length if start is None else slots)
  visible_BxSxT = ((slot_T[None, None, :] <= slot_S[None, :, None])
                   & (slot_T[None, None, :] >= first_B[:, None, None]))
  if cfg.sliding_window:  # the last `sliding_window` slots, itself included
    visible_BxSxT &= slot_T[None, None, :] > slot_S[None, :, None] - cfg.sliding_window
  stacks = [layers for layers in (model.dense_layers, model.layers) if layers is not None]
  x_BxSxD, updated = model.embed(tokens_BxS), []
  first = 0
  for layers in stacks:
    graphdef, layer_state = nnx.split(layers)
    count = jax.tree.leaves(layer_state)[0].shape[0]
    x_BxSxD, stack_cache = jax.lax.scan(
        functools.partial(_cached_layer, graphdef, positions_BxS, start, visible_BxSxT),
        x_BxSxD, (layer_state, *(c[first:first + count] for c in cache)))
    updated.append(stack_cache)
    first += count
  cache = tuple(jnp.concatenate(parts) for parts in zip(*updated))
  return model.head(x_BxSxD, model.embed.table() if cfg.tie_embeddings else None), cache


def _cached_layer(graphdef: nnx.GraphDef, positions_BxS: jax.Array, start: jax.Array | None,
                  visible_BxSxT: jax.Array, x_BxSxD: jax.Array, inputs):
  """One block on S new tokens, what it caches written into its cache slice."""
  state, *cache = inputs
  block = nnx.merge(graphdef, state)
  attend = (_prefill if start is None else _latent_attention
            if isinstance(block.attn, LatentAttention) else _attention)
  out_BxSxNxH, cache = attend(block.attn, block.attn_norm(x_BxSxD), positions_BxS, cache,
                              start, visible_BxSxT)
  x_BxSxD = x_BxSxD + block.attn.project_out(out_BxSxNxH.astype(x_BxSxD.dtype))
  x_BxSxD = x_BxSxD + block.mlp(block.mlp_norm(x_BxSxD))
  return x_BxSxD, cache


def _written(cache_BxTx: tuple[jax.Array, ...], new_BxSx: tuple[jax.Array, ...],
             start: jax.Array | int) -> tuple[jax.Array, ...]:
  """Each cache array with the S new tokens' entries in slots [start, start + S)."""
  return tuple(jax.lax.dynamic_update_slice_in_dim(c, n.astype(c.dtype), start, axis=1)
               for c, n in zip(cache_BxTx, new_BxSx))


def _prefill(attn, x_BxSxD, positions_BxS, cache, _, visible_BxSxS):
  """Attention of the S prompt tokens among themselves, what they cache
  written into slots [0, S)."""
  q_BxSxNxH, k_BxSxKxH, v_BxSxKxH = attn.qkv(x_BxSxD, positions_BxS)
  out_BxSxNxH = jax.nn.dot_product_attention(q_BxSxNxH, k_BxSxKxH, v_BxSxKxH,
                                             mask=visible_BxSxS[:, None])
  cached = (attn.latent(x_BxSxD, positions_BxS) if isinstance(attn, LatentAttention)
            else (k_BxSxKxH, v_BxSxKxH))
  return out_BxSxNxH, _written(cache, cached, 0)


def _attention(attn, x_BxSxD, positions_BxS, cache, start, visible_BxSxT):
  """Attention over cached keys and values [B, T, K, H]."""
  q_BxSxNxH, *kv = attn.qkv(x_BxSxD, positions_BxS)
  k_BxTxKxH, v_BxTxKxH = _written(cache, kv, start)
  out_BxSxNxH = jax.nn.dot_product_attention(q_BxSxNxH, k_BxTxKxH, v_BxTxKxH,
                                             mask=visible_BxSxT[:, None])
  return out_BxSxNxH, (k_BxTxKxH, v_BxTxKxH)


def _latent_attention(attn: LatentAttention, x_BxSxD, positions_BxS, cache, start,
                      visible_BxSxT):
  """MLA over cached latents [B, T, kv_lora_rank] and rotated keys [B, T, rope_head_dim]."""
  c_BxTxC, k_rope_BxTxR = _written(cache, attn.latent(x_BxSxD, positions_BxS), start)
  out_BxSxNxV = attn.absorbed_attention(attn.query(x_BxSxD, positions_BxS), c_BxTxC,
                                        k_rope_BxTxR, visible_BxSxT)
  return out_BxSxNxV, (c_BxTxC, k_rope_BxTxR)


def cache_shapes(cfg, rows: int, slots: int) -> tuple[tuple[tuple[int, ...], ...], tuple]:
  """The shapes of the two cache arrays of a model (`LlamaConfig`) and their
  logical names: keys and values [layers, B, T, K, H], or MLA's latents and
  rotated keys [layers, B, T, width]."""
  lead = (cfg.num_layers, rows, slots)
  if cfg.mla.kv_lora_rank:
    return ((*lead, cfg.mla.kv_lora_rank), (*lead, cfg.mla.rope_head_dim)), LATENT_CACHE_NAMES
  return ((*lead, cfg.num_kv_heads, cfg.head_dim),) * 2, CACHE_NAMES


@dataclasses.dataclass(frozen=True)
class Generator:
  """`generator(prompts, max_tokens, sampling, seed)` for a model on a mesh."""
  graphdef: nnx.GraphDef
  params: dict      # laid out by `rules.params`
  mesh: Mesh
  rules: r.ShardingRules
  eos_id: int | None = None
  model_state: dict | None = None  # an MoE model's router biases

  def __post_init__(self):
    bad = [axis for axis in ("pipeline", "sequence") if self.mesh.shape[axis] > 1]
    if bad:
      raise ConfigError(f"config.mesh.{bad[0]}", "generation runs on the data, fsdp and tensor "
                        f"axes; set config.mesh.{bad[0]}=1")

  def __call__(self, prompts: list[list[int]], max_tokens: int, sampling: Sampling,
               seed: int = 0) -> list[list[int]]:
    """The tokens generated after each prompt: `max_tokens`, or fewer up to and
    including the end-of-sequence token."""
    replicas = self.mesh.shape["data"] * self.mesh.shape["fsdp"]
    rows = -(-len(prompts) // replicas) * replicas  # spare rows repeat the first prompt
    prompts_padded = prompts + [prompts[0]] * (rows - len(prompts))
    prompt_len = max(map(len, prompts_padded))
    first_B = np.array([prompt_len - len(p) for p in prompts_padded], np.int32)
    tokens_BxP = np.zeros((rows, prompt_len), np.int32)
    for row, prompt in enumerate(prompts_padded):
      tokens_BxP[row, first_B[row]:] = prompt
    prefill, decode = self._compiled(rows, prompt_len + max_tokens, sampling)
    key = jax.random.key(seed)
    with jax.set_mesh(self.mesh), nnx.logical_axis_rules(self.rules.params):
      token_B, cache = prefill(self.weights, tokens_BxP, first_B, key)
      generated = [token_B]
      for step in tqdm(range(1, max_tokens), desc="generate", unit="token", leave=False):
        token_B, cache = decode(self.weights, token_B, cache, prompt_len + step - 1, first_B,
                                jax.random.fold_in(key, step))
        generated.append(token_B)
        if step % 16 == 0 and self._all_ended(generated, len(prompts)):
          break
    tokens_BxN = np.stack(jax.device_get(generated), axis=1)[:len(prompts)]
    return [self._until_eos(row.tolist()) for row in tokens_BxN]

  @property
  def weights(self) -> tuple:
    """What the module is merged from: the parameters, and any model state."""
    return (self.params,) + ((self.model_state,) if self.model_state is not None else ())

  def _all_ended(self, generated: list[jax.Array], rows: int) -> bool:
    """Whether each of the first `rows` rows (the prompts, not the spare rows) has ended."""
    if self.eos_id is None:
      return False
    return bool(jnp.any(jnp.stack(generated, 1)[:rows] == self.eos_id, axis=1).all())

  def _until_eos(self, tokens: list[int]) -> list[int]:
    return tokens[:tokens.index(self.eos_id) + 1] if self.eos_id in tokens else tokens

  def _compiled(self, rows: int, slots: int, sampling: Sampling):
    """The prefill and decode functions, jitted (each compiles once per shape)."""
    graphdef = self.graphdef

    def fresh_cache(model):
      shapes, names = cache_shapes(model.cfg, rows, slots)
      return tuple(r.constrain(jnp.zeros(shape, jnp.dtype(model.cfg.compute_dtype)), names)
                   for shape in shapes)

    def prefill(weights, tokens_BxP, first_B, key):
      model = nnx.merge(graphdef, *weights)
      positions_BxP = jnp.maximum(jnp.arange(tokens_BxP.shape[1])[None] - first_B[:, None], 0)
      logits_BxPxV, cache = forward_with_cache(model, tokens_BxP, positions_BxP, fresh_cache(model),
                                               None, first_B)
      return sample(logits_BxPxV[:, -1], key, sampling), cache

    def decode(weights, token_B, cache, slot, first_B, key):
      model = nnx.merge(graphdef, *weights)
      positions_Bx1 = (slot - first_B)[:, None]
      logits_Bx1xV, cache = forward_with_cache(model, token_B[:, None], positions_Bx1, cache, slot,
                                               first_B)
      return sample(logits_Bx1xV[:, 0], key, sampling), cache

    return jax.jit(prefill), jax.jit(decode, donate_argnums=2)


def prompt_ids(tokenizer: tokenizers.Tokenizer, texts: list[str],
               vocab_size: int) -> list[list[int]]:
  """Each text as `[bos] + tokens` (a prompt goes on: no end-of-document token)."""
  prompts = [ids[:-1].tolist() for ids in tokenizers.document_ids(tokenizer, texts)]
  if not all(prompts):
    raise ConfigError("--prompt", "a prompt is empty; give some text")
  if max(max(ids) for ids in prompts) >= vocab_size:
    raise ConfigError("config.tokenizer", f"its ids exceed the model's vocab_size {vocab_size}; "
                      "use the tokenizer the model was trained with")
  return prompts


def from_workdir(workdir, step: int, setup: Setup, eos_id: int | None) -> Generator:
  """A generator with the weights of checkpoint `step` of `workdir` on `setup`'s mesh."""
  shardings = r.tree_shardings(setup.spec.names, setup.mesh, setup.rules.params)
  params, model_state = read_weights(workdir, step, setup, shardings)
  return Generator(setup.spec.graphdef, params, setup.mesh, setup.rules, eos_id, model_state)
