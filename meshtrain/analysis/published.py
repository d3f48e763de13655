"""Published training runs the planner is checked against (docs/planner.md,
tests/test_search.py): each model's dimensions as a Llama-shaped config, the
cluster, the published mesh and the published throughput."""

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
  note: str = ""
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
MEGATRON = "Narayanan et al. 2021, Efficient Large-Scale Language Model Training, Table 1"
TORCHTITAN = "pytorch/torchtitan docs/performance.md"

PIPELINE_BUBBLE = (
    "with meshtrain's costs the 16-stage pipeline's bubble and its exposed sends (15% to "
    "25% of the step) cost more than FSDP's gathers, which hide under compute, and in "
    "meshtrain's memory model the mesh fits only with recomputation, so meshes with FSDP "
    "and at most two stages rank first")

NO_ZERO = (
    "Megatron-LM (2021) had no ZeRO or FSDP, so it split large models with tensor "
    "parallelism; meshtrain's ZeRO-1 and FSDP meshes move as many bytes, hidden "
    "under compute, where tensor parallelism's are exposed, so it ranks them first")

RUNS = (
    Run("Llama 3 405B, 8,192 GPUs", LLAMA3, "h100", 8192, _llama3(), 8192, 2048,
        dict(data=64, pipeline=16, tensor=8), 430, False, note=PIPELINE_BUBBLE),
    Run("Llama 3 405B, 16,384 GPUs", LLAMA3, "h100", 16384, _llama3(), 8192, 2048,
        dict(data=128, pipeline=16, tensor=8), 400, False, note=PIPELINE_BUBBLE),
    Run("Llama 3 405B, 16,384 GPUs, 131K context", LLAMA3, "h100", 16384, _llama3(), 131_072,
        128, dict(data=8, pipeline=16, sequence=16, tensor=8), 380, False, note=PIPELINE_BUBBLE),
    Run("Megatron-LM GPT 1.7B", MEGATRON, "a100_80gb", 32, _gpt(24, 2304, 24), 2048, 512,
        dict(data=32), 137, True, remat="full"),
    Run("Megatron-LM GPT 18.4B", MEGATRON, "a100_80gb", 256, _gpt(48, 6144, 40), 2048, 1024,
        dict(data=32, tensor=8), 135, True, remat="full", note=NO_ZERO),
    Run("Megatron-LM GPT 145.6B", MEGATRON, "a100_80gb", 1536, _gpt(96, 12288, 80), 2048, 2304,
        dict(data=24, pipeline=8, tensor=8), 148, True, remat="full", note=NO_ZERO),
    Run("Megatron-LM GPT 1T", MEGATRON, "a100_80gb", 3072, _gpt(160, 25600, 128), 2048, 3072,
        dict(data=6, pipeline=64, tensor=8), 163, True, remat="full", note=NO_ZERO),
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
