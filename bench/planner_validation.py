"""The planner against published training runs: writes docs/planner.md's table.

  python bench/planner_validation.py

For each run of `meshtrain.planner.published`: the rank of the published mesh
among every configuration that fits, its predicted TFLOP/s per device beside
the published figure, and the planner's own first choice with how much
faster it predicts it than the published mesh (with the recomputation the
search would choose there, where that is faster than the run's own) and, in
brackets, than the run as published.
"""

import sys
import time
from pathlib import Path

from meshtrain.config import load
from meshtrain.planner import clusters, published, search

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
from report import write_section  # noqa: E402


def mesh_text(sizes: dict) -> str:
  return " x ".join(f"{a}={n}" for a, n in sizes.items() if n > 1) or "one device"


def main():
  # First, so that no earlier search has warmed a cache.
  start = time.process_time()
  _, fitting, _ = search.search(load(REPO / "configs" / "llama_70b.py"), 1024,
                                clusters.PRESETS["h100"], top=5)
  seconds = time.process_time() - start
  rows, table = [], [
      "| run | devices | published mesh | rank (of fitting) | published TFLOP/s | "
      "predicted | predicted / published | planner's first choice | its prediction | "
      "first choice faster than the mesh (than the run) |",
      "|---|---|---|---|---|---|---|---|---|---|"]
  for run in published.RUNS:
    start = time.process_time()
    check = search.check_published(run)
    first = check["first"]
    rows.append({"run": run.name, "rank": check["rank"], "tied": check["tied"],
                 "fitting": check["fitting"], "published_tflops": check["published_tflops"],
                 "predicted_tflops": check["predicted_tflops"],
                 "first_speedup": check["first_speedup"],
                 "first_speedup_as_run": check["first_speedup_as_run"],
                 "on_mesh_remat": check["on_mesh"].candidate.remat,
                 "first": first.as_dict() if first else None,
                 "search_cpu_s": time.process_time() - start})
    choice = (f"{mesh_text(first.candidate.sizes)}, remat {first.candidate.remat}"
              if first else "nothing fits")
    if check["rank"] is None:
      rank = "- (does not fit)"
    else:
      rank = f"{check['rank']} of {check['fitting']}" + (
          f", tied with {check['tied']}" if check["tied"] else "")
    table.append(
        f"| {run.name} | {run.devices:,} {run.cluster} | {mesh_text(dict(run.mesh))}, remat "
        f"{run.remat} | {rank} | {check['published_tflops']:.0f} | "
        f"{check['predicted_tflops']:.0f} | "
        f"{check['predicted_tflops'] / check['published_tflops']:.2f} | "
        f"{choice} | {check['first_tflops'] or 0:.0f} | {check['first_speedup'] or 0:.2f}x "
        f"({check['first_speedup_as_run'] or 0:.2f}x) |")
    print(table[-1], flush=True)
  rows.append({"run": "llama_70b search on 1,024 h100", "fitting": fitting, "search_cpu_s": seconds})
  table.append(f"\nSearching configs/llama_70b.py on 1,024 h100 ({fitting} configurations fit) "
               f"took {seconds:.1f} CPU seconds (the target is under 30).")
  write_section("planner_validation", rows, "\n".join(table),
                command="python bench/planner_validation.py", doc=REPO / "docs" / "planner.md")


if __name__ == "__main__":
  main()
