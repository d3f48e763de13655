"""Matmul FLOPs read from a compiled XLA program, loops counted by their trips.

XLA's own cost analysis counts a while loop's body once and a conditional's
most expensive branch, which says little about a pipeline: its step is a
loop over ticks whose body is a `lax.switch` on what the stage runs. Here
every `dot` counts 2 x output elements x contracted size, a loop body counts
times its known trip count, and a conditional either its costliest branch
or, where the caller knows how often each branch runs (a schedule table),
the weighted sum. Elementwise work is left out: matmuls are what a pipeline
could repeat (a recomputed forward) or lose.
"""

import functools
import math
import re
from collections.abc import Mapping, Sequence

from meshtrain.analysis import hlo


def _dims(attributes: str, key: str) -> list[int]:
  match = re.search(key + r"=\{([\d,]*)\}", attributes)
  return [int(d) for d in match.group(1).split(",") if d] if match else []


def _elements(shape: str) -> list[int]:
  match = re.search(r"\[([\d,]*)\]", shape)
  return [int(d) for d in match.group(1).split(",") if d] if match else []


def dot_flops(program, branch_weights: Mapping[int, Sequence[float]] | None = None) -> float:
  """Matmul FLOPs of one run of `program` (compiled, or its `as_text()`) on
  one device.

  branch_weights: {number of branches: weight per branch}: a conditional
  with that many branches counts sum(weight_i x FLOPs of branch i) instead of
  its costliest branch (per execution; the weights of a branch taken on a
  third of the executions is 1/3).
  """
  module = hlo._parse_module(hlo._hlo_text(program))
  branch_weights = dict(branch_weights or {})

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
        weights = branch_weights.get(len(costs))
        total += (sum(w * c for w, c in zip(weights, costs)) if weights is not None
                  else max(costs, default=0.0))
      else:
        total += sum(flops(c) for c in callees)
    return total

  return flops(module.entry)
