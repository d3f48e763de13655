"""Pipeline schedule tables: validity, bubble and memory formulas, drawing."""

import dataclasses
import json

import numpy as np
import pytest

from meshtrain.parallel.pipeline import draw
from meshtrain.parallel.pipeline import schedule as schedule_lib

SIZES = [(p, m) for p in (2, 4, 8) for m in (p, 2 * p, 3 * p, 4 * p, p + 1)]
CASES = ([("gpipe", p, m, 1) for p, m in SIZES]
         + [("1f1b", p, m, 1) for p, m in SIZES]
         + [("interleaved_1f1b", p, m, v) for p, m in SIZES for v in (2, 3)])
COSTS = [(1.0, 1.0), (1.0, 2.0)]


def _case_id(case):
  return "{}-P{}-M{}-V{}".format(*case)


@pytest.fixture(scope="module", params=CASES, ids=_case_id)
def built(request):
  name, p, m, v = request.param
  return schedule_lib.build(name, p, m, v)


def test_every_builder_makes_a_valid_table(built):
  schedule_lib.validate(built)


@pytest.mark.parametrize("fwd_cost, bwd_cost", COSTS)
def test_bubble_matches_the_textbook_formula(built, fwd_cost, bwd_cost):
  ideal = (built.num_stages - 1) / (
      built.num_chunks * built.num_microbatches + built.num_stages - 1)
  assert schedule_lib.bubble_fraction(built, fwd_cost, bwd_cost) == (
      pytest.approx(ideal, abs=1e-12))


@pytest.mark.parametrize("p, m", [(1, 1), (1, 5), (3, 1), (4, 3), (5, 2)])
def test_tiny_and_short_pipelines_are_valid(p, m):
  for name in ("gpipe", "1f1b"):
    schedule = schedule_lib.build(name, p, m)
    schedule_lib.validate(schedule)
    assert schedule_lib.bubble_fraction(schedule, 1.0, 2.0) == pytest.approx(
        schedule_lib.ideal_bubble_fraction(p, m))


def test_one_f_one_b_is_the_fused_tick_table():
  p, m = 4, 8
  schedule = schedule_lib.one_f_one_b(p, m)
  assert schedule.num_ticks == m + 2 * p - 2
  for tick in range(schedule.num_ticks):
    for stage in range(p):
      fwd, bwd = tick - stage, tick - 2 * p + 2 + stage
      assert schedule.fwd_mb[tick, stage] == (fwd if 0 <= fwd < m else -1)
      assert schedule.bwd_mb[tick, stage] == (bwd if 0 <= bwd < m else -1)


@pytest.mark.parametrize("p, m", [(2, 2), (4, 4), (4, 13), (8, 8), (8, 20)])
def test_one_f_one_b_stash_is_flat_in_microbatches(p, m):
  schedule = schedule_lib.one_f_one_b(p, m)
  expected = [min(m, 2 * (p - s) - 1) for s in range(p)]
  assert schedule.act_slots_per_stage == expected
  assert schedule_lib.peak_in_flight(schedule) == expected
  assert schedule.num_grad_slots == 1


@pytest.mark.parametrize("p, m", [(2, 3), (4, 8)])
def test_gpipe_holds_every_microbatch(p, m):
  schedule = schedule_lib.gpipe(p, m)
  assert schedule_lib.peak_in_flight(schedule) == [m] * p
  assert schedule.act_slots_per_stage == [m] * p


@pytest.mark.parametrize("p, m, v", [(2, 4, 2), (4, 8, 2), (4, 16, 3),
                                     (8, 8, 2)])
def test_interleaved_in_flight_matches_megatron_warmup(p, m, v):
  schedule = schedule_lib.interleaved_one_f_one_b(p, m, v)
  expected = [min(v * m, (v + 1) * p - 2 * s - 1) for s in range(p)]
  assert schedule_lib.peak_in_flight(schedule) == expected
  assert schedule.act_slots_per_stage == expected


def test_interleaved_with_uneven_groups_waits_in_slots():
  schedule = schedule_lib.interleaved_one_f_one_b(3, 7, 2)
  schedule_lib.validate(schedule)
  peak = schedule_lib.peak_in_flight(schedule)
  assert schedule.act_slots_per_stage[0] > peak[0]  # inputs wait on stage 0
  assert schedule.num_grad_slots > 1  # and gradients wait too


def _edited(schedule, **cells):
  """A copy with cells replaced: field=((tick, stage), value) or a list."""
  changes = {}
  for field, edits in cells.items():
    array = getattr(schedule, field).copy()
    for index, value in edits if isinstance(edits, list) else [edits]:
      array[index] = value
    changes[field] = array
  return dataclasses.replace(schedule, **changes)


def test_validator_catches_a_missing_backward():
  schedule = schedule_lib.one_f_one_b(3, 4)
  broken = _edited(schedule, bwd_mb=((6, 0), -1), bwd_chunk=((6, 0), -1),
                   bwd_slot=((6, 0), -1), bwd_grad_slot=((6, 0), -1))
  with pytest.raises(ValueError, match="backward of microbatch 2 chunk 0 .*"
                     "is missing"):
    schedule_lib.validate(broken)


def test_validator_catches_a_duplicated_forward():
  schedule = schedule_lib.gpipe(2, 3)
  broken = _edited(schedule, fwd_mb=((1, 0), 0))
  with pytest.raises(ValueError, match=r"runs at ticks \[0, 1\]"):
    schedule_lib.validate(broken)


def test_validator_catches_a_forward_before_its_input():
  no_op = np.full((3, 2), -1)
  fwd = no_op.copy()
  fwd[0] = 0  # stage 1 runs at tick 0, stage 0's output arrives at tick 1
  bwd = no_op.copy()
  bwd[1, 1] = bwd[2, 0] = 0
  broken = schedule_lib.from_ops("broken", 2, 1, 1, fwd, fwd, bwd, bwd)
  with pytest.raises(ValueError, match="before its input"):
    schedule_lib.validate(broken)


def test_validator_catches_a_backward_before_its_gradient():
  schedule = schedule_lib.gpipe(2, 1)  # B on stage 1 at tick 1, stage 0 at 2
  broken = schedule_lib.from_ops(
      "broken", 2, 1, 1, schedule.fwd_mb, schedule.fwd_chunk,
      schedule.bwd_mb[[0, 2, 1]], schedule.bwd_chunk[[0, 2, 1]])
  with pytest.raises(ValueError, match="before its gradient"):
    schedule_lib.validate(broken)


def test_validator_catches_a_slot_overwrite():
  schedule = schedule_lib.one_f_one_b(4, 8)
  live_slot = schedule.fwd_slot[3, 1]  # microbatch 2, backward at tick 7
  broken = _edited(schedule, act_recv_slot=((4, 1), live_slot),
                   fwd_slot=((4, 1), live_slot))
  with pytest.raises(ValueError, match="tick 4 stage 1: writing the activation"
                     " of microbatch 3 chunk 0 overwrites slot"):
    schedule_lib.validate(broken)


def test_validator_catches_a_read_of_the_wrong_slot():
  schedule = schedule_lib.one_f_one_b(4, 8)
  other_slot = schedule.fwd_slot[3, 1]
  broken = _edited(schedule, bwd_slot=((7, 2), other_slot + 1))
  with pytest.raises(ValueError, match="tick 7 stage 2: reads slot"):
    schedule_lib.validate(broken)


def test_validator_catches_a_slot_without_an_op():
  schedule = schedule_lib.one_f_one_b(2, 2)
  broken = _edited(schedule, fwd_slot=((3, 1), 0))
  with pytest.raises(ValueError, match="fwd_slot is 0 but no op uses a slot"):
    schedule_lib.validate(broken)


@pytest.mark.parametrize("call, message", [
    (lambda: schedule_lib.one_f_one_b(0, 4), "num_stages must be a positive"),
    (lambda: schedule_lib.gpipe(4, 0), "num_microbatches must be a positive"),
    (lambda: schedule_lib.gpipe(2.5, 4), "num_stages must be a positive"),
    (lambda: schedule_lib.interleaved_one_f_one_b(4, 8, 0),
     "num_chunks must be a positive"),
    (lambda: schedule_lib.interleaved_one_f_one_b(4, 3, 2),
     "raise num_microbatches to 4 or more"),
    (lambda: schedule_lib.build("zero_bubble", 4, 8), "choose one of gpipe"),
    (lambda: schedule_lib.build("1f1b", 4, 8, 2), "use interleaved_1f1b"),
])
def test_bad_inputs_raise_clear_errors(call, message):
  with pytest.raises(ValueError, match=message):
    call()


def test_to_text_shows_fused_ticks():
  text = schedule_lib.to_text(schedule_lib.one_f_one_b(2, 2))
  assert text.splitlines() == [
      "    0    1    2    3",
      "s0  F0   F1   B0   B1",
      "s1  .    F0B0 F1B1 .",
  ]


def test_to_text_shows_chunks_when_interleaved():
  text = schedule_lib.to_text(schedule_lib.interleaved_one_f_one_b(2, 2, 2))
  assert text.splitlines()[1].split()[1:4] == ["F0.0", "F1.0", "F0.1"]


def test_describe_is_json_ready():
  summary = schedule_lib.describe(
      schedule_lib.interleaved_one_f_one_b(4, 8, 2), 1.0, 2.0)
  assert json.loads(json.dumps(summary)) == summary
  assert summary["bubble_fraction"] == pytest.approx(3 / 19)
  assert summary["ideal_bubble_fraction"] == pytest.approx(3 / 19)
  assert summary["peak_in_flight"] == [11, 9, 7, 5]
  assert summary["stash_slots"] == [11, 9, 7, 5]
  assert (summary["stages"], summary["microbatches"],
          summary["virtual_stages"]) == (4, 8, 2)


def test_schedule_arrays_are_read_only_int32():
  schedule = schedule_lib.one_f_one_b(2, 2)
  assert schedule.fwd_mb.dtype == np.int32
  with pytest.raises(ValueError):
    schedule.fwd_mb[0, 0] = 1


@pytest.mark.parametrize("name, v", [("1f1b", 1), ("interleaved_1f1b", 2)])
def test_draw_gantt_writes_a_png_and_returns_the_figure(tmp_path, name, v):
  path = tmp_path / f"{name}.png"
  figure = draw.draw_gantt(schedule_lib.build(name, 4, 8, v), str(path))
  assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  assert path.stat().st_size > 1000
  (axes,) = figure.axes
  assert len(axes.patches) == 2 * 8 * 4 * v  # one box per forward and per backward
