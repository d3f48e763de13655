"""`meshtrain verify` on every strategy preset: the sharded step against the
same step unsharded under plain `jax.jit`, meshtrain's Llama, float32.

  python bench/verify_presets.py

Each preset of configs/ with the tiny model on 8 simulated CPU devices, two
AdamW steps on the first batch (`meshtrain.analysis.selfcheck.verify_config`).
Writes the worst relative difference (loss or a gradient, and which) of each
into docs/partitioner_issues.md, the reference for what float32 reordering
alone leaves.
"""

import os
import sys
from pathlib import Path

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import jax  # noqa: E402

from meshtrain.analysis.selfcheck import TOLERANCE, verify_config  # noqa: E402
from meshtrain.config import load  # noqa: E402
from meshtrain.mesh import axis_sizes  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
from report import write_section  # noqa: E402

PRESETS = ["dp", "zero1", "zero2", "fsdp", "hsdp", "tp", "tp_sp", "cp_ring", "cp_ulysses",
           "pp_1f1b", "megatron_3d"]


def main():
  rows = []
  table = ["| preset | mesh | loss | worst gradient | worst | verdict |", "|---|---|---|---|---|---|"]
  for name in PRESETS:
    cfg = load(REPO / "configs" / f"{name}.py", "tiny")
    report = verify_config(cfg)
    what, path, value = report.worst
    worst_grad = max(report.paths, key=lambda p: p.grads)
    sizes = axis_sizes(cfg.mesh, jax.device_count())
    mesh = " x ".join(f"{a}={n}" for a, n in sizes.items() if n != 1)
    rows.append({"preset": name, "mesh": sizes, "loss": report.loss,
                 "worst_gradient": worst_grad.grads, "worst_gradient_path": worst_grad.path,
                 "ok": report.ok()})
    table.append(f"| {name} | {mesh} | {report.loss:.1e} | {worst_grad.grads:.1e} "
                 f"(`{worst_grad.path}`) | {what}{' of ' + path if path else ''} | "
                 f"{'OK' if report.ok() else 'MISMATCH'} |")
    print(table[-1], flush=True)
  table.append(f"\nTolerance {TOLERANCE:.0e}; {jax.device_count()} devices, tiny model, 2 steps.")
  write_section("verify_presets", rows, "\n".join(table), command="python bench/verify_presets.py",
                doc=REPO / "docs" / "partitioner_issues.md")


if __name__ == "__main__":
  main()
