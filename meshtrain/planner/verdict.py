"""The last lines of `meshtrain plan`: whether the plan fits a device, and if
not, what to try, as commands.

A device holds `capacity` bytes that a step may plan for (a cluster's
`hbm_bytes x usable_memory`, or what the device present reports). The plan's
`total` is what one device needs; the train state (weights, gradients,
optimizer state) is the part that more devices split when they shard it
(`config.mesh.fsdp`, ZeRO-3), the rest (activations, one layer's backward) is
what recomputation and smaller microbatches shrink.
"""

import math

STATE = ("params", "grads", "optimizer")


def verdict(memory_bytes: dict, devices: int, capacity: float, device: str, config_args: str,
            cluster: str, remat: str) -> dict:
  """{"fits": bool, "text": lines}: `memory_bytes` is the plan's analytic
  memory of one device, `capacity` the bytes one `device` may use;
  `config_args` the plan's --config flags, `cluster` the --cluster to search."""
  total, gib = memory_bytes["total"], 2**30
  if total <= capacity:
    return {"fits": True, "text": (
        f"verdict: fits {device}: {total / gib:.1f} GiB a device of the {capacity / gib:.1f} GiB "
        f"usable ({1 - total / capacity:.0%} to spare)")}
  state = sum(memory_bytes.get(key) or 0 for key in STATE)
  search = f"meshtrain plan {config_args} --search --devices {devices} --cluster {cluster}"
  lines = [f"verdict: does not fit {device}: {total / gib:.1f} GiB a device, "
           f"{total / capacity:.1f}x the {capacity / gib:.1f} GiB usable. Try:",
           f"  {search}    (meshes, ZeRO, recomputation, microbatches, pipeline)"]
  if remat in ("none", "selective"):
    lines.append(f"  meshtrain plan {config_args} --devices {devices} --config.remat=full"
                 "    (recompute each layer in the backward)")
  if state > capacity:
    lines.append(f"  the train state alone (weights, gradients, optimizer) is {state / gib:.1f} "
                 "GiB a device: shard it over more devices (--config.mesh.fsdp=-1 "
                 "--config.mesh.data=1, or --config.zero_stage=3) or plan for more "
                 f"(--devices {devices * 2 ** math.ceil(math.log2(state / capacity))})")
  return {"fits": False, "text": "\n".join(lines)}
