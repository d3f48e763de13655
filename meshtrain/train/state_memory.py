"""The bytes of the train state alone on one device: weights, gradients and
optimizer state, from the sharding rules (no activations, no compile).

Every weight is laid out three ways by the rules (`rules.ShardingRules`): as
it computes (`params`), as its gradient accumulates (`grads`) and as the
optimizer keeps it (`optimizer`). `leaf_layouts` reads, per weight, which
mesh axes split it in each and what one device holds; `state_bytes` sums
them; `check_fits` refuses, before anything is allocated, a run whose state
outgrows a device. The planner (`planner.plan.analytic`) adds the
activations and the collectives to the same layouts.
"""

import dataclasses
import functools
import math
import os

import jax
import jax.numpy as jnp

from meshtrain import rules as r
from meshtrain.errors import ConfigError
from meshtrain.train import local_sgd
from meshtrain.train.parallelize import stage_layout

BATCH_AXES = ("data", "fsdp")


@functools.cache  # a search asks for the same weights under the same few tables
def spec_axes(names: tuple, rules: r.Rules) -> frozenset[str]:
  return frozenset(jax.tree.leaves(tuple(r.logical_to_spec(names, rules))))


@functools.cache
def expert_split_axes(names: tuple, rules: r.Rules) -> frozenset[str]:
  """The mesh axes that split a weight's `experts` dimension (expert parallelism):
  each device computes with its own experts, gathers none over these axes and
  reduces none of their gradients there."""
  spec = r.logical_to_spec(names, rules)
  return frozenset(a for name, part in zip(names, spec) if name == r.EXPERTS
                   for a in jax.tree.leaves(part))


@functools.lru_cache(maxsize=4096)  # meshes are interned: one entry each
def sizes(mesh) -> dict[str, int]:
  """`mesh.shape`, made once (jax makes a new dict at every read of it)."""
  return dict(mesh.shape)


def prod(axes, mesh) -> int:
  return math.prod(sizes(mesh)[a] for a in axes)


def stacked_slots(cfg) -> int | None:
  """The layers the stacked weights take room for on a pipeline of uneven
  stages: P x V chunks of max(counts) slots (the empty slots hold zeros, but
  memory all the same); None where they are the model's own layers."""
  layout = stage_layout(cfg)
  return None if layout.even_split else len(layout.counts) * layout.slots


def pipeline_sums(compute: float, gathered_axes, mesh) -> float:
  """Elements of one weight's gradient sum on a pipeline stage: the
  executor (`runtime.initial_state`) sums every microbatch's gradients in
  float32 in the layout the stage computes with (`compute` elements, split
  over `tensor` and the stage's layers), further split over the automatic
  axes that split the working weights for storage (`gathered_axes`: `fsdp`),
  and reduces them over `data` and `sequence`, manual axes of its
  shard_map, only after the last tick, so neither divides them
  (tests/test_plan.py)."""
  return compute / prod(gathered_axes, mesh)



@dataclasses.dataclass(frozen=True)
class LeafLayout:
  """One weight as the rules lay it out on the mesh.

  Attributes:
    names: its logical axis names.
    params, grads, optimizer: the mesh axes that split it in each layout.
    gathered: the batch axes that split it for storage only (gathered to compute).
    compute: the elements one device computes with (gathered over `gathered`).
    working: the elements one device stores of the working copy.
    master: the elements one device keeps in the optimizer's layout.
    grads_kept: the gradient elements one device holds before the update.
    layers: the layers it stacks (1 for a weight outside the layers' stack).
  """
  names: tuple
  params: frozenset
  grads: frozenset
  optimizer: frozenset
  gathered: frozenset
  compute: float
  working: float
  master: float
  grads_kept: float
  layers: int


def leaf_layouts(cfg, spec, rules: r.ShardingRules, mesh) -> list[LeafLayout]:
  """Every weight of `spec` laid out by `rules` on `mesh` (stacked layers as
  a pipeline's slots hold them). Of `cfg` it reads `stacked_slots`, whether
  gradients accumulate (`grad_accum_steps` > 1) and the model's depth."""
  batch_axes = {a for a in BATCH_AXES if sizes(mesh)[a] > 1}
  slots = stacked_slots(cfg)
  layouts = []
  for names, leaf in zip(jax.tree.leaves(spec.names, is_leaf=lambda x: isinstance(x, tuple)),
                         jax.tree.leaves(spec.abstract_params)):
    p_axes, g_axes, o_axes = (spec_axes(names, t) for t in (rules.params, rules.grads,
                                                             rules.optimizer))
    gathered = frozenset(batch_axes - expert_split_axes(names, rules.params))
    size = leaf.size // leaf.shape[0] * slots if slots and names[0] == r.LAYERS else leaf.size
    compute = size / prod(p_axes - gathered, mesh)
    # With one microbatch nothing accumulates: each layer's gradients go straight
    # into the optimizer layout (XLA reduce-scatters them inside the backward's
    # scan), so ZeRO-1 and ZeRO-2 compile to one program; the `grads` rules
    # only lay out an accumulator.
    kept = compute / prod((g_axes if cfg.grad_accum_steps > 1 else o_axes) & gathered, mesh)
    layouts.append(LeafLayout(
        names, p_axes, g_axes, o_axes, gathered, compute,
        working=compute / prod(p_axes & gathered, mesh), master=size / prod(o_axes, mesh),
        grads_kept=kept, layers=cfg.model.num_layers if names[0] == r.LAYERS else 1))
  return layouts


def state_bytes(cfg, spec, rules: r.ShardingRules, mesh,
                layouts: list[LeafLayout] | None = None) -> dict[str, float]:
  """Per device: `params`, `grads`, `optimizer` (and `local_sgd_outer`, local
  SGD's outer state) on the device, and `host`, what `config.offload` keeps
  in pinned host memory. `layouts`: `leaf_layouts`' own, when already read."""
  param_bytes = jnp.dtype(cfg.param_dtype).itemsize
  grad_bytes = jnp.dtype(cfg.grad_dtype).itemsize
  pipelined = sizes(mesh)["pipeline"] > 1
  memory = dict.fromkeys(("params", "grads", "optimizer", "host"), 0.0)
  for leaf in layouts or leaf_layouts(cfg, spec, rules, mesh):
    same = cfg.param_dtype == "float32" and leaf.params == leaf.optimizer  # working is master
    streamed = cfg.offload.params and leaf.layers > 1  # fetched one layer at a time
    master_on_host = cfg.offload.optimizer or streamed
    memory["host"] += 4 * leaf.master * master_on_host + 8 * leaf.master * cfg.offload.optimizer
    memory["params"] += ((4 * leaf.master if same else param_bytes * leaf.working)
                         / (leaf.layers if streamed else 1))
    memory["optimizer"] += (8 * leaf.master * (not cfg.offload.optimizer)
                            + 4 * leaf.master * (not same and not master_on_host))
    memory["grads"] += (4 * pipeline_sums(leaf.compute, leaf.params & leaf.gathered, mesh)
                        if pipelined else grad_bytes * leaf.grads_kept)
  if cfg.local_sgd.inner_steps:
    memory["local_sgd_outer"] = local_sgd.plan(cfg, spec, rules, mesh)["outer_state_bytes"]
  return memory


def device_memory(device) -> int | None:
  """Bytes one device can hold: its allocator's limit (GPU, TPU); on CPU the
  host's memory over its local devices; None where neither is known."""
  stats = device.memory_stats() or {}
  if "bytes_limit" in stats:
    return stats["bytes_limit"]
  if device.platform == "cpu":
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // jax.local_device_count()
  return None


def check_fits(setup) -> None:
  """Refuses, before anything is allocated, a run whose train state alone
  (weights, gradients and optimizer state on the device) outgrows a
  device's memory: where it would die allocating, on CPU killed by the host
  without a word."""
  memory = state_bytes(setup.cfg, setup.spec, setup.rules, setup.mesh)
  state = sum(v for k, v in memory.items() if k != "host")
  limit = device_memory(jax.local_devices()[0])
  if limit and state > limit:
    raise ConfigError("config.mesh", f"the train state alone (weights, gradients, optimizer "
                      f"state) needs {state / 2**30:.1f} GiB a device, more than the "
                      f"{limit / 2**30:.1f} GiB one has; split it over more devices "
                      "(config.mesh.fsdp, config.zero_stage), move the optimizer to the host "
                      "(config.offload.optimizer) or train a smaller model (`meshtrain plan` "
                      "shows where the bytes go)")
