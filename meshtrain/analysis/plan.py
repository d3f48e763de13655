"""Per-device memory and per-step communication of a config: an analytic model
derived from the rules tables, and the same figures read from the compiled step.

The analytic model follows each weight through the three layouts of
`rules.ShardingRules` (see `meshtrain.train.step`):

  master (optimizer layout) --all-gather over axes it drops--> working copy
  working copy --all-gather over its batch axes, per layer and pass--> compute
  gradient --reduce-scatter over the `grads` batch axes, per microbatch--> accumulator
  accumulator --all-reduce (or reduce-scatter into the optimizer layout) over
      the remaining batch axes, once per step--> optimizer

"Batch axes" are the mesh axes that split the batch (`data`, `fsdp`); the other
axes a weight is split over (`tensor`) stay split in compute. Bytes follow the
ring convention of `meshtrain.analysis.hlo`. Activations use Korthikanti et
al.'s per-layer formula (bytes for 2-byte activations, scaled to
`compute_dtype`), plus the float32 logits and their gradient.
"""

import collections
import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh, AxisType

from meshtrain import rules as r
from meshtrain.analysis import hlo
from meshtrain.mesh import AXES, axis_sizes
from meshtrain.train import setup as setup_lib
from meshtrain.train.state import llama_spec, model_config

BATCH_AXES = ("data", "fsdp")


def abstract_mesh(mesh_cfg, num_devices: int) -> AbstractMesh:
  sizes = axis_sizes(mesh_cfg, num_devices)
  return AbstractMesh(tuple(sizes[a] for a in AXES), AXES, axis_types=(AxisType.Auto,) * len(AXES))


def _spec_axes(names, rules) -> set[str]:
  return set(jax.tree.leaves(tuple(r.logical_to_spec(names, rules))))


def _prod(axes, mesh) -> int:
  return math.prod(mesh.shape[a] for a in axes)


def _label(axes) -> str:
  return "+".join(a for a in AXES if a in axes)


@dataclasses.dataclass
class _Comm:
  """Analytic collectives, summed by (kind, axis)."""
  totals: dict = dataclasses.field(default_factory=lambda: collections.defaultdict(lambda: [0, 0]))

  def add(self, kind: str, axes, operand_bytes: float, mesh, count: int = 1) -> None:
    n = _prod(axes, mesh)
    if n == 1 or operand_bytes == 0:
      return
    per_op = {"all-reduce": 2 * operand_bytes * (n - 1) / n,
              "all-gather": operand_bytes * (n - 1) / n,      # operand = gathered output
              "reduce-scatter": operand_bytes * (n - 1) / n}[kind]
    total = self.totals[(kind, _label(axes))]
    total[0] += count
    total[1] += per_op * count

  def as_list(self) -> list[dict]:
    return [{"kind": k, "axis": a, "count": c, "bytes": int(b)}
            for (k, a), (c, b) in sorted(self.totals.items())]


def analytic(cfg, spec, rules: r.ShardingRules, mesh) -> dict:
  """Per-device memory (bytes) and per-step collectives of the train step."""
  param_bytes = jnp.dtype(cfg.param_dtype).itemsize
  act_bytes = jnp.dtype(cfg.compute_dtype).itemsize
  accum = cfg.grad_accum_steps
  batch_axes = {a for a in BATCH_AXES if mesh.shape[a] > 1}
  # Gradients are summed over every axis that splits the tokens.
  token_axes = batch_axes | ({"sequence"} if mesh.shape["sequence"] > 1 else set())
  per_replica = accum > 1 and "data" in batch_axes

  m = cfg.model
  memory = dict.fromkeys(("params", "grads", "optimizer", "activations"), 0.0)
  comm = _Comm()
  for names, leaf in zip(jax.tree.leaves(spec.names, is_leaf=lambda x: isinstance(x, tuple)),
                         jax.tree.leaves(spec.abstract_params)):
    p_axes, g_axes, o_axes = (_spec_axes(names, t) for t in (rules.params, rules.grads, rules.optimizer))
    compute = leaf.size / _prod(p_axes - batch_axes, mesh)   # elements one device computes with
    working, master = compute / _prod(p_axes & batch_axes, mesh), leaf.size / _prod(o_axes, mesh)
    grads = compute / _prod(g_axes & batch_axes, mesh)
    if cfg.param_dtype == "float32" and p_axes == o_axes:  # the working copy is the master
      memory["params"] += 4 * master
      memory["optimizer"] += 8 * master
    else:
      memory["params"] += param_bytes * working
      memory["optimizer"] += 12 * master
    memory["grads"] += 4 * grads

    comm.add("all-gather", o_axes - p_axes, param_bytes * working, mesh)
    layers = m.num_layers if names[0] == r.LAYERS else 1  # stacked: one op per layer
    comm.add("all-gather", p_axes & batch_axes, param_bytes * compute / layers, mesh,
             _gathers(names, cfg))
    comm.add("reduce-scatter", g_axes & batch_axes, param_bytes * compute / layers, mesh,
             accum * layers)
    rest = token_axes - g_axes
    reductions = 1 if accum == 1 or per_replica else accum
    grad_bytes = (4 if per_replica else param_bytes) * grads
    comm.add("reduce-scatter", rest & o_axes, grad_bytes, mesh, reductions)
    comm.add("all-reduce", rest - o_axes, grad_bytes / _prod(rest & o_axes, mesh), mesh,
             reductions)

  memory["activations"] = activation_bytes(cfg, mesh) * act_bytes / 2
  b = cfg.global_batch // accum // _prod(batch_axes, mesh)
  s = cfg.seq_len // mesh.shape["sequence"]
  memory["activations"] += 2 * 4 * b * s * m.vocab_size / mesh.shape["tensor"]  # logits + grad
  # Megatron tensor parallelism: per attention and MLP block, forward and
  # backward (and the recomputed forward), one all-reduce of the block's
  # activations — or with sequence parallelism an all-gather into the block and
  # a reduce-scatter out of it.
  blocks = (6 if cfg.remat == "full" else 4) * m.num_layers * accum
  activation = act_bytes * b * s * m.embed_dim
  if cfg.tensor_sequence_parallel:
    comm.add("all-gather", {"tensor"}, activation, mesh, blocks)
    comm.add("reduce-scatter", {"tensor"}, activation, mesh, blocks)
  else:
    comm.add("all-reduce", {"tensor"}, activation, mesh, blocks)
  memory["total"] = sum(memory.values())
  return {"memory_bytes": {k: int(v) for k, v in memory.items()},
          "collectives": comm.as_list()}


def _gathers(names, cfg) -> int:
  """How often a step gathers a weight split over batch axes (what XLA does):
  a stacked layer weight per layer and microbatch, forward and backward and
  again when recomputed; an embedding used only for lookups once (the backward
  of a lookup does not read the table); any other weight forward and backward,
  or once with accumulation (the gather is hoisted out of the microbatch loop)."""
  if names[0] == r.LAYERS:
    return (3 if cfg.remat == "full" else 2) * cfg.grad_accum_steps * cfg.model.num_layers
  lookup_only = names == (r.VOCAB, r.EMBED) and not cfg.model.tie_embeddings
  return 1 if lookup_only or cfg.grad_accum_steps > 1 else 2


def activation_bytes(cfg, mesh) -> float:
  """Korthikanti et al. (2022), bytes per device for 2-byte activations, all layers."""
  m = cfg.model
  b = cfg.global_batch // cfg.grad_accum_steps // _prod(
      [a for a in BATCH_AXES if mesh.shape[a] > 1], mesh)
  s, h, a, t = cfg.seq_len // mesh.shape["sequence"], m.embed_dim, m.num_heads, mesh.shape["tensor"]
  sbh = s * b * h
  sp = cfg.tensor_sequence_parallel
  stored = 34 / t if sp else 10 + 24 / t          # norms, residuals, matmul inputs, MLP
  attention = 5 * a * s / (h * t)                  # scores, softmax, dropout mask
  if cfg.remat == "full":   # the layer inputs, plus one layer being recomputed
    return 2 * sbh / (t if sp else 1) * m.num_layers + sbh * (stored + attention)
  if cfg.remat == "selective":
    return sbh * stored * m.num_layers
  return sbh * (stored + attention) * m.num_layers


def compile_step(setup) -> jax.stages.Compiled:
  """The real train step compiled for setup.mesh, from shapes alone (nothing allocated)."""
  cfg = setup.cfg
  abstract_state = jax.tree.map(
      lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding),
      jax.eval_shape(setup.init_state), setup.shardings)
  batch = {key: jax.ShapeDtypeStruct((cfg.global_batch, cfg.seq_len), np.int32,
                                     sharding=setup.train_step.batch_sharding)
           for key in ("inputs", "targets")}
  return setup.train_step.lower(abstract_state, batch).compile()


def measured(setup) -> dict:
  """Memory and collectives of the compiled train step."""
  compiled = compile_step(setup)
  memory = hlo.memory_bytes(compiled)
  return {"memory_bytes": {"arguments": memory["arguments"], "temp": memory["temp"],
                           "total": memory["total"]},
          "collectives": [dataclasses.asdict(c) for c in hlo.collectives(compiled, setup.mesh)]}


def plan(cfg, num_devices: int, compile_step: bool) -> dict:
  """The `meshtrain plan` report. Without `compile_step` no device is touched,
  so it works for any model on any number of devices."""
  mesh = abstract_mesh(cfg.mesh, num_devices)
  setup_lib.validate(cfg, mesh)
  spec = llama_spec(model_config(cfg))
  report = {"devices": num_devices, "mesh": dict(mesh.shape), "zero_stage": cfg.zero_stage,
            "parameters": int(sum(x.size for x in jax.tree.leaves(spec.abstract_params))),
            "analytic": analytic(cfg, spec, setup_lib.sharding_rules(cfg, mesh), mesh)}
  if compile_step:
    report["measured"] = measured(setup_lib.build(cfg))
  report["collectives"] = report["measured" if compile_step else "analytic"]["collectives"]
  return report


def _mib(value) -> str:
  return "-" if value is None else f"{value / 2**20:10.2f}"


def format_plan(report: dict) -> str:
  shape = " x ".join(f"{a}={s}" for a, s in report["mesh"].items() if s > 1) or "one device"
  zero = f", zero_stage {report['zero_stage']}" if report["mesh"]["data"] > 1 else ""
  lines = [f"{report['parameters'] / 1e6:.2f}M parameters on {report['devices']} devices, "
           f"mesh {shape}{zero}", "", "memory per device (MiB)        analytic"]
  for key, value in report["analytic"]["memory_bytes"].items():
    lines.append(f"  {key:<26}{_mib(value)}")
  if "measured" in report:
    lines.append("measured (compiled step)")
    for key, value in report["measured"]["memory_bytes"].items():
      lines.append(f"  {key:<26}{_mib(value)}")
  lines += ["", "collectives per step           count   analytic MiB   measured count   measured MiB"]
  merged = collections.defaultdict(lambda: [None, None, None, None])
  for i, side in enumerate(("analytic", "measured")):
    for c in report.get(side, {}).get("collectives", []):
      row = merged[(c["kind"], c["axis"])]
      row[2 * i] = (row[2 * i] or 0) + c["count"]
      row[2 * i + 1] = (row[2 * i + 1] or 0) + c["bytes"]
  for (kind, axis), (count, nbytes, m_count, m_bytes) in sorted(merged.items()):
    lines.append(f"  {kind + ' ' + axis:<26}{count if count is not None else '-':>9}   {_mib(nbytes)}   "
                 f"{m_count if m_count is not None else '-':>14}   {_mib(m_bytes)}")
  return "\n".join(lines)
