"""`meshtrain schedule`: a pipeline schedule's table of F, B and W ops printed
(and drawn with `--out`), with its bubble and in-flight microbatches."""

import json
import math
from pathlib import Path

from absl import flags

from meshtrain.cli import common
from meshtrain.errors import ConfigError
from meshtrain.parallel.pipeline import draw, measures, schedule as schedules

FLAGS = flags.FlagValues()
_STAGES = flags.DEFINE_integer("stages", 4, "pipeline stages", flag_values=FLAGS)
_MICROBATCHES = flags.DEFINE_integer("microbatches", 8, "microbatches per step",
                                     flag_values=FLAGS)
_SCHEDULE = flags.DEFINE_enum("schedule", "1f1b", schedules.SCHEDULE_NAMES, "which one",
                              flag_values=FLAGS)
_VIRTUAL = flags.DEFINE_integer("virtual", 1, "model chunks per stage (interleaved; zb_v: 2)",
                                flag_values=FLAGS)
_COSTS = flags.DEFINE_string("costs", "1,1,1", "cost of F, B (input gradient) and "
                             "W (weight gradient) of one stage, e.g. 1,1,1 or 1,2,0 (Megatron)",
                             flag_values=FLAGS)
_OUT = flags.DEFINE_string("out", None, "write a Gantt chart PNG here", flag_values=FLAGS)
_JSON = flags.DEFINE_bool("json", False, "print JSON instead of the table", flag_values=FLAGS)

# The most stage-ticks this command builds and prints, and the most ops it
# draws with --out (a box and a label each), in seconds.
MAX_SCHEDULE_CELLS = 300_000
MAX_CHART_OPS = 3_000


def main(argv: list[str]) -> None:
  del argv
  costs = _costs(_COSTS.value)
  _check_chart_path()
  _check_schedule_flags()
  table = schedules.build(_SCHEDULE.value, _STAGES.value, _MICROBATCHES.value, _VIRTUAL.value)
  summary = measures.describe(table, costs)
  if _OUT.value:
    try:
      draw.draw_gantt(table, _OUT.value, costs)
    except OSError as error:
      raise ConfigError("--out", f"cannot write {_OUT.value} ({error.strerror or error}); "
                        "write the chart elsewhere") from None
    summary["chart"] = _OUT.value
  if _JSON.value:
    print(json.dumps(summary, indent=2))
    return
  print(measures.to_text(table))
  print(f"\nbubble fraction {summary['bubble_fraction']:.4f} with F,B,W costs {_COSTS.value} "
        f"(paper's formula {summary['paper_bubble_fraction']:.4f}, textbook (P-1)/(VM+P-1) "
        f"{summary['ideal_bubble_fraction']:.4f}); in flight per stage (awaiting B) "
        f"{summary['peak_in_flight']}, awaiting W {summary['peak_awaiting_w']}")
  if _OUT.value:
    print(f"chart: {_OUT.value}")


def _costs(text: str) -> tuple[float, float, float]:
  try:
    costs = tuple(float(c) for c in text.split(","))
  except ValueError:
    costs = ()
  if len(costs) != 3 or not all(map(math.isfinite, costs)) or min(costs) < 0 or costs[0] <= 0:
    raise ConfigError("--costs", f"{text!r} is not three costs F,B,W (F > 0, B and W >= 0), "
                      "e.g. --costs=1,1,1")
  return costs


def _check_schedule_flags() -> None:
  """The schedule the flags name, as `schedules.check` sees it (the flag of its
  wrong argument named), then the size of what this command prints and draws."""
  arguments = {"name": _SCHEDULE, "num_stages": _STAGES, "num_microbatches": _MICROBATCHES,
               "num_chunks": _VIRTUAL}
  try:
    schedules.check(**{argument: flag.value for argument, flag in arguments.items()})
  except schedules.ArgumentError as error:
    raise ConfigError(f"--{arguments[error.argument].name}", str(error)) from None
  sizes = (_STAGES, _MICROBATCHES, _VIRTUAL)
  stages, microbatches, virtual = (flag.value for flag in sizes)
  cells = stages * (3 * virtual * microbatches + 2 * stages)  # about ticks x stages
  if cells > MAX_SCHEDULE_CELLS:
    largest = max(sizes, key=lambda flag: flag.value)
    raise ConfigError(f"--{largest.name}", f"{stages} stages x {virtual} chunks x {microbatches} "
                      f"microbatches make a table of about {cells:,} stage-ticks, over the "
                      f"{MAX_SCHEDULE_CELLS:,} this command prints; give fewer")
  ops = 3 * stages * virtual * microbatches  # F, B and W
  if _OUT.value and ops > MAX_CHART_OPS:
    raise ConfigError("--out", f"a chart of {stages} stages x {virtual} chunks x {microbatches} "
                      f"microbatches has {ops:,} ops, over the {MAX_CHART_OPS:,} it draws; give "
                      "fewer, or leave out --out (the table is printed)")


def _check_chart_path() -> None:
  if _OUT.value is None:
    return
  out = Path(_OUT.value).absolute()
  if not _OUT.value or out.is_dir():
    raise ConfigError("--out", f"{_OUT.value!r} is not a file name; give the chart's file, "
                      "e.g. --out schedule.png")
  if out.suffix.removeprefix(".").lower() not in draw.FORMATS:
    raise ConfigError("--out", f"{out.name} has no image extension; end it with one of "
                      f"{', '.join('.' + f for f in draw.FORMATS)}")
  if not out.parent.is_dir():
    raise ConfigError("--out", f"folder {out.parent} does not exist; create it or write the "
                      "chart elsewhere")


COMMAND = common.Command("schedule", FLAGS, main, paths=lambda: [("--out", _OUT.value, True)])
