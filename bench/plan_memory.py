"""`meshtrain plan` against `plan --compile` for every preset and strategy.

  python bench/plan_memory.py

Compiles (does not run) the train step of each config on 8 simulated CPU
devices and puts the analytic total (params + grads + optimizer + activations
+ backward) beside `memory_analysis()`'s arguments + temp. Writes
docs/memory_plan.md's tables.
"""

import os
import sys
from pathlib import Path

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

from meshtrain.config import load  # noqa: E402
from meshtrain.planner.plan import abstract_mesh, plan, residual_bytes  # noqa: E402
from meshtrain.train.run import sharding_rules  # noqa: E402

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
    if cfg.compute_dtype != "float32":  # XLA's CPU backend computes bfloat16 in float32
      cfg = cfg.copy_and_resolve_references()
      cfg.compute_dtype = cfg.param_dtype = "float32"
      yield f"{model}, float32", cfg
  for strategy in STRATEGIES:
    yield f"small, {strategy}", load(REPO / "configs" / f"{strategy}.py")
  for remat in REMAT:
    cfg = load(REPO / "configs" / "tp_sp.py")
    cfg.remat = remat
    yield f"small, tp_sp, remat={remat}", cfg


def layer_sbh(remat: str, tensor: int, sp: bool) -> float:
  """What one llama_8b-shaped layer saves (s=4096, b=1, bf16), in units of
  s·b·h bytes: the 2-layer model's residuals less the 1-layer model's."""
  cfg = load(REPO / "configs" / "llama_8b.py")
  cfg.update(seq_len=4096, global_batch=1, remat=remat, tensor_sequence_parallel=sp)
  cfg.attention.implementation = "xla"
  cfg.mesh.update(data=1, tensor=tensor)
  mesh = abstract_mesh(cfg.mesh, tensor)
  rules = sharding_rules(cfg, mesh)
  one, two = (residual_bytes(cfg, mesh, rules, layers=n, rows=1, remat=remat) for n in (1, 2))
  return (two - one) / (cfg.seq_len * cfg.model.embed_dim)


def layer_table() -> str:
  """Per-layer saved bytes beside Korthikanti et al.'s GPT formulas (a = 32 heads,
  s = 4096, h = 4096: 5as/h = 160)."""
  megatron = {("none", 1, False): 34 + 160, ("none", 8, False): 10 + 24 / 8 + 160 / 8,
              ("none", 8, True): 34 / 8 + 160 / 8, ("selective", 1, False): 34,
              ("selective", 8, False): 10 + 24 / 8, ("selective", 8, True): 34 / 8,
              ("full", 1, False): 2, ("full", 8, False): 2, ("full", 8, True): 2 / 8}
  lines = ["| remat | tensor | sequence parallel | meshtrain (sbh) | Megatron GPT formula (sbh) |",
           "|---|---|---|---|---|"]
  for (remat, tensor, sp), formula in megatron.items():
    lines.append(f"| {remat} | {tensor} | {sp} | {layer_sbh(remat, tensor, sp):.1f} | {formula:.1f} |")
  return "\n".join(lines)


def main():
  write_section("layer_residuals", [], layer_table(), command="python bench/plan_memory.py",
                doc=REPO / "docs" / "memory_plan.md")
  rows, table = [], [
      "| config | params | grads | optimizer | activations | backward | analytic total | "
      "measured arguments | measured temp | measured total | analytic / measured |",
      "|---|---|---|---|---|---|---|---|---|---|---|"]
  for name, cfg in configs():
    print(f"compiling {name}", flush=True)
    report = plan(cfg, 8, compile_step=True)
    a, m = report["analytic"]["memory_bytes"], report["measured"]["memory_bytes"]
    rows.append({"config": name, "analytic": a, "measured": m})
    table.append(f"| {name} | " + " | ".join(
        f"{v / MIB:.1f}" for v in (a["params"], a["grads"], a["optimizer"], a["activations"],
                                   a["backward"], a["total"], m["arguments"], m["temp"], m["total"]))
        + f" | {a['total'] / m['total']:.2f} |")
    print(table[-1], flush=True)
  write_section("plan_memory", rows, "MiB per device, 8 simulated CPU devices.\n\n" +
                "\n".join(table), command="python bench/plan_memory.py",
                doc=REPO / "docs" / "memory_plan.md")


if __name__ == "__main__":
  main()
