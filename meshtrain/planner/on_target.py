"""`plan --search --target`: the search's fastest candidates compiled for a
GPU cluster on this machine (deviceless, as `plan --target` compiles the
config's own layout), those whose compiled memory does not fit a device
dropped. The search's memory is arithmetic; the compiled program's is what
XLA's GPU compiler allocates, so a candidate kept here fits by the program
that would run."""

import dataclasses

import ml_collections

from meshtrain import gpu_targets
from meshtrain.analysis import hlo
from meshtrain.errors import ConfigError
from meshtrain.planner import clusters, search
from meshtrain.planner.plan import compile_step, usable_memory
from meshtrain.train import setup as setup_lib
from meshtrain.train.run import resolve

# Candidates compiled for each one `--top` asks for, at most: the search's
# memory is within 10% of the compiled program's on the rows checked
# (tests/test_gpu_program.py), so a few dropped is what to expect.
COMPILED_PER_SHOWN = 3


@dataclasses.dataclass(frozen=True)
class Compiled:
  """A candidate's estimate beside its step compiled for the target: the
  bytes a device needs by the compiled program, and whether they fit."""
  estimate: search.Estimate
  memory_bytes: int
  fits: bool

  def as_dict(self, base_config: str) -> dict:
    return {**self.estimate.as_dict(base_config),
            "compiled": {"memory_bytes": self.memory_bytes, "fits": self.fits}}


def cluster_of(target: gpu_targets.Target) -> clusters.Cluster:
  """The cluster preset of the target's kind, its hosts as the target's."""
  if target.name not in clusters.PRESETS:
    raise ConfigError("--target", f"{target} has no cluster preset to search with; name a "
                      f"kind of {', '.join(gpu_targets.KINDS)}")
  return dataclasses.replace(clusters.PRESETS[target.name],
                             devices_per_host=target.devices_per_host)


def compiled_candidates(cfg, results: list[search.Estimate], target: gpu_targets.Target, top: int,
                        usable: int | None = None) -> list[Compiled]:
  """The search's `results`, fastest first, each compiled for `target`,
  until `top` of them fit a device (`usable` bytes; default what the
  target's preset allows, `plan.usable_memory`)."""
  usable = usable_memory(target) if usable is None else usable
  compiled = []
  for estimate in results:
    total = program_bytes(cfg, estimate.candidate, tuple(estimate.across_hosts), target)
    compiled.append(Compiled(estimate, total, total <= usable))
    if sum(c.fits for c in compiled) == top:
      break
  return compiled


def program_bytes(cfg, candidate: search.Candidate, across_hosts: tuple[str, ...],
                  target: gpu_targets.Target) -> int:
  """The bytes a device needs by the train step of `cfg` laid out as
  `candidate` (its `across_hosts` axes spanning hosts), compiled for
  `target`'s GPUs."""
  candidate_cfg = ml_collections.ConfigDict(candidate.config(cfg).to_dict())
  candidate_cfg.mesh.across_hosts = ",".join(across_hosts)
  run = resolve(candidate_cfg, gpu_targets.devices(target))
  return hlo.memory_bytes(compile_step(setup_lib.assemble(run)))["total"]


def format_compiled(compiled: list[Compiled], fitting: int, target: gpu_targets.Target,
                    base_config: str) -> str:
  """`search.format_search`'s ranking of the candidates that fit by their
  compiled programs, then every candidate compiled, kept or dropped, its
  compiled memory beside the search's."""
  kept = [c.estimate for c in compiled if c.fits]
  lines = [search.format_search(kept, fitting, cluster_of(target), target.num_devices,
                                base_config) if kept else
           "none of the search's first candidates fits by its compiled program", "",
           f"Compiled for {target} on this machine ({usable_memory(target) / 2**30:.1f} GiB "
           f"usable a device), the search's first {len(compiled)}:"]
  for i, c in enumerate(compiled, 1):
    searched = c.estimate.memory_bytes["total"]
    lines.append(f"  {i}. {'kept' if c.fits else 'dropped, over the device'}: compiled "
                 f"{c.memory_bytes / 2**30:.3g} GiB, searched {searched / 2**30:.3g} GiB "
                 f"({searched / c.memory_bytes:.2f}x); {search.describe(c.estimate.candidate)}")
  return "\n".join(lines)
