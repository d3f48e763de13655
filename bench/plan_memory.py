"""`meshtrain plan` against `plan --compile` for every preset and strategy.

  python bench/plan_memory.py

Compiles (does not run) the train step of each config on 8 simulated CPU
devices and puts the analytic total (params + grads + optimizer + activations)
beside `memory_analysis()`'s arguments + temp. Writes docs/memory_plan.md's table.
"""

import os
import sys
from pathlib import Path

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

from meshtrain.analysis.plan import plan  # noqa: E402
from meshtrain.config import load  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
from report import write_section  # noqa: E402

STRATEGIES = ("dp", "zero1", "zero2", "fsdp", "hsdp", "tp", "tp_sp", "cp_ulysses", "cp_ring",
              "pp_1f1b", "megatron_3d")
MODELS = ("tiny", "small", "llama_125m")
REMAT = ("selective", "full")
MIB = 2**20


def configs():
  """(name, config): each model preset data-parallel, each strategy on the
  small model, and the small model's tp_sp under each recomputation policy."""
  for model in MODELS:
    cfg = load(REPO / "configs" / f"{model}.py")
    cfg.mesh.data = -1
    yield model, cfg
  for strategy in STRATEGIES:
    yield f"small, {strategy}", load(REPO / "configs" / f"{strategy}.py")
  for remat in REMAT:
    cfg = load(REPO / "configs" / "tp_sp.py")
    cfg.remat = remat
    yield f"small, tp_sp, remat={remat}", cfg


def main():
  rows, table = [], [
      "| config | params | grads | optimizer | activations | analytic total | "
      "measured arguments | measured temp | measured total | analytic / measured |",
      "|---|---|---|---|---|---|---|---|---|---|"]
  for name, cfg in configs():
    print(f"compiling {name}", flush=True)
    report = plan(cfg, 8, compile_step=True)
    a, m = report["analytic"]["memory_bytes"], report["measured"]["memory_bytes"]
    rows.append({"config": name, "analytic": a, "measured": m})
    table.append(f"| {name} | " + " | ".join(
        f"{v / MIB:.1f}" for v in (a["params"], a["grads"], a["optimizer"], a["activations"],
                                   a["total"], m["arguments"], m["temp"], m["total"]))
        + f" | {a['total'] / m['total']:.2f} |")
    print(table[-1], flush=True)
  write_section("plan_memory", rows, "MiB per device, 8 simulated CPU devices.\n\n" +
                "\n".join(table), command="python bench/plan_memory.py",
                doc=REPO / "docs" / "memory_plan.md")


if __name__ == "__main__":
  main()
