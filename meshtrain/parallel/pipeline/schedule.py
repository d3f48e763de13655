"""Pipeline schedules as static tables: what every stage runs at every tick.

A runtime (one `lax.scan` over ticks inside `shard_map`) indexes these arrays
with `(tick, axis_index('pipeline'))`; nothing here runs a model. This module
holds the table and its builders; `checks.validate` checks a table, `measures`
times and prints it, `draw` draws it.

Ops. The backward is split as zero-bubble pipelines split it (Qi et al.
2023): F (forward, keeps its residuals), B (input gradient, sent on at once)
and W (weight gradient, frees the residuals); each costs about one F, and a
stage runs at most one op per tick. P stages, M microbatches, V model chunks
per stage, placed by the table's `placement`:
  - "loop" (Megatron's interleaved layout): chunk v of stage s is global
    chunk c = v * P + s. After its op every stage sends an F output one step
    right on the ring (stage P-1 to stage 0 moves on to the next chunk) and
    a B output (the input gradient) one step left.
  - "v" (V = 2, the V of ZB-V and DualPipeV): stage s holds chunks s and
    2P - 1 - s, so a microbatch goes down the stages and comes back up them.
    On the way down F outputs go right and B outputs left, on the way up
    the other way; stage P-1 hands chunk P-1's output to chunk P (and chunk
    P's input gradient to chunk P-1) without a send. Values on the way up
    (chunks P and beyond) arrive in their own slot columns
    (`act_recv2_slot`, `grad_recv2_slot`), since a stage may receive one
    from each side in a tick.
A value made at tick t is usable from tick t + 1 on.

Builders are per-stage op orders (like JaxPP's task lists) placed by one
rule: each stage runs its next op at the first tick its inputs are there.
"""

import dataclasses
import functools
import heapq

import numpy as np

SCHEDULE_NAMES = ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zb_h2", "zb_v")
# The schedules whose tables place their chunks on the V (`placement` "v").
V_SCHEDULES = ("zb_v",)
PLACEMENTS = ("loop", "v")
IDLE, F, B, W = 0, 1, 2, 3
OP_LETTERS = {F: "F", B: "B", W: "W"}

# Every buffer of a stage: the values it holds, where they are written and
# read (table columns), and what frees them. (kind, stage, mb, chunk) keys.
SLOT_FIELDS = ("act_recv_slot", "act_recv2_slot", "act_slot", "grad_recv_slot",
               "grad_recv2_slot", "grad_slot", "res_slot", "cut_slot", "head_res_slot",
               "head_cut_slot")
ARRAY_FIELDS = ("op", "mb", "chunk", *SLOT_FIELDS)
BUFFERS = {  # buffer -> (columns written, read, read last)
    "act": ("act_recv_slot", "act_recv2_slot", "act_slot"),      # arrival -> F
    "grad": ("grad_recv_slot", "grad_recv2_slot", "grad_slot"),  # arrival -> B
    "res": ("res_slot", "res_slot", "res_slot"),             # F -> B -> W
    "cut": ("cut_slot", "cut_slot", "cut_slot"),             # B -> W
    "head_res": ("head_res_slot", "head_res_slot", "head_res_slot"),  # last chunk's head
    "head_cut": ("head_cut_slot", "head_cut_slot", "head_cut_slot"),
}


@dataclasses.dataclass(frozen=True, eq=False)
class Schedule:
  """A pipeline schedule: int32 arrays of shape [ticks, stages], -1 = none.

  op: IDLE, F, B or W; mb, chunk: its microbatch and chunk v in [0, V).
  Slots (each buffer holds `slots[buffer]` values per stage):
    act_recv_slot / grad_recv_slot: where the activation (gradient) arriving
      at the start of this tick is written, -1 if none arrives;
      act_recv2_slot / grad_recv2_slot: the same for one of a chunk on the
      V's way up (chunks P and beyond; -1 in a "loop" table).
    act_slot: the activation F reads (and frees); -1 for chunk 0 of stage 0,
      whose F starts from the embedding.
    grad_slot: the output gradient B reads (and frees); -1 for the last chunk,
      whose gradient is the loss's.
    res_slot: the residuals F writes, B reads and W reads and frees.
    cut_slot: what B computes for W (gradients at the weights' outputs).
    head_res_slot, head_cut_slot: the same for the head and loss, which only
      the last chunk runs.
  A forward-only schedule (`forward_only`) has F ops only and no slots but act.
  """

  name: str
  num_stages: int
  num_microbatches: int
  num_chunks: int
  op: np.ndarray
  mb: np.ndarray
  chunk: np.ndarray
  act_recv_slot: np.ndarray
  act_recv2_slot: np.ndarray
  act_slot: np.ndarray
  grad_recv_slot: np.ndarray
  grad_recv2_slot: np.ndarray
  grad_slot: np.ndarray
  res_slot: np.ndarray
  cut_slot: np.ndarray
  head_res_slot: np.ndarray
  head_cut_slot: np.ndarray
  placement: str = "loop"

  def __post_init__(self):
    # Read-only int32 copies: the table cannot change under a runtime.
    for field in ARRAY_FIELDS:
      array = np.array(getattr(self, field), dtype=np.int32)
      array.setflags(write=False)
      object.__setattr__(self, field, array)

  def global_chunks(self, stage, v):
    return global_chunks(self.placement, self.num_stages, stage, v)

  def stage_chunks(self, c):
    return stage_chunks(self.placement, self.num_stages, c)

  @property
  def num_ticks(self) -> int:
    return self.op.shape[0]

  @property
  def has_backward(self) -> bool:
    return bool((self.op == B).any())

  def slots_per_stage(self, buffer: str) -> list[int]:
    """Slots of `buffer` each stage uses (its most values at once)."""
    columns = np.stack([getattr(self, c) for c in BUFFERS[buffer]])
    return [int(n) + 1 for n in columns.max(axis=(0, 1))]

  def num_slots(self, buffer: str) -> int:
    return max(self.slots_per_stage(buffer))

  def sends(self) -> np.ndarray:
    """[ticks, 2] bool: whether some stage receives an activation (column 0)
    or a gradient (column 1) at the next tick, so that every stage sends
    one after this tick."""
    arrives = np.stack([(self.act_recv_slot >= 0).any(1), (self.grad_recv_slot >= 0).any(1)], 1)
    return np.concatenate([arrives[1:], np.zeros((1, 2), bool)])


def global_chunks(placement: str, num_stages: int, stage, v):
  """The global chunk that local chunk `v` of `stage` is (ints or int arrays)."""
  stage, v = np.asarray(stage), np.asarray(v)
  c = (np.where(v == 0, stage, 2 * num_stages - 1 - stage) if placement == "v"
       else v * num_stages + stage)
  return int(c) if c.ndim == 0 else c


def stage_chunks(placement: str, num_stages: int, c) -> tuple:
  """(stage, local chunk v) of global chunk `c` (an int or an int array)."""
  c = np.asarray(c)
  if placement == "v":
    stage, v = np.where(c < num_stages, c, 2 * num_stages - 1 - c), (c >= num_stages).astype(int)
  else:
    stage, v = c % num_stages, c // num_stages
  return (int(stage), int(v)) if c.ndim == 0 else (stage, v)


# Building from per-stage op orders.

Op = tuple[int, int, int]  # (kind, mb, chunk)


def place(name: str, num_stages: int, num_microbatches: int, num_chunks: int,
          orders: list[list[Op]], placement: str = "loop") -> Schedule:
  """Places each stage's ops in order, every op at the first tick it can run.

  An F needs its input (the previous chunk's F, a tick earlier); a B its F
  and the next chunk's B (a tick earlier); a W its B. Stages move in lock
  step, one op per tick.
  """
  done: dict[Op, int] = {}  # (kind, mb, global chunk) -> tick
  last = num_stages * num_chunks - 1
  position = [0] * num_stages
  left = sum(map(len, orders))
  rows = []
  while left:
    tick = len(rows)
    row = [(IDLE, -1, -1)] * num_stages
    ran = []
    for stage in range(num_stages):
      if position[stage] == len(orders[stage]):
        continue
      kind, mb, v = orders[stage][position[stage]]
      c = global_chunks(placement, num_stages, stage, v)
      if kind == F:
        ready = c == 0 or done.get((F, mb, c - 1), tick) < tick
      elif kind == B:
        ready = done.get((F, mb, c), tick) < tick and (
            c == last or done.get((B, mb, c + 1), tick) < tick)
      else:
        ready = done.get((B, mb, c), tick) < tick
      if ready:
        row[stage] = (kind, mb, v)
        position[stage] += 1
        ran.append((kind, mb, c))
    if not ran:
      raise ValueError(f"{name}: the op orders deadlock at tick {tick} "
                       f"(next ops {[o[p] if p < len(o) else None for o, p in zip(orders, position)]})")
    done.update(dict.fromkeys(ran, tick))
    left -= len(ran)
    rows.append(row)
  table = np.array(rows, np.int32).reshape(len(rows), num_stages, 3)
  return from_ops(name, num_stages, num_microbatches, num_chunks,
                  table[..., 0], table[..., 1], table[..., 2], placement)


def from_ops(name: str, num_stages: int, num_microbatches: int, num_chunks: int,
             op: np.ndarray, mb: np.ndarray, chunk: np.ndarray,
             placement: str = "loop") -> Schedule:
  """Completes op tables into a Schedule by giving each value a buffer slot.

  Every value lives from its write to its last read; each takes the lowest
  slot free over that span. Greedy by start time is optimal for intervals,
  so a stage uses exactly as many slots as it ever holds values at once.
  """
  op, mb, chunk = (np.asarray(t, np.int32) for t in (op, mb, chunk))
  tables = {field: np.full(op.shape, -1, np.int32) for field in SLOT_FIELDS}
  for events in _value_events(num_stages, num_chunks, op, mb, chunk, placement).values():
    slot_of_value = _assign_slots(events, num_stages)
    for index, column in enumerate(SLOT_FIELDS):
      here = events.column == index
      tables[column][events.tick[here], events.stage[here]] = slot_of_value[events.value[here]]
  return Schedule(name, num_stages, num_microbatches, num_chunks, op, mb, chunk, **tables,
                  placement=placement)


# What an op of chunk c at tick t writes or reads: (its kind, the buffer, the
# value's chunk as c + offset, the column of SLOT_FIELDS, the tick as t +
# offset, the chunks c it applies to: "any", "last" (c = P V - 1), "not
# first" or "not last", "down" and "up" (its value's chunk on the way down
# or up the V: every value is "down" in a "loop" table), and whether only a
# table with B ops has it: a forward-only table stashes nothing). A cell's
# events are met in this order, which breaks ties between values that start
# at the same tick.
_EVENT_RULES = (
    (F, "act", 0, "act_slot", 0, "not first", False),
    (F, "act", 1, "act_recv_slot", 1, "next down", False),
    (F, "act", 1, "act_recv2_slot", 1, "next up", False),
    (F, "res", 0, "res_slot", 0, "any", True),
    (F, "head_res", 0, "head_res_slot", 0, "last", True),
    (B, "res", 0, "res_slot", 0, "any", True),
    (B, "cut", 0, "cut_slot", 0, "any", True),
    (B, "grad", 0, "grad_slot", 0, "not last", True),
    (B, "head_res", 0, "head_res_slot", 0, "last", True),
    (B, "head_cut", 0, "head_cut_slot", 0, "last", True),
    (B, "grad", -1, "grad_recv_slot", 1, "previous down", True),
    (B, "grad", -1, "grad_recv2_slot", 1, "previous up", True),
    (W, "res", 0, "res_slot", 0, "any", True),
    (W, "cut", 0, "cut_slot", 0, "any", True),
    (W, "head_res", 0, "head_res_slot", 0, "last", True),
    (W, "head_cut", 0, "head_cut_slot", 0, "last", True),
)


@dataclasses.dataclass(frozen=True)
class _Events:
  """One buffer's reads and writes in the order a walk over the table
  (tick by tick, stage by stage, `_EVENT_RULES` in a cell) meets them, as
  int arrays: the stage, the value's microbatch and chunk v, the column
  (index in SLOT_FIELDS), the tick, and `value`, which of the buffer's
  values (numbered as first met)."""
  stage: np.ndarray
  mb: np.ndarray
  chunk: np.ndarray
  column: np.ndarray
  tick: np.ndarray
  value: np.ndarray


def _value_events(num_stages: int, num_chunks: int, op: np.ndarray, mb: np.ndarray,
                  chunk: np.ndarray, placement: str = "loop") -> dict[str, _Events]:
  """buffer -> its `_Events`, read off the op tables by `_EVENT_RULES`."""
  num_ticks, last = op.shape[0], num_stages * num_chunks - 1
  cell_tick, cell_stage = np.nonzero(op != IDLE)  # tick-major, as the walk goes
  kind, cell_mb = op[cell_tick, cell_stage], mb[cell_tick, cell_stage]
  c = global_chunks(placement, num_stages, cell_stage, chunk[cell_tick, cell_stage])
  has_backward = bool((kind == B).any())
  turn = num_stages if placement == "v" else last + 1  # the first chunk on the way up
  where = {"any": c >= 0, "last": c == last, "not first": c > 0, "not last": c < last,
           "next down": c + 1 < turn, "next up": (c + 1 >= turn) & (c < last),
           "previous down": (c > 0) & (c - 1 < turn), "previous up": c - 1 >= turn}
  parts = {buffer: [] for buffer in BUFFERS}
  for rule, (rule_kind, buffer, c_offset, column, tick_offset, chunks, backward) in enumerate(
      _EVENT_RULES):
    if backward and not has_backward:
      continue
    tick = cell_tick + tick_offset
    cells = np.nonzero((kind == rule_kind) & where[chunks] & (tick < num_ticks))[0]
    parts[buffer].append(np.stack([
        cells * len(_EVENT_RULES) + rule, c[cells] + c_offset, cell_mb[cells],
        np.full(len(cells), SLOT_FIELDS.index(column)), tick[cells]]))
  events = {}
  for buffer, found in parts.items():
    walk, value_c, value_mb, column, tick = np.concatenate([np.empty((5, 0), int), *found], 1)
    if not walk.size:
      continue
    in_walk = np.argsort(walk, kind="stable")
    value_c, value_mb, column, tick = (a[in_walk] for a in (value_c, value_mb, column, tick))
    _, first, value = np.unique(value_c * (int(mb.max()) + 1) + value_mb, return_index=True,
                                return_inverse=True)
    as_met = np.argsort(np.argsort(first))
    value_stage, value_v = stage_chunks(placement, num_stages, value_c)
    events[buffer] = _Events(value_stage, value_mb, value_v, column, tick, as_met[value.ravel()])
  return events


def value_uses(num_stages: int, num_chunks: int, op: np.ndarray, mb: np.ndarray,
               chunk: np.ndarray, placement: str = "loop"
               ) -> dict[str, dict[tuple[int, int, int], list[tuple[str, int]]]]:
  """buffer -> {(stage, mb, chunk): [(column, tick), ...]}: what
  `from_ops` places, for `checks` to replay."""
  uses = {buffer: {} for buffer in BUFFERS}
  for buffer, e in _value_events(num_stages, num_chunks, np.asarray(op), np.asarray(mb),
                                 np.asarray(chunk), placement).items():
    for stage, mb_, v, column, tick in zip(*(a.tolist() for a in (
        e.stage, e.mb, e.chunk, e.column, e.tick))):
      uses[buffer].setdefault((stage, mb_, v), []).append((SLOT_FIELDS[column], tick))
  return uses


def _assign_slots(events: _Events, num_stages: int) -> np.ndarray:
  """The slot of each value: by start tick (ties: as first met), each takes
  its stage's lowest slot whose value is dead by then (`free`: ordered
  heaps; `busy`: (last tick, slot) heaps)."""
  values = int(events.value.max()) + 1
  start, end = np.full(values, np.iinfo(np.int64).max), np.full(values, -1)
  np.minimum.at(start, events.value, events.tick)
  np.maximum.at(end, events.value, events.tick)
  stage = np.zeros(values, np.int64)
  stage[events.value] = events.stage
  slots = [0] * num_stages  # slots each stage has opened
  free = [[] for _ in range(num_stages)]
  busy = [[] for _ in range(num_stages)]
  slot_of_value = np.zeros(values, np.int32)
  order = np.argsort(start, kind="stable")
  for value, s, begin, finish in zip(order.tolist(), stage[order].tolist(),
                                     start[order].tolist(), end[order].tolist()):
    while busy[s] and busy[s][0][0] < begin:
      heapq.heappush(free[s], heapq.heappop(busy[s])[1])
    if free[s]:
      slot = heapq.heappop(free[s])
    else:
      slot, slots[s] = slots[s], slots[s] + 1
    heapq.heappush(busy[s], (finish, slot))
    slot_of_value[value] = slot
  return slot_of_value


# Op orders.


def _megatron_orders(num_stages: int, num_microbatches: int, num_chunks: int,
                     warmup: list[int]) -> list[list[Op]]:
  """Warm-up forwards, then one forward and one backward (B then W) in turn,
  then the remaining backwards: Megatron's 1F1B and interleaved order.

  Forwards go in groups of P microbatches (the last takes the remainder):
  chunk 0 for the group, then chunk 1, ...; backwards in the same groups with
  the chunks reversed.
  """
  fwd, bwd = [], []
  for group in _microbatch_groups(num_microbatches, num_stages):
    fwd += [(mb, v) for v in range(num_chunks) for mb in group]
    bwd += [(mb, v) for v in reversed(range(num_chunks)) for mb in group]
  orders = []
  for stage in range(num_stages):
    n = min(warmup[stage], len(fwd))
    order = [(F, *item) for item in fwd[:n]]
    for i in range(len(bwd)):
      if n + i < len(fwd):
        order.append((F, *fwd[n + i]))
      order += [(B, *bwd[i]), (W, *bwd[i])]
    orders.append(order)
  return orders


def _microbatch_groups(num_microbatches: int, num_stages: int) -> list[range]:
  """Consecutive groups of P microbatches; the last takes the remainder."""
  starts = list(range(0, num_microbatches - num_stages + 1, num_stages)) or [0]
  ends = starts[1:] + [num_microbatches]
  return [range(start, end) for start, end in zip(starts, ends)]


def gpipe(num_stages: int, num_microbatches: int) -> Schedule:
  """All forwards, then all backwards; every stage holds all M microbatches."""
  _check_sizes(num_stages, num_microbatches, 1)
  order = ([(F, mb, 0) for mb in range(num_microbatches)]
           + [op for mb in range(num_microbatches) for op in ((B, mb, 0), (W, mb, 0))])
  return place("gpipe", num_stages, num_microbatches, 1, [order] * num_stages)


def one_f_one_b(num_stages: int, num_microbatches: int) -> Schedule:
  """Megatron's 1F1B: stage s runs P - s - 1 warm-up forwards, so it holds
  min(M, P - s) microbatches; B and W run back to back (Megatron's backward)."""
  _check_sizes(num_stages, num_microbatches, 1)
  warmup = [num_stages - s - 1 for s in range(num_stages)]
  return place("1f1b", num_stages, num_microbatches, 1,
               _megatron_orders(num_stages, num_microbatches, 1, warmup))


def interleaved_one_f_one_b(num_stages: int, num_microbatches: int,
                            num_chunks: int) -> Schedule:
  """Megatron's interleaved 1F1B with V chunks per stage: warm-up
  (P - s - 1) * 2 + (V - 1) * P forwards on stage s, so its bubble is about
  (P - 1)/(V M + P - 1) at the cost of more chunk activations in flight.
  M must be a multiple of P (for V > 1): chunk v + 1 of a microbatch needs
  P ticks to come round the ring, which a group of P microbatches fills."""
  _check_sizes(num_stages, num_microbatches, num_chunks)
  _check_interleaving(num_stages, num_microbatches, num_chunks)
  warmup = [(num_stages - s - 1) * 2 + (num_chunks - 1) * num_stages
            for s in range(num_stages)]
  if num_chunks == 1:
    warmup = [num_stages - s - 1 for s in range(num_stages)]
  return place("interleaved_1f1b", num_stages, num_microbatches, num_chunks,
               _megatron_orders(num_stages, num_microbatches, num_chunks, warmup))


def _zero_bubble(name: str, num_stages: int, num_microbatches: int,
                 before_b: list[int], before_w: list[int]) -> Schedule:
  """Zero-bubble placement (Qi et al. 2023): each tick a stage runs a B if a
  gradient waits, else an F if it holds fewer than `before_b[s]` microbatches
  awaiting their B and fewer than `before_w[s]` awaiting their W, else a W:
  W is the op that fills the bubbles."""
  _check_sizes(num_stages, num_microbatches, 1)
  m, last = num_microbatches, num_stages - 1
  done: dict[tuple[int, int, int], int] = {}
  next_f, next_b, next_w = [0] * num_stages, [0] * num_stages, [0] * num_stages
  rows = []
  while min(next_w) < m:
    tick = len(rows)
    row = []
    for s in range(num_stages):
      ready_f = next_f[s] < m and (s == 0 or done.get((F, next_f[s], s - 1), tick) < tick)
      ready_b = (next_b[s] < next_f[s] and done.get((F, next_b[s], s), tick) < tick
                 and (s == last or done.get((B, next_b[s], s + 1), tick) < tick))
      if ready_b:
        row.append((B, next_b[s]))
        next_b[s] += 1
      elif (ready_f and next_f[s] - next_b[s] < before_b[s]
            and next_f[s] - next_w[s] < before_w[s]):
        row.append((F, next_f[s]))
        next_f[s] += 1
      elif next_w[s] < next_b[s]:
        row.append((W, next_w[s]))
        next_w[s] += 1
      else:
        row.append((IDLE, -1))
    for s, (kind, mb) in enumerate(row):
      if kind != IDLE:
        done[kind, mb, s] = tick
    rows.append(row)
  op = np.array([[kind for kind, _ in row] for row in rows], np.int32)
  mbs = np.array([[mb for _, mb in row] for row in rows], np.int32)
  return from_ops(name, num_stages, num_microbatches, 1, op, mbs, np.where(op > 0, 0, -1))


def zb_h1(num_stages: int, num_microbatches: int) -> Schedule:
  """ZB-H1: 1F1B's activations (P - s microbatches awaiting B on stage s),
  up to P - 1 W deferred into the bubbles: (P - 1)/(3M + P - 1) at F = B = W,
  a third of 1F1B's idle time."""
  p = num_stages
  return _zero_bubble("zb_h1", p, num_microbatches, [p - s for s in range(p)],
                      [2 * p - s - 1 for s in range(p)])


def zb_h2(num_stages: int, num_microbatches: int) -> Schedule:
  """ZB-H2: up to 2(P - s) - 1 microbatches awaiting B on stage s, enough
  warm-up forwards to fill the start of the pipeline; more memory, and the
  smallest bubble when W costs less than F or B."""
  p = num_stages
  return _zero_bubble("zb_h2", p, num_microbatches, [2 * (p - s) - 1 for s in range(p)],
                      [3 * p - 2 * s - 2 for s in range(p)])


def zb_v(num_stages: int, num_microbatches: int) -> Schedule:
  """ZB-V (Qi et al. 2023, section 6; 2024's V-ZB): 2P chunks on the V, each
  F, B and W of a chunk half a stage's. Each tick a stage runs a B whose
  output gradient is there (the oldest microbatch first, then the chunk on
  the way up), else an F whose input is there (the chunk on the way up
  first) while it holds fewer than 2P chunks' activations awaiting their W,
  1F1B's peak (P microbatches of a whole stage's layers), else the oldest W.
  Each chunk runs its microbatches' F and B in order. The paper's bubble at
  F = B = W is zero; in lock step it is (P - 1)/(6M + P - 1) once M >= 2P
  (docs/pipeline.md). Its sends are twice 1F1B's."""
  _check_sizes(num_stages, num_microbatches, 2)
  p, m = num_stages, num_microbatches
  last, holds = 2 * p - 1, 2 * p
  done: dict[tuple[int, int, int], int] = {}  # (kind, mb, global chunk) -> tick
  next_f, next_b = [0] * (2 * p), [0] * (2 * p)  # per global chunk, its next microbatch
  chunks = [(global_chunks("v", p, s, 1), global_chunks("v", p, s, 0)) for s in range(p)]
  awaiting_w = [[] for _ in range(p)]  # (mb, c) in the order their B ran
  rows, left = [], 3 * m * 2 * p
  while left:
    tick, row = len(rows), []

    def ran(key) -> bool:
      return done.get(key, tick) < tick
    for s in range(p):
      ready_b = [(next_b[c], c) for c in chunks[s] if next_b[c] < next_f[c]
                 and ran((F, next_b[c], c)) and (c == last or ran((B, next_b[c], c + 1)))]
      ready_f = [(next_f[c], c) for c in chunks[s]
                 if next_f[c] < m and (c == 0 or ran((F, next_f[c], c - 1)))]
      held = sum(next_f[c] for c in chunks[s]) - sum(next_b[c] for c in chunks[s]) + len(
          awaiting_w[s])
      if ready_b:
        mb, c = min(ready_b, key=lambda item: item[0])
        row.append((B, mb, c))
        next_b[c] += 1
        awaiting_w[s].append((mb, c))
      elif ready_f and held < holds:
        mb, c = ready_f[0]
        row.append((F, mb, c))
        next_f[c] += 1
      elif awaiting_w[s]:
        row.append((W, *awaiting_w[s].pop(0)))
      else:
        row.append((IDLE, -1, -1))
    ops = [cell for cell in row if cell[0] != IDLE]
    if not ops:
      raise ValueError(f"zb_v: nothing can run at tick {tick}")
    done.update(dict.fromkeys(ops, tick))
    left -= len(ops)
    rows.append([(kind, mb, -1 if kind == IDLE else stage_chunks("v", p, c)[1])
                 for kind, mb, c in row])
  table = np.array(rows, np.int32)
  return from_ops("zb_v", p, m, 2, table[..., 0], table[..., 1], table[..., 2], "v")


def forward_only(num_stages: int, num_microbatches: int, num_chunks: int = 1) -> Schedule:
  """Forwards only (evaluation): GPipe's forward wave, nothing stashed."""
  _check_sizes(num_stages, num_microbatches, num_chunks)
  order = [(F, mb, v) for group in _microbatch_groups(num_microbatches, num_stages)
           for v in range(num_chunks) for mb in group]
  return place("forward", num_stages, num_microbatches, num_chunks, [order] * num_stages)


@functools.lru_cache(maxsize=256)
def build(name: str, num_stages: int, num_microbatches: int,
          num_chunks: int = 1) -> Schedule:
  """The schedule called `name` (one of SCHEDULE_NAMES), built once per
  arguments and shared: its arrays are read-only."""
  table = _build(name, num_stages, num_microbatches, num_chunks)
  for field in ARRAY_FIELDS:
    getattr(table, field).flags.writeable = False
  return table


class ArgumentError(ValueError):
  """Arguments no schedule is built from; `argument` names the wrong one:
  "name", "num_stages", "num_microbatches" or "num_chunks" (for several, the
  first that `check` looks at)."""

  def __init__(self, argument: str, message: str):
    super().__init__(message)
    self.argument = argument


def check(name: str, num_stages: int, num_microbatches: int, num_chunks: int = 1) -> None:
  """Raises the ArgumentError that `build` would for these arguments, without
  building the table (which takes seconds for thousands of microbatches). It
  looks at the name, then each size (a positive integer), then how the sizes
  fit the schedule."""
  if name not in SCHEDULE_NAMES:
    raise ArgumentError("name", f"unknown pipeline schedule {name!r}: choose one of "
                        f"{', '.join(SCHEDULE_NAMES)}")
  _check_sizes(num_stages, num_microbatches, num_chunks)
  if name in V_SCHEDULES and num_chunks != 2:
    raise ArgumentError("num_chunks", f"{name} runs two chunks per stage (the V), got "
                        f"num_chunks={num_chunks}: use 2")
  if name not in (*V_SCHEDULES, "interleaved_1f1b") and num_chunks != 1:
    raise ArgumentError("num_chunks", f"{name} runs one chunk per stage, got num_chunks="
                        f"{num_chunks}: use interleaved_1f1b or num_chunks=1")
  if name == "interleaved_1f1b":
    _check_interleaving(num_stages, num_microbatches, num_chunks)


def _build(name: str, num_stages: int, num_microbatches: int, num_chunks: int) -> Schedule:
  check(name, num_stages, num_microbatches, num_chunks)
  if name == "interleaved_1f1b":
    return interleaved_one_f_one_b(num_stages, num_microbatches, num_chunks)
  builders = {"gpipe": gpipe, "1f1b": one_f_one_b, "zb_h1": zb_h1, "zb_h2": zb_h2,
              "zb_v": zb_v}
  return builders[name](num_stages, num_microbatches)


def _check_sizes(num_stages: int, num_microbatches: int, num_chunks: int) -> None:
  sizes = dict(num_stages=num_stages, num_microbatches=num_microbatches,
               num_chunks=num_chunks)
  for key, value in sizes.items():
    if not isinstance(value, int | np.integer) or value < 1:
      raise ArgumentError(key, f"{key} must be a positive integer, got {value!r}")


def _check_interleaving(num_stages: int, num_microbatches: int, num_chunks: int) -> None:
  if num_chunks > 1 and num_microbatches % num_stages:
    raise ArgumentError(
        "num_microbatches", f"interleaved_1f1b needs num_microbatches to be a multiple of "
        f"num_stages (Megatron's rule), got {num_microbatches} microbatches on {num_stages} "
        f"stages: use {num_stages * max(1, round(num_microbatches / num_stages))} microbatches, "
        "or num_chunks=1")
