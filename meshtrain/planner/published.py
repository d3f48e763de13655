"""Published training runs: each model's dimensions as a Llama-shaped config,
the cluster (a preset, or one of `CLUSTERS`), the published mesh and stage
layout, and the published throughput.

Two sets that never meet: `CALIBRATION` fits the planner's free numbers, the
kernel efficiency and the elementwise passes (bench/calibrate_planner.py
writes them with its rows into calibration.py), and `RUNS` validates the
planner (docs/planner.md, tests/test_search.py) and is never used to fit."""

import dataclasses

from meshtrain import config as config_lib
from meshtrain.parallel.pipeline.stages import balanced_counts
from meshtrain.planner import clusters


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
  # The published layers per pipeline chunk, for each number of chunks a
  # stage the run may have had (none: the planner's own layouts).
  stage_layers: tuple[str, ...] = ()
  # Megatron's sequence parallelism with the tensor split (Korthikanti et al.
  # 2022): not in Megatron-LM's 2021 runs, nor in BLOOM's and OPT's
  # Megatron-based stacks of the time.
  tensor_sequence_parallel: bool = True
  # The pipeline schedules the run's software had, priced as it runs them
  # (`search.as_published`: 1F1B and interleaved 1F1B with the backward in
  # one op), and its microbatches a step (0: not published; the fastest count).
  schedules: tuple[str, ...] = ("1f1b", "interleaved_1f1b")
  microbatches: int = 0
  # Its context-parallel strategy under `sequence` (None: the fastest meshtrain
  # runs), priced with a flash kernel on the local queries, as published
  # software runs it (`search.Candidate.flash_context`).
  sequence_strategy: str | None = None

  def config(self):
    c = config_lib.get_config()
    c.model.update(self.model)
    c.update(seq_len=self.seq_len, global_batch=self.global_batch, compute_dtype="bfloat16",
             param_dtype="bfloat16", remat=self.remat)
    return c


def _llama3():
  # Dubey et al. 2024, Table 3: 405B has 126 layers, 16,384 width, 53,248 FFN,
  # 128 heads, 8 kv heads, 128,256 vocabulary.
  return dict(vocab_size=128_256, embed_dim=16_384, num_layers=126, num_heads=128,
              num_kv_heads=8, head_dim=128, mlp_dim=53_248, rope_theta=500_000.0)


def fewer_at_the_ends(layers: int, chunks: int) -> str:
  """`config.pipeline.stage_layers` with one layer fewer on the first and the
  last chunk than on the others (Megatron-Core's
  account_for_embedding_in_pipeline_split: the embedding and the head each
  take a layer's place): `balanced_counts` with a layer's worth more on each
  end. ValueError where the layers and the two ends do not make equal
  chunks of 2 or more."""
  per_chunk, rest = divmod(layers + 2, chunks)
  if rest or per_chunk < 2:
    raise ValueError(f"{layers} layers and 2 ends do not make {chunks} chunks of 2 or more")
  return ",".join(map(str, balanced_counts(layers, chunks, first=1, last=1)))


# Dubey et al. 2024, Section 3.3.2: one layer fewer on the first and the last
# of the 16 stages, with an interleaved schedule of V chunks a stage (V not
# published; meshtrain runs at least a layer a chunk, so V of 1, 2 or 4).
LLAMA3_STAGES = tuple(fewer_at_the_ends(126, 16 * v) for v in (1, 2, 4))


def _gpt(heads, hidden, layers, vocab=51_200):
  # Narayanan et al. 2021, Table 1: GPT with 51,200 vocabulary and 2,048
  # sequences; Llama-shaped here: SwiGLU with 8h/3 (the same weights as a 4h
  # GeLU MLP), as many kv heads as heads.
  mlp = round(hidden * 8 / 3 / 128) * 128
  return dict(vocab_size=vocab, embed_dim=hidden, num_layers=layers, num_heads=heads,
              num_kv_heads=heads, head_dim=hidden // heads, mlp_dim=mlp)


def _llama3_8b():
  return dict(vocab_size=128_256, embed_dim=4096, num_layers=32, num_heads=32, num_kv_heads=8,
              head_dim=128, mlp_dim=14_336, rope_theta=500_000.0)


LLAMA3 = "Dubey et al. 2024, The Llama 3 Herd of Models, Table 4"
MEGATRON_SP = "Korthikanti et al. 2022, Reducing Activation Recomputation, Tables 3 and 5"
MEGATRON = "Narayanan et al. 2021, Efficient Large-Scale Language Model Training, Table 1"
TORCHTITAN = "pytorch/torchtitan docs/performance.md"
BLOOM = ("Le Scao et al. 2022, BLOOM; bigscience-workshop/bigscience "
         "train/tr11-176B-ml/README.md and tr11-176B-ml.slurm")
OPT = "Zhang et al. 2022, OPT, Section 2.4 and Table 1; facebookresearch/metaseq"
MT_NLG = ("Smith et al. 2022, Using DeepSpeed and Megatron to Train Megatron-Turing NLG 530B, "
          "Section 3 (system throughput)")

# MT-NLG 530B on Megatron-DeepSpeed (Smith et al. 2022, Section 3): Megatron-LM
# 2021's 529.6B shape (105 layers, width 20,480, 128 heads; a calibration row)
# with its layout, tensor 8 x pipeline 35 (3 layers a stage) a replica, 1,920
# sequences of 2,048 a step (its batch after the ramp), every layer
# recomputed, TFLOP/s per GPU counted with the recomputation, on 280, 350 and
# 420 DGX A100 nodes (8, 10 and 12 replicas).
MT_NLG_TFLOPS = {280: 126, 350: 121, 420: 113}
# DeepSpeed's pipeline engine runs 1F1B only (its TrainSchedule). The paper
# does not state the microbatch; its three step times (60.1, 50.2 and 44.4 s)
# lie on a line in the sequences a replica whose intercept is the 1F1B
# bubble of 34 microbatches of 2 sequences, not of 1 (docs/planner.md;
# tests/test_search.py checks it): microbatches of 2, as BLOOM ran on the
# same software.
MT_NLG_SEQUENCES_A_MICROBATCH = 2


def _mt_nlg(nodes: int, tflops: float) -> "Run":
  data = nodes // 35
  return Run(f"MT-NLG 530B, {nodes} nodes", MT_NLG, "a100_80gb", nodes * 8,
             _gpt(128, 20480, 105), 2048, 1920, dict(data=data, pipeline=35, tensor=8), tflops,
             True, remat="full", tensor_sequence_parallel=False, schedules=("1f1b",),
             microbatches=1920 // data // MT_NLG_SEQUENCES_A_MICROBATCH)


RUNS = (
    Run("Llama 3 405B, 8,192 GPUs", LLAMA3, "h100", 8192, _llama3(), 8192, 2048,
        dict(data=64, pipeline=16, tensor=8), 430, False, stage_layers=LLAMA3_STAGES),
    Run("Llama 3 405B, 16,384 GPUs", LLAMA3, "h100", 16384, _llama3(), 8192, 2048,
        dict(data=128, pipeline=16, tensor=8), 400, False, stage_layers=LLAMA3_STAGES),
    # Dubey et al. 2024, Section 3.3.2: context parallelism by all-gathering
    # the keys and values, each rank's queries in two chunks for the causal
    # mask's balance.
    Run("Llama 3 405B, 16,384 GPUs, 131K context", LLAMA3, "h100", 16384, _llama3(), 131_072,
        128, dict(data=8, pipeline=16, sequence=16, tensor=8), 380, False,
        stage_layers=LLAMA3_STAGES, sequence_strategy="all_gather_kv"),
    Run("Megatron-LM GPT 1.7B", MEGATRON, "a100_80gb", 32, _gpt(24, 2304, 24), 2048, 512,
        dict(data=32), 137, True, remat="full", tensor_sequence_parallel=False),
    Run("Megatron-LM GPT 18.4B", MEGATRON, "a100_80gb", 256, _gpt(48, 6144, 40), 2048, 1024,
        dict(data=32, tensor=8), 135, True, remat="full", tensor_sequence_parallel=False),
    Run("Megatron-LM GPT 145.6B", MEGATRON, "a100_80gb", 1536, _gpt(96, 12288, 80), 2048, 2304,
        dict(data=24, pipeline=8, tensor=8), 148, True, remat="full",
        tensor_sequence_parallel=False),
    Run("Megatron-LM GPT 1T", MEGATRON, "a100_80gb", 3072, _gpt(160, 25600, 128), 2048, 3072,
        dict(data=6, pipeline=64, tensor=8), 163, True, remat="full",
        tensor_sequence_parallel=False),
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
    Run("torchtitan Llama 3.1 8B, compiled", TORCHTITAN, "h100_500w", 8, _llama3_8b(), 8192, 16,
        dict(fsdp=8), 0, False, remat="selective", tokens_per_s=6667),
    # The same file's earlier table (2024): Llama 3 8B, FSDP on 64 A100s
    # (80 GB), local batch 1 x 8,192, selective (op) activation checkpointing:
    # 2,973 tokens/s per GPU, 58.2% MFU.
    Run("torchtitan Llama 3 8B, 64 A100", TORCHTITAN, "a100_80gb", 64, _llama3_8b(), 8192, 64,
        dict(fsdp=64), 0, False, remat="selective", tokens_per_s=2973),
    # BLOOM (BigScience's tr11 run, Megatron-DeepSpeed): 384 A100 80GB on 48
    # nodes of Jean Zay (`CLUSTERS`) as tensor 4 x pipeline 12 x data 8
    # (ZeRO-1, which its bf16 optimizer implements), 70 layers, width
    # 14,336, 112 heads, a GeLU MLP of 4h, the vocabulary padded to 250,880,
    # 2,048-token sequences, 2,048 a step in microbatches of 2 (DeepSpeed's
    # 1F1B, the only schedule of its pipeline engine); full recomputation
    # (--checkpoint-activations). The stages as its README draws them
    # (--pp-partition-method 'type:transformer|embedding': the tied
    # embedding counts as a layer on the first and the last stage). About
    # 150 TFLOP/s per GPU (the BigScience model page), counted with the
    # recomputation (the README's "hardware TFLOPs", Megatron's 4 x 2 factor).
    Run("BLOOM 176B", BLOOM, "jean_zay_a100", 384, _gpt(112, 14_336, 70, vocab=250_880), 2048,
        2048, dict(data=8, pipeline=12, tensor=4), 150, True, remat="full",
        stage_layers=(fewer_at_the_ends(70, 12),), tensor_sequence_parallel=False,
        schedules=("1f1b",), microbatches=2048 // 8 // 2),
    # OPT-175B: 992 A100 80GB, Fully Sharded Data Parallel with Megatron-LM
    # tensor parallelism of 8 (so FSDP over 124), 96 layers, width 12,288, 96
    # heads, a ReLU MLP of 4h, GPT-2's BPE (50,272 in the model), 2,048-token
    # sequences, 2M tokens a step: metaseq's launcher gives each of the 124
    # FSDP ranks 2M // 124 // 2,048 = 8 sequences, 992 in all; activation
    # checkpointing (metaseq's OPT launcher: --checkpoint-activations). "Up to
    # 147 TFLOP/s per GPU" does not say how it counts; read as Megatron-LM's
    # convention of the time (recomputation counted): 147 model TFLOP/s would
    # be 63% of peak in hardware FLOPs, above every Megatron-LM run of 2021.
    Run("OPT-175B", OPT, "a100_80gb", 992, _gpt(96, 12_288, 96, vocab=50_272), 2048, 992,
        dict(fsdp=124, tensor=8), 147, True, remat="full", tensor_sequence_parallel=False),
    *(_mt_nlg(nodes, tflops) for nodes, tflops in MT_NLG_TFLOPS.items()),
)

# Clusters of published runs that no preset of `meshtrain.planner.clusters`
# describes. Jean Zay's A100 partition (BLOOM's tr11 README; Le Scao et al.
# 2022 on its hardware): 8 A100 80GB a node with NVLink (taken as the
# `a100_80gb` preset's), and 4 Omni-Path links of 100 Gb/s a node: 50 GB/s
# for 8 GPUs, 6.25 GB/s each.
CLUSTERS = {
    "jean_zay_a100": dataclasses.replace(clusters.PRESETS["a100_80gb"], name="jean_zay_a100",
                                         inter_host=50e9 / 8),
    # torchtitan's Grand Teton H100s at a 500 W power limit, where the preset's
    # 989 TFLOP/s is the 700 W part's. Under a power cap the clock falls until
    # the dynamic power (~ f V^2, with V ~ f over the boost range: ~ f^3) fits:
    # f x (500 / 700)^(1/3) = 0.894 f. An assumption from that physics, no fit;
    # HBM and links as the preset's.
    "h100_500w": dataclasses.replace(clusters.PRESETS["h100"], name="h100_500w",
                                     peak_flops=clusters.PRESETS["h100"].peak_flops
                                     * (500 / 700) ** (1 / 3)),
}


def cluster(name: str) -> clusters.Cluster:
  """A run's cluster: one of `CLUSTERS`, else a preset or file (`clusters.load`)."""
  return CLUSTERS[name] if name in CLUSTERS else clusters.load(name)


# The rest of Narayanan et al.'s Table 1 (the rows RUNS does not hold): GPT
# models on DGX A100s (Selene) with full recomputation, sequences of 2,048,
# TFLOP/s per GPU counting the recomputation.
CALIBRATION = (
    Run("Megatron-LM GPT 3.6B", MEGATRON, "a100_80gb", 64, _gpt(32, 3072, 30), 2048, 512,
        dict(data=32, tensor=2), 138, True, remat="full", tensor_sequence_parallel=False),
    Run("Megatron-LM GPT 7.5B", MEGATRON, "a100_80gb", 128, _gpt(32, 4096, 36), 2048, 512,
        dict(data=32, tensor=4), 142, True, remat="full", tensor_sequence_parallel=False),
    Run("Megatron-LM GPT 39.1B", MEGATRON, "a100_80gb", 512, _gpt(64, 8192, 48), 2048, 1536,
        dict(data=32, pipeline=2, tensor=8), 138, True, remat="full",
        tensor_sequence_parallel=False),
    Run("Megatron-LM GPT 76.1B", MEGATRON, "a100_80gb", 1024, _gpt(80, 10240, 60), 2048, 1792,
        dict(data=32, pipeline=4, tensor=8), 140, True, remat="full",
        tensor_sequence_parallel=False),
    Run("Megatron-LM GPT 310.1B", MEGATRON, "a100_80gb", 1920, _gpt(128, 16384, 96), 2048, 2160,
        dict(data=15, pipeline=16, tensor=8), 155, True, remat="full",
        tensor_sequence_parallel=False),
    Run("Megatron-LM GPT 529.6B", MEGATRON, "a100_80gb", 2520, _gpt(128, 20480, 105), 2048, 2520,
        dict(data=9, pipeline=35, tensor=8), 163, True, remat="full",
        tensor_sequence_parallel=False),
)
