"""A config checked against a mesh before anything is built or compiled.

`check` holds the rules that need the mesh's sizes (what each axis must
divide, the experts' axes, the pipeline's microbatches, the context-parallel
split, cuDNN's attention), `check_machine` those that need this machine's
devices (the experts' GPU-only paths); each failure is one `ConfigError`
naming the key and the fix. `meshtrain.train.run.resolve` runs both (the
second on real devices alone), for every command before it builds.
"""

import math

from jax.sharding import Mesh

from meshtrain import rules as r
from meshtrain.data import PACKING
from meshtrain.errors import ConfigError
from meshtrain.models import mla, moe as moe_lib
from meshtrain.parallel import attention, experts, float8, hopper_gemm, sequence
from meshtrain.parallel.pipeline import schedule as schedules
from meshtrain.parallel.pipeline.stages import StageLayout
from meshtrain.train import parallelize

DTYPES = ("float32", "bfloat16", "float16")
REMAT = ("none", "full", "selective", "offload")
NAN_POLICIES = ("stop", "skip")
ATTENTION = ("", "xla", "cudnn")


def _check_choice(key: str, value, choices) -> None:
  if value not in choices:
    raise ConfigError(key, f"{value!r} is not one of {', '.join(map(repr, choices))}")


def check(cfg, mesh: Mesh) -> None:
  """Checks the config against the mesh before anything is compiled."""
  _check_choice("config.param_dtype", cfg.param_dtype, DTYPES)
  _check_choice("config.compute_dtype", cfg.compute_dtype, DTYPES)
  _check_choice("config.grad_dtype", cfg.grad_dtype, DTYPES)
  _check_choice("config.remat", cfg.remat, REMAT)
  _check_choice("config.zero_stage", cfg.zero_stage, r.ZERO_STAGES)
  _check_choice("config.nan_policy", cfg.nan_policy, NAN_POLICIES)
  _check_choice("config.attention.sequence_strategy", cfg.attention.sequence_strategy,
                sequence.STRATEGIES)
  _check_choice("config.attention.implementation", cfg.attention.implementation, ATTENTION)
  _check_choice("config.data.packing", cfg.data.packing, PACKING)
  _check_float8(cfg, mesh)
  if cfg.data.packing == "segments" and cfg.attention.implementation == "cudnn":
    raise ConfigError("config.attention.implementation",
                      "cudnn cannot keep packed documents apart (jax 0.10 gives it no segment "
                      "ids); use 'xla' or '' with config.data.packing='segments'")
  m = cfg.model
  if m.num_heads % m.num_kv_heads:
    raise ConfigError("config.model.num_kv_heads",
                      f"{m.num_kv_heads} does not divide num_heads={m.num_heads}")
  if m.head_dim % 2 and not m.mla.kv_lora_rank:
    raise ConfigError("config.model.head_dim", f"rotary positions need an even head_dim, got {m.head_dim}")
  replicas = mesh.shape["data"] * mesh.shape["fsdp"]
  if mesh.shape["pipeline"] > 1:
    _check_pipeline(cfg, mesh, replicas)
  if cfg.global_batch % replicas:
    raise ConfigError(
        "config.global_batch",
        f"{cfg.global_batch} sequences do not split over data x fsdp = {replicas} devices; "
        f"use a multiple of {replicas}")
  if cfg.grad_accum_steps < 1 or (cfg.global_batch // replicas) % cfg.grad_accum_steps:
    raise ConfigError(
        "config.grad_accum_steps",
        f"{cfg.grad_accum_steps} must divide the {cfg.global_batch // replicas} sequences "
        f"each of the data x fsdp = {replicas} replicas gets")
  weight_shards = mesh.shape["fsdp"] * (mesh.shape["data"] if cfg.zero_stage else 1)
  for names, size, axes in (
      (("num_heads", "mlp_dim", "vocab_size"), mesh.shape["tensor"],
       "config.mesh.tensor"),
      (("embed_dim",), weight_shards,
       "config.mesh.fsdp" + (" x config.mesh.data (zero_stage > 0)" if cfg.zero_stage else ""))):
    for name in names:
      if m[name] % size:
        raise ConfigError(f"config.model.{name}", f"{m[name]} is not divisible by {axes} = {size}")
  length_shards = mesh.shape["sequence"] * (mesh.shape["tensor"] if cfg.tensor_sequence_parallel else 1)
  if cfg.seq_len % length_shards:
    raise ConfigError(
        "config.seq_len", f"{cfg.seq_len} is not divisible by config.mesh.sequence" +
        (" x config.mesh.tensor (tensor_sequence_parallel)" if cfg.tensor_sequence_parallel else "") +
        f" = {length_shards}")
  if m.sliding_window and mesh.shape["sequence"] > 1 and cfg.attention.sequence_strategy == "ring":
    raise ConfigError("config.attention.sequence_strategy", "the ring has no sliding window "
                      f"(config.model.sliding_window={m.sliding_window}); use all_gather_kv or "
                      "ulysses")
  if mesh.shape["sequence"] > 1:
    try:
      sequence.check_split(cfg.attention.sequence_strategy, m.num_heads, cfg.seq_len,
                           mesh.shape["sequence"])
    except ValueError as error:
      raise ConfigError("config.attention.sequence_strategy", str(error)) from None
  if cfg.attention.implementation == "cudnn":
    _check_cudnn(cfg, mesh)
  if m.mla.kv_lora_rank:
    _check_mla(cfg, weight_shards)
  if m.moe.num_experts:
    _check_moe(cfg, mesh)


def _check_cudnn(cfg, mesh: Mesh) -> None:
  """cuDNN's flash attention (jax.nn.dot_product_attention): 16-bit
  activations, outside the pipeline, heads a multiple of 8 up to 128 wide
  (that it runs on NVIDIA GPUs alone, jax says where it does not)."""
  key = "config.attention.implementation"
  if cfg.compute_dtype == "float32":
    raise ConfigError(key, "cudnn needs 16-bit activations; set config.compute_dtype=bfloat16 "
                      "or use xla")
  if mesh.shape["pipeline"] > 1:
    raise ConfigError(key, f"cudnn does not compile inside the pipeline in jax 0.10.2: "
                      f"{parallelize.CUDNN_IN_PIPELINE}; use xla (or \"\", which picks it there)")
  width = mla.widths(cfg.model)[2]
  if not attention.flash_fits(width):
    raise ConfigError(key, f"cudnn needs heads a multiple of 8 up to 128 wide, got {width}"
                      f"{' (Multi-head Latent Attention)' if cfg.model.mla.kv_lora_rank else ''}; "
                      "use xla")


def _check_float8(cfg, mesh: Mesh) -> None:
  _check_choice("config.float8", cfg.float8, float8.CHOICES)
  if cfg.float8 == "none":
    return
  for why, unbuilt in (
      # the stages' shard_map makes local SGD's replica axis `data` manual, which
      # float8 takes for an axis of the batch's tokens
      ("local SGD's replicas in the pipeline (config.local_sgd.inner_steps)",
       mesh.shape["pipeline"] > 1 and cfg.local_sgd.inner_steps),
      ("the experts' grouped GEMMs (config.model.moe.num_experts)", cfg.model.moe.num_experts)):
    if unbuilt:
      raise ConfigError("config.float8", f"{cfg.float8}: {why} do not run in float8 yet; set "
                        "config.float8=none for this model")


def _check_mla(cfg, weight_shards: int) -> None:
  """Multi-head Latent Attention against the rest of the model and the mesh
  (its latents split over fsdp, and data under ZeRO, where a weight has no
  `embed` dimension)."""
  m, key = cfg.model, "config.model.mla"
  if m.num_kv_heads != m.num_heads:
    raise ConfigError("config.model.num_kv_heads", f"{m.num_kv_heads}, but Multi-head Latent "
                      f"Attention has a key and value head per query head; set it to "
                      f"model.num_heads = {m.num_heads}")
  if m.mla.rope_head_dim % 2:
    raise ConfigError(f"{key}.rope_head_dim", f"rotary positions need an even width, got "
                      f"{m.mla.rope_head_dim}")
  for name in ("qkv_bias", "qk_norm"):
    if m[name]:
      raise ConfigError(f"config.model.{name}", "is not an option of Multi-head Latent Attention "
                        "(it normalises its latents instead); set it to False")
  for name in ("kv_lora_rank", "q_lora_rank"):
    if m.mla[name] % weight_shards:
      raise ConfigError(f"{key}.{name}", f"{m.mla[name]} is not divisible by config.mesh.fsdp" +
                        (" x config.mesh.data (zero_stage > 0)" if cfg.zero_stage else "") +
                        f" = {weight_shards}, which split the latents")


def _check_moe(cfg, mesh: Mesh) -> None:
  """The Mixture-of-Experts settings against the model and the mesh."""
  moe, key = cfg.model.moe, "config.model.moe"
  _check_choice(f"{key}.router", moe.router, moe_lib.ROUTERS)
  _check_choice("config.experts.grouped_gemm", cfg.experts.grouped_gemm, experts.CHOICES)
  _check_choice("config.experts.dispatch", cfg.experts.dispatch, experts.DISPATCHES)
  if not 1 <= moe.experts_per_token <= moe.num_experts:
    raise ConfigError(f"{key}.experts_per_token", f"{moe.experts_per_token} must be between 1 "
                      f"and model.moe.num_experts = {moe.num_experts}")
  if moe.num_experts % moe.expert_groups:
    raise ConfigError(f"{key}.expert_groups", f"{moe.num_experts} experts do not make "
                      f"{moe.expert_groups} equal groups; use a divisor of model.moe.num_experts")
  group = moe.num_experts // moe.expert_groups
  fewest = -(-moe.experts_per_token // group)  # groups that hold k experts
  if moe.groups_per_token and not fewest <= moe.groups_per_token <= moe.expert_groups:
    raise ConfigError(f"{key}.groups_per_token", f"{moe.groups_per_token} must be between "
                      f"{fewest} (groups of {group} experts holding model.moe.experts_per_token = "
                      f"{moe.experts_per_token}) and model.moe.expert_groups = "
                      f"{moe.expert_groups}, or 0 for every group")
  if moe.first_dense_layers >= cfg.model.num_layers:
    raise ConfigError(f"{key}.first_dense_layers", f"{moe.first_dense_layers} leaves no MoE layer "
                      f"of the {cfg.model.num_layers}; use fewer or set model.moe.num_experts=0")
  axes = parallelize.expert_axes(cfg)
  bad = [a for a in axes if a not in experts.EXPERT_AXES] or [a for a in axes if axes.count(a) > 1]
  if bad:
    raise ConfigError("config.expert_parallel", f"{bad[0]!r}: name each of "
                      f"{', '.join(experts.EXPERT_AXES)} (the axes that split the tokens) at most "
                      "once, comma-separated, or \"\" to keep every expert on every device")
  split = math.prod(mesh.shape[a] for a in axes)
  if moe.num_experts % split:
    raise ConfigError(f"{key}.num_experts", f"{moe.num_experts} experts do not split over "
                      f"config.expert_parallel {cfg.expert_parallel!r} = {split} devices; use a "
                      f"multiple of {split} or other axes")
  hidden = moe.mlp_dim or cfg.model.mlp_dim
  if hidden % mesh.shape["tensor"]:
    raise ConfigError(f"{key}.mlp_dim", f"each expert's hidden width {hidden} is not divisible "
                      f"by config.mesh.tensor = {mesh.shape['tensor']}")
  if moe.shared_mlp_dim % mesh.shape["tensor"]:
    raise ConfigError(f"{key}.shared_mlp_dim", f"the shared MLP's hidden width "
                      f"{moe.shared_mlp_dim} is not divisible by config.mesh.tensor = "
                      f"{mesh.shape['tensor']}")
  held = [a for a in axes if a in experts.PIPELINE_HELD_AXES and mesh.shape[a] > 1]
  if mesh.shape["pipeline"] > 1 and held:
    raise ConfigError("config.expert_parallel", f"{held[0]!r}: the pipeline holds "
                      f"{' and '.join(experts.PIPELINE_HELD_AXES)} itself, each stage's layers "
                      "whole over them; inside a pipeline split the experts over fsdp (or \"\")")
  if cfg.local_sgd.inner_steps and ("data" in axes or moe.bias_update_rate):
    raise ConfigError("config.local_sgd.inner_steps", "local SGD trains each `data` replica "
                      "alone: its experts cannot be split over `data` and its biases would "
                      "drift apart; take `data` out of config.expert_parallel and set "
                      "config.model.moe.bias_update_rate=0")


def check_machine(cfg, mesh: Mesh) -> None:
  """What this machine's devices must run (`check` leaves it out, so that
  `meshtrain plan` plans any config anywhere): the experts' GPU-only paths."""
  run, device = cfg.experts, mesh.devices.flat[0]
  if not cfg.model.moe.num_experts:
    return
  why = run.grouped_gemm == "hopper" and hopper_gemm.unsupported(
      device, cfg.compute_dtype, parallelize.expert_widths(cfg))
  if why:
    raise ConfigError("config.experts.grouped_gemm", f"hopper: {why}; use auto or tiled")
  split = math.prod(mesh.shape[a] for a in parallelize.expert_axes(cfg))
  why = run.dispatch == "ragged" and split > 1 and experts.ragged_unsupported(device)
  if why:
    raise ConfigError("config.experts.dispatch", f"ragged: {why}; use padded")


def _check_pipeline(cfg, mesh: Mesh, replicas: int) -> None:
  p, m, v = mesh.shape["pipeline"], cfg.pipeline.microbatches, cfg.pipeline.virtual_stages
  _check_choice("config.pipeline.schedule", cfg.pipeline.schedule, schedules.SCHEDULE_NAMES)
  moe = cfg.model.moe
  dense = moe.first_dense_layers if moe.num_experts else 0  # these run on stage 0, before the rest
  stacked = cfg.model.num_layers - dense
  if not cfg.pipeline.stage_layers.strip() and stacked % (p * v):
    uneven = StageLayout.balanced(stacked, p, v).counts
    raise ConfigError("config.model.num_layers",
                      f"{stacked} layers" + (f" (after the {dense} leading dense ones)" if dense
                                             else "")
                      + f" do not split evenly into config.mesh.pipeline={p} stages x "
                      f"config.pipeline.virtual_stages={v} chunks"
                      + (f"; split them unevenly with config.pipeline.stage_layers, e.g. "
                         f"\"{','.join(map(str, uneven))}\"" if min(uneven) else ""))
  try:
    parallelize.stage_layout(cfg)
  except ValueError as error:
    raise ConfigError("config.pipeline.stage_layers", str(error)) from None
  rows = cfg.global_batch // replicas
  if rows % (m * cfg.grad_accum_steps):
    raise ConfigError("config.pipeline.microbatches",
                      f"{m} microbatches x config.grad_accum_steps={cfg.grad_accum_steps} must "
                      f"divide the {rows} sequences each of the data x fsdp = {replicas} "
                      f"replicas gets")
  if mesh.shape["sequence"] > 1 and cfg.attention.sequence_strategy == "ring":
    # A collective-permute involves every device its pairs name, every stage,
    # but in a tick only the busy stages run the ring's (docs/pipeline.md).
    raise ConfigError("config.attention.sequence_strategy",
                      "ring attention cannot run inside the pipeline (its sends would need every "
                      "stage at once); use all_gather_kv (Llama 3's context parallelism) or "
                      "ulysses, or set config.mesh.sequence=1")
  if cfg.offload.params:
    raise ConfigError("config.offload.params", "the pipeline stages the layers' weights itself; "
                      "set it to False (config.offload.optimizer composes)")
  if cfg.remat == "offload":
    raise ConfigError("config.remat", "the pipeline keeps each microbatch's residuals in its own "
                      "device buffers, not on the host; use selective or full")
  if cfg.pipeline.schedule in schedules.V_SCHEDULES:
    raise ConfigError("config.pipeline.schedule",
                      f"{cfg.pipeline.schedule}'s tables are built (`meshtrain schedule "
                      f"--schedule {cfg.pipeline.schedule} --virtual 2` draws them) but "
                      "the pipeline does not run the V placement yet; use zb_h1 or 1f1b")
  if v > 1 and cfg.pipeline.schedule != "interleaved_1f1b":
    raise ConfigError("config.pipeline.virtual_stages",
                      f"{cfg.pipeline.schedule} runs one chunk per stage, got {v}: set it to 1 "
                      f"or config.pipeline.schedule=interleaved_1f1b")
  if cfg.pipeline.schedule == "interleaved_1f1b" and v > 1 and m % p:
    raise ConfigError("config.pipeline.microbatches",
                      f"interleaved_1f1b needs config.pipeline.microbatches to be a multiple of "
                      f"config.mesh.pipeline={p} (a group of {p} fills the ring), got {m}: use "
                      f"{p * max(1, round(m / p))} or config.pipeline.virtual_stages=1")
  try:
    schedules.check(cfg.pipeline.schedule, p, m, v)
  except ValueError as error:
    raise ConfigError("config.pipeline.microbatches", str(error)) from None
