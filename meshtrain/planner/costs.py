"""The parts of the planner's step-time model, each a function a hand can check.

- `collective_seconds`: a collective's time by latency and bandwidth (the
  alpha-beta model): every ring hop pays the link's latency, the bytes move
  at the collective bandwidth NCCL reaches of the line rate; an all-reduce
  takes the ring or the tree, whichever is faster (NCCL picks by size).
- `gemm_seconds`: a matmul on its per-device shape by the roofline: its
  FLOPs at the calibrated kernel efficiency, or its operands' and result's
  bytes at the memory bandwidth, whichever takes longer, so small
  per-device GEMMs (a thin tensor-parallel split) run below peak; under
  float8 its operands move one byte an element, and `quantize_seconds` the
  quantizer's passes over them.
- `elementwise_seconds`: norms, residual adds, activation functions and the
  like read and write a layer's activations through memory, a fitted
  number of passes.
- `exposed_behind_layers`: traffic issued per layer (FSDP's gathers and
  reduce-scatters, DDP's bucketed all-reduce) hides behind the layer's
  compute: one layer's worth is always exposed (the first gather before
  anything runs, the last reduction after everything ran), and of the rest
  what exceeds each layer's compute, or where it hides, what it slows the
  compute beside it (`OVERLAP_SLOWDOWN`), whichever is more.
- `lockstep_bubble`: the share of a meshtrain schedule table's cells where
  a stage idles: meshtrain's executor runs every stage in lock step, one op
  a tick, so this is the bubble it runs (zero-bubble schedules included).
- `lockstep_seconds`: the same table with each op at its own cost (uneven
  stages, the head on the last one): a tick lasts as long as its longest op.
- `fused_backward_seconds`: a pipeline as published software runs 1F1B
  and interleaved 1F1B (Megatron-LM, DeepSpeed), its backward computing
  input and weight gradients in one op: the busiest stage's work, and the
  fill and drain through the other stages (Narayanan et al. 2021).
- `table_counts`: what these read from a table, past 8 microbatches a stage
  on a line through two smaller tables instead of the table itself.
"""

import dataclasses
import functools
import math

import numpy as np

from meshtrain.parallel.pipeline import schedule as schedules

# Bus bandwidth of a large NCCL collective over line rate: nccl-tests'
# all-reduce on DGX H100 (NVLink 4) reports about 360 of 450 GB/s, on
# InfiniBand NDR about 40 of 50 GB/s per GPU. A stated constant, not fitted.
COLLECTIVE_BANDWIDTH = 0.8
# Latency of one hop (one step of a ring, one level of a tree), in seconds:
# NCCL's small-message all-reduce over 8 NVLink GPUs takes about 15 us in 7
# ring steps (~2 us each); across hosts an InfiniBand hop adds ~5 us.
HOP_LATENCY = {"intra": 2e-6, "inter": 6e-6}


def hops(kind: str, n: int) -> int:
  """Latency steps of one collective over `n` devices (ring algorithms; the
  tree's 2 log2 n for an all-reduce where that is fewer)."""
  if n <= 1:
    return 0
  if kind == "all-reduce":
    return min(2 * (n - 1), 2 * math.ceil(math.log2(n)))
  if kind == "collective-permute":
    return 1
  return n - 1  # all-gather, reduce-scatter, all-to-all


def collective_seconds(kind: str, n: int, ring_bytes: float, count: float, bandwidth: float,
                       latency: float) -> float:
  """`count` collectives over `n` devices moving `ring_bytes` per device in
  all (the ring convention of `meshtrain.planner.plan`) on links of
  `bandwidth` bytes/s per direction and `latency` s per hop."""
  return ring_bytes / (bandwidth * COLLECTIVE_BANDWIDTH) + count * hops(kind, n) * latency


def gemm_seconds(m: float, k: float, n: float, peak_flops: float, memory_bandwidth: float,
                 efficiency: float, operand_bytes: int = 2, output_bytes: int = 2) -> float:
  """One [m, k] x [k, n] matmul on a device: 2mkn FLOPs at `efficiency` of
  peak, or its operands' mk + kn elements and its output's mn through
  memory, whichever is slower."""
  flops = 2 * m * k * n
  moved = operand_bytes * (m * k + k * n) + output_bytes * m * n
  return max(flops / (peak_flops * efficiency), moved / memory_bandwidth)


# Bytes `meshtrain.parallel.float8.quantize` moves for an element of a
# bfloat16 operand: it reads it for the absolute maximum, reads it again to
# scale and convert it, and writes one byte (the GEMM's read of that byte is
# `gemm_seconds`').
QUANTIZE_BYTES = 2 + 2 + 1


def quantize_seconds(elements: float, memory_bandwidth: float) -> float:
  """The float8 quantizer's passes over `elements` operand elements."""
  return QUANTIZE_BYTES * elements / memory_bandwidth


def elementwise_seconds(tokens: float, widths: float, passes: float,
                        memory_bandwidth: float, element_bytes: int = 2) -> float:
  """Elementwise work of one layer's forward on `tokens` tokens whose
  activations sum to `widths` elements a token: `passes` reads or writes of
  them through memory."""
  return passes * tokens * widths * element_bytes / memory_bandwidth


# Bytes XLA's masked attention moves through memory per score element of a
# layer (`meshtrain.parallel.attention`, bf16 inputs): forward, the float32
# scores written and read by the softmax, the bf16 probabilities written and
# read by the PV matmul (4 + 4 + 2 + 2); backward, the probabilities read for
# dV, the float32 dP written and read, the probabilities read again, the bf16
# dS written and read by the dQ and dK matmuls (2 + 4 + 4 + 2 + 2 + 2 + 2);
# the forward again where recomputed.
SCORE_BYTES = {"forward": 12, "backward": 18}


def attention_scores_seconds(elements: float, recomputed: bool, memory_bandwidth: float) -> float:
  """Forward and backward of XLA's attention over `elements` scores of one
  layer (and the forward again where `recomputed`): their float32 scores and
  bf16 probabilities through memory (`SCORE_BYTES`)."""
  passes = SCORE_BYTES["forward"] * (1 + recomputed) + SCORE_BYTES["backward"]
  return elements * passes / memory_bandwidth


# Compute that runs beside a collective runs this much slower (NCCL's
# kernels take SMs and memory bandwidth from it): 18.9% on average over GPT
# and Llama layers on A100 and H100 (arXiv 2507.03114, "Characterizing
# Compute-Communication Overlap in GPU-Accelerated Distributed Deep
# Learning", 2025; 40% at most). A stated constant, not fitted.
OVERLAP_SLOWDOWN = 0.189


def exposed_behind_layers(traffic_s: float, compute_s: float, layers: int) -> float:
  """Of `traffic_s` issued evenly over `layers` layers that together compute
  for `compute_s`, the seconds it adds to them: one layer's traffic, and in
  every other layer what its traffic takes beyond its compute, or, where the
  compute outlasts it, what the compute loses running beside it: t seconds
  of traffic let the compute do t / (1 + s) seconds of its work, so the
  layer ends t s / (1 + s) later (s = `OVERLAP_SLOWDOWN`)."""
  if traffic_s <= 0:
    return 0.0
  per_layer, per_compute = traffic_s / layers, compute_s / layers
  slowed = per_layer * OVERLAP_SLOWDOWN / (1 + OVERLAP_SLOWDOWN)
  return per_layer + (layers - 1) * max(slowed, per_layer - per_compute)


# The buffers a stage holds values in, as `TableCounts.slots` counts them.
SLOT_BUFFERS = ("inputs", "res", "cut", "head_res", "head_cut")


@dataclasses.dataclass(frozen=True)
class TableCounts:
  """What the planner reads from meshtrain's table for a schedule.

  idle, cells: idle stage-ticks, and all of them; sends: ticks after which
  every stage sends (`Schedule.sends`); slots: a stage's most values held in
  each of `SLOT_BUFFERS` (`Schedule.num_slots`; inputs and input gradients
  waiting together); ticks_by_chunks: how many ticks run each row of
  chunks over the stages (-1 where a stage idles)."""

  idle: float
  cells: float
  sends: float
  slots: tuple[float, ...]  # in the order of SLOT_BUFFERS
  ticks_by_chunks: dict[tuple[int, ...], float]

  def along(self, other: "TableCounts", t: float) -> "TableCounts":
    """The counts (1 - t) of the way from self to `other` and t of the way."""
    on_line = lambda a, b: a + (b - a) * t  # noqa: E731
    rows = self.ticks_by_chunks.keys() | other.ticks_by_chunks.keys()
    return TableCounts(
        on_line(self.idle, other.idle), on_line(self.cells, other.cells),
        on_line(self.sends, other.sends),
        tuple(on_line(a, b) for a, b in zip(self.slots, other.slots)),
        {row: on_line(self.ticks_by_chunks.get(row, 0), other.ticks_by_chunks.get(row, 0))
         for row in rows})


def counted(table: schedules.Schedule) -> TableCounts:
  """The `TableCounts` of a built table."""
  rows, ticks = np.unique(np.where(table.op != schedules.IDLE, table.chunk, -1), axis=0,
                          return_counts=True)
  return TableCounts(
      int((table.op == schedules.IDLE).sum()), table.op.size, int(table.sends().sum()),
      (table.num_slots("act") + table.num_slots("grad"),
       *(table.num_slots(name) for name in SLOT_BUFFERS[1:])),
      {tuple(row.tolist()): int(n) for row, n in zip(rows, ticks)})


# Tables up to this many microbatches a stage are built; past it, every count
# in `TableCounts` lies on a line in the microbatch count: every schedule's
# steady state repeats with each `stages` microbatches more, adding the same
# ticks, idle cells, sends and slots (tests/test_search.py checks the line
# against built tables). One sequence per microbatch is thousands of
# microbatches, whose tables take a second and more each to build (1,536 on 64
# stages: 1.4 CPU s).
BUILT_PER_STAGE = 5  # from 3 and 4 a stage (zb_h2 is not yet steady from 2 and 3)


@functools.cache
def table_counts(name: str, stages: int, microbatches: int, chunks: int = 1) -> TableCounts:
  """`counted` of meshtrain's table for the schedule: of the table itself up
  to BUILT_PER_STAGE x `stages` microbatches, else on the line through two
  built tables whose counts, 3 and 4 times `stages` and more, leave the same
  remainder by `stages`."""
  if microbatches <= BUILT_PER_STAGE * stages:
    return counted(schedules.build(name, stages, microbatches, chunks))
  low = (BUILT_PER_STAGE - 2) * stages + microbatches % stages
  at_low, at_high = (table_counts(name, stages, n, chunks) for n in (low, low + stages))
  return at_low.along(at_high, (microbatches - low) / stages)


def lockstep_bubble(name: str, stages: int, microbatches: int, chunks: int = 1) -> float:
  """Idle share of stage-ticks in meshtrain's table for the schedule."""
  counts = table_counts(name, stages, microbatches, chunks)
  return counts.idle / counts.cells


def lockstep_seconds(name: str, microbatches: int, work_VxP: np.ndarray) -> float:
  """Seconds the ops of meshtrain's table for the schedule take when every
  tick lasts as long as its longest op (the executor runs the stages in lock
  step) and an op of chunk v on stage s takes work_VxP[v, s] / (3 x
  microbatches): that chunk's work in a step, spread evenly over its F, B
  and W of every microbatch. Where all chunks do alike, ticks x one op:
  the stages' busy time over (1 - `lockstep_bubble`)."""
  chunks, stages = work_VxP.shape
  work_with_idle_VxP = np.vstack([work_VxP, np.zeros(stages)])  # row -1: an idle stage
  rows_RxP, ticks_R = _tick_rows(name, stages, microbatches, chunks)
  longest_R = work_with_idle_VxP[rows_RxP, np.arange(stages)].max(axis=1)
  return float(longest_R @ ticks_R) / (3 * microbatches)


@functools.cache
def _tick_rows(name: str, stages: int, microbatches: int, chunks: int
               ) -> tuple[np.ndarray, np.ndarray]:
  """`table_counts`' ticks_by_chunks as arrays: the rows of chunks over the
  stages (R x stages) and the ticks that run each (R)."""
  by_row = table_counts(name, stages, microbatches, chunks).ticks_by_chunks
  return np.array(list(by_row), dtype=int).reshape(-1, stages), np.array(list(by_row.values()))


def fused_backward_seconds(microbatches: int, work_VxP: np.ndarray) -> float:
  """Seconds a pipeline's step takes whose backward computes a microbatch's
  input and weight gradients in one op (1F1B and interleaved 1F1B as
  Megatron-LM, DeepSpeed and Meta run them; meshtrain's tables split the
  two, so its own 1F1B idles less): the busiest stage's work a step, and
  the fill and the drain, which take a microbatch's forward and backward
  once through each other stage, one of its V chunks (the rows of
  work_VxP) at a time: with p stages of equal work w, w (1 + (p - 1) / (V x
  microbatches)), Narayanan et al. 2021, Section 2.2. work_VxP as
  `lockstep_seconds` takes it."""
  chunks, _ = work_VxP.shape
  stage_s = work_VxP.sum(axis=0)
  return float(stage_s.max() + (stage_s.sum() - stage_s.max()) / (chunks * microbatches))
