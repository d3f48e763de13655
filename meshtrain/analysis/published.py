"""Published training runs: each model's dimensions as a Llama-shaped config,
the cluster, the published mesh and the published throughput.

Two sets that never meet: `CALIBRATION` fits the planner's one free number,
the kernel efficiency (bench/calibrate_planner.py writes it with its rows
into calibration.json), and `RUNS` validates the planner (docs/planner.md,
tests/test_search.py) and is never used to fit."""

import dataclasses

from meshtrain import config as config_lib


@dataclasses.dataclass(frozen=True)
class Run:
  name: str
  source: str
  cluster: str
  devices: int
  model: dict                # config.model fields
  seq_len: int
  global_batch: int          # sequences per step
  mesh: dict                 # the published degrees, as meshtrain axes
  tflops: float              # published TFLOP/s per device (0: from tokens_per_s)
  counts_recompute: bool     # the published FLOPs include recomputation (Megatron-LM's)
  remat: str = "none"
  tokens_per_s: float = 0.0  # published tokens/s per device, where that is the figure

  def config(self):
    c = config_lib.get_config()
    c.model.update(self.model)
    c.update(seq_len=self.seq_len, global_batch=self.global_batch, compute_dtype="bfloat16",
             param_dtype="bfloat16", remat=self.remat)
    return c


def _llama3():
  # Dubey et al. 2024, Table 3: 405B has 126 layers, 16,384 width, 53,248 FFN,
  # 128 heads, 8 kv heads, 128,256 vocabulary. meshtrain splits layers evenly
  # over stages: 128 layers (Llama 3 drops one layer from the first and the
  # last stage to balance embedding and head, the same work per stage).
  return dict(vocab_size=128_256, embed_dim=16_384, num_layers=128, num_heads=128,
              num_kv_heads=8, head_dim=128, mlp_dim=53_248, rope_theta=500_000.0)


def _gpt(heads, hidden, layers):
  # Narayanan et al. 2021, Table 1: GPT with 51,200 vocabulary and 2,048
  # sequences; Llama-shaped here: SwiGLU with 8h/3 (the same weights as a 4h
  # GeLU MLP), as many kv heads as heads.
  mlp = round(hidden * 8 / 3 / 128) * 128
  return dict(vocab_size=51_200, embed_dim=hidden, num_layers=layers, num_heads=heads,
              num_kv_heads=heads, head_dim=hidden // heads, mlp_dim=mlp)


def _llama3_8b():
  return dict(vocab_size=128_256, embed_dim=4096, num_layers=32, num_heads=32, num_kv_heads=8,
              head_dim=128, mlp_dim=14_336, rope_theta=500_000.0)


LLAMA3 = "Dubey et al. 2024, The Llama 3 Herd of Models, Table 4"
MEGATRON_SP = "Korthikanti et al. 2022, Reducing Activation Recomputation, Tables 3 and 5"
MEGATRON = "Narayanan et al. 2021, Efficient Large-Scale Language Model Training, Table 1"
TORCHTITAN = "pytorch/torchtitan docs/performance.md"

RUNS = (
    Run("Llama 3 405B, 8,192 GPUs", LLAMA3, "h100", 8192, _llama3(), 8192, 2048,
        dict(data=64, pipeline=16, tensor=8), 430, False),
    Run("Llama 3 405B, 16,384 GPUs", LLAMA3, "h100", 16384, _llama3(), 8192, 2048,
        dict(data=128, pipeline=16, tensor=8), 400, False),
    Run("Llama 3 405B, 16,384 GPUs, 131K context", LLAMA3, "h100", 16384, _llama3(), 131_072,
        128, dict(data=8, pipeline=16, sequence=16, tensor=8), 380, False),
    Run("Megatron-LM GPT 1.7B", MEGATRON, "a100_80gb", 32, _gpt(24, 2304, 24), 2048, 512,
        dict(data=32), 137, True, remat="full"),
    Run("Megatron-LM GPT 18.4B", MEGATRON, "a100_80gb", 256, _gpt(48, 6144, 40), 2048, 1024,
        dict(data=32, tensor=8), 135, True, remat="full"),
    Run("Megatron-LM GPT 145.6B", MEGATRON, "a100_80gb", 1536, _gpt(96, 12288, 80), 2048, 2304,
        dict(data=24, pipeline=8, tensor=8), 148, True, remat="full"),
    Run("Megatron-LM GPT 1T", MEGATRON, "a100_80gb", 3072, _gpt(160, 25600, 128), 2048, 3072,
        dict(data=6, pipeline=64, tensor=8), 163, True, remat="full"),
    # Korthikanti et al. 2022 (sequence parallelism and selective recomputation),
    # Tables 3 and 5: the same GPT family on DGX A100s, tensor parallelism of
    # 8 with sequence parallelism, batch = GPUs, 2,048 tokens; model FLOPs
    # utilization 41.5%, 51.4%, 56.0%, 56.3% of 312 TFLOP/s.
    Run("Megatron-LM 2022 GPT 22B", MEGATRON_SP, "a100_80gb", 8, _gpt(64, 6144, 48), 2048, 4,
        dict(tensor=8), 0.415 * 312, False, remat="selective"),
    Run("Megatron-LM 2022 GPT 175B", MEGATRON_SP, "a100_80gb", 64, _gpt(96, 12288, 96), 2048, 64,
        dict(pipeline=8, tensor=8), 0.514 * 312, False, remat="selective"),
    Run("Megatron-LM 2022 GPT 530B", MEGATRON_SP, "a100_80gb", 280, _gpt(128, 20480, 105), 2048,
        280, dict(pipeline=35, tensor=8), 0.560 * 312, False, remat="selective"),
    Run("Megatron-LM 2022 GPT 1T", MEGATRON_SP, "a100_80gb", 512, _gpt(160, 25600, 128), 2048,
        512, dict(pipeline=64, tensor=8), 0.563 * 312, False, remat="selective"),
    # MaxText's GPU results (2024; DESIGN.md's reference numbers): Llama2-7B on
    # one host of 8 H100s, FSDP over the host, 492 TFLOP/s per GPU by model
    # FLOPs. Sequence length and batch are MaxText's Llama2 defaults as we
    # read them (4,096 tokens, 4 sequences per device); the prediction hardly
    # depends on them.
    Run("MaxText Llama2-7B", "google/maxtext (GPU results, 2024)", "h100", 8,
        dict(vocab_size=32_000, embed_dim=4096, num_layers=32, num_heads=32, num_kv_heads=32,
             head_dim=128, mlp_dim=11_008), 4096, 32, dict(fsdp=8), 492, False),
    # torchtitan's docs/performance.md, Table 1: Llama 3.1 8B, FSDP on 8 H100s
    # (Grand Teton, 500 W power limit), bf16, selective activation
    # checkpointing, local batch 2 x 8,192. The "FSDP + torch.compile" row
    # (6,667 tokens/s per GPU), because meshtrain's step is compiled too; the
    # eager row is 5,762. In TFLOP/s by the PaLM FLOPs per token.
    Run("torchtitan Llama 3.1 8B, compiled", TORCHTITAN, "h100", 8, _llama3_8b(), 8192, 16,
        dict(fsdp=8), 0, False, remat="selective", tokens_per_s=6667),
    # The same file's earlier table (2024): Llama 3 8B, FSDP on 64 A100s
    # (80 GB), local batch 1 x 8,192, selective (op) activation checkpointing:
    # 2,973 tokens/s per GPU, 58.2% MFU.
    Run("torchtitan Llama 3 8B, 64 A100", TORCHTITAN, "a100_80gb", 64, _llama3_8b(), 8192, 64,
        dict(fsdp=64), 0, False, remat="selective", tokens_per_s=2973),
)

# The rest of Narayanan et al.'s Table 1 (the rows RUNS does not hold): GPT
# models on DGX A100s (Selene) with full recomputation, sequences of 2,048,
# TFLOP/s per GPU counting the recomputation.
CALIBRATION = (
    Run("Megatron-LM GPT 3.6B", MEGATRON, "a100_80gb", 64, _gpt(32, 3072, 30), 2048, 512,
        dict(data=32, tensor=2), 138, True, remat="full"),
    Run("Megatron-LM GPT 7.5B", MEGATRON, "a100_80gb", 128, _gpt(32, 4096, 36), 2048, 512,
        dict(data=32, tensor=4), 142, True, remat="full"),
    Run("Megatron-LM GPT 39.1B", MEGATRON, "a100_80gb", 512, _gpt(64, 8192, 48), 2048, 1536,
        dict(data=32, pipeline=2, tensor=8), 138, True, remat="full"),
    Run("Megatron-LM GPT 76.1B", MEGATRON, "a100_80gb", 1024, _gpt(80, 10240, 60), 2048, 1792,
        dict(data=32, pipeline=4, tensor=8), 140, True, remat="full"),
    Run("Megatron-LM GPT 310.1B", MEGATRON, "a100_80gb", 1920, _gpt(128, 16384, 96), 2048, 2160,
        dict(data=15, pipeline=16, tensor=8), 155, True, remat="full"),
    Run("Megatron-LM GPT 529.6B", MEGATRON, "a100_80gb", 2520, _gpt(128, 20480, 105), 2048, 2520,
        dict(data=9, pipeline=35, tensor=8), 163, True, remat="full"),
)
