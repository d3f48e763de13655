"""Pipeline schedule tables: validity, bubble and memory against the published
formulas (Megatron-LM, Qi et al. 2023), drawing, and the `schedule` command."""

import dataclasses
import json

import numpy as np
import pytest
from conftest import cli_in_process

from meshtrain.parallel.pipeline import checks, draw, measures
from meshtrain.parallel.pipeline import schedule as schedule_lib

SIZES = [(p, m) for p in (2, 4, 8) for m in (p, 2 * p, 4 * p)] + [(4, 5), (8, 9)]
CASES = ([(name, p, m, 1) for name in ("gpipe", "1f1b", "zb_h1", "zb_h2") for p, m in SIZES]
         + [("interleaved_1f1b", p, m, v) for p, m in SIZES if m % p == 0 for v in (2, 3)]
         + [("zb_v", p, m, 2) for p, m in SIZES])


def _case_id(case):
  return "{}-P{}-M{}-V{}".format(*case)


@pytest.fixture(scope="module", params=CASES, ids=_case_id)
def built(request):
  name, p, m, v = request.param
  return schedule_lib.build(name, p, m, v)


def test_every_builder_makes_a_valid_table(built):
  checks.validate(built)
  ops = built.num_stages * built.num_microbatches * built.num_chunks
  assert [(built.op == kind).sum() for kind in (1, 2, 3)] == [ops] * 3


def test_bubble_is_at_most_the_papers(built):
  """Lock step, one op per tick, F = B = W: the measured bubble (the event
  timeline, equal to the idle ticks) is within the published formula; the
  zero-bubble schedules reach it."""
  p, m, v = built.num_stages, built.num_microbatches, built.num_chunks
  measured = measures.bubble_fraction(built)
  assert measured == pytest.approx(float((built.op == 0).mean()))
  paper = measures.paper_bubble_fraction(built.name, p, m, (1, 1, 1), v)
  if built.name == "zb_h1":
    assert measured == pytest.approx((p - 1) / (3 * m + p - 1))
    assert measured == pytest.approx(paper)
  elif built.name == "zb_v":  # the paper's 0 times the busiest stage; lock step idles
    assert paper == 0 and measured <= (p - 1) / (3 * m + p - 1)  # ZB-H1's at most
    if m >= 2 * p:  # the microbatches fill the V: P - 1 ticks of half a stage
      assert measured == pytest.approx((p - 1) / (6 * m + p - 1))
  elif built.name != "zb_h2":  # (P-1)(F+B-2W) = 0 < the fill no lock step avoids
    assert measured <= paper + 1e-12


@pytest.mark.parametrize("p, m", [(2, 4), (4, 8), (4, 32), (8, 8), (8, 32)])
def test_zb_h1_idles_a_third_of_1f1b_at_the_same_memory(p, m):
  """The issue's acceptance: idle time per stage <= 1/3 of 1F1B's (Megatron's
  (P-1)(F+B+W) with B and W fused), same peak in-flight."""
  zb, one_f_one_b = schedule_lib.zb_h1(p, m), schedule_lib.one_f_one_b(p, m)
  idle = lambda s: (s.op == 0).sum(axis=0)
  assert (idle(zb) <= (p - 1) * 3 / 3).all(), idle(zb)
  assert measures.bubble_fraction(zb) == pytest.approx((p - 1) / (3 * m + p - 1))
  assert measures.peak_in_flight(zb) == measures.peak_in_flight(one_f_one_b)
  assert measures.bubble_fraction(zb) < measures.bubble_fraction(one_f_one_b)


@pytest.mark.parametrize("p, m", [(2, 2), (4, 4), (4, 13), (8, 8), (8, 20)])
def test_one_f_one_b_holds_p_minus_s(p, m):
  schedule = schedule_lib.one_f_one_b(p, m)
  expected = [min(m, p - s) for s in range(p)]
  assert measures.peak_in_flight(schedule) == expected
  assert schedule.slots_per_stage("res") == expected  # W follows B: freed together
  assert schedule.num_slots("cut") == 1


@pytest.mark.parametrize("p, m", [(2, 3), (4, 8)])
def test_gpipe_holds_every_microbatch(p, m):
  schedule = schedule_lib.gpipe(p, m)
  assert measures.peak_in_flight(schedule) == [m] * p
  assert schedule.slots_per_stage("res") == [m] * p


@pytest.mark.parametrize("p, m, v", [(2, 4, 2), (4, 8, 2), (4, 16, 3), (8, 8, 2)])
def test_interleaved_in_flight_is_megatron_warmup_plus_one(p, m, v):
  schedule = schedule_lib.interleaved_one_f_one_b(p, m, v)
  warmup = [(p - s - 1) * 2 + (v - 1) * p for s in range(p)]
  assert measures.peak_in_flight(schedule) == [min(v * m, w + 1) for w in warmup]


@pytest.mark.parametrize("p, m", [(2, 4), (4, 8), (4, 16), (8, 16)])
def test_zb_v_goes_down_the_stages_and_back_up_at_1f1bs_memory(p, m):
  """ZB-V's V: stage s holds chunks s and 2P - 1 - s; every stage holds at
  most 2P chunks' activations (half a stage's layers each: 1F1B's P
  microbatches on its first stage), so its memory is balanced; its idle
  time is a quarter of 1F1B's (P(P - 1) cells of half a stage's op against
  2P(P - 1) of a whole one's); stage P-1 hands each microbatch from chunk
  P-1 to chunk P on the next tick, without a send (the first of the V's way
  up)."""
  table = schedule_lib.build("zb_v", p, m, 2)
  assert table.placement == "v"
  assert [table.global_chunks(s, v) for s in range(p) for v in (0, 1)] == [
      c for s in range(p) for c in (s, 2 * p - 1 - s)]
  assert all(table.stage_chunks(table.global_chunks(s, v)) == (s, v)
             for s in range(p) for v in (0, 1))
  assert measures.peak_awaiting_w(table) == [2 * p] * p
  one_f_one_b = schedule_lib.build("1f1b", p, m)
  assert (table.op == 0).sum() == p * (p - 1) and (one_f_one_b.op == 0).sum() == 2 * p * (p - 1)
  turn = p - 1
  for mb in range(m):
    (down,) = np.argwhere((table.op[:, turn] == schedule_lib.F) & (table.mb[:, turn] == mb)
                          & (table.chunk[:, turn] == 0))[:, 0]
    assert table.act_recv2_slot[down + 1, turn] >= 0  # chunk P's input, from chunk P-1


def test_validator_catches_a_v_table_read_as_a_loop():
  """The same ops on Megatron's loop placement break its dependencies."""
  table = schedule_lib.build("zb_v", 4, 8, 2)
  with pytest.raises(ValueError, match="before its"):
    checks.validate(dataclasses.replace(table, placement="loop"))
  with pytest.raises(ValueError, match="placement 'v' with 3 chunks"):
    checks.validate(dataclasses.replace(table, num_chunks=3))


def test_zb_h2_warms_up_more():
  p, m = 4, 16
  assert measures.peak_in_flight(schedule_lib.zb_h2(p, m)) == [2 * (p - s) - 1 for s in range(p)]


def test_costs_move_the_bubble_as_the_paper_says():
  """W half of F and B: the zero-bubble schedules still beat 1F1B."""
  costs = (1.0, 1.0, 0.5)
  bubble = {name: measures.bubble_fraction(schedule_lib.build(name, 4, 16), costs)
            for name in ("1f1b", "zb_h1", "zb_h2")}
  assert bubble["zb_h2"] <= bubble["zb_h1"] < bubble["1f1b"], bubble


def test_forward_only_runs_every_forward_and_nothing_else():
  schedule = schedule_lib.forward_only(4, 8, 2)
  checks.validate(schedule)
  assert not schedule.has_backward
  assert (schedule.op == schedule_lib.F).sum() == 4 * 8 * 2
  assert schedule.num_ticks == 8 * 2 + 4 - 1  # one wave, no stall


def _edited(schedule, **cells):
  """A copy with cells replaced: field=((tick, stage), value) or a list."""
  changes = {}
  for field, edits in cells.items():
    array = getattr(schedule, field).copy()
    for index, value in edits if isinstance(edits, list) else [edits]:
      array[index] = value
    changes[field] = array
  return dataclasses.replace(schedule, **changes)


def _cell_of(schedule, kind, mb, stage):
  (tick,) = np.argwhere((schedule.op[:, stage] == kind) & (schedule.mb[:, stage] == mb))[0]
  return int(tick), stage


def test_validator_catches_a_missing_w():
  schedule = schedule_lib.one_f_one_b(3, 4)
  cell = _cell_of(schedule, schedule_lib.W, 2, 0)
  broken = schedule_lib.from_ops("broken", 3, 4, 1, *(
      _edited(schedule, op=(cell, 0), mb=(cell, -1), chunk=(cell, -1)).__getattribute__(f)
      for f in ("op", "mb", "chunk")))
  with pytest.raises(ValueError, match="W of microbatch 2 chunk 0 .*is missing"):
    checks.validate(broken)


def test_validator_catches_a_w_before_its_b():
  schedule = schedule_lib.one_f_one_b(2, 2)
  b, w = _cell_of(schedule, schedule_lib.B, 0, 1), _cell_of(schedule, schedule_lib.W, 0, 1)
  op = schedule.op.copy()
  op[b], op[w] = schedule_lib.W, schedule_lib.B
  broken = schedule_lib.from_ops("broken", 2, 2, 1, op, schedule.mb, schedule.chunk)
  with pytest.raises(ValueError, match="before its"):
    checks.validate(broken)


def test_validator_catches_a_slot_overwrite():
  schedule = schedule_lib.one_f_one_b(4, 8)
  f0, f1 = _cell_of(schedule, schedule_lib.F, 0, 0), _cell_of(schedule, schedule_lib.F, 1, 0)
  broken = _edited(schedule, res_slot=(f1, schedule.res_slot[f0]))
  with pytest.raises(ValueError, match="overwrites slot"):
    checks.validate(broken)


def test_validator_catches_a_read_of_the_wrong_slot():
  schedule = schedule_lib.one_f_one_b(4, 8)
  b = _cell_of(schedule, schedule_lib.B, 3, 0)
  broken = _edited(schedule, res_slot=(b, schedule.res_slot[b] + 1))
  with pytest.raises(ValueError, match="reads slot"):
    checks.validate(broken)


@pytest.mark.parametrize("call, argument, message", [
    (lambda: schedule_lib.one_f_one_b(0, 4), "num_stages", "num_stages must be a positive"),
    (lambda: schedule_lib.gpipe(4, 0), "num_microbatches", "num_microbatches must be a positive"),
    (lambda: schedule_lib.gpipe(2.5, 4), "num_stages", "num_stages must be a positive"),
    (lambda: schedule_lib.interleaved_one_f_one_b(4, 8, 0), "num_chunks",
     "num_chunks must be a positive"),
    (lambda: schedule_lib.interleaved_one_f_one_b(4, 6, 2), "num_microbatches",
     "multiple of num_stages"),
    (lambda: schedule_lib.build("zero_bubble", 4, 8), "name", "choose one of gpipe"),
    (lambda: schedule_lib.build("zb_h1", 4, 8, 2), "num_chunks", "use interleaved_1f1b"),
    (lambda: schedule_lib.check("zb_h1", 0, 8, 2), "num_stages",  # sizes first
     "num_stages must be a positive"),
])
def test_bad_inputs_raise_clear_errors(call, argument, message):
  with pytest.raises(schedule_lib.ArgumentError, match=message) as error:
    call()
  assert error.value.argument == argument


def test_to_text_shows_one_op_per_tick():
  text = measures.to_text(schedule_lib.one_f_one_b(2, 2))
  assert text.splitlines() == [
      "    0  1  2  3  4  5  6  7",
      "s0  F0 F1 .  B0 W0 .  B1 W1",
      "s1  .  F0 B0 W0 F1 B1 W1 .",
  ]


def test_describe_is_json_ready():
  summary = measures.describe(schedule_lib.zb_h1(4, 8), (1.0, 1.0, 1.0))
  assert json.loads(json.dumps(summary)) == summary
  assert summary["bubble_fraction"] == pytest.approx(3 / 27)
  assert summary["paper_bubble_fraction"] == pytest.approx(3 / 27)
  assert summary["peak_in_flight"] == [4, 3, 2, 1]


def test_schedule_arrays_are_read_only_int32():
  schedule = schedule_lib.one_f_one_b(2, 2)
  assert schedule.op.dtype == np.int32
  with pytest.raises(ValueError):
    schedule.op[0, 0] = 1


@pytest.mark.parametrize("name, v", [("zb_h1", 1), ("interleaved_1f1b", 2)])
def test_draw_gantt_colours_f_b_w_apart(tmp_path, name, v):
  path = tmp_path / f"{name}.png"
  figure = draw.draw_gantt(schedule_lib.build(name, 4, 8, v), str(path), (1.0, 1.0, 1.0))
  assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  (axes,) = figure.axes
  assert len(axes.patches) == 3 * 8 * 4 * v  # one box per F, B and W
  colours = {tuple(patch.get_facecolor()) for patch in axes.patches}
  assert len(colours) == 3 * v


def test_schedule_command_takes_costs_and_reports_in_flight(tmp_path, capfd, monkeypatch):
  """In this process; tests/test_cli.py runs the command in its own."""
  monkeypatch.chdir(tmp_path)
  code, out, err = cli_in_process(["schedule", "--stages=4", "--microbatches=8",
                                   "--schedule=zb_h1", "--costs=1,1,1", "--json"], capfd)
  assert code == 0, err
  summary = json.loads(out)
  assert summary["peak_in_flight"] == [4, 3, 2, 1]
  assert summary["bubble_fraction"] == pytest.approx(3 / 27)
  code, _, err = cli_in_process(["schedule", "--costs=1,x"], capfd)
  assert code == 2 and err.strip().startswith("error: --costs"), err
