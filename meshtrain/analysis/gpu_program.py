"""What a program XLA's GPU compiler built shows: each collective's overlap with
compute, the hosts it crosses, and the kernels.

A compiled GPU module is scheduled (`is_scheduled=true`): each computation's
instructions run in the order printed, and an asynchronous collective is a
`-start` and a `-done` (an all-to-all: an `async-start` calling it) with the
work XLA put between them running while the bytes move. `collectives(program,
mesh)` adds to each of `hlo.collective_ops` what runs under it: the matmul
FLOPs (dots, cuBLAS calls, cuDNN attention) scheduled between its start and
its done, loops and branches between them included (a loop at its trip
count, a conditional at its costliest branch), and whether its groups span
devices of several hosts (`process_index`). A collective with no matmul under
it is exposed: the step waits for it (apart from the elementwise work beside
it). `hidden_share` sums that into one figure of merit: the share of the
bytes moved with some matmul scheduled under them.

`kernels(program)` lists the GEMM and attention kernels by kind (cuBLAS,
cuBLASLt, its float8 matmul, a Triton GEMM fusion, XLA's own fused dot,
cuDNN's flash attention) and operand type, each as often as it runs.

Deviceless programs are not autotuned: the kernels' kinds are XLA's choices
for the target, their tile sizes and cuBLAS algorithms are defaults.
"""

import collections
import dataclasses
import functools
import json
import math
import re

import numpy as np
from jax.sharding import Mesh

from meshtrain.analysis import hlo

_CUBLAS = {"__cublas$gemm": "cublas gemm", "__cublas$lt$matmul": "cublasLt matmul",
           "__cublas$lt$matmul$f8": "cublasLt float8 matmul"}
_TRITON_GEMMS = ("__triton_gemm", "__triton_nested_gemm_fusion")
FLASH_ATTENTION = "cudnn flash attention"


@dataclasses.dataclass(frozen=True)
class ScheduledCollective:
  """One collective instruction of a GPU program and what runs under it.

  Attributes:
    op: the instruction as `hlo.collective_ops` reads it (kind, axis, bytes, ...).
    asynchronous: a start/done pair (work may run between them), not one blocking op.
    crosses_hosts: whether some group holds devices of two hosts.
    overlapped_flops: matmul FLOPs scheduled between its start and done, per execution.
    overlapped_matmuls: matmul and attention kernels there, per execution.
  """
  op: hlo.CollectiveOp
  asynchronous: bool
  crosses_hosts: bool
  overlapped_flops: float
  overlapped_matmuls: int

  @property
  def hidden(self) -> bool:
    return self.overlapped_matmuls > 0


def _dims(attributes: str, key: str) -> list[int]:
  match = re.search(rf"{key}=\{{([\d,]*)\}}", attributes)
  return [int(d) for d in match.group(1).split(",") if d] if match else []


def _shape_dims(shape: str) -> list[int]:
  """The dimensions of an array shape (a tuple's first element)."""
  match = re.search(r"[a-z][a-z0-9]*\[([^\]]*)\]", shape)
  return [int(d.lstrip("<=")) for d in match.group(1).split(",") if d] if match else []


def _elements(shape: str) -> int:
  return math.prod(_shape_dims(shape))


def _dot_flops(module, inst, contracting: list[int]) -> float:
  """2 x output elements x contracted elements (`contracting`: the lhs's dims)."""
  lhs = module.by_name[(inst.computation, inst.operands[0])]
  lhs_dims = _shape_dims(lhs.shape)
  return 2.0 * _elements(inst.shape) * math.prod(lhs_dims[d] for d in contracting)


def _backend_config(inst) -> dict:
  match = re.search(r"backend_config=(\{.*\})\s*$", inst.attributes)
  if not match:
    return {}
  try:
    return json.loads(match.group(1))
  except json.JSONDecodeError:
    return {}


def _attention_flops(module, inst) -> float:
  """cuDNN flash attention: 4 B N T S H a forward (scores and output), 2.5 times
  that a backward; q is [B, T, N, H] or a layout of it, k's length S is its
  second dimension in jax's BTNH convention."""
  q = _shape_dims(module.by_name[(inst.computation, inst.operands[0])].shape)
  k = _shape_dims(module.by_name[(inst.computation, inst.operands[1])].shape)
  forward = 4.0 * math.prod(q) * (k[1] if len(k) > 1 else 1)
  return forward * (2.5 if "Backward" in inst.attributes else 1.0)


def _kernel(module, inst) -> tuple[str, float] | None:
  """(kind, FLOPs) of a matmul or attention instruction, else None."""
  if inst.opcode == "dot":
    return "dot", _dot_flops(module, inst, _dims(inst.attributes, "lhs_contracting_dims"))
  if inst.opcode != "custom-call":
    return None
  target = re.search(r'custom_call_target="([^"]+)"', inst.attributes).group(1)
  if target in _CUBLAS:
    numbers = _backend_config(inst).get("gemm_backend_config", {}).get("dot_dimension_numbers", {})
    contracting = [int(d) for d in numbers.get("lhs_contracting_dimensions", [])]
    return _CUBLAS[target], _dot_flops(module, inst, contracting)
  if target.startswith("__cudnn$fmha"):
    return FLASH_ATTENTION, _attention_flops(module, inst)
  return None


def _flops(module):
  """FLOPs and matmul kernels of one run of a computation, called ones included."""
  @functools.cache
  def of(name: str) -> tuple[float, int]:
    flops, kernels = 0.0, 0
    for inst in module.computations[name]:
      f, k = of_instruction(inst)
      flops, kernels = flops + f, kernels + k
    return flops, kernels

  def of_instruction(inst) -> tuple[float, int]:
    found = _kernel(module, inst)
    if found:
      return found[1], 1
    callees = [of(c) for c in module.called(inst)]
    if not callees:
      return 0.0, 0
    if inst.opcode == "while":
      trips = hlo._trip_count(inst) or 1  # noqa: SLF001 (the package's own parser)
      return trips * sum(f for f, _ in callees), trips * sum(k for _, k in callees)
    if inst.opcode == "conditional":
      return max(callees)
    flops, kernels = sum(f for f, _ in callees), sum(k for _, k in callees)
    return flops, (min(kernels, 1) if inst.opcode == "fusion" else kernels)  # a fusion: 1 kernel

  return of_instruction


def _collective_of(module, inst) -> str | None:
  """The collective instruction an async start begins: itself, or the one an
  `async-start` calls."""
  opcode = inst.opcode.removesuffix("-start")
  if opcode in (*hlo.KINDS, hlo._RAGGED):  # noqa: SLF001
    return inst.name
  if inst.opcode == "async-start":
    for callee in module.called(inst):
      for called in module.computations[callee]:
        if called.opcode in (*hlo.KINDS, hlo._RAGGED):  # noqa: SLF001
          return called.name
  return None


def _overlaps(module) -> dict[str, tuple[bool, float, int]]:
  """Collective name -> (asynchronous, FLOPs and kernels between its start and done)."""
  flops_of = _flops(module)
  found = {}
  for name, instructions in module.computations.items():
    position = {inst.name: i for i, inst in enumerate(instructions)}
    for i, inst in enumerate(instructions):
      if not inst.opcode.endswith("-start"):
        continue
      collective = _collective_of(module, inst)
      done = [u for u in module.users[(name, inst.name)] if u.opcode.endswith("-done")]
      if collective is None or not done:
        continue
      between = instructions[i + 1:position[done[0].name]]
      work = [flops_of(b) for b in between]
      found[collective] = (True, sum(f for f, _ in work), sum(k for _, k in work))
  return found


def _crossing_axes(mesh: Mesh):
  """A function of a '+'-joined axis set of the mesh: whether its groups span hosts."""
  process = np.vectorize(lambda d: d.process_index)(mesh.devices)

  @functools.cache
  def crosses(axes: str) -> bool:
    spanned = [mesh.axis_names.index(a) for a in axes.split("+") if a]
    if not spanned:
      return False
    kept = [i for i in range(process.ndim) if i not in spanned]
    groups = np.moveaxis(process, spanned + kept, range(process.ndim))
    groups = groups.reshape(math.prod(process.shape[i] for i in spanned), -1)
    return bool((groups != groups[:1]).any())
  return crosses


def collectives(program, mesh: Mesh) -> list[ScheduledCollective]:
  """Every collective of a compiled GPU program with what XLA scheduled under it."""
  module = hlo._parse_module(hlo._hlo_text(program))  # noqa: SLF001
  overlaps = _overlaps(module)
  crosses = _crossing_axes(mesh)
  scheduled = []
  for op in hlo.collective_ops(program, mesh):
    asynchronous, flops, matmuls = overlaps.get(op.name, (False, 0.0, 0))
    scheduled.append(ScheduledCollective(op, asynchronous, crosses(op.axis), flops, matmuls))
  return scheduled


def hidden_share(scheduled: list[ScheduledCollective]) -> float | None:
  """The share of the bytes collectives move with a matmul scheduled under them
  (None where nothing moves)."""
  total = sum(c.op.bytes for c in scheduled)
  return sum(c.op.bytes for c in scheduled if c.hidden) / total if total else None


def summary(scheduled: list[ScheduledCollective]) -> list[dict]:
  """By kind and axis: count, bytes, the bytes hidden under matmuls, the bytes
  that cross hosts, and whether every op is asynchronous."""
  rows = collections.defaultdict(lambda: {"count": 0, "bytes": 0, "hidden_bytes": 0,
                                          "cross_host_bytes": 0, "asynchronous": True})
  for c in scheduled:
    row = rows[(c.op.kind, c.op.axis)]
    row["count"] += c.op.count
    row["bytes"] += c.op.bytes
    row["hidden_bytes"] += c.op.bytes * c.hidden
    row["cross_host_bytes"] += c.op.bytes * c.crosses_hosts
    row["asynchronous"] &= c.asynchronous
  return [{"kind": kind, "axis": axis, **row}
          for (kind, axis), row in sorted(rows.items(),
                                          key=lambda kv: (hlo.KINDS.index(kv[0][0]), kv[0][1]))]


def _operand_types(module, inst) -> str:
  """The element types of a kernel's first two operands, 'bf16 x bf16'."""
  types = [re.match(r"\(?([a-z][a-z0-9]*)\[", module.by_name[(inst.computation, o)].shape)
           for o in inst.operands[:2]]
  return " x ".join(t.group(1) for t in types if t)


def kernels(program) -> list[dict]:
  """GEMM and attention kernels by kind and operand types, each with how often it runs."""
  module = hlo._parse_module(hlo._hlo_text(program))  # noqa: SLF001
  executions = hlo._executions(module)  # noqa: SLF001
  counts = collections.Counter()
  for name, instructions in module.computations.items():
    if name not in executions or name in module.fusion_of:
      continue  # fused computations are read through their fusion
    for inst in instructions:
      found = _fused_kernel(module, inst)
      if found:
        counts[found] += executions[name].count
  return [{"kernel": kind, "operands": types, "count": count}
          for (kind, types), count in sorted(counts.items())]


def _fused_kernel(module, inst) -> tuple[str, str] | None:
  """(kind, operand types) of a kernel instruction outside fused computations."""
  found = _kernel(module, inst)
  if found:
    return found[0], _operand_types(module, inst)
  if inst.opcode != "fusion":
    return None
  dots = [i for c in _fused_computations(module, inst) for i in module.computations[c]
          if i.opcode == "dot"]
  if not dots:
    return None
  kind = _backend_config(inst).get("fusion_backend_config", {}).get("kind", "")
  return ("triton gemm" if kind in _TRITON_GEMMS else "fused dot"), _operand_types(module, dots[0])


def _fused_computations(module, inst) -> list[str]:
  """The computations a fusion runs, nested fusions included."""
  names = []
  for callee in module.called(inst):
    names.append(callee)
    for nested in module.computations[callee]:
      if nested.opcode == "fusion":
        names.extend(_fused_computations(module, nested))
  return names
