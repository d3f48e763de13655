"""Gantt chart of a pipeline schedule: one row per stage, time on x."""

import os

import matplotlib
import numpy as np
from matplotlib.axes import Axes
from matplotlib.backend_bases import FigureCanvasBase
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from meshtrain.parallel.pipeline import measures, schedule as schedule_lib

# The file types `draw_gantt` writes, by the path's extension.
FORMATS = tuple(FigureCanvasBase.get_supported_filetypes())

# F blue, B orange, W green; darker for later chunks.
_COLORS = {schedule_lib.F: matplotlib.colormaps["Blues"],
           schedule_lib.B: matplotlib.colormaps["Oranges"],
           schedule_lib.W: matplotlib.colormaps["Greens"]}


def draw_gantt(schedule: schedule_lib.Schedule, path: str | os.PathLike | None = None,
               costs: tuple[float, float, float] = (1.0, 1.0, 1.0)) -> Figure:
  """The chart as a matplotlib Figure (shown inline in a notebook), also written
  to `path` as a PNG if given; boxes sit where `measures.timeline` puts
  them with F, B and W costing `costs`.

  Forwards are blue, input gradients (B) orange, weight gradients (W) green,
  darker for later chunks; each box shows its microbatch.
  """
  start, end = measures.timeline(schedule, costs)
  total = float(np.nanmax(end))
  shortest = min(c for c in costs if c > 0) / schedule.num_chunks
  figure = Figure(figsize=(np.clip(0.3 * total / shortest, 6, 60),
                           1.2 + 0.45 * schedule.num_stages))
  axes = figure.add_subplot()
  for tick, stage in np.argwhere(schedule.op != schedule_lib.IDLE):
    _box(axes, schedule, tick, stage, start[tick, stage], end[tick, stage] - start[tick, stage])
  _decorate(axes, schedule, total, costs)
  figure.tight_layout()
  if path is not None:
    figure.savefig(path, dpi=100)
  return figure


def _shade(kind: int, schedule: schedule_lib.Schedule,
           chunk: int) -> tuple[float, float, float, float]:
  return _COLORS[kind](0.45 + 0.4 * chunk / max(schedule.num_chunks - 1, 1))


def _box(axes: Axes, schedule: schedule_lib.Schedule, tick: int, stage: int,
         left: float, width: float) -> None:
  kind = int(schedule.op[tick, stage])
  color = _shade(kind, schedule, schedule.chunk[tick, stage])
  axes.barh(stage, width, left=left, height=0.8, edgecolor="white", linewidth=0.5, color=color)
  red, green, blue, _ = color
  is_dark = 0.299 * red + 0.587 * green + 0.114 * blue < 0.5
  axes.text(left + width / 2, stage, str(schedule.mb[tick, stage]), ha="center", va="center",
            fontsize=7, color="white" if is_dark else "black")


def _decorate(axes: Axes, schedule: schedule_lib.Schedule, total_time: float,
              costs: tuple[float, float, float]) -> None:
  bubble = measures.bubble_fraction(schedule, costs)
  paper = measures.paper_bubble_fraction(
      schedule.name, schedule.num_stages, schedule.num_microbatches, costs, schedule.num_chunks)
  axes.set_title(
      f"{schedule.name}: P={schedule.num_stages} M={schedule.num_microbatches}"
      f" V={schedule.num_chunks}, F,B,W cost {','.join(f'{c:g}' for c in costs)}: "
      f"bubble {bubble:.3f} (paper's formula {paper:.3f})")
  axes.set_xlim(0, total_time)
  axes.set_ylim(schedule.num_stages - 0.5, -0.5)  # stage 0 on top
  axes.set_yticks(range(schedule.num_stages), [f"stage {s}" for s in range(schedule.num_stages)])
  axes.set_xlabel("time (one stage's forward = F cost)")
  kinds = [k for k in (schedule_lib.F, schedule_lib.B, schedule_lib.W) if (schedule.op == k).any()]
  handles = [
      Patch(color=_shade(kind, schedule, v), label=f"{schedule_lib.OP_LETTERS[kind]} chunk {v}"
            if schedule.num_chunks > 1 else schedule_lib.OP_LETTERS[kind])
      for kind in kinds for v in range(schedule.num_chunks)]
  axes.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8,
              frameon=False)
