"""How often each instruction of a compiled program ran, read from a profiler trace.

`hlo.collective_ops` counts from the program text, which cannot tell which
branch of a conditional runs: it counts every branch as if it ran. A
pipeline's tick holds one conditional per op (F, B, W) and one per send, each
taken where the schedule table says, so that static count is several times
what runs. `executions(call, compiled)` runs the program once under `jax.profiler`
and counts the ops that ran: XLA's CPU runtime records every executed thunk with
its HLO op name and device (`args.hlo_op`, `args.device_ordinal`), once per
loop iteration and only for the branch taken.
"""

import collections
import gzip
import json
import re
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax


def module_name(compiled: Any) -> str:
  """The HLO module name of a compiled program ("jit_step")."""
  return re.match(r"HloModule (\S+?),", compiled.as_text()).group(1)


def executions(call: Callable[[], Any], compiled: Any, num_devices: int) -> dict[str, float]:
  """Runs `call()` (one run of `compiled`) traced; returns how often each HLO op
  of `compiled` ran per device, averaged over the `num_devices` devices."""
  name = module_name(compiled)
  with tempfile.TemporaryDirectory() as directory:
    jax.profiler.start_trace(directory, create_perfetto_trace=True)
    try:
      jax.block_until_ready(call())
    finally:
      jax.profiler.stop_trace()
    (trace,) = Path(directory).rglob("perfetto_trace.json.gz")
    events = json.load(gzip.open(trace))["traceEvents"]
  counts = collections.Counter(
      event["args"]["hlo_op"] for event in events
      if event.get("ph") == "X" and event.get("args", {}).get("hlo_module") == name
      and "hlo_op" in event["args"] and not event["name"].startswith("end: "))
  return {op: count / num_devices for op, count in counts.items()}
