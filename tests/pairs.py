"""Which strategies and features a table of composition cases puts together.

The composition tests (test_moe.py, test_mtp.py) cover their strategies and
features pairwise, not as a full product: each case is a config, and
`labels(cfg)` reads off it what it composes (mesh axes split, the ZeRO stage,
accumulation, recomputation, the sequence strategy, pipeline schedules, the
MoE options). `covered(cases)` is every pair some case holds; each file keeps
the pairs it must cover (`REQUIRED`) beside its cases and a quick test asserts
none is missing, so a case merged or removed cannot drop a pair silently.

`python tests/pairs.py` prints each file's table: every label against every
other, `x` where a case composes them.
"""

import itertools
import sys
from pathlib import Path


def labels(cfg, devices: int = 8) -> frozenset[str]:
  """What `cfg` (a micro config on `devices`) composes, as short names."""
  from meshtrain.planner.plan import abstract_mesh
  sizes = dict(abstract_mesh(cfg.mesh, devices).shape)
  found = {axis for axis, size in sizes.items() if size > 1} or {"one device"}
  if sizes["sequence"] > 1:
    found.add(cfg.attention.sequence_strategy)
  if sizes["pipeline"] > 1:
    found.add(cfg.pipeline.schedule)
    if cfg.pipeline.stage_layers:
      found.add("uneven stages")
  if sizes["tensor"] > 1 and cfg.tensor_sequence_parallel:
    found.add("megatron-sp")
  if cfg.zero_stage:
    found.add(f"zero{cfg.zero_stage}")
  if cfg.grad_accum_steps > 1:
    found.add("accumulate")
  if cfg.remat != "none":
    found.add(f"remat {cfg.remat}")
  if any(cfg.offload.values()):
    found.add("offload")
  model = cfg.model
  if model.mtp_layers:
    found.add(f"mtp depth {model.mtp_layers}")
  if model.tie_embeddings:
    found.add("tied")
  moe = model.moe
  if moe.num_experts:
    found.add("moe")
    axes = [a for a in cfg.expert_parallel.split(",") if a and sizes[a] > 1]
    found.add("experts over " + "+".join(axes) if axes else "experts whole")
    for flag, name in ((moe.capacity_factor, "capacity"), (moe.shared_mlp_dim, "shared expert"),
                       (moe.shared_gate, "shared gate"), (moe.first_dense_layers, "first dense"),
                       (moe.router == "sigmoid", "sigmoid"), (moe.groups_per_token, "groups"),
                       (moe.aux_loss_coef, "switch loss"), (moe.bias_update_rate, "bias balancing"),
                       (cfg.experts.grouped_gemm == "ragged_dot", "ragged_dot")):
      if flag:
        found.add(name)
  return frozenset(found)


def parse(text: str) -> set[tuple[str, str]]:
  """Pairs written one label a line, `a: b, c` for (a, b) and (a, c)."""
  found = set()
  for line in filter(None, (line.strip() for line in text.splitlines())):
    a, _, others = line.partition(":")
    found |= {tuple(sorted((a.strip(), b.strip()))) for b in others.split(",") if b.strip()}
  return found


def write(pairs_) -> str:
  """`parse`'s text of `pairs_`."""
  firsts = sorted({a for a, _ in pairs_})
  return "\n".join(f"{a}: " + ", ".join(sorted(b for x, b in pairs_ if x == a)) for a in firsts)


def covered(case_labels) -> set[tuple[str, str]]:
  """Every (a, b), a < b, that some case's labels hold together."""
  return {pair for held in case_labels for pair in itertools.combinations(sorted(held), 2)}


def missing(case_labels, required) -> list[tuple[str, str]]:
  """The pairs of `required` no case holds (each pair in either order)."""
  have = covered(case_labels)
  return sorted(tuple(sorted(p)) for p in required if tuple(sorted(p)) not in have)


def table(case_labels) -> str:
  """Every label against every other: `x` where some case holds the two."""
  have = covered(case_labels)
  names = sorted(set().union(*case_labels))
  width = max(map(len, names))
  rows = [" " * width + " " + " ".join(f"{i:>2}" for i in range(len(names)))]
  for i, a in enumerate(names):
    marks = ["  " if a == b else " x" if tuple(sorted((a, b))) in have else " ." for b in names]
    rows.append(f"{a:>{width}} " + " ".join(marks) + f"  {i}")
  return "\n".join(rows)


if __name__ == "__main__":
  import os
  os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
  sys.path.insert(0, str(Path(__file__).parent))
  import test_moe
  import test_mtp
  for name, cases in (("test_moe: training on one mesh", test_moe.composition_labels()),
                      ("test_moe: the pipeline", test_moe.pipelined_labels()),
                      ("test_mtp", test_mtp.case_labels())):
    print(f"{name}: {len(cases)} cases\n{table(list(cases.values()))}\n")
