"""`meshtrain plan --search`: the mesh, ZeRO stage, recomputation and
microbatches for a model on a cluster, ranked by a predicted step time.

Step-time model (per step, one device; all devices do equal work):

  compute   hardware FLOPs / devices / (peak x ACHIEVABLE): the model's FLOPs
            (`meshtrain.models.flops`, PaLM's count) plus what recomputation
            adds (a layer forward under remat=full or in a pipeline backward,
            the attention core under selective).
  comms     each collective of `meshtrain.analysis.plan.analytic`, its bytes
            over the bandwidth of the link class its mesh axes cross: an axis
            crosses hosts when it and the axes inside it (`meshtrain.mesh.AXES`,
            tensor innermost) hold more devices than a host.
  overlap   collectives over the batch axes (data, fsdp: weight all-gathers
            prefetched under the previous layer, gradient reductions under the
            backward) hide under compute; only what exceeds it shows.
            Tensor, sequence and pipeline traffic is exposed.
  bubble    a pipeline idles (p-1)/(v·m+p-1) of the step: the busy time
            stretched by 1/(1 - bubble).

Memory is `plan`'s: state from the rules, activations from the residuals the
model saves (traced once per kind of layout and scaled: `_ActivationModel`).
"""

import dataclasses
import functools
import itertools
import math
import shlex

import jax
import jax.numpy as jnp
import ml_collections
from jax.sharding import AbstractMesh, AxisType

from meshtrain import rules as r
from meshtrain.analysis import clusters, plan as plan_lib, residuals
from meshtrain.models import flops
from meshtrain.parallel import experts
from meshtrain.analysis.clusters import Cluster
from meshtrain.mesh import AXES
from meshtrain.parallel.pipeline import measures
from meshtrain.train import setup as setup_lib
from meshtrain.train.parallelize import llama_spec, model_config, slots

# Share of peak FLOP/s a bf16 transformer step sustains in its kernels (matmuls,
# attention, norms and optimizer together), before communication and bubbles.
# Published runs put it at about half: Megatron-LM's data-parallel 1.7B model
# computed at 44% of A100 peak with its gradient reduction hidden (Narayanan et
# al. 2021, Table 1), MaxText's Llama2-7B at 50% of H100 peak.
ACHIEVABLE = 0.5
BATCH_AXES = ("data", "fsdp")
REMATS = ("none", "selective", "full")


def _divisors(n: int) -> list[int]:
  return [d for d in range(1, n + 1) if n % d == 0]


def _abstract_mesh(sizes: dict) -> AbstractMesh:
  return AbstractMesh(tuple(sizes.get(a, 1) for a in AXES), AXES,
                      axis_types=(AxisType.Auto,) * len(AXES))


@dataclasses.dataclass(frozen=True)
class Candidate:
  mesh: tuple[tuple[str, int], ...]  # (axis, size) in AXES order
  zero_stage: int = 0
  remat: str = "none"
  grad_accum_steps: int = 1
  microbatches: int = 1              # pipeline microbatches per step
  virtual_stages: int = 1
  tensor_sequence_parallel: bool = False
  expert_parallel: str | None = None  # MoE: config.expert_parallel (None: the config's)

  @property
  def sizes(self) -> dict[str, int]:
    return dict(self.mesh)

  def config(self, base: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    cfg = ml_collections.ConfigDict(base.to_dict())
    cfg.mesh.update(self.sizes)
    cfg.update(zero_stage=self.zero_stage, remat=self.remat,
               grad_accum_steps=self.grad_accum_steps,
               tensor_sequence_parallel=self.tensor_sequence_parallel)
    if self.expert_parallel is not None:
      cfg.expert_parallel = self.expert_parallel
    if self.sizes["pipeline"] > 1:
      cfg.pipeline.update(microbatches=self.microbatches, virtual_stages=self.virtual_stages,
                          schedule="interleaved_1f1b" if self.virtual_stages > 1 else "1f1b")
    return cfg

  def flags(self, across_hosts: list[str]) -> str:
    """The `--config.*` overrides that run this candidate."""
    parts = [f"--config.mesh.{a}={n}" for a, n in self.mesh]
    parts += [f"--config.zero_stage={self.zero_stage}", f"--config.remat={self.remat}",
              f"--config.grad_accum_steps={self.grad_accum_steps}",
              f"--config.tensor_sequence_parallel={self.tensor_sequence_parallel}"]
    if self.expert_parallel is not None:
      parts.append(f"--config.expert_parallel={shlex.quote(self.expert_parallel)}")
    if self.sizes["pipeline"] > 1:
      schedule = "interleaved_1f1b" if self.virtual_stages > 1 else "1f1b"
      parts += [f"--config.pipeline.schedule={schedule}",
                f"--config.pipeline.microbatches={self.microbatches}",
                f"--config.pipeline.virtual_stages={self.virtual_stages}"]
    if across_hosts:
      parts.append(f"--config.mesh.across_hosts={','.join(across_hosts)}")
    return " ".join(parts)


def across_hosts(sizes: dict, cluster: Cluster) -> list[str]:
  """Axes whose devices span hosts, outer first: those that, with every axis
  inside them, hold more devices than one host."""
  crossing, inner = [], 1
  for axis in reversed(AXES):
    inner *= sizes[axis]
    if sizes[axis] > 1 and inner > cluster.devices_per_host:
      crossing.append(axis)
  return crossing[::-1]


# Layers and sequences of the traced model: odd numbers no model dimension is
# likely to equal, so that stacked and per-sequence residuals stand out.
TRACED_LAYERS, TRACED_ROWS = 7, 22  # rows: 11 per device of the traced mesh


class _ActivationModel:
  """Per-device activation bytes for any mesh from one trace per kind of
  layout: the residuals of the model on a mesh of 2s with the same kinds of
  splits, each scaled to the real mesh by the axes that split it, to the
  real rows and (stacked over the layers' scan) to the real depth."""

  def __init__(self, cfg, flash: bool):
    self.cfg, self.flash = cfg, flash

  @functools.cache
  def _traced(self, remat: str, tensor: bool, sequence: bool, split_kv: bool):
    """(bytes, splitting axes, per sequence?, stacked over layers?) of each
    residual of a TRACED_LAYERS-layer model on TRACED_ROWS sequences, on a mesh of 2s."""
    sizes = {"data": 2, "tensor": 2 if tensor else 1, "sequence": 2 if sequence else 1}
    mesh = _abstract_mesh(sizes)
    rules = r.strategy_rules(mesh, 0, tensor_sequence_parallel=tensor, split_kv_heads=split_kv)
    model_cfg = plan_lib.traced_model(self.cfg, TRACED_LAYERS, remat)
    spec = llama_spec(model_cfg, slots(self.cfg, mesh, implementation="xla"))
    batch = {k: jax.ShapeDtypeStruct((TRACED_ROWS, self.cfg.seq_len), jnp.int32)
             for k in ("inputs", "targets")}
    saved = residuals.saved_residuals(plan_lib.llama_loss(spec), spec.abstract_params,
                                      spec.names, batch, mesh, rules)
    out = []
    for x in saved:
      axes = {a for split in x.spec for a in split}
      stacked = x.shape[0] == TRACED_LAYERS and not x.spec[0]
      scores = x.shape[-2:] == (self.cfg.seq_len, self.cfg.seq_len)
      out.append((x.bytes, axes, "data" in axes or TRACED_ROWS in x.shape[:2], stacked, scores))
    return out

  def bytes(self, sizes: dict, remat: str, rows: float, layers: int) -> tuple[float, float]:
    """Residuals of `layers` layers, and of embedding, head and loss, on
    `rows` sequences per device (sequence parallelism whenever `tensor` splits)."""
    t, s = sizes["tensor"], sizes["sequence"]
    replicas = sizes["data"] * sizes["fsdp"]
    totals = [0.0, 0.0]
    for nbytes, axes, per_row, stacked, scores in self._traced(
        remat, t > 1, s > 1, self.cfg.model.num_kv_heads % t == 0):
      if scores and self.flash:  # flash attention keeps no scores (without `sequence`)
        continue
      nbytes *= (rows * replicas / TRACED_ROWS if per_row else 1) * (
          layers / TRACED_LAYERS if stacked else 1)
      totals[not stacked] += nbytes / (replicas if "data" in axes else 1) / (
          t if "tensor" in axes else 1) / (s if "sequence" in axes else 1)
    return totals[0], totals[1]


@dataclasses.dataclass
class Estimate:
  candidate: Candidate
  step_s: float
  compute_s: float
  exposed_s: dict            # mesh axis label -> seconds not hidden
  bubble_s: float
  memory_bytes: dict
  model_flops: float         # per step, all devices
  hardware_flops: float      # with recomputation
  tokens_per_s_per_device: float
  model_tflops_per_device: float
  hardware_tflops_per_device: float
  mfu: float
  across_hosts: list

  def as_dict(self, base_config: str = "") -> dict:
    row = dataclasses.asdict(self)
    row["candidate"] = dataclasses.asdict(self.candidate) | {"mesh": self.candidate.sizes}
    row["command"] = (f"meshtrain train {base_config} ".replace("  ", " ") +
                      self.candidate.flags(self.across_hosts)).strip()
    return row


class StepModel:
  """Predicted step time and memory of a model (a config) on a cluster."""

  def __init__(self, cfg, cluster: Cluster, achievable: float = ACHIEVABLE):
    self.cfg, self.cluster, self.achievable = cfg, cluster, achievable
    self.model_cfg = model_config(cfg)
    self.spec = llama_spec(self.model_cfg)
    m = cfg.model
    self.flops_per_token = flops.flops_per_token(self.model_cfg, self.spec.abstract_params,
                                                 cfg.seq_len)
    moe = self.model_cfg.moe
    routed = moe.experts_per_token / moe.num_experts if moe.num_experts else 1.0
    layer_params = sum(  # stacked matrices, not norm scales; of the routed experts, k of E
        x.size * (routed if getattr(path[-1], "key", "") in flops.ROUTED else 1.0)
        for path, x in jax.tree_util.tree_leaves_with_path(self.spec.abstract_params["layers"])
        if x.ndim > 2)
    self.layer_forward = 2 * layer_params + 4 * m.num_layers * m.num_heads * m.head_dim * cfg.seq_len
    self.attention_forward = 4 * m.num_layers * m.num_heads * m.head_dim * cfg.seq_len
    self.activations = _ActivationModel(cfg, cluster.flash_attention)

  def recompute_per_token(self, c: Candidate) -> float:
    forwards = {"none": 0.0, "selective": 0.0, "full": 1.0}[c.remat]
    return forwards * self.layer_forward + (c.remat == "selective") * self.attention_forward

  def activation_and_backward_bytes(self, cfg, c: Candidate) -> tuple[int, int]:
    """`plan.activation_bytes` and `plan.backward_bytes`, from the scaled traces."""
    sizes = c.sizes
    replicas = sizes["data"] * sizes["fsdp"]
    rows = cfg.global_batch // c.grad_accum_steps
    layers = cfg.model.num_layers
    inputs, residual_slots, head_slots = 0.0, 1, 1
    if sizes["pipeline"] > 1:
      input_slots, residual_slots, head_slots = plan_lib.pipeline_slots(
          cfg, sizes["pipeline"], c.microbatches, c.virtual_stages)
      rows, layers = rows // c.microbatches, layers // (sizes["pipeline"] * c.virtual_stages)
      length = cfg.seq_len // (sizes["tensor"] if c.tensor_sequence_parallel else 1)
      inputs = (input_slots * rows / replicas * length / sizes["sequence"]
                * cfg.model.embed_dim * jnp.dtype(cfg.compute_dtype).itemsize)
    saved, head = self.activations.bytes(sizes, c.remat, rows / replicas, layers)
    backward = 2 * self.activations.bytes(sizes, "none", rows / replicas, 1)[0]
    return int(inputs + residual_slots * saved + head_slots * head), int(backward)

  def analytic(self, cfg, c: Candidate) -> dict:
    """`plan.analytic` (state bytes and collectives) without the activations."""
    mesh = _abstract_mesh(c.sizes)
    return plan_lib.analytic(cfg, self.spec, setup_lib.sharding_rules(cfg, mesh), mesh,
                             activations=0)

  def estimate(self, c: Candidate, cfg=None, report: dict | None = None) -> Estimate:
    cfg = cfg or c.config(self.cfg)
    report = report or self.analytic(cfg, c)
    cluster, sizes = self.cluster, c.sizes
    devices = math.prod(sizes.values())
    activations, backward = self.activation_and_backward_bytes(cfg, c)
    memory = dict(report["memory_bytes"], activations=activations, backward=backward)
    memory["total"] = sum(v for k, v in memory.items() if k != "total")
    tokens = cfg.global_batch * cfg.seq_len
    model_flops = tokens * self.flops_per_token
    hardware_flops = tokens * (self.flops_per_token + self.recompute_per_token(c))
    compute = hardware_flops / devices / (cluster.peak_flops * self.achievable)
    crossing = across_hosts(sizes, cluster)
    by_axis: dict[str, float] = {}
    for coll in report["collectives"]:
      bandwidth = (cluster.inter_host if set(coll["axis"].split("+")) & set(crossing)
                   else cluster.intra_host)
      # A layer waits for its tokens' dispatch: an all-to-all hides behind nothing.
      key = coll["axis"] + (" all-to-all" if coll["kind"] == "all-to-all" else "")
      by_axis[key] = by_axis.get(key, 0.0) + coll["bytes"] / bandwidth
    weights = lambda k: set(k.split("+")) <= set(BATCH_AXES)  # noqa: E731 (gathers, gradients)
    hidden = sum(v for k, v in by_axis.items() if weights(k))
    exposed = {k: v for k, v in by_axis.items() if not weights(k)}
    if hidden > compute:
      exposed["data+fsdp (beyond compute)"] = hidden - compute
    bubble = 0.0
    if sizes["pipeline"] > 1:
      share = measures.ideal_bubble_fraction(sizes["pipeline"], c.microbatches, c.virtual_stages)
      bubble = (compute + sum(exposed.values())) * share / (1 - share)
    step = compute + sum(exposed.values()) + bubble
    return Estimate(
        c, step, compute, exposed, bubble, memory, model_flops, hardware_flops,
        tokens / step / devices, model_flops / step / devices / 1e12,
        hardware_flops / step / devices / 1e12,
        model_flops / step / devices / cluster.peak_flops, crossing)

  def fits(self, memory_bytes: float) -> bool:
    return memory_bytes <= self.cluster.hbm_bytes * self.cluster.usable_memory


def meshtrain_runs(cfg, c: Candidate) -> str:
  """'' if meshtrain runs the candidate, else why not (its validation's message)."""
  try:
    setup_lib.validate(c.config(cfg), _abstract_mesh(c.sizes))
  except ValueError as error:
    return str(error)
  return ""


def expert_layouts(cfg, sizes: dict) -> list[str | None]:
  """The values of `config.expert_parallel` worth trying on a mesh: every
  expert on every device, and each set of the token axes that split the
  mesh whose devices split the experts evenly (none inside a pipeline).
  [None] for a dense model."""
  moe = cfg.model.moe
  if not moe.num_experts:
    return [None]
  if sizes["pipeline"] > 1:
    return [""]
  axes = [a for a in experts.EXPERT_AXES if sizes[a] > 1]
  subsets = (s for n in range(1, len(axes) + 1) for s in itertools.combinations(axes, n))
  return ["", *(",".join(s) for s in subsets
                if moe.num_experts % math.prod(sizes[a] for a in s) == 0)]


def candidates(cfg, devices: int, cluster: Cluster):
  """Every mesh, schedule, accumulation and expert layout to try for the model
  on `devices` (`search` keeps those meshtrain runs); ZeRO-1 whenever `data` > 1
  splits the weights (it moves what DDP moves and holds less), sequence
  parallelism whenever `tensor` > 1."""
  m = cfg.model
  ring = cfg.attention.sequence_strategy == "ring"  # does not compose with pipeline
  # The layers a pipeline splits (a MoE model's leading dense ones run before them).
  staged = m.num_layers - (m.moe.first_dense_layers if m.moe.num_experts else 0)
  for tensor in _divisors(math.gcd(devices, cluster.devices_per_host)):
    if m.num_heads % tensor or m.mlp_dim % tensor or m.vocab_size % tensor:
      continue
    for sequence in _divisors(devices // tensor):
      if cfg.seq_len % (sequence * tensor):
        continue
      rest = devices // tensor // sequence
      for pipeline in _divisors(rest):
        if staged % pipeline or (pipeline > 1 and sequence > 1 and ring):
          continue
        for fsdp in _divisors(rest // pipeline):
          data = rest // pipeline // fsdp
          replicas = data * fsdp
          if cfg.global_batch % replicas or m.embed_dim % fsdp:
            continue
          mesh = (("data", data), ("pipeline", pipeline), ("fsdp", fsdp),
                  ("sequence", sequence), ("tensor", tensor))
          zero = int(data > 1 and m.embed_dim % (fsdp * data) == 0)
          rows = cfg.global_batch // replicas
          for layout in expert_layouts(cfg, dict(mesh)):
            base = dict(mesh=mesh, zero_stage=zero, tensor_sequence_parallel=tensor > 1,
                        expert_parallel=layout)
            if pipeline == 1:
              for accum in (a for a in (1, 2, 4, 8) if rows % a == 0):
                yield Candidate(**base, grad_accum_steps=accum)
              continue
            for chunks in (1, 2, 4):
              if staged % (pipeline * chunks):
                continue
              # Up to 4p microbatches: the bubble is then under 1/(4v+1), and
              # more only shrink each microbatch.
              for micro in (k * pipeline for k in (1, 2, 4)):
                if rows % micro == 0:
                  yield Candidate(**base, microbatches=micro, virtual_stages=chunks)


def search(cfg, devices: int, cluster: Cluster, top: int = 5,
           achievable: float = ACHIEVABLE) -> tuple[list[Estimate], int, StepModel]:
  """The `top` fastest candidates that fit, each with its cheapest
  recomputation that fits (recomputation only adds time), and how many fit.
  Of equally fast ones, the one that leaves the most memory free comes first."""
  model = StepModel(cfg, cluster, achievable)
  best = []
  for c in candidates(cfg, devices, cluster):
    if meshtrain_runs(cfg, c):
      continue
    cfg_c = c.config(cfg)
    state = model.analytic(cfg_c, c)["memory_bytes"]
    held = state["params"] + state["grads"] + state["optimizer"]
    for remat in REMATS:
      chosen = dataclasses.replace(c, remat=remat)
      cfg_c.remat = remat
      if model.fits(held + sum(model.activation_and_backward_bytes(cfg_c, chosen))):
        best.append(model.estimate(chosen, cfg_c))
        break
  best.sort(key=lambda e: (e.step_s, e.memory_bytes["total"]))
  return best[:top], len(best), model


def rank_of(results: list[Estimate], sizes: dict) -> int | None:
  """1-based rank of the fastest candidate on mesh `sizes` among `results`;
  equally fast candidates share a rank. None where no candidate has it."""
  mine = [e.step_s for e in results if e.candidate.sizes == sizes]
  return 1 + sum(e.step_s < min(mine) for e in results) if mine else None


def check_published(run, rank: bool = True) -> dict:
  """A published run (`meshtrain.analysis.published`) through the planner: the
  rank of its mesh among everything that fits (as meshtrain would run it),
  the predicted TFLOP/s per device of its configuration as published (its
  recomputation, counted where the publication counts it), and the planner's
  own first choice. Without `rank` no search runs (rank, first: None)."""
  cfg, cluster = run.config(), clusters.load(run.cluster)
  if rank:
    results, fitting, model = search(cfg, run.devices, cluster, top=10**9)
  else:  # only the published configuration's prediction
    results, fitting, model = [], None, StepModel(cfg, cluster)
  sizes = {a: run.mesh.get(a, 1) for a in AXES}
  rank = rank_of(results, sizes)
  # As the publication ran it: its recomputation, with the fastest schedule and
  # ZeRO stage meshtrain fits on its mesh (any, where none fits).
  if rank is None:  # does not fit, or meshtrain does not run it
    rows = cfg.global_batch // (sizes["data"] * sizes["fsdp"])
    p, layers = sizes["pipeline"], cfg.model.num_layers
    schedules_ = [(rows if p > 1 else 1, v) for v in (1, 2, 4)
                  if layers % (p * v) == 0 and (v == 1 or rows % p == 0)]
    mine = min((model.estimate(Candidate(tuple(sizes.items()), remat=run.remat,
                                         microbatches=m, virtual_stages=v,
                                         tensor_sequence_parallel=sizes["tensor"] > 1))
                for m, v in schedules_), key=lambda e: e.step_s)
  else:
    mine = min((model.estimate(dataclasses.replace(e.candidate, remat=run.remat))
                for e in results if e.candidate.sizes == sizes), key=lambda e: e.step_s)
  published = run.tflops or run.tokens_per_s * model.flops_per_token / 1e12

  def tflops(e):
    return e.hardware_tflops_per_device if run.counts_recompute else e.model_tflops_per_device
  return {"run": run.name, "fitting": fitting, "rank": rank, "published_tflops": published,
          "predicted_tflops": tflops(mine), "published": mine,
          "first": results[0] if results else None,
          "first_tflops": tflops(results[0]) if results else None}


def format_search(results: list[Estimate], fitting: int, cluster: Cluster, devices: int,
                  base_config: str) -> str:
  lines = [f"{fitting} configurations fit on {devices} x {cluster.name}; the fastest "
           f"{len(results)} (compute at {ACHIEVABLE:.0%} of peak):", ""]
  for i, e in enumerate(results, 1):
    mesh = " x ".join(f"{a}={n}" for a, n in e.candidate.mesh if n > 1) or "one device"
    c = e.candidate
    extras = [f"zero {c.zero_stage}", f"remat {c.remat}"]
    if c.grad_accum_steps > 1:
      extras.append(f"accumulate {c.grad_accum_steps}")
    if c.sizes["pipeline"] > 1:
      extras.append(f"{c.microbatches} microbatches, {c.virtual_stages} chunks/stage")
    if c.expert_parallel is not None:
      extras.append(f"experts over {c.expert_parallel.replace(',', ' x ')}"
                    if c.expert_parallel else "every expert on every device")
    comm = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in e.exposed_s.items() if v > 0) or "none"
    lines += [f"{i}. {mesh}; {', '.join(extras)}",
              f"   step {e.step_s * 1e3:.1f} ms = compute {e.compute_s * 1e3:.1f} + exposed comm "
              f"({comm}) + bubble {e.bubble_s * 1e3:.1f} ms",
              f"   {e.tokens_per_s_per_device:,.0f} tokens/s/device, "
              f"{e.model_tflops_per_device:.0f} TFLOP/s/device (MFU {e.mfu:.1%}), "
              f"memory {e.memory_bytes['total'] / 2**30:.1f} GiB/device "
              f"(activations {e.memory_bytes['activations'] / 2**30:.1f})",
              f"   {e.as_dict(base_config)['command']}", ""]
  return "\n".join(lines)
