"""The default configuration: every key meshtrain reads, with its default.

`meshtrain train` with no `--config` runs this: the tiny model on the built-in
synthetic task. Presets in `configs/` start from `get_config()` and change a few
keys. One comment per field says what it does.
"""

import copy
import functools
import importlib.util
import pathlib
import re

import ml_collections

DEFAULT_WORKDIR = "runs/default"


def get_config() -> ml_collections.ConfigDict:
  """Every key meshtrain reads, at its default, section by section."""
  c = ml_collections.ConfigDict()
  for add in (_run_keys, _device_keys, _model_keys, _execution_keys, _optimization_keys,
              _io_keys):
    add(c)
  return c


def _run_keys(c: ml_collections.ConfigDict) -> None:
  """The run's size, precision and step loop."""
  c.seed = 0                    # parameter init and data order
  c.workdir = DEFAULT_WORKDIR   # checkpoints, metrics.jsonl, TensorBoard events, config.json (a configs/ file's default: runs/<file>[_<arg>])
  c.steps = 200                 # optimizer steps to run
  c.global_batch = 16           # sequences per optimizer step, over all devices
  c.seq_len = 128               # tokens per sequence
  c.grad_accum_steps = 1        # microbatches per step; divides global_batch / (data * fsdp)
  c.param_dtype = "float32"     # working copy of the weights in forward/backward (master stays float32)
  c.compute_dtype = "float32"   # activations and matmul inputs: float32, bfloat16 or float16
  c.float8 = "none"             # the projections' GEMMs in float8: none | tensorwise | rowwise | blockwise (docs/float8.md)
  c.grad_dtype = "float32"      # gradients and their accumulator: float32 or bfloat16 (2 bytes/param, as ZeRO counts)
  c.remat = "none"              # activation recomputation per layer: none | full | selective | offload
  c.tensor_sequence_parallel = False  # Megatron-SP: norms and residuals split the length over `tensor`
  c.zero_stage = 0              # over `data`: 0 DDP, 1 shard optimizer state, 2 + gradients, 3 + weights
  c.expert_parallel = "fsdp"    # MoE: mesh axes that split the experts, e.g. "data,fsdp" (docs/moe.md)
  c.simulate_devices = 0        # >0: run on this many simulated CPU devices
  c.peak_flops = 0.0            # peak FLOP/s of one device for MFU (0: unknown, mfu is null)
  c.log_every = 10              # steps between metric fetches (the only host syncs in the loop)
  c.nan_policy = "stop"         # non-finite loss/grads: stop (save last good state, exit 3) | skip (drop, count)


def _device_keys(c: ml_collections.ConfigDict) -> None:
  """How the devices are laid out and the processes join."""
  c.mesh = ml_collections.ConfigDict()
  c.mesh.data = -1              # replicas (batch); -1 fills the remaining devices
  c.mesh.fsdp = 1               # shards batch and parameters, gradients, optimizer state
  c.mesh.tensor = 1             # shards heads, mlp and vocab (Megatron)
  c.mesh.pipeline = 1           # shards layers into stages
  c.mesh.sequence = 1           # shards the sequence (context parallel)
  c.mesh.across_hosts = "data"  # with several processes: axes spanning hosts, outer first (data,pipeline)

  c.distributed = ml_collections.ConfigDict()
  c.distributed.num_processes = 1         # processes (hosts) in the job; 0: detect (Slurm, Open MPI, TPU)
  c.distributed.process_id = -1           # this process's id when num_processes > 1
  c.distributed.coordinator_address = ""  # host:port of process 0 when num_processes > 1
  c.distributed.timeout_s = 120           # joining, and noticing a lost peer (its heartbeats stop): exit 4
  c.distributed.step_timeout_s = 300      # several processes: a step, save or evaluation running longer is a hang: exit 4, stacks in the workdir (0: off)
  c.distributed.compile_timeout_s = 1800  # the same for what compiles: setting up, the first step, the first evaluation
  c.distributed.save_timeout_s = 3600     # the same for a save that waits for the disk: the last one, a preemption's (0: no limit)


def _model_keys(c: ml_collections.ConfigDict) -> None:
  """What the model is: what a checkpoint holds and a resume compares."""
  c.model = ml_collections.ConfigDict()
  c.model.vocab_size = 256      # byte-level tokenizer
  c.model.embed_dim = 128
  c.model.num_layers = 4
  c.model.num_heads = 4
  c.model.num_kv_heads = 2      # grouped-query attention: divides num_heads
  c.model.head_dim = 32
  c.model.mlp_dim = 384         # SwiGLU hidden size
  c.model.rope_theta = 10_000.0
  c.model.norm_eps = 1e-5
  c.model.tie_embeddings = False  # share the input embedding with the output head
  c.model.qkv_bias = False      # biases on the q, k and v projections (Qwen2)
  c.model.qk_norm = False       # RMSNorm of each query and key head before RoPE (Qwen3)
  c.model.sliding_window = 0    # attend to the last N tokens only (Mistral); 0: the whole causal prefix
  c.model.rope_scaling_factor = 1.0  # RoPE context scaling (rope_scaling_type); 1: none
  c.model.rope_low_freq_factor = 1.0  # llama3: wavelengths > original/low are divided by factor
  c.model.rope_high_freq_factor = 4.0  # llama3: wavelengths < original/high are kept
  c.model.rope_original_max_positions = 8192  # llama3, yarn: the context length before scaling
  c.model.rope_scaling_type = "llama3"  # when rope_scaling_factor != 1: llama3 | yarn (HF rope_type)
  c.model.rope_beta_fast = 32.0       # yarn: frequencies turning more than this often in the original context are kept
  c.model.rope_beta_slow = 1.0        # yarn: those turning less often than this are divided by the factor
  c.model.rope_attention_factor = 0.0  # yarn: multiplies cos and sin (0: from the factor and the mscales)
  c.model.rope_mscale = 0.0           # yarn: DeepSeek's mscale (0: unset)
  c.model.rope_mscale_all_dim = 0.0   # yarn: DeepSeek's mscale_all_dim (0: unset)
  c.model.rope_truncate = True        # yarn: round the band of interpolated frequencies to whole dimensions
  c.model.mtp_layers = 0        # multi-token prediction modules after the model (DeepSeek-V3: 1; docs/moe.md)
  c.model.mtp_loss_coef = 0.1   # their mean loss's weight in the training loss (DeepSeek-V3: 0.3, later 0.1)
  c.model.mla = ml_collections.ConfigDict()  # Multi-head Latent Attention (DeepSeek-V2/V3; models/mla.py)
  c.model.mla.kv_lora_rank = 0        # the key-value latent's width (DeepSeek-V3: 512; 0: grouped-query attention)
  c.model.mla.q_lora_rank = 0         # the query latent's width (1536; 0: queries projected from x)
  c.model.mla.rope_head_dim = 64      # rotated dims of a query head and of the key part the heads share (model.head_dim: the rest, 128)
  c.model.mla.v_head_dim = 128        # a value head's width
  c.model.mla.rope_interleave = True  # RoPE on interleaved pairs, as DeepSeek's checkpoints lay them out
  c.model.moe = ml_collections.ConfigDict()  # Mixture-of-Experts MLP (docs/moe.md)
  c.model.moe.num_experts = 0         # routed experts per MoE layer (0: the dense SwiGLU MLP)
  c.model.moe.experts_per_token = 2   # k: experts each token goes to
  c.model.moe.mlp_dim = 0             # each expert's SwiGLU hidden size (0: model.mlp_dim)
  c.model.moe.shared_mlp_dim = 0      # a dense SwiGLU beside the routed experts (0: none; DeepSeek, Qwen2-MoE)
  c.model.moe.shared_gate = False     # scale the shared expert's output by sigmoid(x . w) (Qwen2-MoE)
  c.model.moe.first_dense_layers = 0  # leading layers that keep the dense MLP (DeepSeek-V3: 3)
  c.model.moe.router = "softmax"      # expert scores: softmax (Mixtral, Qwen) | sigmoid (DeepSeek-V3)
  c.model.moe.expert_groups = 1       # experts in this many equal groups (DeepSeek-V3's n_group: 8)
  c.model.moe.groups_per_token = 0    # a token's experts from its best groups only (topk_group: 4; 0: all)
  c.model.moe.group_scored_by = 2     # a group's score: the sum of its this many best experts' (DeepSeek-V3: 2; V2: 1)
  c.model.moe.normalize_top_k = True  # renormalise the k chosen scores to sum to 1 (Mixtral; Qwen3's norm_topk_prob)
  c.model.moe.route_scale = 1.0       # multiplies the k weights (DeepSeek-V3: 2.5)
  c.model.moe.aux_loss_coef = 0.01    # switch load-balancing loss, 1.0 x coef when balanced (0: off)
  c.model.moe.bias_update_rate = 0.0  # DeepSeek-V3's auxiliary-loss-free balancing step (0: off; 1e-3)
  c.model.moe.capacity_factor = 0.0   # 0: dropless; c > 0: an expert takes ceil(c x L x k / E) tokens per sequence


def _execution_keys(c: ml_collections.ConfigDict) -> None:
  """How the model runs on the devices (a resume may change it)."""
  c.experts = ml_collections.ConfigDict()  # how the MoE layers run (not saved as the model: a resume may change it)
  c.experts.grouped_gemm = "auto"  # a device's GEMMs: auto | tiled | ragged_dot | hopper (docs/moe.md)
  c.experts.dispatch = "padded"    # the all-to-alls: padded (whole buckets) | ragged (the rows alone; GPU/TPU)

  c.attention = ml_collections.ConfigDict()
  c.attention.sequence_strategy = "all_gather_kv"  # when mesh.sequence > 1: all_gather_kv | ulysses | ring
  c.attention.implementation = ""  # "" (cudnn on NVIDIA GPUs in bf16, else xla) | xla | cudnn (flash)

  c.pipeline = ml_collections.ConfigDict()
  c.pipeline.schedule = "1f1b"      # when mesh.pipeline > 1: gpipe | 1f1b | interleaved_1f1b | zb_h1 | zb_h2 (zb_v: tables only)
  c.pipeline.microbatches = 4       # per step; divides global_batch / (data * fsdp)
  c.pipeline.virtual_stages = 1     # model chunks per stage (interleaved_1f1b)
  c.pipeline.stage_layers = ""      # uneven stages: layers per chunk in model order, e.g. "7,8,8,7" ("": even)


def _optimization_keys(c: ml_collections.ConfigDict) -> None:
  """The optimizer, its outer loop and where its state lives."""
  c.optimizer = ml_collections.ConfigDict()
  c.optimizer.name = "adamw"        # adamw | sgd | lion | adafactor (optax)
  c.optimizer.learning_rate = 3e-3  # peak, after linear warmup; cosine decay to the end
  c.optimizer.warmup_steps = 20
  c.optimizer.min_lr_ratio = 0.1    # final learning rate as a share of the peak
  c.optimizer.b1 = 0.9
  c.optimizer.b2 = 0.95
  c.optimizer.eps = 1e-8
  c.optimizer.momentum = 0.0        # sgd: heavy-ball momentum (0: plain SGD)
  c.optimizer.weight_decay = 0.1    # decoupled (sgd: added to the gradient); not on norm scales and biases
  c.optimizer.clip_norm = 1.0       # global gradient norm clipping (0: off)

  c.local_sgd = ml_collections.ConfigDict()  # DiLoCo over `data`: replicas sync every inner_steps
  c.local_sgd.inner_steps = 0             # steps between syncs of the `data` replicas (0: off, plain DP)
  c.local_sgd.outer_optimizer = "nesterov"  # applies the mean parameter delta: sgd | momentum | nesterov
  c.local_sgd.outer_learning_rate = 0.7   # DiLoCo's 0.7; sgd at 1.0 with no momentum averages the replicas
  c.local_sgd.outer_momentum = 0.9        # DiLoCo's 0.9, of momentum and nesterov (0: none)

  c.loss_scale = ml_collections.ConfigDict()  # dynamic loss scaling, on when either dtype is float16
  c.loss_scale.initial = 32768.0  # starting scale (2**15)
  c.loss_scale.period = 2000      # finite steps in a row before the scale doubles; an overflow halves it

  c.offload = ml_collections.ConfigDict()
  c.offload.optimizer = False     # float32 master weights and optimizer state in pinned host memory between steps
  c.offload.params = False        # the layers' weights in pinned host memory; each layer's come to the device while it runs


def _io_keys(c: ml_collections.ConfigDict) -> None:
  """Checkpoints, data, initial weights and evaluation."""
  c.checkpoint = ml_collections.ConfigDict()
  c.checkpoint.every_steps = 100   # steps between async saves into workdir/checkpoints (0: only the last step)
  c.checkpoint.keep = 3            # newest checkpoints kept (0: all)
  c.checkpoint.restore_from = ""   # start a new workdir from another run's checkpoints dir, or one step dir in it
  c.checkpoint.allow_changes = False  # resume a workdir whose seed, batch, seq_len, data or model changed

  c.data = ml_collections.ConfigDict()
  c.data.source = "synthetic"   # synthetic | text | tokens (a `meshtrain prepare` directory)
  c.data.path = ""              # UTF-8 text file for source=text, prepared directory for source=tokens
  c.data.packing = "auto"       # auto: segments for a corpus with a loss mask (chat), else concat | concat: attend across documents | segments: only inside one
  c.init_from = ""              # "" random init, or "hf:DIR" a Hugging Face Llama's weights (meshtrain/hf)
  c.tokenizer = ""              # text <-> ids for samples and exports: "" the data's (text: bytes), or a spec (data/tokenizer.py)

  c.eval = ml_collections.ConfigDict()
  c.eval.every_steps = 0        # steps between evaluations on the validation split, and at the last step (0: none)
  c.eval.batches = 4            # global batches per evaluation, the same ones every time


# Keys that have moved: how the model runs left `model`, which holds what a
# checkpoint's model is (a resume compares it).
MOVED = {"model.moe.grouped_gemm": "experts.grouped_gemm",
         "model.moe.dispatch": "experts.dispatch"}


def from_saved(saved: dict) -> ml_collections.ConfigDict:
  """The config a run saved (`saved`, its config.json: keys it predates at
  their defaults, keys it holds where `MOVED` puts them now)."""
  cfg = get_config()
  cfg.update(_moved(saved))
  return cfg


def _moved(saved: dict) -> dict:
  saved = copy.deepcopy(saved)
  for old, new in MOVED.items():
    *path, name = old.split(".")
    section = functools.reduce(lambda d, k: d.get(k) if isinstance(d, dict) else None, path, saved)
    if isinstance(section, dict) and name in section:
      *path, new_name = new.split(".")
      functools.reduce(lambda d, k: d.setdefault(k, {}), path, saved)[new_name] = section.pop(name)
  return saved


def load(path, *args) -> ml_collections.ConfigDict:
  """Calls `get_config(*args)` of a config file (`configs/tp.py:tiny` is
  `load("configs/tp.py", "tiny")`): strategy presets start from a model preset."""
  spec = importlib.util.spec_from_file_location(pathlib.Path(path).stem, path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(*args)


def preset_workdir(config_arg: str) -> str:
  """The workdir of a run of the config file `config_arg` (`configs/tp.py:tiny`)
  that sets none: `runs/tp_tiny`, so that presets never share one."""
  path, _, arg = config_arg.partition(":")
  name = "_".join(filter(None, (pathlib.Path(path).stem, re.sub(r"\W+", "_", arg).strip("_"))))
  return f"runs/{name}"
