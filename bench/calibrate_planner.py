"""Fits the planner's two free numbers on the calibration runs alone and
writes them into meshtrain/planner/calibration.py and docs/planner.md.

  python bench/calibrate_planner.py

The rows are `meshtrain.planner.published.CALIBRATION`, none of them among
the runs the planner is validated on (`published.RUNS`). The kernel
efficiency and the elementwise passes minimize the sum of squared log ratios
of predicted to published TFLOP/s per device of each run as published (its
mesh and recomputation; the fastest schedule meshtrain runs there): a grid
over the passes, golden-section search over the efficiency on [0.2, 1].
"""

import math
import sys
from pathlib import Path

from meshtrain.planner import clusters, published, search

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
from report import write_section  # noqa: E402

TARGET = REPO / "meshtrain" / "planner" / "calibration.py"
PASSES = [2.0 * i for i in range(31)]


class Fit:
  """The calibration runs' models, built once; predictions at any numbers."""

  def __init__(self):
    self.models = [(run, search.StepModel(run.config(), clusters.load(run.cluster)))
                   for run in published.CALIBRATION]

  def ratios(self, efficiency: float, passes: float) -> list[float]:
    out = []
    for run, model in self.models:
      model.efficiency, model.elementwise = efficiency, passes
      estimate = search.as_published(model, run)
      predicted = (estimate.hardware_tflops_per_device if run.counts_recompute
                   else estimate.model_tflops_per_device)
      out.append(predicted / run.tflops)
    return out

  def loss(self, efficiency: float, passes: float) -> float:
    return sum(math.log(r) ** 2 for r in self.ratios(efficiency, passes))


def golden_section(f, low: float, high: float, tolerance: float = 1e-4) -> float:
  ratio = (math.sqrt(5) - 1) / 2
  a, b = low, high
  c, d = b - ratio * (b - a), a + ratio * (b - a)
  fc, fd = f(c), f(d)
  while b - a > tolerance:
    if fc < fd:
      b, d, fd = d, c, fc
      c = b - ratio * (b - a)
      fc = f(c)
    else:
      a, c, fc = c, d, fd
      d = a + ratio * (b - a)
      fd = f(d)
  return (a + b) / 2


def fitted(fit: Fit) -> tuple[float, float]:
  """The kernel efficiency (to the 4 digits written) and the elementwise
  passes that minimize `fit.loss`: what meshtrain/planner/calibration.py
  must hold (tests/test_search.py checks it)."""
  best = min(((golden_section(lambda e: fit.loss(e, p), 0.2, 1.0), p) for p in PASSES),
             key=lambda point: fit.loss(*point))
  return round(best[0], 4), best[1]


def main():
  fit = Fit()
  efficiency, passes = fitted(fit)
  names = tuple(run.name for run, _ in fit.models)
  source = TARGET.read_text()
  head = source[:source.index("KERNEL_EFFICIENCY =")]
  TARGET.write_text(head + f"KERNEL_EFFICIENCY = {efficiency}\nELEMENTWISE_PASSES = {passes}\n"
                    + "FITTED_ON = (\n" + "".join(f"    {name!r},\n" for name in names) + ")\n")
  rows, table = [], ["| calibration run | devices | mesh | published TFLOP/s | fitted prediction "
                     "| ratio |", "|---|---|---|---|---|---|"]
  for (run, _), ratio in zip(fit.models, fit.ratios(efficiency, passes)):
    rows.append({"run": run.name, "published_tflops": run.tflops,
                 "predicted_tflops": run.tflops * ratio})
    mesh = " x ".join(f"{a}={n}" for a, n in run.mesh.items())
    table.append(f"| {run.name} | {run.devices:,} {run.cluster} | {mesh}, remat {run.remat} | "
                 f"{run.tflops:.0f} | {run.tflops * ratio:.0f} | {ratio:.2f} |")
  spread = math.sqrt(fit.loss(efficiency, passes) / len(rows))
  table.append(f"\nFitted: kernel efficiency **{efficiency}** of peak, **{passes:g}** "
               f"elementwise passes (root mean square log ratio {spread:.3f}).")
  print("\n".join(table))
  write_section("planner_calibration",
                rows + [{"kernel_efficiency": efficiency, "elementwise_passes": passes}],
                "\n".join(table), command="python bench/calibrate_planner.py",
                doc=REPO / "docs" / "planner.md")


if __name__ == "__main__":
  main()
