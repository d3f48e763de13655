"""Checks of a schedule table: every op once, in dependency order, and every
buffer slot written before it is read and free when it is written."""

from typing import NoReturn

import numpy as np

from meshtrain.parallel.pipeline.schedule import (ARRAY_FIELDS, B, BUFFERS, F, IDLE, OP_LETTERS,
                                                  PLACEMENTS, SLOT_FIELDS, W, Schedule,
                                                  value_uses)

def validate(schedule: Schedule) -> None:
  """Raises ValueError naming the first broken rule, tick and stage.

  Checks: ops are valid (kind, mb, chunk); every F, B and W of each (mb,
  global chunk) runs exactly once (a forward-only table: every F, no B or
  W); F of chunk c after F of c - 1, B after its F and after B of c + 1, W
  after its B; replaying the buffers, values go to free slots and every op
  reads the slot holding its own value.
  """
  if schedule.placement not in PLACEMENTS or (
      schedule.placement == "v" and schedule.num_chunks != 2):
    raise ValueError(f"placement {schedule.placement!r} with {schedule.num_chunks} chunks a "
                     f"stage: a table is 'loop' (any chunks) or 'v' (two)")
  shape = schedule.op.shape
  if len(shape) != 2 or shape[1] != schedule.num_stages:
    raise ValueError(f"op has shape {shape}, expected [ticks, {schedule.num_stages}]")
  for field in ARRAY_FIELDS:
    if getattr(schedule, field).shape != shape:
      raise ValueError(f"{field} has shape {getattr(schedule, field).shape}, expected {shape}")
  bad = ((schedule.op < IDLE) | (schedule.op > W) | (schedule.mb >= schedule.num_microbatches)
         | (schedule.chunk >= schedule.num_chunks)
         | ((schedule.op == IDLE) != (schedule.mb < 0)) | ((schedule.mb < 0) != (schedule.chunk < 0)))
  if bad.any():
    tick, stage = np.argwhere(bad)[0]
    raise ValueError(f"tick {tick} stage {stage}: op {schedule.op[tick, stage]} (microbatch "
                     f"{schedule.mb[tick, stage]}, chunk {schedule.chunk[tick, stage]}) is not a "
                     f"valid op, microbatch and chunk, nor idle with both -1")
  kinds = (F, B, W) if schedule.has_backward else (F,)
  ticks = {kind: _op_ticks(schedule, kind, kind in kinds) for kind in (F, B, W)}
  _check_dependencies(schedule, ticks)
  _check_buffers(schedule)


def _op_ticks(schedule: Schedule, kind: int, required: bool) -> dict[tuple[int, int], int]:
  """(mb, global chunk) -> tick of its one `kind` op; raises if not one."""
  found: dict[tuple[int, int], list[int]] = {}
  for tick, stage in np.argwhere(schedule.op == kind):
    key = (int(schedule.mb[tick, stage]),
           schedule.global_chunks(int(stage), int(schedule.chunk[tick, stage])))
    found.setdefault(key, []).append(int(tick))
  for mb in range(schedule.num_microbatches):
    for c in range(schedule.num_stages * schedule.num_chunks):
      at = found.get((mb, c), [])
      if len(at) != (1 if required else 0):
        what = "is missing" if not at else f"runs at ticks {at}"
        raise ValueError(f"{OP_LETTERS[kind]} of {_value(schedule, mb, c)} {what}; it must run "
                         f"{'exactly once' if required else 'never in a forward-only table'}")
  return {key: at[0] for key, at in found.items()}


def _value(schedule: Schedule, mb: int, chunk: int) -> str:
  stage, v = schedule.stage_chunks(chunk)
  return f"microbatch {mb} chunk {chunk} (stage {stage}, virtual chunk {v})"


def _check_dependencies(schedule: Schedule, ticks: dict[int, dict]) -> None:
  last = schedule.num_stages * schedule.num_chunks - 1
  rules = [(F, F, -1, "its input"), (B, F, 0, "its forward"), (B, B, 1, "its gradient"),
           (W, B, 0, "its input gradient")]
  for kind, need_kind, offset, what in rules:
    for (mb, c), tick in ticks[kind].items():
      if not 0 <= c + offset <= last:
        continue
      need = ticks[need_kind][mb, c + offset]
      if tick <= need:
        raise ValueError(f"{OP_LETTERS[kind]} of {_value(schedule, mb, c)} runs at tick {tick}, "
                         f"before {what} from tick {need} is there")


class _Buffer:
  """Replays one stage's slots: writes need a free slot, reads their value."""

  def __init__(self, kind: str, stage: int):
    self.kind, self.stage, self.held = kind, stage, {}

  def write(self, tick: int, slot: int, value: tuple[int, int]) -> None:
    if slot < 0:
      self.fail(tick, f"{self._name(value)} needs a slot but has {slot}")
    if slot in self.held:
      self.fail(tick, f"writing {self._name(value)} overwrites slot {slot}, "
                f"which still holds {self._name(self.held[slot])}")
    self.held[slot] = value

  def read(self, tick: int, slot: int, value: tuple[int, int], free: bool) -> None:
    held = self.held.get(slot)
    if held != value:
      self.fail(tick, f"reads slot {slot} for {self._name(value)} but it "
                f"holds {self._name(held) if held else 'nothing'}")
    if free:
      del self.held[slot]

  def fail(self, tick: int, message: str) -> NoReturn:
    raise ValueError(f"tick {tick} stage {self.stage}: {message}")

  def _name(self, value: tuple[int, int]) -> str:
    return f"the {self.kind} of microbatch {value[0]} chunk {value[1]}"


def _check_buffers(schedule: Schedule) -> None:
  """Replays every stage's buffers tick by tick: arrivals, then the op, which
  writes and reads exactly the slots its values need."""
  expected = {}  # (column, tick, stage) -> (buffer, value, action)
  for buffer, uses in value_uses(schedule.num_stages, schedule.num_chunks, schedule.op,
                                  schedule.mb, schedule.chunk, schedule.placement).items():
    for (stage, mb, v), events in uses.items():
      events = sorted(events, key=lambda e: e[1])
      for i, (column, tick) in enumerate(events):
        action = "write" if i == 0 else ("free" if i == len(events) - 1 else "read")
        expected[column, tick, stage] = (buffer, (mb, v), action)
  for stage in range(schedule.num_stages):
    buffers = {name: _Buffer(name, stage) for name in BUFFERS}
    for tick in range(schedule.num_ticks):
      for column in SLOT_FIELDS:
        slot = int(getattr(schedule, column)[tick, stage])
        use = expected.get((column, tick, stage))
        if use is None:
          if slot != -1:
            buffers["act"].fail(tick, f"{column} is {slot} but no value uses it")
          continue
        name, value, action = use
        if action == "write":
          buffers[name].write(tick, slot, value)
        else:
          buffers[name].read(tick, slot, value, free=action == "free")
