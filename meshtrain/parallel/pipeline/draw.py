"""Gantt chart of a pipeline schedule: one row per stage, time on x."""

import os

import matplotlib
import numpy as np
from matplotlib.axes import Axes
from matplotlib.colors import Colormap
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from meshtrain.parallel.pipeline import schedule as schedule_lib

_FWD_COLORS = matplotlib.colormaps["Blues"]
_BWD_COLORS = matplotlib.colormaps["Oranges"]


def draw_gantt(schedule: schedule_lib.Schedule, path: str | os.PathLike | None = None,
               fwd_cost: float = 1.0, bwd_cost: float = 2.0) -> Figure:
  """The chart as a matplotlib Figure (shown inline in a notebook), also written
  to `path` as a PNG if given; tick widths follow the lock-step model of
  `bubble_fraction`.

  Forwards are blue, backwards orange, darker for later chunks; each box shows
  its microbatch. A fused tick draws F then B on the same row.
  """
  durations = schedule_lib.tick_durations(schedule, fwd_cost, bwd_cost)
  starts = np.concatenate([[0.0], np.cumsum(durations)[:-1]])
  chunk_fwd = fwd_cost / schedule.num_chunks
  chunk_bwd = bwd_cost / schedule.num_chunks
  width_inches = np.clip(0.3 * durations.sum() / chunk_fwd, 6, 60)
  figure = Figure(figsize=(width_inches, 1.2 + 0.45 * schedule.num_stages))
  axes = figure.add_subplot()
  for tick, stage in np.argwhere(schedule.fwd_mb >= 0):
    _box(axes, schedule, "fwd", tick, stage, starts[tick], chunk_fwd)
  for tick, stage in np.argwhere(schedule.bwd_mb >= 0):
    offset = chunk_fwd if schedule.fwd_mb[tick, stage] >= 0 else 0.0
    _box(axes, schedule, "bwd", tick, stage, starts[tick] + offset, chunk_bwd)
  _decorate(axes, schedule, durations.sum(), fwd_cost, bwd_cost)
  figure.tight_layout()
  if path is not None:
    figure.savefig(path, dpi=100)
  return figure


def _shade(colors: Colormap, schedule: schedule_lib.Schedule,
           chunk: int) -> tuple[float, float, float, float]:
  return colors(0.45 + 0.4 * chunk / max(schedule.num_chunks - 1, 1))


def _box(axes: Axes, schedule: schedule_lib.Schedule, kind: str, tick: int,
         stage: int, left: float, width: float) -> None:
  chunk = getattr(schedule, f"{kind}_chunk")[tick, stage]
  colors = _FWD_COLORS if kind == "fwd" else _BWD_COLORS
  color = _shade(colors, schedule, chunk)
  axes.barh(stage, width, left=left, height=0.8, edgecolor="white",
            linewidth=0.5, color=color)
  red, green, blue, _ = color
  is_dark = 0.299 * red + 0.587 * green + 0.114 * blue < 0.5
  axes.text(left + width / 2, stage, str(getattr(schedule, f"{kind}_mb")[
      tick, stage]), ha="center", va="center", fontsize=7,
            color="white" if is_dark else "black")


def _decorate(axes: Axes, schedule: schedule_lib.Schedule, total_time: float,
              fwd_cost: float, bwd_cost: float) -> None:
  bubble = schedule_lib.bubble_fraction(schedule, fwd_cost, bwd_cost)
  ideal = schedule_lib.ideal_bubble_fraction(
      schedule.num_stages, schedule.num_microbatches, schedule.num_chunks)
  axes.set_title(
      f"{schedule.name}: P={schedule.num_stages} M={schedule.num_microbatches}"
      f" V={schedule.num_chunks}, F:B cost {fwd_cost:g}:{bwd_cost:g}, "
      f"bubble {bubble:.3f} (ideal {ideal:.3f})")
  axes.set_xlim(0, total_time)
  axes.set_ylim(schedule.num_stages - 0.5, -0.5)  # stage 0 on top
  axes.set_yticks(range(schedule.num_stages),
                  [f"stage {s}" for s in range(schedule.num_stages)])
  axes.set_xlabel("time (one stage's forward = fwd_cost)")
  handles = [
      Patch(color=_shade(colors, schedule, v), label=f"{kind} chunk {v}"
            if schedule.num_chunks > 1 else kind)
      for kind, colors in (("F", _FWD_COLORS), ("B", _BWD_COLORS))
      for v in range(schedule.num_chunks)]
  axes.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0),
              fontsize=8, frameon=False)
