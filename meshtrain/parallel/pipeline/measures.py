"""What a schedule costs: bubble shares (measured on its timeline and by the
papers' formulas), in-flight microbatches, and its table as text."""

import numpy as np

from meshtrain.parallel.pipeline.schedule import B, BUFFERS, F, IDLE, OP_LETTERS, W, Schedule

def ideal_bubble_fraction(num_stages: int, num_microbatches: int, num_chunks: int = 1) -> float:
  """(P - 1)/(V M + P - 1): the textbook bubble of GPipe, 1F1B, interleaved."""
  return (num_stages - 1) / (num_chunks * num_microbatches + num_stages - 1)


def paper_bubble_fraction(name: str, num_stages: int, num_microbatches: int,
                          costs: tuple[float, float, float] = (1.0, 1.0, 1.0),
                          num_chunks: int = 1) -> float:
  """The bubble share by the formulas of Qi et al. 2023 (Table 1), idle time
  (P - 1)(F + B + W) for 1F1B and GPipe (over V for interleaved),
  (P - 1)(F + B - W) for ZB-H1 and (P - 1)(F + B - 2W), at least 0, for ZB-H2,
  none for ZB-V (its section 6, at F = B = W), against M (F + B + W) of work
  per stage."""
  f, b, w = costs
  idle = {"zb_h1": f + b - w, "zb_h2": max(f + b - 2 * w, 0.0), "zb_v": 0.0}.get(
      name, (f + b + w) / num_chunks)
  idle *= num_stages - 1
  return idle / (num_microbatches * (f + b + w) + idle)


def timeline(schedule: Schedule, costs: tuple[float, float, float] = (1.0, 1.0, 1.0)
             ) -> tuple[np.ndarray, np.ndarray]:
  """Start and end time of every op, [ticks, stages], with F, B, W costing
  `costs` (a whole stage's layers; a chunk costs 1/V): each stage runs its ops
  in table order, each as soon as the stage is free and its inputs are done
  (no lock step). Idle cells are NaN."""
  cost = np.array([0.0, *costs]) / schedule.num_chunks
  start = np.full(schedule.op.shape, np.nan)
  end = np.full(schedule.op.shape, np.nan)
  finished: dict[tuple[int, int, int], float] = {}
  free = [0.0] * schedule.num_stages
  last = schedule.num_stages * schedule.num_chunks - 1
  for tick in range(schedule.num_ticks):
    for stage in range(schedule.num_stages):
      kind = int(schedule.op[tick, stage])
      if kind == IDLE:
        continue
      mb = int(schedule.mb[tick, stage])
      c = schedule.global_chunks(stage, int(schedule.chunk[tick, stage]))
      needs = {F: [(F, mb, c - 1)] if c > 0 else [],
               B: [(F, mb, c)] + ([(B, mb, c + 1)] if c < last else []),
               W: [(B, mb, c)]}[kind]
      start[tick, stage] = max([free[stage]] + [finished[n] for n in needs])
      end[tick, stage] = free[stage] = start[tick, stage] + cost[kind]
      finished[kind, mb, c] = end[tick, stage]
  return start, end


def bubble_fraction(schedule: Schedule, costs: tuple[float, float, float] = (1.0, 1.0, 1.0)) -> float:
  """Share of stage-time spent idle on the `timeline`: 1 - busy / (P * makespan)."""
  start, end = timeline(schedule, costs)
  busy = np.nansum(end - start)
  return float(1.0 - busy / (schedule.num_stages * np.nanmax(end)))


def peak_in_flight(schedule: Schedule) -> list[int]:
  """Per stage, the most microbatch-chunks whose activations it holds for
  their B (forwarded, input gradient not yet computed), Megatron's count:
  GPipe M; 1F1B and ZB-H1 min(M, P - s)."""
  return _peak_between(schedule, F, B if schedule.has_backward else F)


def peak_awaiting_w(schedule: Schedule) -> list[int]:
  """Per stage, the most microbatch-chunks forwarded whose W has not run:
  the residual slots (W frees them)."""
  return _peak_between(schedule, F, W if schedule.has_backward else F)


def _peak_between(schedule: Schedule, opens: int, closes: int) -> list[int]:
  """Most values opened and not yet closed, counted after each tick's op (a
  closing op still holds its value while it runs)."""
  held = (np.cumsum(schedule.op == opens, axis=0) - np.cumsum(schedule.op == closes, axis=0)
          + (schedule.op == closes))
  return [int(n) for n in held.max(axis=0)] if schedule.num_ticks else [0] * schedule.num_stages


def to_text(schedule: Schedule) -> str:
  """Rows are stages, columns ticks; cells F3, B1, W1, or F3.1 (mb.chunk)."""
  ticks = range(schedule.num_ticks)
  cells = [[_cell(schedule, tick, stage) for tick in ticks] for stage in range(schedule.num_stages)]
  width = max(len(cell) for row in cells for cell in row)
  header = " " * 4 + " ".join(f"{tick:<{width}}" for tick in ticks)
  rows = [f"s{stage:<3}" + " ".join(f"{cell:<{width}}" for cell in row)
          for stage, row in enumerate(cells)]
  return "\n".join(line.rstrip() for line in [header, *rows])


def _cell(schedule: Schedule, tick: int, stage: int) -> str:
  kind = int(schedule.op[tick, stage])
  if kind == IDLE:
    return "."
  v = schedule.chunk[tick, stage]
  return f"{OP_LETTERS[kind]}{schedule.mb[tick, stage]}" + (f".{v}" if schedule.num_chunks > 1 else "")


def describe(schedule: Schedule, costs: tuple[float, float, float] = (1.0, 1.0, 1.0)) -> dict:
  """A JSON-ready summary of the schedule and its cost."""
  p, m, v = schedule.num_stages, schedule.num_microbatches, schedule.num_chunks
  return {
      "name": schedule.name,
      "stages": p,
      "microbatches": m,
      "virtual_stages": v,
      "ticks": schedule.num_ticks,
      "costs": {"F": costs[0], "B": costs[1], "W": costs[2]},
      "bubble_fraction": bubble_fraction(schedule, costs),
      "paper_bubble_fraction": paper_bubble_fraction(schedule.name, p, m, costs, v),
      "ideal_bubble_fraction": ideal_bubble_fraction(p, m, v),
      "tick_bubble_fraction": float((schedule.op == IDLE).mean()),
      "peak_in_flight": peak_in_flight(schedule),
      "peak_awaiting_w": peak_awaiting_w(schedule),
      "slots": {buffer: schedule.slots_per_stage(buffer) for buffer in BUFFERS},
  }
