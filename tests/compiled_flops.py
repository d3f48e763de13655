"""Matmul FLOPs read from a compiled XLA program, loops counted by their trips.

XLA's own cost analysis counts a while loop's body once and a conditional's
most expensive branch, which says little about a pipeline: its step is a
loop over ticks whose body holds one conditional per op (F, B, W), each
taking its branch on some ticks only. Here every `dot` counts 2 x output
elements x contracted size, a loop body counts times its known trip count,
and a conditional either its costliest branch or, where the caller knows how
often a two-way conditional takes its branch (a schedule table, by the named
scope the conditional was traced under), the weighted sum. Elementwise work
is left out: matmuls are what a pipeline could repeat (a recomputed forward)
or lose.
"""

import functools
import math
import re
from collections.abc import Mapping

from meshtrain.analysis import hlo


def _dims(attributes: str, key: str) -> list[int]:
  match = re.search(key + r"=\{([\d,]*)\}", attributes)
  return [int(d) for d in match.group(1).split(",") if d] if match else []


def _elements(shape: str) -> list[int]:
  match = re.search(r"\[([\d,]*)\]", shape)
  return [int(d) for d in match.group(1).split(",") if d] if match else []


def _scope(inst) -> str | None:
  """The named scope a conditional was traced under: `.../SCOPE/cond` in its op name."""
  match = re.search(r'op_name="[^"]*?([^/"]+)/cond"', inst.attributes)
  return match.group(1) if match else None


def dot_flops(program, cond_weights: Mapping[str, float] | None = None) -> float:
  """Matmul FLOPs of one run of `program` (compiled, or its `as_text()`) on
  one device.

  cond_weights: {named scope: share}: a two-way conditional traced under
  that scope (`with jax.named_scope(scope): lax.cond(...)`) takes its branch
  on that share of its executions, and counts share x its FLOPs plus (1 -
  share) x the other branch's, instead of its costliest branch.
  """
  module = hlo._parse_module(hlo._hlo_text(program))
  cond_weights = dict(cond_weights or {})

  def instruction_flops(inst) -> float:
    if inst.opcode != "dot":
      return 0.0
    lhs = module.by_name[(inst.computation, inst.operands[0])]
    contracted = math.prod(_elements(lhs.shape)[d] for d in _dims(inst.attributes, "lhs_contracting_dims"))
    return 2.0 * math.prod(_elements(inst.shape)) * contracted

  @functools.cache
  def flops(name: str) -> float:
    total = 0.0
    for inst in module.computations[name]:
      total += instruction_flops(inst)
      callees = module.called(inst)
      if inst.opcode == "while":
        total += (hlo._trip_count(inst) or 1) * sum(flops(c) for c in callees)
      elif inst.opcode == "conditional":
        costs = [flops(c) for c in callees]
        share = cond_weights.get(_scope(inst))
        # A two-way conditional lists its false branch first.
        total += (share * costs[1] + (1 - share) * costs[0]
                  if share is not None and len(costs) == 2 else max(costs, default=0.0))
      else:
        total += sum(flops(c) for c in callees)
    return total

  return flops(module.entry)
