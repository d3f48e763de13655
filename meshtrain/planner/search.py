"""`meshtrain plan --search`: the mesh, ZeRO stage, recomputation, schedule,
microbatches and pipeline stage layout for a model on a cluster, ranked by a
predicted step time.

Step-time model (per step, one device; the parts are `meshtrain.planner.costs`):

  compute   hardware FLOPs / devices / (peak x KERNEL_EFFICIENCY), the one
            fitted number (`meshtrain.planner.calibration`): the model's
            FLOPs (`meshtrain.models.flops`, PaLM's count) plus what
            recomputation adds (a layer forward under remat=full, the
            attention core under selective); plus what each weight matmul
            on its per-device shape loses to memory bandwidth (roofline),
            and where XLA's attention runs (under `sequence`, or with no
            flash kernel) its scores through memory.
            All devices do alike, but on a pipeline: there each chunk does
            its layers' share (`config.pipeline.stage_layers`) and the last
            also the head's matmuls; compute is the busiest stage's.
  comms     each collective of `meshtrain.planner.plan.analytic` by latency
            per hop and bandwidth of the link class its mesh axes cross: an
            axis crosses hosts when it and the axes inside it
            (`meshtrain.mesh.AXES`, tensor innermost) hold more devices than
            a host.
  overlap   traffic over the batch axes (data, fsdp: weight gathers and
            gradient reductions, issued layer by layer) hides behind each
            layer's compute, one layer's worth always exposed; tensor,
            sequence, pipeline and all-to-all traffic is exposed, and so is
            what runs once outside the layers (`StepModel.outside_layers`:
            a pipeline's gradient reduction and ZeRO-1 gather, the
            reduction after accumulation).
  bubble    meshtrain's lock-step schedule table with every op at its
            chunk's cost, a tick as long as its longest op: the idle ticks
            and the waits for a busier stage; exposed traffic within the
            ticks stretched by 1/(1 - the table's idle share). A published
            run (`as_published`) is priced with its software's schedule
            instead, the backward in one op (`costs.fused_backward_seconds`).

Memory is `plan`'s: state from the rules, activations from the residuals the
model saves (traced once per kind of layout and scaled: `_ActivationModel`),
and two layers of gathered weights where the batch axes split them (the
layer running and the one prefetched).
"""

import collections
import dataclasses
import functools
import itertools
import math
import shlex
import types

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from jax.sharding import AbstractMesh, AxisType

from meshtrain import rules as r
from meshtrain.errors import ConfigError
from meshtrain.mesh import AXES
from meshtrain.models import flops, mla
from meshtrain.parallel import attention, experts, float8, sequence as sequence_lib
from meshtrain.parallel.pipeline.stages import balanced_counts, chunk_loads
from meshtrain.planner import calibration, costs, plan as plan_lib, published, residuals
from meshtrain.planner.clusters import Cluster
from meshtrain.train import run as resolution
from meshtrain.train.run import sharding_rules
from meshtrain.train.state_memory import leaf_layouts, stacked_slots
from meshtrain.train.parallelize import llama_spec, model_config, slots

BATCH_AXES = ("data", "fsdp")
REMATS = ("none", "selective", "full")
SECTIONS = ("mesh", "pipeline", "attention")  # the config's sections a candidate sets
# The config keys a search chooses, a section's whole (ending in ".") or one key:
# the --config override of one would be replaced.
CHOSEN_KEYS = ("mesh.", "pipeline.", "attention.sequence_strategy", "zero_stage", "remat",
               "grad_accum_steps", "tensor_sequence_parallel", "expert_parallel")


def chooses(key: str) -> bool:
  """Whether the search chooses config key `key` (as "mesh.fsdp")."""
  return any(key.startswith(k) if k.endswith(".") else key == k for k in CHOSEN_KEYS)


class ConfigView(types.SimpleNamespace):
  """A ConfigDict's values as plain attributes and its sections as views:
  read as a ConfigDict is (`cfg.a`, `cfg["a"]`, `get`, `in`, `to_dict`) at a
  plain attribute's cost (a ConfigDict read goes through three methods, a
  copy through `dir()` for every field), for what the search reads hundreds
  of times a candidate. Values are shared with the ConfigDict: set none of
  them in place; `replace` makes a view with others."""

  @classmethod
  def of(cls, cfg: ml_collections.ConfigDict) -> "ConfigView":
    return cls(**{k: cls.of(v) if isinstance(v, ml_collections.ConfigDict) else v
                  for k, v in cfg.items()})

  def __getitem__(self, key: str):
    return getattr(self, key)

  def __contains__(self, key: str) -> bool:
    return key in vars(self)

  def get(self, key: str, default=None):
    return getattr(self, key, default)

  def to_dict(self) -> dict:
    return {k: v.to_dict() if isinstance(v, ConfigView) else v for k, v in vars(self).items()}

  def replace(self, **changes) -> "ConfigView":
    return ConfigView(**{**vars(self), **changes})


def _divisors(n: int) -> list[int]:
  """The divisors of `n`, ascending (up to its square root and their pairs: fast for any n)."""
  low = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
  return low + [n // d for d in reversed(low) if d * d != n]


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
  schedule: str = "1f1b"             # with a pipeline: 1f1b, zb_h1, interleaved_1f1b
  stage_layers: str = ""             # with a pipeline: layers per chunk ("": the even split)
  tensor_sequence_parallel: bool = False
  expert_parallel: str | None = None  # MoE: config.expert_parallel (None: the config's)
  sequence_strategy: str | None = None  # with `sequence`: config.attention.sequence_strategy
  # Pricing a published run only (meshtrain does not run it): tensor
  # parallelism before Megatron's sequence parallelism, its norms and residual
  # adds on every tensor rank over every token (Megatron-LM 2021, whose
  # scatter/gather optimization still split its pipeline sends over `tensor`
  # as sequence parallelism does, so the collectives are priced as with it).
  replicated_norms: bool = False
  # Pricing a published run only: its pipeline's backward computes input and
  # weight gradients in one op (`costs.fused_backward_seconds`), as the
  # software of published runs does in 1F1B and interleaved 1F1B.
  fused_backward: bool = False
  # Pricing a published run only: under `sequence` its attention runs a flash
  # kernel on the local queries (Meta's all-gather context parallelism, whose
  # query chunks balance the causal mask), where meshtrain's all_gather_kv
  # runs XLA's masked attention.
  flash_context: bool = False

  @property
  def sizes(self) -> dict[str, int]:
    return dict(self.mesh)

  def settings(self) -> dict[str, dict]:
    """What this candidate sets, by section of the config ("" the top level)."""
    top = dict(zero_stage=self.zero_stage, remat=self.remat,
               grad_accum_steps=self.grad_accum_steps,
               tensor_sequence_parallel=self.tensor_sequence_parallel)
    if self.expert_parallel is not None:
      top["expert_parallel"] = self.expert_parallel
    pipeline = dict(stage_layers=self.stage_layers)
    if self.sizes["pipeline"] > 1:
      pipeline.update(microbatches=self.microbatches, virtual_stages=self.virtual_stages,
                      schedule=self.schedule)
    attention = ({} if self.sequence_strategy is None
                 else dict(sequence_strategy=self.sequence_strategy))
    return {"": top, "mesh": self.sizes, "pipeline": pipeline, "attention": attention}

  def config(self, base: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """`base` with this candidate's `settings`. Only the sections a candidate
    changes (mesh, pipeline, attention) are copied; the others (model, data,
    ...) are `base`'s own: read them, never set them."""
    settings = self.settings()
    cfg = ml_collections.ConfigDict(base)  # a ConfigDict copied from one shares its sections
    for section in SECTIONS:
      cfg[section] = ml_collections.ConfigDict(base[section])
      cfg[section].update(settings[section])
    cfg.update(settings[""])
    return cfg

  def view(self, base: "ConfigView") -> "ConfigView":
    """`config` as a `ConfigView` of a view of the base: what the search reads."""
    settings = self.settings()
    return base.replace(**settings[""], **{s: base[s].replace(**settings[s]) for s in SECTIONS})

  def flags(self, across_hosts: list[str]) -> str:
    """The `--config.*` overrides that run this candidate."""
    parts = [f"--config.mesh.{a}={n}" for a, n in self.mesh]
    parts += [f"--config.zero_stage={self.zero_stage}", f"--config.remat={self.remat}",
              f"--config.grad_accum_steps={self.grad_accum_steps}",
              f"--config.tensor_sequence_parallel={self.tensor_sequence_parallel}"]
    if self.expert_parallel is not None:
      parts.append(f"--config.expert_parallel={shlex.quote(self.expert_parallel)}")
    if self.sequence_strategy is not None:
      parts.append(f"--config.attention.sequence_strategy={self.sequence_strategy}")
    if self.sizes["pipeline"] > 1:
      parts += [f"--config.pipeline.schedule={self.schedule}",
                f"--config.pipeline.microbatches={self.microbatches}",
                f"--config.pipeline.virtual_stages={self.virtual_stages}"]
      if self.stage_layers:
        parts.append(f"--config.pipeline.stage_layers={self.stage_layers}")
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


# Layers of the traced model, an odd number no model dimension is likely to
# equal, so that stacked residuals stand out; and the sequences a device runs
# in the first of its two traces (twice as many in the second): as few as a
# large model's microbatch puts on a device.
TRACED_LAYERS, TRACED_ROWS = 7, 2


_ACTIVATION_MODELS: dict[tuple[str, bool], "_ActivationModel"] = {}


class _ActivationModel:
  """Per-device activation bytes for any mesh from a few traces per kind of
  layout: the residuals of the model on a mesh of 2s with the same kinds of
  splits (and the candidate's degree of expert parallelism), traced on two
  row counts, each scaled to the real mesh by the axes that split it, to the
  real rows (a part per row and a part that is not: an expert's working
  weights, or the tiles of its grouped GEMM at the least) and, stacked over
  the layers' scan, to the real depth."""

  def __init__(self, cfg, flash: bool):
    self.cfg, self.flash = cfg, flash

  @classmethod
  def shared(cls, cfg, flash: bool) -> "_ActivationModel":
    """The model of `cfg`'s contents: one for every search of the same
    config (on other device counts, other clusters), so each traces once."""
    key = (cfg.to_json_best_effort(sort_keys=True), flash)
    if key not in _ACTIVATION_MODELS:
      _ACTIVATION_MODELS[key] = cls(ml_collections.ConfigDict(cfg.to_dict()), flash)  # a copy
    return _ACTIVATION_MODELS[key]

  @functools.cache
  def _traced(self, remat: str, tensor: bool, strategy: str | None, split_kv: bool,
              experts: int, cut: bool = False) -> dict[tuple, tuple[float, float]]:
    """The residuals of a TRACED_LAYERS-layer model on a mesh of 2s
    (`sequence` 2 with context-parallel `strategy`, 1 without one), or with
    the routed experts split over `data` = `experts` devices (an axis that
    splits no weight), summed by how they scale, (split over tensor?,
    sequence?, stacked over layers?, attention scores?): (bytes a device
    holds whatever its rows, bytes a row), the line through TRACED_ROWS and
    twice that sequences a device. With `cut`, instead of the residuals
    what a pipeline's B leaves W (`plan.split_values`), one layer's counted
    as TRACED_LAYERS layers stacked."""
    sizes = {"data": max(experts, 2), "tensor": 2 if tensor else 1,
             "sequence": 2 if strategy else 1}
    mesh = _abstract_mesh(sizes)
    expert_axes = ("data",) if experts > 1 else ()
    rules = r.strategy_rules(mesh, 0, tensor_sequence_parallel=tensor, split_kv_heads=split_kv,
                             expert_axes=expert_axes)
    model_cfg = plan_lib.traced_model(self.cfg, TRACED_LAYERS, remat)
    cfg = ml_collections.ConfigDict(self.cfg.to_dict())
    cfg.attention.sequence_strategy = strategy or cfg.attention.sequence_strategy
    cfg.expert_parallel, cfg.remat = ",".join(expert_axes), remat
    spec = llama_spec(model_cfg, slots(cfg, mesh, plan_lib.traced_execution(cfg, mesh)))

    def kinds(rows: int) -> collections.Counter:
      batch = {k: jax.ShapeDtypeStruct((rows * sizes["data"], self.cfg.seq_len), jnp.int32)
               for k in ("inputs", "targets")}
      if cut:  # one layer's, counted as TRACED_LAYERS stacked
        kept = plan_lib.split_values(spec, cfg, rows * sizes["data"], mesh, rules)
        values = [(dataclasses.replace(x, device_bytes=x.device_bytes * TRACED_LAYERS), True)
                  for x in kept["cut"]]
      else:
        values = [(x, x.shape[:1] == (TRACED_LAYERS,) and not x.spec[0])  # not a scalar's
                  for x in residuals.saved_residuals(plan_lib.llama_loss(spec),
                                                     spec.abstract_params, spec.names, batch,
                                                     mesh, rules)]
      by_kind = collections.Counter()
      for x, stacked in values:
        axes = {a for split in x.spec for a in split}
        scores = plan_lib.attention_scores(x.shape, self.cfg, rows * sizes["data"])
        by_kind[("tensor" in axes, "sequence" in axes, stacked, scores)] += x.device_bytes
      return by_kind

    one, two = kinds(TRACED_ROWS), kinds(2 * TRACED_ROWS)
    return {kind: (2 * one[kind] - two[kind], (two[kind] - one[kind]) / TRACED_ROWS)
            for kind in one | two}

  @functools.cache
  def _scaling(self, remat: str, tensor: bool, strategy: str | None, split_kv: bool,
               experts: int, cut: bool = False) -> list[tuple]:
    """`_traced`'s kinds as (fixed bytes, bytes a row, *kind), expert
    parallelism added as the difference it makes to the layout traced with
    all_gather_kv (it changes the experts, the strategy the attention: one
    trace per expert split, not per split and strategy), where it changes
    anything: where the experts split over 2 devices change nothing the
    layout keeps, it keeps none of their weights or tokens (recomputation
    saves none of them),
    and no split changes it."""
    kinds = collections.defaultdict(lambda: (0.0, 0.0), self._traced(
        remat, tensor, strategy, split_kv, 1, cut))
    alike = strategy and "all_gather_kv"
    if experts > 1 and (self._traced(remat, tensor, alike, split_kv, 2, cut)
                        != self._traced(remat, tensor, alike, split_kv, 1, cut)):
      for sign, split in ((1, experts), (-1, 1)):
        for kind, line in self._traced(remat, tensor, alike, split_kv, split, cut).items():
          kinds[kind] = tuple(a + sign * b for a, b in zip(kinds[kind], line))
    return [(*line, *kind) for kind, line in kinds.items()]

  def bytes(self, sizes: dict, remat: str, rows: float, layers: int,
            strategy: str | None = None, experts: int = 1,
            cut: bool = False) -> tuple[float, float]:
    """Residuals of `layers` layers, and of embedding, head and loss, on
    `rows` sequences per device (sequence parallelism whenever `tensor`
    splits; under `sequence`, context-parallel `strategy`, default the
    config's; the routed experts split over `experts` devices); with `cut`,
    what a pipeline's B leaves W for `layers` layers."""
    t, s = sizes["tensor"], sizes["sequence"]
    totals = [0.0, 0.0]
    strategy = (strategy or self.cfg.attention.sequence_strategy) if s > 1 else None
    for fixed, per_row, tensor, seq, stacked, scores in self._scaling(
        remat, t > 1, strategy, self.cfg.model.num_kv_heads % t == 0, experts, cut):
      if scores and self.flash:  # whole-length scores: a flash kernel keeps none
        continue
      nbytes = (fixed + per_row * rows) * (layers / TRACED_LAYERS if stacked else 1)
      totals[not stacked] += nbytes * (2 / t if tensor else 1) * (2 / s if seq else 1)
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

  def __init__(self, cfg, cluster: Cluster, efficiency: float = calibration.KERNEL_EFFICIENCY,
               elementwise: float = calibration.ELEMENTWISE_PASSES):
    self.cfg, self.cluster = cfg, cluster
    self.view = ConfigView.of(cfg)
    self.efficiency, self.elementwise = efficiency, elementwise
    self.model_cfg = model_config(cfg)
    self.spec = llama_spec(self.model_cfg)
    m = cfg.model
    self.flops_per_token = flops.flops_per_token(self.model_cfg, self.spec.abstract_params,
                                                 cfg.seq_len)
    moe = self.model_cfg.moe
    routed = moe.experts_per_token / moe.num_experts if moe.num_experts else 1.0
    layers = self.spec.abstract_params["layers"]
    matrices = [  # stacked matrices, not norm scales; of the routed experts, k of E
        (x.size * (routed if getattr(path[-1], "key", "") in flops.ROUTED else 1.0), names)
        for (path, x), names in zip(jax.tree_util.tree_leaves_with_path(layers), jax.tree.leaves(
            self.spec.names["layers"], is_leaf=lambda n: isinstance(n, tuple))) if x.ndim > 2]
    layer_params = sum(size for size, _ in matrices)
    self.layer_weights = sum(x.size for x in jax.tree.leaves(layers)) / m.num_layers  # all experts
    self.attention_forward = flops.attention_per_token(
        dataclasses.replace(self.model_cfg, mtp_layers=0), cfg.seq_len)  # the layers'
    self.layer_forward = 2 * layer_params + self.attention_forward
    self.peak_flops = self._peak_flops(cfg, cluster, 6 * sum(
        size for size, names in matrices if float8.runs_in_float8(names)))
    # The head's matmul a token, forward and backward, and the multi-token
    # prediction modules', and that in layers (of the model's average one):
    # the last pipeline chunk's work beyond its own.
    self.head_flops = 6 * m.embed_dim * m.vocab_size + flops.mtp_per_token(
        self.model_cfg, self.spec.abstract_params, cfg.seq_len)
    self.head_layers = self.head_flops * m.num_layers / (self.flops_per_token - self.head_flops)
    self.dense_layers = plan_lib.dense_layers(cfg)
    # cuDNN's flash attention where the cluster has it and the heads fit it.
    self.flash = cluster.flash_attention and attention.flash_fits(mla.widths(m)[2])
    self.activations = _ActivationModel.shared(cfg, self.flash)
    self._reports: dict[Candidate, dict] = {}
    self._layouts: dict[tuple, list] = {}

  def _peak_flops(self, cfg, cluster: Cluster, projection_flops: float) -> float:
    """The FLOP/s a device runs the step's matmuls at: the bfloat16 peak, or
    under a `config.float8` recipe of float8 GEMMs (`float8.float8_gemms`),
    on a cluster with them, the projections' share of a token's FLOPs
    (`projection_flops` of `flops_per_token`, its forward and backward; a
    recomputed forward has the same mix) at the float8 peak and the rest
    (attention's scores, the head, MLA's down-projections) at bfloat16's."""
    if not float8.float8_gemms(cfg.float8) or not cluster.float8_flops:
      return cluster.peak_flops
    share = projection_flops / self.flops_per_token
    return 1 / ((1 - share) / cluster.peak_flops + share / cluster.float8_flops)

  def expert_split(self, c: Candidate) -> int:
    """The devices that split the routed experts (`config.expert_parallel`;
    1 in a dense model)."""
    if not self.model_cfg.moe.num_experts:
      return 1
    layout = self.cfg.expert_parallel if c.expert_parallel is None else c.expert_parallel
    return math.prod(c.sizes[a.strip()] for a in layout.split(",") if a.strip())

  def recompute_per_token(self, c: Candidate) -> float:
    forwards = {"none": 0.0, "selective": 0.0, "full": 1.0}[c.remat]
    return forwards * self.layer_forward + (c.remat == "selective") * self.attention_forward

  def layer_gemms(self, c: Candidate, tokens: float) -> tuple[list, list]:
    """One layer's weight matmuls on one device, [m, k] x [k, n], for
    `tokens` tokens of one microbatch there: split by `tensor` (kv heads
    whole where it does not divide them); routed experts as the tokens
    each local expert receives; Multi-head Latent Attention's latents whole
    on each device, as its down-projections are. Two lists: the
    projections, and MLA's down-projections (in bfloat16 under every
    `config.float8`: `float8.runs_in_float8`)."""
    m, t = self.cfg.model, c.sizes["tensor"]
    kv = m.num_kv_heads / t if m.num_kv_heads % t == 0 else m.num_kv_heads
    d, h = m.embed_dim, m.head_dim
    gemms = [(tokens, d, (m.num_heads / t + 2 * kv) * h), (tokens, m.num_heads / t * h, d)]
    downs = []
    if m.mla.kv_lora_rank:
      latent, (qk, v, _), heads = m.mla, mla.widths(m), m.num_heads / t
      downs = [(tokens, d, latent.q_lora_rank)] * bool(latent.q_lora_rank) + [
          (tokens, d, latent.kv_lora_rank + latent.rope_head_dim)]
      gemms = [(tokens, latent.q_lora_rank or d, heads * qk),
               (tokens, latent.kv_lora_rank, heads * (h + v)), (tokens, heads * v, d)]
    moe = self.model_cfg.moe
    if not moe.num_experts:
      return gemms + [(tokens, d, 2 * m.mlp_dim / t), (tokens, m.mlp_dim / t, d)], downs
    split = self.expert_split(c)
    local = moe.num_experts / split
    routed = tokens * split * moe.experts_per_token / moe.num_experts  # per local expert
    width = (moe.mlp_dim or m.mlp_dim) / t
    gemms += [(routed, d, 2 * width), (routed, width, d)] * int(local)
    if moe.shared_mlp_dim:
      gemms += [(tokens, d, 2 * moe.shared_mlp_dim / t), (tokens, moe.shared_mlp_dim / t, d)]
    return gemms, downs

  def gemm_excess_s(self, c: Candidate, gemms: list, passes: int, projections: bool) -> float:
    """What the roofline adds to one pass of one layer's `gemms` over their
    FLOPs at the kernel efficiency (`memory_bound_s` counts `passes` of
    them). The `projections`' GEMMs, under a recipe of float8 GEMMs, run at
    the float8 peak with one-byte operands, and the quantizer's passes add,
    a pass's share of them: each pass quantizes two of a GEMM's three
    matrices (forward x and w, input gradient g and w, weight gradient x and
    g, a recomputed forward x and w), a weight on its FSDP shard (XLA
    quantizes before the gather)."""
    cluster = self.cluster
    in_float8 = (projections and float8.float8_gemms(self.cfg.float8)
                 and bool(cluster.float8_flops))
    peak = cluster.float8_flops if in_float8 else cluster.peak_flops
    excess = sum(costs.gemm_seconds(*g, peak, cluster.memory_bandwidth, self.efficiency,
                                    1 if in_float8 else 2)
                 - 2 * math.prod(g) / (peak * self.efficiency) for g in gemms)
    if not in_float8:
      return excess
    shards = c.sizes["fsdp"]
    quantized = sum(m * k * (2 + (passes > 3)) + k * n / shards * (passes - 1) + 2 * m * n
                    for m, k, n in gemms) / passes  # memory_bound_s counts `passes` of excess
    return excess + costs.quantize_seconds(quantized, cluster.memory_bandwidth)

  def memory_bound_s(self, c: Candidate, cfg) -> float:
    """Per step on this device, what memory bandwidth adds to the matmuls'
    FLOPs at the kernel efficiency: what the weight matmuls lose on their
    per-device shapes (the roofline), the elementwise work (norms,
    residual adds, the SwiGLU product, rotary, softmax outside the fused
    kernel): `elementwise` bf16 passes over each token's activation widths
    a layer (`costs.elementwise_seconds`), fitted with the efficiency; and
    XLA attention's scores (`score_elements`, `costs.attention_scores_seconds`)."""
    sizes, cluster = c.sizes, self.cluster
    if not cluster.memory_bandwidth:
      return 0.0
    microbatches = c.microbatches if sizes["pipeline"] > 1 else c.grad_accum_steps
    rows = cfg.global_batch / microbatches / (sizes["data"] * sizes["fsdp"])
    tokens = rows * cfg.seq_len / sizes["sequence"]
    layers = cfg.model.num_layers / sizes["pipeline"]
    passes = 3 + (c.remat == "full")  # forward, two backward matmuls each, a recomputed forward
    projections, downs = self.layer_gemms(c, tokens)
    excess = (self.gemm_excess_s(c, projections, passes, projections=True)
              + self.gemm_excess_s(c, downs, passes, projections=False))
    gemms = projections + downs
    # The activations the layer's matmuls write, a token's share: a routed
    # expert writes its width on the rows it receives, not on every token.
    widths = sum(rows_in * n for rows_in, _, n in gemms) / tokens
    # Of them, the width-wide partial sums of the tensor-parallel output
    # projections (attention's and the MLP's down projection): under Megatron's
    # sequence parallelism they are reduce-scattered (read once whole) and the
    # norm's output all-gathered (written once whole) for the next matmul, and
    # the rest of their passes (residual add, norm, ...) run on a rank's share
    # of the tokens; without it every rank runs them all on every token.
    t = sizes["tensor"]
    partial = sum(n for g, _, n in gemms if g == tokens and n == cfg.model.embed_dim
                  ) if t > 1 else 0.0
    split = t if c.tensor_sequence_parallel and not c.replicated_norms else 1
    whole = min(2.0, self.elementwise)
    elementwise = costs.elementwise_seconds(tokens, widths - partial, self.elementwise,
                                            cluster.memory_bandwidth) + costs.elementwise_seconds(
        tokens, partial, whole + (self.elementwise - whole) / split, cluster.memory_bandwidth)
    scores = costs.attention_scores_seconds(self.score_elements(c, cfg, rows), c.remat != "none",
                                            cluster.memory_bandwidth)
    return ((excess + elementwise) * passes + scores) * layers * microbatches

  def score_elements(self, c: Candidate, cfg, rows: float) -> float:
    """Attention scores one layer of one microbatch of `rows` sequences a
    device writes through memory: XLA's masked attention (`parallel.attention`)
    runs under `sequence` > 1 for all_gather_kv's local queries against every
    key and the ring's blocks ((n + 1) / 2n of those), and everywhere the
    cluster has no flash kernel; cuDNN's flash attention, over a whole length
    (one device's, or ulysses' local heads), keeps its scores on chip (0), as
    does a published run's context parallelism (`Candidate.flash_context`)."""
    sizes, m = c.sizes, cfg.model
    n = sizes["sequence"]
    whole_length = n == 1 or cfg.attention.sequence_strategy == "ulysses"
    if (whole_length or c.flash_context) and self.flash:
      return 0.0
    ring = (n + 1) / (2 * n) if n > 1 and cfg.attention.sequence_strategy == "ring" else 1.0
    return rows * m.num_heads / sizes["tensor"] * cfg.seq_len / n * cfg.seq_len * ring

  def chunk_work(self, c: Candidate, cfg) -> np.ndarray:
    """[V, P] seconds a step computes on a device for each chunk v of stage s:
    the hardware FLOPs at the kernel efficiency plus `memory_bound_s`, all
    devices alike without a pipeline ([1, 1]). With one, each chunk's layers
    (`plan.chunk_layers`: `config.pipeline.stage_layers`, and an MoE model's
    leading dense layers on the first chunk) and on the last chunk the
    head's matmuls; the matmuls at `peak_flops` (float8's share at its peak)."""
    sizes = c.sizes
    per_token = self.flops_per_token + self.recompute_per_token(c)
    flops_s = (cfg.global_batch * cfg.seq_len * per_token / math.prod(sizes.values())
               / (self.peak_flops * self.efficiency))
    memory_s = self.memory_bound_s(c, cfg)
    stages = sizes["pipeline"]
    if stages == 1:
      return np.array([[flops_s + memory_s]])
    head = self.head_flops / per_token  # the head's share of the FLOPs
    layer_s = ((1 - head) * flops_s + memory_s) * stages / cfg.model.num_layers
    work_VxP = plan_lib.chunk_layers(cfg, layer_s)
    work_VxP[-1, -1] += head * flops_s * stages
    return work_VxP

  def activation_and_backward_bytes(self, cfg, c: Candidate) -> tuple[int, int]:
    """`plan.activation_bytes` and `plan.backward_bytes`, from the scaled traces."""
    sizes = c.sizes
    replicas = sizes["data"] * sizes["fsdp"]
    rows = cfg.global_batch // c.grad_accum_steps
    layers = cfg.model.num_layers
    inputs, cut = 0.0, 0.0
    held = {"res": 1, "cut": 0, "head_res": 1, "head_cut": 0}
    if sizes["pipeline"] > 1:
      held = plan_lib.pipeline_slots(cfg, sizes["pipeline"], c.microbatches, c.virtual_stages)
      rows, layers = rows // c.microbatches, plan_lib.stage_layers(cfg)[1]
      length = cfg.seq_len // (sizes["tensor"] if c.tensor_sequence_parallel else 1)
      inputs = (held["inputs"] * rows / replicas * length / sizes["sequence"]
                * cfg.model.embed_dim * jnp.dtype(cfg.compute_dtype).itemsize)
    split = self.expert_split(c)
    saved, head = self.activations.bytes(sizes, c.remat, rows / replicas, layers,
                                         c.sequence_strategy, split)
    if sizes["pipeline"] > 1:
      cut = self.activations.bytes(sizes, c.remat, rows / replicas, layers, c.sequence_strategy,
                                   split, cut=True)[0]
    backward = 2 * self.activations.bytes(sizes, "none", rows / replicas, 1,
                                          c.sequence_strategy, split)[0]
    if sizes["pipeline"] == 1:  # `plan.backward_bytes`
      logits = (rows / replicas * cfg.seq_len / sizes["sequence"] * cfg.model.vocab_size
                / sizes["tensor"] * jnp.dtype(cfg.compute_dtype).itemsize)
      backward = max(logits, backward - head)
    return int(inputs + held["res"] * saved + held["cut"] * cut
               + (held["head_res"] + held["head_cut"]) * head), int(backward)

  def buffer_bytes(self, cfg, c: Candidate) -> int:
    """Two layers of gathered working weights (the one running and the one
    prefetched) where the batch axes split the weights for storage."""
    sizes = c.sizes
    gathered = sizes["fsdp"] > 1 or (c.zero_stage >= 3 and sizes["data"] > 1)
    if not gathered:
      return 0
    return int(2 * self.layer_weights * jnp.dtype(cfg.param_dtype).itemsize / sizes["tensor"])

  def memory(self, cfg, c: Candidate, state: dict) -> dict:
    """Per-device bytes: the state's, activations, backward and buffers."""
    activations, backward = self.activation_and_backward_bytes(cfg, c)
    memory = dict(state, activations=activations, backward=backward,
                  buffers=self.buffer_bytes(cfg, c))
    memory["total"] = sum(v for k, v in memory.items() if k not in ("total", "host"))
    return memory

  def analytic(self, cfg, c: Candidate) -> dict:
    """`plan.analytic` (state bytes and collectives) without the activations,
    once per candidate (`cfg`: its view, whose recomputation decides how
    often a forward's collectives run)."""
    if c not in self._reports:
      self._reports[c] = self._analytic(cfg, c, collectives=True)
    return self._reports[c]

  def state_bytes(self, cfg, c: Candidate) -> dict:
    """`plan.analytic`'s memory without the activations (its collectives
    uncounted: what is enough to tell whether a candidate fits)."""
    return self._analytic(cfg, c, collectives=False)["memory_bytes"]

  def _analytic(self, cfg, c: Candidate, collectives: bool) -> dict:
    mesh = _abstract_mesh(c.sizes)
    rules = sharding_rules(cfg, mesh)
    # Of the config `leaf_layouts` reads the slots, whether gradients
    # accumulate and the model (the base's): candidates share them.
    key = (rules, mesh, stacked_slots(cfg), cfg.grad_accum_steps > 1)
    if key not in self._layouts:
      self._layouts[key] = leaf_layouts(cfg, self.spec, rules, mesh)
    return plan_lib.analytic(cfg, self.spec, rules, mesh, activations=0,
                             collectives=collectives, layouts=self._layouts[key])

  def collective_s(self, coll: dict, sizes: dict, crossing: list[str]) -> float:
    axes = coll["axis"].split("+")
    inter = bool(set(axes) & set(crossing))
    return costs.collective_seconds(
        coll["kind"], math.prod(sizes[a] for a in axes), coll["bytes"], coll["count"],
        self.cluster.inter_host if inter else self.cluster.intra_host,
        costs.HOP_LATENCY["inter" if inter else "intra"])

  @staticmethod
  def outside_layers(c: Candidate, coll: dict) -> bool:
    """Whether a collective of `plan.analytic` runs once a step outside the
    layers' compute: in a pipeline the gradients' reduction over `data` and
    `sequence` (after the last tick) and ZeRO-1's weight gather over `data`
    (before the first); with accumulation (no pipeline) each `data`
    replica's summed gradients reduced after the microbatches' scan."""
    axes = set(coll["axis"].split("+"))
    reduction = coll["kind"] in ("reduce-scatter", "all-reduce") and "data" in axes
    if c.sizes["pipeline"] > 1:
      return (reduction or coll["kind"] == "all-gather" and "data" in axes
              or coll["kind"] == "all-reduce" and "sequence" in axes)
    return c.grad_accum_steps > 1 and reduction

  def outside_layers_s(self, c: Candidate, report: dict, crossing: list[str]) -> dict:
    """Seconds of the `outside_layers` collectives, none hidden. A
    pipeline's reduction is of its float32 sums (`state_memory.pipeline_sums`, the
    `grads` bytes) over data x sequence: a reduce-scatter where ZeRO splits
    the optimizer over `data`, else an all-reduce."""
    sizes = c.sizes
    if sizes["pipeline"] == 1:
      return {"data (after accumulation)": sum(
          self.collective_s(coll, sizes, crossing) for coll in report["collectives"]
          if self.outside_layers(c, coll))}
    gather = sum(self.collective_s(coll, sizes, crossing) for coll in report["collectives"]
                 if coll["kind"] == "all-gather" and self.outside_layers(c, coll))
    axes = [a for a in ("data", "sequence") if sizes[a] > 1]
    n = math.prod(sizes[a] for a in axes)
    kind = "reduce-scatter" if c.zero_stage and sizes["data"] > 1 else "all-reduce"
    grads = report["memory_bytes"]["grads"] * (n - 1) / n * (2 if kind == "all-reduce" else 1)
    reduction = self.collective_s({"kind": kind, "axis": "+".join(axes), "count": 1,
                                   "bytes": grads}, sizes, crossing) if axes else 0.0
    return {"data (before the ticks)": gather, "data+sequence (after the ticks)": reduction}

  def estimate(self, c: Candidate, cfg=None, report: dict | None = None) -> Estimate:
    cfg = cfg or c.view(self.view)
    report = report or self.analytic(cfg, c)
    cluster, sizes = self.cluster, c.sizes
    devices = math.prod(sizes.values())
    memory = self.memory(cfg, c, report["memory_bytes"])
    tokens = cfg.global_batch * cfg.seq_len
    model_flops = tokens * self.flops_per_token
    hardware_flops = tokens * (self.flops_per_token + self.recompute_per_token(c))
    work_VxP = self.chunk_work(c, cfg)
    compute = float(work_VxP.sum(axis=0).max())  # the busiest stage's
    crossing = across_hosts(sizes, cluster)
    once = self.outside_layers_s(c, report, crossing)
    by_axis: dict[str, float] = {}
    for coll in report["collectives"]:
      if self.outside_layers(c, coll):
        continue
      # A layer waits for its tokens' dispatch: an all-to-all hides behind nothing.
      key = coll["axis"] + (" all-to-all" if coll["kind"] == "all-to-all" else "")
      by_axis[key] = by_axis.get(key, 0.0) + self.collective_s(coll, sizes, crossing)
    weights = lambda k: set(k.split("+")) <= set(BATCH_AXES)  # noqa: E731 (gathers, gradients)
    exposed = {k: v for k, v in by_axis.items() if not weights(k)}
    batch_traffic = sum(v for k, v in by_axis.items() if weights(k))
    layer_slots = plan_lib.stage_layers(cfg)[0] * max(
        c.grad_accum_steps, c.microbatches if sizes["pipeline"] > 1 else 1)
    if batch_traffic:
      exposed["data+fsdp (not hidden)"] = costs.exposed_behind_layers(batch_traffic, compute,
                                                                       layer_slots)
    bubble = 0.0
    if sizes["pipeline"] > 1:  # idle ticks, and ticks that wait for a busier stage
      if c.fused_backward:
        ticks = costs.fused_backward_seconds(c.microbatches, work_VxP)
        share = 1 - compute / ticks
      else:
        share = costs.lockstep_bubble(c.schedule, sizes["pipeline"], c.microbatches,
                                      c.virtual_stages)
        ticks = costs.lockstep_seconds(c.schedule, c.microbatches, work_VxP)
      bubble = ticks - compute + sum(exposed.values()) * share / (1 - share)
    exposed |= {k: v for k, v in once.items() if v > 0}
    step = compute + sum(exposed.values()) + bubble
    return Estimate(
        c, step, compute, exposed, bubble, memory, model_flops, hardware_flops,
        tokens / step / devices, model_flops / step / devices / 1e12,
        hardware_flops / step / devices / 1e12,
        model_flops / step / devices / cluster.peak_flops, crossing)

  def fits(self, memory_bytes: float) -> bool:
    return memory_bytes <= self.cluster.hbm_bytes * self.cluster.usable_memory


def meshtrain_runs(cfg, c: Candidate, cfg_c=None) -> str:
  """'' if meshtrain runs the candidate (`cfg_c`: its config, if made
  already), else why not (the message of the run's resolution)."""
  try:
    resolution.check(cfg_c or c.config(cfg), _abstract_mesh(c.sizes))
  except ValueError as error:
    return str(error)
  return ""


def expert_layouts(cfg, sizes: dict) -> list[str | None]:
  """The values of `config.expert_parallel` worth trying on a mesh: every
  expert on every device, and each set of the token axes that split the
  mesh whose devices split the experts evenly (inside a pipeline, not those
  it holds). [None] for a dense model."""
  moe = cfg.model.moe
  if not moe.num_experts:
    return [None]
  held = experts.PIPELINE_HELD_AXES if sizes["pipeline"] > 1 else ()
  axes = [a for a in experts.EXPERT_AXES if sizes[a] > 1 and a not in held]
  subsets = (s for n in range(1, len(axes) + 1) for s in itertools.combinations(axes, n))
  return ["", *(",".join(s) for s in subsets
                if moe.num_experts % math.prod(sizes[a] for a in s) == 0)]


def microbatch_counts(rows: int, stages: int) -> list[int]:
  """Pipeline microbatch counts to try for `rows` sequences per replica:
  every count from p stages up that divides the rows, one sequence per
  microbatch included (`candidates` keeps interleaving to the multiples of
  p, as meshtrain's validation does). Past `costs.BUILT_PER_STAGE` x p the
  planner reads the schedule's table off a line (`costs.table_counts`)
  instead of building it."""
  return [n for n in _divisors(rows) if n >= stages]


# The most a pipeline chunk may do over the mean of all chunks (layers, and
# the head's and the first chunk's extra work) for the search to try the
# split: in lock step every stage waits for the busiest, so beyond this a
# third of every tick idles, where fewer stages or chunks, with more layers
# each, split evenly. It keeps the search's time (80 layers on 64 stages: 2
# against a mean of 1.27) and leaves it the splits where nothing else fits
# (OPT-175B on 992 GPUs: 96 layers on 31 stages, 4 against a mean of 3.1).
MOST_OVER_MEAN = 1.5


@functools.cache
def stage_split(layers: int, stages: int, chunks: int, first: float, last: float) -> str | None:
  """The `config.pipeline.stage_layers` to try for `layers` layers on
  `stages` stages of `chunks` chunks: the even split ("") where the chunks
  divide the layers and no other split leaves the busiest chunk less work,
  else `balanced_counts`' (layers that do not divide; a head worth more
  than a layer). None where some chunk would have no layer, or the busiest
  would do more than MOST_OVER_MEAN of the mean. One split per stage count
  and chunks, so that the search stays about as fast."""
  n = stages * chunks
  if layers < n:
    return None
  busiest = lambda counts: max(chunk_loads(counts, first, last))  # noqa: E731
  even, balanced = (layers // n,) * n, balanced_counts(layers, n, first, last)
  split = even if layers % n == 0 and busiest(balanced) >= busiest(even) else balanced
  if busiest(split) > MOST_OVER_MEAN * (layers + first + last) / n:
    return None
  return "" if split == even else ",".join(map(str, split))


def candidates(model: StepModel, devices: int, only: dict | None = None):
  """Every mesh, schedule, stage layout, accumulation and expert layout to
  try for the model on `devices` (`search` keeps those meshtrain runs), or
  on the mesh `only` (taken as named even where its FSDP degree does not
  divide the width meshtrain splits: PyTorch's FSDP pads its flat shards,
  and `as_published` prices published runs that did); ZeRO-1 whenever
  `data` > 1 splits the weights (it moves what DDP moves and holds less),
  sequence parallelism whenever `tensor` > 1, a pipeline's stage layout
  from `stage_split` with the head's work in layers (`StepModel.head_layers`)."""
  def skip(axis: str, size: int) -> bool:
    return only is not None and only[axis] != size

  cfg, cluster = model.cfg, model.cluster
  m = cfg.model
  # The layers a pipeline splits (a MoE model's leading dense ones run before them).
  staged = m.num_layers - model.dense_layers
  for tensor in _divisors(math.gcd(devices, cluster.devices_per_host)):
    if m.num_heads % tensor or m.mlp_dim % tensor or m.vocab_size % tensor or skip("tensor",
                                                                                 tensor):
      continue
    for sequence in _divisors(devices // tensor):
      if cfg.seq_len % (sequence * tensor) or skip("sequence", sequence):
        continue
      rest = devices // tensor // sequence
      for pipeline in _divisors(rest):
        if staged < pipeline or skip("pipeline", pipeline):
          continue
        # Each context-parallel strategy (the ring does not compose with a pipeline).
        strategies = [None] if sequence == 1 else [
            s for s in sequence_lib.STRATEGIES if not (s == "ring" and pipeline > 1)]
        for fsdp in _divisors(rest // pipeline):
          data = rest // pipeline // fsdp
          replicas = data * fsdp
          if cfg.global_batch % replicas or (m.embed_dim % fsdp and only is None) or skip(
              "fsdp", fsdp):
            continue
          mesh = (("data", data), ("pipeline", pipeline), ("fsdp", fsdp),
                  ("sequence", sequence), ("tensor", tensor))
          zero = int(data > 1 and m.embed_dim % (fsdp * data) == 0)
          rows = cfg.global_batch // replicas
          for layout, strategy in itertools.product(expert_layouts(cfg, dict(mesh)), strategies):
            base = dict(mesh=mesh, zero_stage=zero, tensor_sequence_parallel=tensor > 1,
                        expert_parallel=layout, sequence_strategy=strategy)
            if pipeline == 1:
              for accum in (a for a in (1, 2, 4, 8) if rows % a == 0):
                yield Candidate(**base, grad_accum_steps=accum)
              continue
            for micro in microbatch_counts(rows, pipeline):
              for chunks in (1, 2, 4) if micro % pipeline == 0 else (1,):
                schedules = ("1f1b", "zb_h1") if chunks == 1 else ("interleaved_1f1b",)
                layers = stage_split(staged, pipeline, chunks, model.dense_layers,
                                     model.head_layers)
                for schedule in schedules if layers is not None else ():
                  yield Candidate(**base, microbatches=micro, virtual_stages=chunks,
                                  schedule=schedule, stage_layers=layers)


def search(cfg, devices: int, cluster: Cluster, top: int = 5,
           efficiency: float = calibration.KERNEL_EFFICIENCY,
           elementwise: float = calibration.ELEMENTWISE_PASSES
           ) -> tuple[list[Estimate], int, StepModel]:
  """The `top` fastest candidates that fit, each with its cheapest
  recomputation that fits (recomputation only adds time), and how many fit.
  Of equally fast ones, the one that leaves the most memory free comes first."""
  model = StepModel(cfg, cluster, efficiency, elementwise)
  best = []
  for c in candidates(model, devices):
    cfg_c = c.view(model.view)
    if meshtrain_runs(cfg, c, cfg_c):
      continue
    state = model.state_bytes(cfg_c, c)  # collectives only for those that fit
    for remat in REMATS:
      chosen = dataclasses.replace(c, remat=remat)
      cfg_c.remat = remat
      if model.fits(model.memory(cfg_c, chosen, state)["total"]):
        best.append(model.estimate(chosen, cfg_c, model.analytic(cfg_c, chosen)))
        break
  best.sort(key=lambda e: (e.step_s, e.memory_bytes["total"]))
  return best[:top], len(best), model


def rank_of(results: list[Estimate], sizes: dict) -> tuple[int, int] | None:
  """The rank of the fastest candidate on mesh `sizes` among `results`
  (1-based), and how many other meshes' candidates tie with it (equal
  predicted step time to 0.1%). None where no candidate has the mesh."""
  mine = [e.step_s for e in results if e.candidate.sizes == sizes]
  if not mine:
    return None
  best = min(mine)
  faster = {tuple(e.candidate.mesh) for e in results if e.step_s < best * (1 - 1e-3)}
  tied = {tuple(e.candidate.mesh) for e in results if abs(e.step_s - best) <= best * 1e-3
          and e.candidate.sizes != sizes}
  return 1 + len(faster), len(tied)


# The schedules whose backward published software runs as one op (meshtrain's
# tables split it; zero-bubble schedules split it everywhere).
FUSED_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")


def as_published(model: StepModel, run, results: list[Estimate] | None = None) -> Estimate:
  """The prediction for a published run as it ran: its mesh, recomputation
  and stage layout (`run.stage_layers`, where it names some: then with as
  many chunks a stage as one of them has), with the fastest of its
  software's schedules (`run.schedules`; 1F1B and interleaved 1F1B priced
  with the backward in one op, `costs.fused_backward_seconds`), its
  microbatches where published (`run.microbatches`, else the fastest
  count), and the fastest ZeRO stage meshtrain runs on that mesh (of
  `results` where the search kept some, else of every candidate on the
  mesh, fitting or not; where meshtrain runs none, as the cost model prices
  them: OPT-175B's FSDP over 124 devices does not divide its width as
  meshtrain splits it)."""
  sizes = {a: run.mesh.get(a, 1) for a in AXES}
  layouts = {text.count(",") + 1: text for text in run.stage_layers}  # by chunks in all
  pipelined = sizes["pipeline"] > 1

  def on_mesh(c: Candidate) -> bool:
    return c.sizes == sizes and run.sequence_strategy in (None, c.sequence_strategy) and (
        not pipelined or (c.schedule in run.schedules and run.microbatches in (0, c.microbatches)
                          and (not layouts or c.virtual_stages * sizes["pipeline"] in layouts)))

  def as_run(c: Candidate) -> Candidate:
    chunks = c.virtual_stages * sizes["pipeline"]
    return dataclasses.replace(c, remat=run.remat,
                               stage_layers=layouts.get(chunks, c.stage_layers),
                               replicated_norms=not run.tensor_sequence_parallel,
                               fused_backward=pipelined and c.schedule in FUSED_SCHEDULES,
                               flash_context=True)
  kept = [e.candidate for e in results or () if on_mesh(e.candidate)]
  if not kept:
    every = [c for c in candidates(model, run.devices, only=sizes) if on_mesh(c)]
    kept = [c for c in every if not meshtrain_runs(model.cfg, c, c.view(model.view))] or every
  if not kept:
    raise ValueError(f"{run.name}: the planner has no layout on the mesh {sizes} with "
                     f"{run.schedules} and {run.microbatches or 'any'} microbatches")
  return min((model.estimate(as_run(c)) for c in kept), key=lambda e: e.step_s)


def check_published(run, rank: bool = True, efficiency: float = calibration.KERNEL_EFFICIENCY,
                    elementwise: float = calibration.ELEMENTWISE_PASSES) -> dict:
  """A published run (`meshtrain.planner.published`) through the planner: the
  predicted TFLOP/s per device of its configuration as published (its
  recomputation, counted where the publication counts it), the rank of its
  mesh among everything that fits (with the meshes tied with it), and the
  planner's own first choice with how much faster it predicts it than the
  published mesh (`first_speedup`: the mesh as run, or the search's fastest
  candidate on it where that is faster, so that both sides choose their
  recomputation alike and the two meshes are compared) and than the run as
  published (`first_speedup_as_run`). Without `rank` no search runs (rank,
  first: None)."""
  cfg, cluster = run.config(), published.cluster(run.cluster)
  if rank:
    results, fitting, model = search(cfg, run.devices, cluster, top=10**9, efficiency=efficiency,
                                     elementwise=elementwise)
  else:
    results, fitting, model = [], None, StepModel(cfg, cluster, efficiency, elementwise)
  sizes = {a: run.mesh.get(a, 1) for a in AXES}
  mine = as_published(model, run, results)
  on_mesh = min([mine, *(e for e in results if e.candidate.sizes == sizes)],
                key=lambda e: e.step_s)
  placed = rank_of(results, sizes)
  figure = run.tflops or run.tokens_per_s * model.flops_per_token / 1e12

  def tflops(e):
    return e.hardware_tflops_per_device if run.counts_recompute else e.model_tflops_per_device
  first = results[0] if results else None
  return {"run": run.name, "fitting": fitting, "rank": placed and placed[0],
          "tied": placed and placed[1], "published_tflops": figure,
          "predicted_tflops": tflops(mine), "published": mine, "on_mesh": on_mesh,
          "first": first, "first_tflops": tflops(first) if first else None,
          "first_speedup": on_mesh.step_s / first.step_s if first else None,
          "first_speedup_as_run": mine.step_s / first.step_s if first else None}


def parse_mesh(text: str, devices: int) -> dict[str, int]:
  """`"data=64,pipeline=16,tensor=8"` -> sizes of every axis (1 where not
  named), checked against `devices`."""
  sizes, named = dict.fromkeys(AXES, 1), set()
  for part in filter(None, (p.strip() for p in text.split(","))):
    axis, _, size = part.partition("=")
    if axis in named:
      raise ConfigError("--mesh", f"names {axis} twice; give each axis once, e.g. "
                        "--mesh data=64,pipeline=16,tensor=8")
    named.add(axis)
    if axis not in AXES or not (size.isascii() and size.isdigit()) or int(size) < 1:
      raise ConfigError("--mesh", f"{part!r} is not AXIS=SIZE with AXIS one of "
                        f"{', '.join(AXES)}; e.g. --mesh data=64,pipeline=16,tensor=8")
    sizes[axis] = int(size)
  if math.prod(sizes.values()) != devices:
    raise ConfigError("--mesh", f"{text} makes {math.prod(sizes.values())} devices, not "
                      f"--devices={devices}")
  return sizes


def _line(e: Estimate) -> str:
  comm = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in e.exposed_s.items() if v > 0) or "none"
  return (f"step {e.step_s * 1e3:.1f} ms = compute {e.compute_s * 1e3:.1f} + exposed comm "
          f"({comm}) + bubble {e.bubble_s * 1e3:.1f} ms; {e.model_tflops_per_device:.0f} "
          f"TFLOP/s/device (MFU {e.mfu:.1%}); memory {e.memory_bytes['total'] / 2**30:.1f} GiB")


def describe(c: Candidate) -> str:
  """The candidate's layout in a line: its mesh and what it sets."""
  mesh = " x ".join(f"{a}={n}" for a, n in c.mesh if n > 1) or "one device"
  extras = [f"zero {c.zero_stage}", f"remat {c.remat}"]
  if c.grad_accum_steps > 1:
    extras.append(f"accumulate {c.grad_accum_steps}")
  if c.sizes["pipeline"] > 1:
    extras.append(f"{c.schedule}, {c.microbatches} microbatches, {c.virtual_stages} chunks/stage")
    if c.stage_layers:
      extras.append(f"layers {c.stage_layers} a chunk")
  if c.expert_parallel is not None:
    extras.append(f"experts over {c.expert_parallel.replace(',', ' x ')}"
                  if c.expert_parallel else "every expert on every device")
  return f"{mesh}; {', '.join(extras)}"


def explain(cfg, devices: int, cluster: Cluster, sizes: dict) -> dict:
  """One layout through the planner: its best prediction (the fastest
  schedule, ZeRO stage and cheapest fitting recomputation meshtrain runs on
  it), its rank among everything that fits (ties named), and the first
  choice beside it with where the time goes differently. Text in `text`."""
  results, fitting, model = search(cfg, devices, cluster, top=10**9)
  on_mesh = [e for e in results if e.candidate.sizes == sizes]
  lines, why = [], ""
  if on_mesh:
    mine = on_mesh[0]
  else:
    runnable = list(candidates(model, devices, only=sizes))
    reasons = [meshtrain_runs(cfg, c) for c in runnable]
    kept = [c for c, reason in zip(runnable, reasons) if not reason]
    if not kept:
      why = (reasons[0] if reasons else "the model's dimensions do not divide over it "
             "(heads, MLP or vocabulary by tensor, a layer for every pipeline chunk, "
             "batch by data x fsdp)")
      return {"text": f"meshtrain does not run {sizes}: {why}", "fits": False, "rank": None}
    mine = min((model.estimate(dataclasses.replace(c, remat="full")) for c in kept),
               key=lambda e: e.step_s)
    why = (f"does not fit: {mine.memory_bytes['total'] / 2**30:.1f} GiB a device with full "
           f"recomputation, over {cluster.hbm_bytes * cluster.usable_memory / 2**30:.1f} usable")
  placed = rank_of(results, sizes)
  lines += [f"your layout: {describe(mine.candidate)}", f"  {_line(mine)}",
            f"  {why}" if why else f"  rank {placed[0]} of {fitting}" +
            (f", tied with {placed[1]} other meshes" if placed[1] else "")]
  first = results[0] if results else None
  if first is not None and first.candidate != mine.candidate:
    lines += [f"first choice: {describe(first.candidate)}", f"  {_line(first)}",
              f"  {mine.step_s / first.step_s:.2f}x faster predicted; where the time differs "
              "(yours - first, ms):"]
    parts = {"compute": (mine.compute_s, first.compute_s),
             "bubble": (mine.bubble_s, first.bubble_s)}
    for key in sorted(set(mine.exposed_s) | set(first.exposed_s)):
      parts[key] = (mine.exposed_s.get(key, 0.0), first.exposed_s.get(key, 0.0))
    lines += [f"    {key}: {(a - b) * 1e3:+.1f}" for key, (a, b) in parts.items()
              if abs(a - b) * 1e3 >= 0.05]
  return {"text": "\n".join(lines), "fits": bool(on_mesh), "rank": placed and placed[0],
          "tied": placed and placed[1], "yours": mine, "first": first}


def format_search(results: list[Estimate], fitting: int, cluster: Cluster, devices: int,
                  base_config: str) -> str:
  lines = [f"{fitting} configurations fit on {devices} x {cluster.name}; the fastest "
           f"{len(results)} (matmuls at {calibration.KERNEL_EFFICIENCY:.0%} of peak, "
           "calibrated):", ""]
  for i, e in enumerate(results, 1):
    lines += [f"{i}. {describe(e.candidate)}", f"   {_line(e)}",
              f"   {e.tokens_per_s_per_device:,.0f} tokens/s/device, activations "
              f"{e.memory_bytes['activations'] / 2**30:.1f} GiB/device",
              f"   {e.as_dict(base_config)['command']}", ""]
  return "\n".join(lines)
