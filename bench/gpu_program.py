"""`meshtrain plan --target` on the presets: the program XLA's GPU compiler
builds for H100 clusters, compiled on this CPU machine.

  python bench/gpu_program.py

For each case: the plan's memory per device against the compiled program's,
the compile's time and the host memory it took (the `plan` process's peak
resident set), and the share of the collective bytes with matmuls scheduled
under them (`analysis.gpu_program.hidden_share`), in all and by kind, for
the programs that fit. Writes
docs/gpu_program.md's table and bench/results/gpu_program.json.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
import meshtrain  # noqa: E402,F401  (first: jax's CUDA plugin without a driver, quietly)
from report import write_section  # noqa: E402

GIB = 2**30
# (name, preset, --config.* overrides, target)
CASES = [
    ("1B ddp", "llama_1b", {"mesh.data": 8}, "h100:1x8"),
    ("1B zero1", "llama_1b", {"mesh.data": 8, "zero_stage": 1}, "h100:1x8"),
    ("1B zero3", "llama_1b", {"mesh.data": 8, "zero_stage": 3}, "h100:1x8"),
    ("1B fsdp", "llama_1b", {"mesh.data": 1, "mesh.fsdp": 8}, "h100:1x8"),
    ("8B fsdp", "llama_8b", {"mesh.data": 1, "mesh.fsdp": 64, "mesh.across_hosts": "fsdp",
                             "global_batch": 64}, "h100:8x8"),
    ("8B tensor x fsdp", "llama_8b", {"mesh.data": 1, "mesh.tensor": 8, "mesh.fsdp": 8,
                                      "mesh.across_hosts": "fsdp"}, "h100:8x8"),
    ("8B tensor x fsdp, batch 32", "llama_8b", {"mesh.data": 1, "mesh.tensor": 8, "mesh.fsdp": 8,
                                                "mesh.across_hosts": "fsdp", "global_batch": 32},
     "h100:8x8"),
    ("Mixtral 8x7B, experts over fsdp", "mixtral_8x7b",
     {"mesh.data": 1, "mesh.tensor": 8, "mesh.fsdp": 8, "mesh.across_hosts": "fsdp",
      "expert_parallel": "fsdp"}, "h100:8x8"),
    ("70B pipeline x tensor x data", "llama_70b",
     {"mesh.data": 8, "mesh.tensor": 8, "mesh.pipeline": 4, "mesh.across_hosts": "data,pipeline",
      "pipeline.microbatches": 16}, "h100:32x8"),
]


def run_case(preset: str, overrides: dict, target: str) -> tuple[dict, float, float]:
  """The plan report, the wall seconds and the peak resident MiB of its process."""
  command = [sys.executable, "-m", "meshtrain.cli", "plan", "--json", "--target", target,
             "--config", str(REPO / "configs" / f"{preset}.py"),
             *(f"--config.{key}={value}" for key, value in overrides.items())]
  start = time.perf_counter()
  process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                             cwd=REPO)
  out = process.stdout.read()
  _, status, usage = os.wait4(process.pid, 0)
  if status:
    raise RuntimeError(f"{' '.join(command)} failed; run it to see why")
  return json.loads(out), time.perf_counter() - start, usage.ru_maxrss / 1024


def shares(measured: dict) -> dict:
  """The hidden share of each kind of collective's bytes."""
  totals = {}
  for c in measured["collectives"]:
    moved, hidden = totals.get(c["kind"], (0, 0))
    totals[c["kind"]] = (moved + c["bytes"], hidden + c["hidden_bytes"])
  return {kind: round(hidden / moved, 3) for kind, (moved, hidden) in totals.items() if moved}


def overlap(row: dict) -> str:
  """The hidden shares' cells: none for a program over the device's memory,
  which XLA's scheduler orders for memory, not overlap (docs/gpu_program.md)."""
  if not row["fits"]:
    return "(does not fit) | "
  return f"{row['hidden_share']:.0%} | " + ", ".join(
      f"{k} {v:.0%}" for k, v in row["hidden_by_kind"].items())


def main() -> None:
  rows = []
  for name, preset, overrides, target in CASES:
    report, seconds, rss = run_case(preset, overrides, target)
    measured, analytic = report["measured"], report["analytic"]["memory_bytes"]
    rows.append({"case": name, "target": target, "overrides": overrides,
                 "plan_gib": round(analytic["total"] / GIB, 2),
                 "compiled_gib": round(measured["memory_bytes"]["total"] / GIB, 2),
                 "fits": measured["fits"], "compile_s": measured["compile_time_s"],
                 "wall_s": round(seconds, 1), "host_peak_mib": round(rss),
                 "hidden_share": round(measured["hidden_share"] or 0, 3),
                 "hidden_by_kind": shares(measured)})
    print(rows[-1], flush=True)
  header = ("| case | target | plan GiB | compiled GiB | plan / compiled | fits | compile s | "
            "host peak MiB | bytes hidden under matmuls | by kind |\n"
            "|---|---|---|---|---|---|---|---|---|---|\n")
  table = header + "\n".join(
      f"| {r['case']} | {r['target']} | {r['plan_gib']} | {r['compiled_gib']} | "
      f"{r['plan_gib'] / r['compiled_gib']:.2f} | {'yes' if r['fits'] else 'no'} | "
      f"{r['compile_s']} | {r['host_peak_mib']} | " + overlap(r) + " |" for r in rows)
  write_section("gpu_program", rows, table, "python bench/gpu_program.py",
                doc=REPO / "docs" / "gpu_program.md")


if __name__ == "__main__":
  main()
