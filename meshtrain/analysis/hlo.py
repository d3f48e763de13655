"""Collectives and memory read from a compiled XLA program.

`collectives(compiled, mesh)` answers "which collectives does this step run,
over which mesh axes, how often, and how many bytes does each device move?"
from `compiled.as_text()`; `memory_bytes(compiled)` reads the per-device
buffer sizes XLA planned; `placements(program)` lists the moves between
device and host memory in the program XLA receives, and whether each runs
inside a loop.

Byte convention (ring algorithm, per device, per execution; N is the per-device
operand size in bytes, n the number of devices in a group):

  all-reduce          2 N (n - 1) / n
  all-gather          N_out (n - 1) / n   with N_out = n N, the gathered output
  reduce-scatter      N (n - 1) / n       N is the unscattered input
  all-to-all          N (n - 1) / n
  collective-permute  N

A `ragged-all-to-all` (`lax.ragged_all_to_all`) is reported as an all-to-all
of its first operand, the rows it may send: how many it does send is known
only when it runs, so the bytes are the most it moves, which routing reaches
only when every row goes to other devices.

Tuple-shaped ops (several operands in one op) sum their operands. Each value is
rounded down to whole bytes, then multiplied by the execution count.

HLO facts this module relies on (jax 0.10, XLA CPU):

- Device ids in replica groups and source-target pairs are logical ids: the
  position in the executable's device assignment. jax builds that assignment
  from the mesh's flattened devices, so logical id `i` is
  `mesh.devices.flat[i]` even when the mesh lists devices out of id order.
- Replica groups come in three spellings: explicit `{{0,1},{2,3}}`, iota
  `[2,4]<=[4,2]T(1,0)`, and mesh axes
  `mesh['axis_0'=2,'axis_1'=4] {'axis_0'}` (optionally with
  `device_ids=([2,4]T(1,0))` and sub-axes `'axis_0':(1)2`). All are parsed.
- GSPMD reduce-scatters become, on CPU, an all-reduce whose every use is a
  `dynamic-slice` (often inside a fusion) keeping this device's part. Such an
  all-reduce is reported with kind "reduce-scatter" and reduce-scatter bytes
  (N (n - 1) / n): what the same program moves on GPU, where XLA turns the
  pattern into a real reduce-scatter; the CPU run moves twice that. When XLA
  combines several gradients into one tuple all-reduce, each element is
  classified on its own.
  `lax.psum_scatter` in `shard_map` stays a real `reduce-scatter`.
- CPU runs bf16 reductions and gathers in f32 (a `convert` before and after,
  `to_apply=%..._promoted`), so bytes read from a CPU program are f32 bytes;
  a GPU or TPU program of the same step moves half as many.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import math
import re
import warnings
from typing import Any, Iterable, Mapping, Protocol

import numpy as np
from jax.sharding import Mesh

KINDS = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "all-to-all",
    "collective-permute",
)
_RAGGED = "ragged-all-to-all"  # operands: rows, output buffer, offsets and sizes
# Ops that forward their input's value whole; a slice after them still slices
# it. `convert` is here because CPU runs bf16 collectives in f32 and converts.
_PASS_THROUGH = ("bitcast", "reshape", "copy", "convert", "get-tuple-element")


class _HasText(Protocol):

  def as_text(self) -> str:
    ...


@dataclasses.dataclass(frozen=True)
class Collective:
  """Collectives of one kind over one set of mesh axes, summed over a program.

  Attributes:
    kind: "all-reduce", "all-gather", "reduce-scatter", "all-to-all" or
      "collective-permute".
    axis: mesh axes the groups span, joined by "+" in mesh order ("data",
      "fsdp+tensor"); "" when every group is a single device.
    count: executions per program run; ops in while loops are multiplied by
      the loop's known trip count. Measured from a run (`executed`), the mean
      over devices, which may be fractional.
    bytes: bytes one device sends per program run under the ring convention of
      this module's docstring, summed over `count`.
    in_loop: whether the ops sit inside a while-loop body (e.g. a layer scan).
  """

  kind: str
  axis: str
  count: float
  bytes: int
  in_loop: bool


@dataclasses.dataclass(frozen=True)
class CollectiveOp:
  """One collective instruction of the compiled program.

  Attributes:
    name: the HLO instruction name, e.g. "all-reduce.1".
    opcode: the HLO opcode without "-start", e.g. "all-reduce".
    kind: what the op does; differs from `opcode` for an all-reduce that is
      sliced into a reduce-scatter, and a ragged-all-to-all (an all-to-all).
    axis: mesh axes spanned, as in `Collective.axis`.
    group_size: devices per replica group (2 for a collective-permute).
    operand_bytes: per-device bytes of the op's operands, one execution.
    count: executions per program run.
    bytes: ring-convention bytes per device per program run (all executions).
    in_loop: whether the op sits inside a while-loop body.
    trip_count_known: False if an enclosing loop had no known trip count; such
      a loop is counted as running once.
  """

  name: str
  opcode: str
  kind: str
  axis: str
  group_size: int
  operand_bytes: int
  count: float
  bytes: int
  in_loop: bool
  trip_count_known: bool


# ---------------------------------------------------------------- HLO parsing


@dataclasses.dataclass(frozen=True)
class _Instruction:
  name: str
  shape: str
  opcode: str
  operands: tuple[str, ...]
  attributes: str
  computation: str
  is_root: bool


@dataclasses.dataclass(frozen=True)
class _Module:
  entry: str
  computations: dict[str, list[_Instruction]]

  @functools.cached_property
  def by_name(self) -> dict[tuple[str, str], _Instruction]:
    return {(i.computation, i.name): i for i in self.instructions()}

  @functools.cached_property
  def users(self) -> dict[tuple[str, str], list[_Instruction]]:
    users = collections.defaultdict(list)
    for inst in self.instructions():
      for operand in inst.operands:
        users[(inst.computation, operand)].append(inst)
    return users

  @functools.cached_property
  def fusion_of(self) -> dict[str, _Instruction]:
    """The fusion instruction that calls each fused computation."""
    return {
        callee: inst for inst in self.instructions() if inst.opcode == "fusion"
        for callee in self.called(inst)
    }

  def instructions(self) -> Iterable[_Instruction]:
    return itertools.chain.from_iterable(self.computations.values())

  def called(self, inst: _Instruction) -> list[str]:
    """Computations an instruction calls (fusions, loops, branches, ...)."""
    names = re.findall(r"%?([\w.\-]+)", inst.attributes)
    return [n for n in names if n in self.computations]


_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*(\(.*)?\{\s*$")
_INSTRUCTION = re.compile(r"^\s+(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")


def _closing(text: str, start: int) -> int:
  """Index just past the bracket group opening at `text[start]`."""
  pairs = {"(": ")", "{": "}", "[": "]"}
  stack = []
  for i in range(start, len(text)):
    if text[i] in pairs:
      stack.append(pairs[text[i]])
    elif stack and text[i] == stack[-1]:
      stack.pop()
      if not stack:
        return i + 1
  raise ValueError(f"unbalanced brackets in HLO: {text[start:start + 80]}")


def _split_top_level(text: str) -> list[str]:
  """Splits on commas that are not inside brackets."""
  parts, depth, current = [], 0, []
  for char in text:
    depth += char in "([{"
    depth -= char in ")]}"
    if char == "," and depth == 0:
      parts.append("".join(current))
      current = []
    else:
      current.append(char)
  parts.append("".join(current))
  return [p.strip() for p in parts if p.strip()]


def _parse_instruction(name: str, rest: str, computation: str,
                       is_root: bool) -> _Instruction:
  """Parses `SHAPE opcode(operands), attributes` after `name = `."""
  shape_end = _closing(rest, 0) if rest.startswith("(") else rest.index(" ")
  shape = rest[:shape_end]
  tail = rest[shape_end:].lstrip()
  open_paren = tail.index("(")
  close_paren = _closing(tail, open_paren)
  operands = tuple(
      part.split()[-1].lstrip("%")
      for part in _split_top_level(tail[open_paren + 1:close_paren - 1]))
  return _Instruction(name, shape, tail[:open_paren], operands,
                      tail[close_paren:], computation, is_root)


def _parse_module(text: str) -> _Module:
  computations: dict[str, list[_Instruction]] = {}
  entry, current = None, None
  for line in text.splitlines():
    header = _HEADER.match(line)
    if header:
      current = header.group(2)
      computations[current] = []
      entry = current if header.group(1) else entry
    elif line.startswith("}"):
      current = None
    elif current is not None and (match := _INSTRUCTION.match(line)):
      computations[current].append(
          _parse_instruction(match.group(2), match.group(3), current,
                             is_root=bool(match.group(1))))
  if entry is None:
    raise ValueError("no ENTRY computation: pass compiled HLO "
                     "(`jit(f).lower(...).compile()` or its `.as_text()`)")
  return _Module(entry, computations)


# ------------------------------------------------------------- shapes, bytes


def _element_bits(dtype: str) -> int:
  """Bits per element of an HLO element type: f32 32, bf16 16, pred 8, s4 4."""
  if dtype == "pred":
    return 8
  digits = re.search(r"\d+", dtype)
  return int(digits.group()) if digits else 0  # token[] and the like: no data


def _shape_bytes(shape: str) -> int:
  """Bytes of an HLO shape; tuples sum their elements."""
  total = 0
  for dtype, dims in re.findall(r"([a-z][a-z0-9]*)\[([^\]]*)\]", shape):
    sizes = [int(d.lstrip("<=")) for d in dims.split(",") if d]
    total += math.ceil(math.prod(sizes) * _element_bits(dtype) / 8)
  return total


def _ring_bytes(opcode: str, operand_bytes: int, group_size: int) -> int:
  """Per-device bytes one execution sends under the ring convention."""
  n = group_size
  if opcode == "collective-permute":
    return operand_bytes
  if opcode == "all-reduce":
    return 2 * operand_bytes * (n - 1) // n
  if opcode == "all-gather":
    return operand_bytes * (n - 1)  # output n N, times (n - 1) / n
  return operand_bytes * (n - 1) // n  # reduce-scatter, all-to-all


# ------------------------------------------------------------ device groups


def _ints(text: str) -> list[int]:
  """`"1,2, 3"` -> [1, 2, 3]."""
  return [int(x) for x in text.split(",") if x.strip()]


def _iota(reshape: list[int], transpose: list[int] | None) -> np.ndarray:
  """The flat device list of an iota tile assignment `[reshape]T(transpose)`."""
  ids = np.arange(math.prod(reshape)).reshape(reshape)
  return (ids.transpose(transpose) if transpose else ids).ravel()


def _device_list(spec: str) -> np.ndarray:
  """Parses a mesh `device_ids=(...)`: `[2,4]T(1,0)` or an explicit list."""
  match = re.fullmatch(r"\s*(?:\[([\d,]+)\])?(?:T\(([\d,]+)\))?([\d,\s]*)",
                       spec)
  if not match:
    raise ValueError(f"unrecognised device_ids: {spec}")
  reshape, transpose, explicit = match.groups()
  if explicit.strip():
    return np.array(_ints(explicit))
  return _iota(_ints(reshape), transpose and _ints(transpose))


def _mesh_axes_groups(sizes_text: str, device_ids: str | None,
                      axes_text: str) -> list[list[int]]:
  """Groups of `mesh[a=2,b=4], device_ids=(...) {a, b:(1)2}`.

  Devices that agree on every coordinate outside the listed (sub-)axes form
  one group. A sub-axis `b:(pre)size` is the digit `(c // rest) % size` of the
  coordinate `c` along `b`, with `rest = |b| / (pre * size)`.
  """
  sizes_by_name = {
      name: int(size)
      for name, size in re.findall(r"'?([^'=,\s]+)'?=(\d+)", sizes_text)
  }
  names, sizes = list(sizes_by_name), list(sizes_by_name.values())
  devices = (_device_list(device_ids) if device_ids else np.arange(
      math.prod(sizes))).reshape(sizes)
  grouped = collections.defaultdict(list)  # axis index -> [(pre, size)]
  for name, pre, size in re.findall(r"'?([^':,\s]+)'?(?::\((\d+)\)(\d+))?",
                                    axes_text):
    axis = names.index(name)
    grouped[axis].append((int(pre), int(size)) if pre else (1, sizes[axis]))

  def key(coords: tuple[int, ...]) -> tuple[int, ...]:
    key = list(coords)
    for axis, parts in grouped.items():
      for pre, size in parts:
        rest = sizes[axis] // (pre * size)
        key[axis] -= (coords[axis] // rest) % size * rest
    return tuple(key)

  groups = collections.defaultdict(list)
  for coords, device in np.ndenumerate(devices):
    groups[key(coords)].append(int(device))
  return list(groups.values())


def _replica_groups(attributes: str, num_devices: int) -> list[list[int]]:
  """Device groups of a collective, from any of the three HLO spellings."""
  if match := re.search(r"replica_groups=\{((?:\{[\d,\s]*\},?\s*)*)\}",
                        attributes):
    groups = [_ints(g) for g in re.findall(r"\{([\d,\s]*)\}", match.group(1))]
    return groups or [list(range(num_devices))]  # {} means all devices
  if match := re.search(
      r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?",
      attributes):
    num_groups, group_size, reshape, transpose = match.groups()
    ids = _iota(_ints(reshape), transpose and _ints(transpose))
    return ids.reshape(int(num_groups), int(group_size)).tolist()
  if match := re.search(
      r"replica_groups=mesh\[([^\]]*)\]"
      r"(?:,\s*device_ids=\(((?:[^()]|\([^()]*\))*)\))?\s*\{([^}]*)\}",
      attributes):
    return _mesh_axes_groups(*match.groups())
  raise ValueError(f"no replica_groups in: {attributes[:200]}")


def _source_target_pairs(attributes: str) -> list[list[int]]:
  """The `{source, target}` device pairs of a collective-permute."""
  match = re.search(r"source_target_pairs=\{((?:\{[\d,\s]*\},?\s*)*)\}",
                    attributes)
  return [_ints(p) for p in re.findall(r"\{([\d,\s]*)\}", match.group(1))]


def _logical_device_coords(program: Any, mesh: Mesh) -> list[tuple[int, ...]]:
  """Mesh coordinates of each logical device id of the program.

  A compiled program run by one process names its device assignment
  (`local_devices()` lists it in order); otherwise the assignment is the
  mesh's flattened device list, which is what jax compiles against.
  """
  coords_by_id = {d.id: c for c, d in np.ndenumerate(mesh.devices)}
  assignment = list(mesh.devices.flat)
  if hasattr(program, "runtime_executable"):
    # A deviceless program (compiled for a GPU target) runs on no device here.
    local = getattr(program.runtime_executable(), "local_devices", lambda: [])()
    if len(local) == mesh.size:
      assignment = local
  return [coords_by_id[d.id] for d in assignment]


def _spanned_axes(groups: list[list[int]], coords: list[tuple[int, ...]],
                  mesh: Mesh) -> str:
  """Mesh axes along which members of some group differ, "+"-joined."""
  spanned = set()
  for group in groups:
    member_coords = np.array([coords[d] for d in group])
    spanned.update(np.flatnonzero((member_coords != member_coords[0]).any(0)))
  return "+".join(name for i, name in enumerate(mesh.axis_names)
                  if i in spanned)


# ------------------------------------------------------ loops and execution


@dataclasses.dataclass(frozen=True)
class _Executions:
  count: int
  in_loop: bool
  trip_count_known: bool


def _trip_count(inst: _Instruction) -> int | None:
  match = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', inst.attributes)
  return int(match.group(1)) if match else None


def _executions(module: _Module) -> dict[str, _Executions]:
  """How often each computation runs per program run, and whether in a loop.

  Counts add over call sites. A computation reached through a while loop is
  in a loop and runs trip-count times per run of the caller; without a known
  trip count it counts once. Conditional branches count as if each ran.
  """
  order: list[str] = []  # callees before callers
  seen: set[str] = set()

  def visit(name: str) -> None:
    seen.add(name)
    for inst in module.computations[name]:
      for callee in module.called(inst):
        if callee not in seen:
          visit(callee)
    order.append(name)

  visit(module.entry)
  counts = collections.Counter({module.entry: 1})
  in_loop, unknown = set(), set()
  for name in reversed(order):
    for inst in module.computations[name]:
      trips = _trip_count(inst) if inst.opcode == "while" else 1
      for callee in module.called(inst):
        counts[callee] += counts[name] * (1 if trips is None else trips)
        if inst.opcode == "while" or name in in_loop:
          in_loop.add(callee)
        if trips is None or name in unknown:
          unknown.add(callee)
  return {
      name: _Executions(counts[name], name in in_loop, name not in unknown)
      for name in order
  }


# ------------------------------------------------ GSPMD reduce-scatter


def _fused_parameter(module: _Module, fusion: _Instruction,
                     index: int) -> _Instruction:
  (computation,) = module.called(fusion)
  return next(i for i in module.computations[computation]
              if i.opcode == "parameter" and i.operands == (str(index),))


def _only_sliced(module: _Module, value: _Instruction) -> bool:
  """Whether every use of `value` keeps only a dynamic-slice of it."""
  fusion = module.fusion_of.get(value.computation)
  if value.is_root and fusion:  # the fused value leaves through the fusion
    return _only_sliced(module, fusion)
  users = module.users[(value.computation, value.name)]
  return bool(users) and all(
      _slices(module, value, user) for user in users)


def _slices(module: _Module, value: _Instruction, user: _Instruction) -> bool:
  if user.opcode in _PASS_THROUGH or user.opcode.endswith("-done"):
    return _only_sliced(module, user)
  if user.opcode == "dynamic-slice":
    return (user.operands[0] == value.name and
            _shape_bytes(user.shape) < _shape_bytes(value.shape))
  if user.opcode == "fusion":
    return all(
        _only_sliced(module, _fused_parameter(module, user, index))
        for index, operand in enumerate(user.operands)
        if operand == value.name)
  return False


# ------------------------------------------------------------------ public


def _hlo_text(program: str | _HasText) -> str:
  """The HLO text without `/*index=5*/` comments, which XLA puts in long operand lists."""
  text = program if isinstance(program, str) else program.as_text()
  return re.sub(r"/\*.*?\*/", "", text)


def _operand_bytes(module: _Module, inst: _Instruction) -> int:
  return sum(
      _shape_bytes(module.by_name[(inst.computation, operand)].shape)
      for operand in inst.operands)


def _scattered_elements(module: _Module, inst: _Instruction) -> set[int]:
  """Operands of a tuple all-reduce whose results are only kept sliced: XLA
  combines the reduce-scatters of sharded weights' gradients and the
  all-reduces of replicated ones (norm scales) into one op."""
  users = module.users[(inst.computation, inst.name)]
  if not users or any(u.opcode != "get-tuple-element" for u in users):
    return set()
  by_index: dict[int, list[_Instruction]] = collections.defaultdict(list)
  for user in users:
    by_index[int(re.search(r"index=(\d+)", user.attributes).group(1))].append(user)
  return {i for i, gtes in by_index.items() if all(_only_sliced(module, g) for g in gtes)}


def _collective_op(module: _Module, inst: _Instruction,
                   coords: list[tuple[int, ...]], mesh: Mesh,
                   executions: _Executions, count: float) -> list[CollectiveOp]:
  """One op, or two when a tuple all-reduce is part reduce-scatter."""
  opcode = inst.opcode.removesuffix("-start")
  if opcode == "collective-permute":
    groups = _source_target_pairs(inst.attributes)
  else:
    groups = _replica_groups(inst.attributes, len(coords))
  group_size = max(map(len, groups), default=1)
  parts = {opcode: _operand_bytes(module, inst)}
  if opcode == _RAGGED:
    parts = {"all-to-all": _shape_bytes(module.by_name[(inst.computation, inst.operands[0])].shape)}
  if opcode == "all-reduce" and group_size > 1:
    if _only_sliced(module, inst):
      parts = {"reduce-scatter": parts[opcode]}
    elif len(inst.operands) > 1:
      scattered = _scattered_elements(module, inst)
      element_bytes = [_shape_bytes(module.by_name[(inst.computation, o)].shape)
                       for o in inst.operands]
      parts = {"reduce-scatter": sum(b for i, b in enumerate(element_bytes) if i in scattered),
               opcode: sum(b for i, b in enumerate(element_bytes) if i not in scattered)}
  return [
      CollectiveOp(
          name=inst.name,
          opcode=opcode,
          kind=kind,
          axis=_spanned_axes(groups, coords, mesh),
          group_size=group_size,
          operand_bytes=operand_bytes,
          count=count,
          bytes=round(count * _ring_bytes(kind, operand_bytes, group_size)),
          in_loop=executions.in_loop,
          trip_count_known=executions.trip_count_known,
      )
      for kind, operand_bytes in parts.items() if operand_bytes
  ]


def collective_ops(program: str | _HasText, mesh: Mesh,
                   executed: Mapping[str, float] | None = None) -> list[CollectiveOp]:
  """Every collective instruction of a compiled program.

  Args:
    program: a `jax.stages.Compiled` or its `as_text()` (compiled HLO, not
      the StableHLO of a `Lowered`).
    mesh: the mesh the program was compiled for; device ids are mapped to its
      coordinates.
    executed: how often each op ran per device in a real run
      (`executions` of tests/op_trace.py); by default counts are static:
      loop bodies times their trip count, every conditional branch as if it ran.

  Async pairs count once (the `-start`); `-done` ops are skipped. Warns when a
  collective sits in a loop without a known trip count (counted once).
  """
  module = _parse_module(_hlo_text(program))
  coords = _logical_device_coords(program, mesh)
  executions = _executions(module)
  ops = [
      op
      for name in executions
      for inst in module.computations[name]
      if inst.opcode.removesuffix("-start") in (*KINDS, _RAGGED)
      for op in _collective_op(
          module, inst, coords, mesh, executions[inst.computation],
          executions[inst.computation].count if executed is None else executed.get(inst.name, 0))
  ]
  for op in ops:
    if executed is None and not op.trip_count_known:
      warnings.warn(f"{op.name}: loop without known trip count, counted once")
  return ops


def collectives(program: str | _HasText, mesh: Mesh,
                executed: Mapping[str, float] | None = None) -> list[Collective]:
  """Collectives of a compiled program, summed by (kind, axis, in_loop).

  See `collective_ops` for the arguments and the module docstring for how
  bytes are counted. Sorted by kind (in `KINDS` order), axis, in_loop.
  """
  totals: dict[tuple[str, str, bool], list[float]] = {}
  for op in collective_ops(program, mesh, executed):
    if not op.count:
      continue
    total = totals.setdefault((op.kind, op.axis, op.in_loop), [0, 0])
    total[0] += op.count
    total[1] += op.bytes
  return [
      Collective(kind, axis, count, nbytes, in_loop)
      for (kind, axis, in_loop), (count, nbytes) in sorted(
          totals.items(), key=lambda kv: (KINDS.index(kv[0][0]), *kv[0][1:]))
  ]


def without_metadata(text: str) -> str:
  """A program's text without source locations (op metadata and the file
  and stack-frame tables), which differ between traces of one program."""
  text = re.sub(r", metadata=\{[^}]*\}", "", text)
  return re.sub(r"\nFileNames\n.*?\n\n(?=\n*(%|ENTRY))", "\n", text, flags=re.S)


def copy_bytes(program: str | _HasText) -> tuple[int, int]:
  """(count, bytes) of the copy instructions in a program, fused ones
  included, each as often as it runs (loops times their trip counts, every
  branch of a conditional as if it ran: static, like `collectives`)."""
  module = _parse_module(_hlo_text(program))
  executions = _executions(module)
  found = [(executions[inst.computation].count, _shape_bytes(inst.shape))
           for inst in module.instructions() if inst.opcode == "copy"]
  return sum(n for n, _ in found), sum(n * b for n, b in found)


def loop_copy_bytes(program: str | _HasText) -> int:
  """Bytes one iteration of the program's first loop (a pipeline's tick)
  moves by copy instructions of their own: buffers XLA copies to pass values
  around, not the layout changes fused into a computation (a transposed or
  concatenated weight). Nested loops count times their trips, each
  conditional at its costliest branch."""
  module = _parse_module(_hlo_text(program))

  @functools.cache
  def copied(name: str) -> int:
    total = 0
    for inst in module.computations[name]:
      total += _shape_bytes(inst.shape) if inst.opcode == "copy" else 0
      callees = [c for c in module.called(inst) if inst.opcode != "fusion"]
      if inst.opcode == "while":
        total += (_trip_count(inst) or 1) * sum(copied(c) for c in callees)
      elif inst.opcode == "conditional":
        total += max((copied(c) for c in callees), default=0)
      else:
        total += sum(copied(c) for c in callees)
    return total

  def first_loop(name: str) -> _Instruction | None:
    for inst in module.computations[name]:
      if inst.opcode == "while":
        return inst
      for callee in module.called(inst):
        if (found := first_loop(callee)) is not None:
          return found
    return None

  loop = first_loop(module.entry)
  if loop is None:
    raise ValueError("the program has no loop")
  body = re.search(r"body=%([\w.\-]+)", loop.attributes).group(1)
  return copied(body)


@dataclasses.dataclass(frozen=True)
class Placement:
  """One move of a value into a memory (`jax.device_put` to a memory space:
  an `annotate_device_placement` custom call in the program XLA receives)."""
  memory: str                # where the value goes: "device" or "pinned_host"
  dims: tuple[int, ...]      # its global shape
  in_loop: bool              # inside a loop body (a layer's scan), not once per program
  executions: int            # per program run: loops times their trip counts
  parameter: int | None      # the program's argument it places, if it places one as it came
  replaced: bool             # its value was placed just before (jax's own output annotation)
  after_barrier: bool        # it passed an optimization barrier: placed no earlier than the
                             # barrier's other operands are computed


def _is_placement(inst: _Instruction) -> bool:
  return inst.opcode == "custom-call" and "annotate_device_placement" in inst.attributes


def placements(program: str | _HasText) -> list[Placement]:
  """The memory placements of an HLO program: the text of
  `lowered.compiler_ir("hlo").as_hlo_text()` (before XLA's passes). jax
  writes them only where the lowering platform has memories apart (GPU, TPU):
  to see a CPU program's, lower it with `lowering_platforms=("cuda",)`."""
  module = _parse_module(_hlo_text(program))
  executions = _executions(module)

  def source(inst: _Instruction) -> tuple[_Instruction, bool]:
    """The value a placement's operand is, through layout annotations and
    optimization barriers, and whether it passed a barrier."""
    barrier = False
    while True:
      if inst.opcode == "custom-call" and 'custom_call_target="Sharding"' in inst.attributes:
        inst = module.by_name[(inst.computation, inst.operands[0])]
        continue
      tuple_of = module.by_name.get((inst.computation, inst.operands[0])) if inst.operands else None
      if (inst.opcode == "get-tuple-element" and tuple_of is not None
          and tuple_of.opcode == "opt-barrier"):
        elements = module.by_name[(inst.computation, tuple_of.operands[0])]
        index = int(re.search(r"index=(\d+)", inst.attributes).group(1))
        inst, barrier = module.by_name[(inst.computation, elements.operands[index])], True
        continue
      return inst, barrier

  found = []
  for inst in filter(_is_placement, module.instructions()):
    memory = re.search(r'_xla_buffer_placement="?(\w+)', inst.attributes).group(1)
    runs = executions[inst.computation]
    dims = re.search(r"\[([\d,]*)\]", inst.shape).group(1)
    value, barrier = source(module.by_name[(inst.computation, inst.operands[0])])
    parameter = (int(value.operands[0]) if value.opcode == "parameter"
                 and value.computation == module.entry else None)
    found.append(Placement(memory, tuple(_ints(dims)), runs.in_loop, runs.count, parameter,
                           _is_placement(value), barrier))
  return found


def memory_bytes(compiled: Any) -> dict[str, int]:
  """Per-device buffer sizes XLA planned for a compiled program.

  Returns:
    "arguments": bytes of this device's input buffers (its shards);
    "outputs": bytes of its output buffers;
    "temp": scratch bytes live during the program (activations, workspace);
    "alias": bytes of outputs that reuse an input buffer (donated arguments);
    "total": arguments + outputs + temp - alias, the peak a device needs.
  """
  stats = compiled.memory_analysis()
  sizes = {
      "arguments": int(stats.argument_size_in_bytes),
      "outputs": int(stats.output_size_in_bytes),
      "temp": int(stats.temp_size_in_bytes),
      "alias": int(stats.alias_size_in_bytes),
  }
  sizes["total"] = (sizes["arguments"] + sizes["outputs"] + sizes["temp"] -
                    sizes["alias"])
  return sizes
