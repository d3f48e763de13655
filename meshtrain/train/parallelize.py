"""The strategies that rewrite the model's program, applied where the model
leaves room for them, as torchtitan's `parallelize` applies them to a model.

Most strategies are rules tables (`meshtrain.rules`) and need nothing here.
The others fill the model's `Slots` and order its batch:
  - context parallelism (`sequence` > 1): the attention slot gets
    `sequence.sequence_attention` with the configured strategy; under `ring`
    the batch comes in the ring's zigzag token order (`batch_order`), so the
    layers run in that order throughout, an MoE layer's capacity counting
    in position order through it (`sequence.count_before`);
  - expert parallelism (`model.moe.num_experts` > 0): the experts slot gets
    `experts.expert_parallel` over `config.expert_parallel`'s axes;
  - weight offload (`offload.params`): the layer-weights slot brings each
    layer's weights from the host as the layer runs;
  - otherwise the attention slot gets the local kernel the device runs best.
"""

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from meshtrain.models import mla, moe
from meshtrain.models.llama import Llama, LlamaConfig, Slots, default_positions
from meshtrain.parallel import attention, experts, offload, sequence
from meshtrain.parallel.pipeline.stages import StageLayout
from meshtrain.train.loss import mtp_metrics
from meshtrain.train.state import ModelSpec, nnx_spec

Batch = dict[str, jax.Array]


def run_device(mesh=None) -> jax.Device:
  """The device whose kernels a run's execution choices are resolved for: the
  first of `mesh`'s devices (real ones, or a GPU target's that this machine
  only compiles for), else this machine's first."""
  if isinstance(mesh, Mesh):
    return mesh.devices.flat[0]
  return jax.devices()[0]


def model_config(cfg) -> LlamaConfig:
  """The model's own settings (its shape, precision and recomputation); how
  it runs on a mesh is its `slots`."""
  model = cfg.model.to_dict()
  return LlamaConfig(**{**model, "moe": moe.MoEConfig(**model["moe"]),
                        "mla": mla.MLAConfig(**model["mla"])},
                     compute_dtype=cfg.compute_dtype, float8=cfg.float8, remat=cfg.remat)


def grouped_gemm(cfg, device: jax.Device | None = None) -> str:
  """`config.experts.grouped_gemm` resolved for `device` (default: `run_device()`)."""
  return experts.gemm_for(cfg.experts.grouped_gemm, cfg.compute_dtype, expert_widths(cfg),
                          device or run_device())


def expert_widths(cfg) -> dict[str, int]:
  """The widths an expert's matmuls contract or write on one device."""
  hidden = cfg.model.moe.mlp_dim or cfg.model.mlp_dim
  return {"config.model.embed_dim": cfg.model.embed_dim,
          "an expert's hidden width on one tensor device": hidden // max(cfg.mesh.tensor, 1)}


def expert_axes(cfg) -> tuple[str, ...]:
  """`config.expert_parallel` as mesh axes."""
  return tuple(a.strip() for a in cfg.expert_parallel.split(",") if a.strip())


def attention_kernel(cfg, device: jax.Device | None = None) -> str:
  """`config.attention.implementation` resolved for `device` (default:
  `run_device()`); "" is XLA's inside the pipeline (`CUDNN_IN_PIPELINE`)."""
  kernel = attention.implementation_for(cfg.attention.implementation, cfg.compute_dtype,
                                        mla.widths(cfg.model)[2], device or run_device(),
                                        packed=cfg.data.packing == "segments")
  return "xla" if kernel == "cudnn" and cfg.mesh.pipeline > 1 else kernel


@dataclasses.dataclass(frozen=True)
class Execution:
  """How the model runs on a run's devices, apart from what it is (a resume
  may change any of it).

  Attributes:
    attention: the attention kernel (`attention_kernel`).
    grouped_gemm: the experts' grouped GEMM (`grouped_gemm`).
    dispatch: how tokens reach their experts (`config.experts.dispatch`).
  """
  attention: str
  grouped_gemm: str
  dispatch: str


def execution_for(cfg, device: jax.Device) -> Execution:
  """`cfg`'s execution choices resolved for `device`."""
  return Execution(attention_kernel(cfg, device), grouped_gemm(cfg, device), cfg.experts.dispatch)


# Why cuDNN's attention does not run in a pipeline's stages (jax 0.10.2, seen in
# the program compiled for GPUs: docs/gpu_program.md).
CUDNN_IN_PIPELINE = (
    "its custom partitioner fails inside the stages' shard_map (it reads `.spec` of a "
    "GSPMDSharding), and made all manual there, the zero-bubble split of its backward fails "
    "Shardy's verification")


def slots(cfg, mesh, execution: Execution) -> Slots:
  """The model's slots for `cfg` on `mesh` (a `Mesh` or an `AbstractMesh`),
  running as `execution` says."""
  implementation = execution.attention
  if mesh.shape["sequence"] > 1:
    strategy = cfg.attention.sequence_strategy
    attend = functools.partial(sequence.sequence_attention, strategy=strategy,
                               zigzag=strategy == "ring", implementation=implementation)
  else:
    attend = functools.partial(attention.causal_attention, implementation=implementation)
  slot = {"attention": attend}
  if cfg.model.moe.num_experts:
    slot["experts"] = functools.partial(
        experts.expert_parallel, axes=expert_axes(cfg),
        per_sequence=model_config(cfg).moe.capacity(cfg.seq_len),
        gemm=execution.grouped_gemm, dispatch=execution.dispatch)
  if cfg.model.moe.num_experts and cfg.attention.sequence_strategy == "ring":
    # An expert's capacity counts in position order, through the zigzag.
    slot["count_before"] = functools.partial(sequence.count_before, zigzag=True)
  if (cfg.model.moe.num_experts or cfg.model.mtp_layers) and mesh.shape["pipeline"] > 1:
    # Inside the pipeline's shard_map `data` (unless local SGD's replica
    # axis) and `sequence` are manual: the counts sum over them; and each of
    # the M microbatches' switch losses weighs 1/M of the step's.
    token_axes = tuple(a for a in ("data", "sequence") if mesh.shape[a] > 1
                       and not (a == "data" and cfg.local_sgd.inner_steps))
    slot["token_sum"] = functools.partial(experts.manual_token_sum, axes=token_axes)
    slot["aux_loss_weight"] = 1 / cfg.pipeline.microbatches
  if cfg.offload.params:
    slot["layer_weights"] = functools.partial(offload.fetch,
                                              working_dtype=jnp.dtype(cfg.param_dtype))
  return Slots(**slot)


def llama_spec(model_cfg: LlamaConfig, model_slots: Slots = Slots(), seed: int = 0) -> ModelSpec:
  spec = nnx_spec(lambda: Llama(model_cfg, rngs=nnx.Rngs(seed), slots=model_slots))
  routed = model_cfg.moe
  metrics = ([functools.partial(moe.metrics, k=routed.experts_per_token)]
             if routed.num_experts else [])
  if model_cfg.mtp_layers:
    metrics.append(mtp_metrics)
  update = (functools.partial(_update_biases, routed.bias_update_rate)
            if routed.num_experts and routed.bias_update_rate else None)
  return dataclasses.replace(
      spec, update_model_state=update,
      metrics=(lambda stats: {k: v for fn in metrics for k, v in fn(stats).items()})
      if metrics else None)


def _update_biases(rate: float, model_state: dict, stats: dict) -> dict:
  """The routed layers' selection biases after a step with these counts: the
  model's layers' first, then its multi-token prediction modules' (`Llama.forward_mtp`)."""
  def update(mlp: dict, load_LxE: jax.Array) -> dict:
    return {**mlp, "bias_E": moe.update_bias(mlp["bias_E"], load_LxE, rate)}

  layers = model_state["layers"]
  routed = len(layers["mlp"]["bias_E"])
  new = {**model_state, "layers": {**layers, "mlp": update(layers["mlp"],
                                                           stats["load_E"][:routed])}}
  if "mtp" in model_state:
    block = model_state["mtp"]["block"]
    new["mtp"] = {**model_state["mtp"], "block": {**block, "mlp": update(
        block["mlp"], stats["load_E"][routed:])}}
  return new


def stage_layout(cfg) -> StageLayout:
  """How `config.pipeline` splits the stacked layers (all but an MoE model's
  leading dense ones) into the chunks of `config.mesh.pipeline` stages; one
  stage of every layer off a pipeline. ValueError names what does not fit."""
  moe_cfg = cfg.model.moe
  stacked = cfg.model.num_layers - (moe_cfg.first_dense_layers if moe_cfg.num_experts else 0)
  if cfg.mesh.pipeline == 1:
    return StageLayout((stacked,), 1)
  return StageLayout.parse(cfg.pipeline.stage_layers, stacked, cfg.mesh.pipeline,
                           cfg.pipeline.virtual_stages)


def _layers_in(restack: Callable):
  """A params or model-state dict with `restack` applied to its `layers`."""
  def apply(tree):
    return {**tree, "layers": restack(tree["layers"])} if tree and "layers" in tree else tree
  return apply


def in_stage_slots(spec: ModelSpec, layout: StageLayout) -> ModelSpec:
  """`spec` with its layers stored in `layout`'s slots (an uneven layout;
  `stages.StageLayout`): created there, and its model state moved there
  after each update from the model's own per-layer counts."""
  if layout.even_split:
    return spec
  slotted, unslotted = _layers_in(layout.to_slots), _layers_in(layout.from_slots)

  def update(model_state, stats):
    return slotted(spec.update_model_state(unslotted(model_state), stats))
  return dataclasses.replace(
      spec, init=lambda: slotted(spec.init()),
      abstract_params=jax.eval_shape(slotted, spec.abstract_params),
      init_model_state=lambda: slotted(spec.init_model_state()),
      update_model_state=update if spec.update_model_state else None)


def from_stage_slots(layout: StageLayout, tree):
  """The model's own weights or model state (or their shapes) from the
  state's: the layers out of `layout`'s slots (`in_stage_slots`)."""
  if layout.even_split:
    return tree
  unslotted = _layers_in(layout.from_slots)
  abstract = any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(tree))
  return jax.eval_shape(unslotted, tree) if abstract else unslotted(tree)


def _as_it_comes(batch: Batch) -> Batch:
  return batch


def batch_order(cfg) -> Callable[[Batch], Batch]:
  """How the loss orders the tokens of a batch before the model sees them: as
  they come, or under `ring` in the ring's zigzag order
  (docs/context_parallel.md)."""
  return ring_order if cfg.attention.sequence_strategy == "ring" else _as_it_comes


def ring_order(batch: Batch) -> Batch:
  """Every [batch, length] array of `batch` in `sequence.zigzag_order` for the
  mesh in context, with each token's rotary position (computed before the
  reordering, inside its document when packed) beside it. Where the mesh
  does not split the length (one device, as the reference runs), the batch
  as it is."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or mesh.shape.get("sequence", 1) == 1:
    return batch
  inputs_BxL = batch["inputs"]
  reordered = {key: sequence.to_zigzag(x, mesh) for key, x in batch.items()}
  if "positions" in batch:
    return reordered
  if "segment_ids" in batch:
    positions_BxL = default_positions(inputs_BxL, batch["segment_ids"])
    return {**reordered, "positions": sequence.to_zigzag(positions_BxL, mesh)}
  # Each token keeps its index as position, wherever it sits: known without moving data.
  order_L = sequence.zigzag_order(inputs_BxL.shape[1], mesh.shape["sequence"])
  return {**reordered, "positions": jnp.broadcast_to(jnp.asarray(order_L), inputs_BxL.shape)}
