"""DeepSeek-V3's multi-token prediction (`model.mtp_layers`): training on any
mesh equals a plain one-device run of a loss written here from the report's
definition (section 2.2), not from meshtrain's: each depth's module sees the
previous depth's normalised hidden state and the embedding of the token k
places ahead, and predicts the token k + 1 places ahead, its loss the mean
over the positions where that token exists, counts and lies in the same
document. Hugging Face's modules are checked in tests/test_mtp_hf.py."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import pairs
from conftest import micro_config, tiered
from equivalence import meshtrain_run
from reference import random_batches
from test_packing import packed_batches
from meshtrain.models.llama import Llama, default_positions
from meshtrain.train.loss import model_loss, with_loss_weights
from meshtrain.train.parallelize import model_config

STEPS = 4


def _rms(x, scale, eps):
  return x / jnp.sqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def _mean_loss(logits_BxLxV, targets_BxL, counted_BxL):
  losses = optax.softmax_cross_entropy_with_integer_labels(logits_BxLxV, targets_BxL)
  return (losses * counted_BxL).sum() / counted_BxL.sum()


def plain_loss(graphdef, params, model_state, batch):
  """The next-token loss plus mtp_loss_coef x the mean of the depths' losses,
  each depth's module run over the whole length on the tokens k places ahead
  (token 0 past the end, as Megatron's rolled inputs have it), its loss
  counted where the target k + 1 places ahead exists, counts and shares the
  position's document. The trunk and the block are the model's own
  (`Llama.hidden`, `Block.forward`); the rest is written here."""
  model = nnx.merge(graphdef, params, *([model_state] if model_state is not None else []))
  cfg = model.cfg
  inputs, targets = batch["inputs"], batch["targets"]
  length = inputs.shape[1]
  segments = batch.get("segment_ids")
  counted = np.ones(targets.shape, bool) if segments is None else segments != 0
  positions = default_positions(inputs, segments)
  x = model.hidden(inputs, segment_ids=segments)[0]
  h = _rms(x, params["head"]["final_norm"]["scale"], cfg.norm_eps)
  table = params["embed"]["embedding_VxD"]
  head = table.T if cfg.tie_embeddings else params["head"]["head_DxV"]
  loss = _mean_loss(h @ head, targets, counted)
  tokens = jnp.concatenate([inputs, targets[:, -1:]], axis=1)  # t_0 ... t_L
  block_def, block_states = nnx.split(model.mtp.block)
  mtp = params["mtp"]
  depth_losses = []
  for k in range(1, cfg.mtp_layers + 1):
    ahead = jnp.pad(tokens[:, k:length + 1], ((0, 0), (0, k - 1)))  # t_{i+k}, 0 past t_L
    e = table[ahead]
    m = jax.tree.map(lambda w: w[k - 1], mtp)
    x = jnp.concatenate([_rms(e, m["embed_norm"]["scale"], cfg.norm_eps),
                         _rms(h, m["hidden_norm"]["scale"], cfg.norm_eps)], axis=-1)
    x = x @ m["proj_2DxD"]
    block = nnx.merge(block_def, jax.tree.map(lambda w: w[k - 1], block_states))
    x = block.forward(x, positions, segments)[0]
    h = _rms(x, m["norm"]["scale"], cfg.norm_eps)
    n = length - k  # positions whose target t_{i+k+1} exists
    valid = counted[:, k:] & (True if segments is None else segments[:, :n] == segments[:, k:])
    depth_losses.append(_mean_loss((h @ head)[:, :n], targets[:, k:], valid))
  return loss + cfg.mtp_loss_coef * jnp.mean(jnp.stack(depth_losses)), jnp.stack(depth_losses)


def plain_run(graphdef, params, model_state, optimizer, batches):
  """Losses, the depths' losses and final weights of plain jitted steps on one device."""
  device = jax.devices()[0]
  params = jax.device_put(params, device)
  opt_state = optimizer.init(params)

  @jax.jit
  def step(params, opt_state, batch):
    (loss, depths), grads = jax.value_and_grad(
        lambda p: plain_loss(graphdef, p, model_state, batch), has_aux=True)(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss, depths

  losses, depth_losses = [], []
  for batch in batches:
    params, opt_state, loss, depths = step(params, opt_state, jax.device_put(batch, device))
    losses.append(float(loss))
    depth_losses.append(np.asarray(depths))
  return np.array(losses), np.array(depth_losses), jax.device_get(params)


# The switch loss's gradient is checked layer by layer in tests/test_moe.py.
MOE = dict(num_experts=8, experts_per_token=2, mlp_dim=32, shared_mlp_dim=32,
           first_dense_layers=1, aux_loss_coef=0.0)
# Pairwise, not a full product: `CASE_PAIRS` (checked below; `python
# tests/pairs.py` draws the table) names the pairs the cases cover between them.
CASES = {
    "fsdp=8 moe": dict(mesh=dict(data=1, fsdp=8), model=dict(moe=MOE)),
    "fsdp=8 depth 2 tied packed": dict(mesh=dict(data=1, fsdp=8), packed=True,
                                       model=dict(mtp_layers=2, tie_embeddings=True)),
    "data=8 zero1 accumulate 2 remat=full": dict(mesh=dict(data=8), zero_stage=1,
                                                  grad_accum_steps=2, remat="full"),
    "tensor=2 fsdp=4 sequence parallel moe": dict(
        mesh=dict(data=1, fsdp=4, tensor=2), tensor_sequence_parallel=True, model=dict(moe=MOE)),
    **{f"sequence=2 fsdp=4 {strategy} packed": dict(
        mesh=dict(data=1, fsdp=4, sequence=2), packed=True,
        attention=dict(sequence_strategy=strategy))
       for strategy in ("ring", "ulysses", "all_gather_kv")},
    "pipeline=2 fsdp=4 1f1b moe": dict(
        mesh=dict(data=1, pipeline=2, fsdp=4), pipeline=dict(microbatches=2),
        model=dict(num_layers=3, moe=MOE)),
    "pipeline=2 data=2 sequence=2 zb_h2 ulysses tied packed": dict(
        mesh=dict(data=2, pipeline=2, sequence=2), packed=True,
        pipeline=dict(schedule="zb_h2", microbatches=4),
        attention=dict(sequence_strategy="ulysses"), model=dict(tie_embeddings=True)),
    "pipeline=2 data=4 interleaved depth 2 accumulate 2": dict(
        mesh=dict(data=4, pipeline=2), grad_accum_steps=2, model=dict(num_layers=4, mtp_layers=2),
        pipeline=dict(schedule="interleaved_1f1b", microbatches=2, virtual_stages=2)),
    "data=2 fsdp=4 accumulate 2 moe": dict(mesh=dict(data=2, fsdp=4), grad_accum_steps=2,
                                           model=dict(moe=MOE)),
    "fsdp=8 offload params and optimizer": dict(mesh=dict(data=1, fsdp=8),
                                                offload=dict(params=True, optimizer=True)),
    "expert_parallel=data,fsdp remat=selective": dict(
        mesh=dict(data=2, fsdp=4), expert_parallel="data,fsdp", remat="selective",
        model=dict(moe=MOE)),
}
QUICK = ("fsdp=8 moe", "fsdp=8 depth 2 tied packed",
         "sequence=2 fsdp=4 ring packed", "pipeline=2 fsdp=4 1f1b moe")


# Every pair the cases covered when each was a case of its own (0e6941b).
CASE_PAIRS = pairs.parse("""
    1f1b: experts over fsdp, first dense, fsdp, moe, mtp depth 1, pipeline, shared expert
    accumulate: data, experts over fsdp, first dense, fsdp, interleaved_1f1b, moe, mtp depth 1, mtp depth 2, pipeline, remat full, shared expert, zero1
    all_gather_kv: fsdp, mtp depth 1, packed, sequence
    data: experts over data+fsdp, experts over fsdp, first dense, fsdp, interleaved_1f1b, moe, mtp depth 1, mtp depth 2, packed, pipeline, remat full, remat selective, sequence, shared expert, tied, ulysses, zb_h2, zero1
    experts over data+fsdp: first dense, fsdp, moe, mtp depth 1, remat selective, shared expert
    experts over fsdp: first dense, fsdp, megatron-sp, moe, mtp depth 1, pipeline, shared expert, tensor
    first dense: fsdp, megatron-sp, moe, mtp depth 1, pipeline, remat selective, shared expert, tensor
    fsdp: megatron-sp, moe, mtp depth 1, mtp depth 2, offload, packed, pipeline, remat selective, ring, sequence, shared expert, tensor, tied, ulysses
    interleaved_1f1b: mtp depth 2, pipeline
    megatron-sp: moe, mtp depth 1, shared expert, tensor
    moe: mtp depth 1, pipeline, remat selective, shared expert, tensor
    mtp depth 1: offload, packed, pipeline, remat full, remat selective, ring, sequence, shared expert, tensor, tied, ulysses, zb_h2, zero1
    mtp depth 2: packed, pipeline, tied
    packed: pipeline, ring, sequence, tied, ulysses, zb_h2
    pipeline: sequence, shared expert, tied, ulysses, zb_h2
    remat full: zero1
    remat selective: shared expert
    ring: sequence
    sequence: tied, ulysses, zb_h2
    shared expert: tensor
    tied: ulysses, zb_h2
    ulysses: zb_h2
""")


def case_config(case):
  """`CASES[case]`'s config, and whether its batches are packed."""
  changes = dict(CASES[case])
  packed = changes.pop("packed", False)
  cfg = micro_config()
  cfg.model.mtp_layers, cfg.model.mtp_loss_coef = 1, 0.3
  cfg.update(changes)
  return cfg, packed


def case_labels():
  return {case: pairs.labels(cfg) | ({"packed"} if packed else set())
          for case, (cfg, packed) in ((case, case_config(case)) for case in CASES)}


def test_the_cases_cover_every_pair_they_must():
  """Merging or removing a case below must not leave a pair of strategies
  and features uncomposed (`python tests/pairs.py` draws the table)."""
  assert pairs.missing(case_labels().values(), CASE_PAIRS) == []


@pytest.mark.parametrize("case", tiered(CASES, QUICK))
def test_matches_a_plain_one_device_loss(case):
  """Losses (next-token + 0.3 x the depths'), the logged `mtp_loss` (the
  depths' mean) and the weights after four steps equal the plain run's; the
  modules' weights train."""
  cfg, packed = case_config(case)
  make = packed_batches if packed else random_batches
  batches = make(STEPS, cfg.global_batch, cfg.seq_len, cfg.model.vocab_size)

  setup, (initial, model_state), losses, params, metrics = meshtrain_run(cfg, batches,
                                                                         with_metrics=True)
  ref_losses, ref_depths, ref_params = plain_run(setup.spec.graphdef, initial, model_state or None,
                                                 setup.optimizer, batches)
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose([m["mtp_loss"] for m in metrics], ref_depths.mean(axis=1),
                             rtol=1e-5, atol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(
      a, b, rtol=1e-5, atol=1e-3 * cfg.optimizer.learning_rate), params, ref_params)
  moved = jax.tree.map(lambda a, b: float(np.max(np.abs(a - b))), params["mtp"], initial["mtp"])
  assert min(jax.tree.leaves(moved)) > 0, moved


def _model(**changes):
  cfg = micro_config()
  cfg.model.mtp_layers = 2
  cfg.update(changes)
  return Llama(model_config(cfg), rngs=nnx.Rngs(0)), cfg


def test_a_position_sees_no_token_beyond_the_one_it_predicts_from():
  """Depth k's logits at position i change with no token after t_{i+k}: the
  modules attend causally, and the tail past the batch's end is padding."""
  model, cfg = _model()
  tokens = random_batches(2, 2, cfg.seq_len + 4, cfg.model.vocab_size)
  first, second = ({key: b[key][:, :cfg.seq_len] for key in ("inputs", "targets")}
                   for b in tokens)
  cut = 9  # positions >= cut change, from t_cut on
  changed = {key: np.concatenate([first[key][:, :cut], second[key][:, cut:]], axis=1)
             for key in first}
  changed["targets"][:, cut - 1] = second["inputs"][:, cut]

  def logits(batch):
    ahead = with_loss_weights(batch, cfg.model.mtp_layers)["mtp_inputs"]
    return model.forward_mtp(batch["inputs"], ahead)[1]
  for k, (a, b) in enumerate(zip(logits(first), logits(changed)), start=1):
    np.testing.assert_allclose(a[:, :cut - k], b[:, :cut - k], rtol=1e-6)
    assert not np.allclose(a[:, cut - k], b[:, cut - k])


def test_each_depths_weights_average_one_over_the_counted_positions():
  """`mtp_loss_weights`: 0 where t_{i+k+1} is past the end, padding or in
  another document, the others equal and averaging 1 over the batch."""
  segments = np.array([[1, 1, 1, 2, 2, 2, 2, 0], [1, 1, 1, 1, 1, 1, 1, 1]])
  batch = {"inputs": np.arange(16).reshape(2, 8), "targets": np.arange(1, 17).reshape(2, 8),
           "segment_ids": segments}
  weighed = with_loss_weights(batch, 2)
  expected = {1: [[1, 1, 0, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 1, 0]],
              2: [[1, 0, 0, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1, 0, 0]]}
  for k, counted in expected.items():
    counted = np.array(counted, np.float32)
    np.testing.assert_allclose(weighed["mtp_loss_weights"][..., k - 1],
                               counted * counted.size / counted.sum())
    np.testing.assert_array_equal(weighed["mtp_targets"][:, :8 - k, k - 1], batch["targets"][:, k:])
  np.testing.assert_array_equal(weighed["mtp_inputs"][0, :, 1], [2, 3, 4, 5, 6, 7, 8, 0])


def test_the_routed_modules_count_in_the_balance_and_move_their_own_biases():
  """The module's routed block adds its counts after the model's layers':
  a uniform router's switch loss is 1 in each, the routed layers' weights in
  the auxiliary loss (x its coefficient) sum to 1 over the model's and the
  modules' together, and the bias update moves each layer's biases by its
  own loads."""
  from meshtrain.train.parallelize import llama_spec
  cfg = micro_config()
  cfg.model.mtp_layers = 2
  cfg.model.moe.update(num_experts=4, experts_per_token=2, aux_loss_coef=0.5,
                       bias_update_rate=0.25)
  spec = llama_spec(model_config(cfg))
  params, state = spec.init(), spec.init_model_state()
  for tree in (params["layers"]["mlp"], params["mtp"]["block"]["mlp"]):
    tree["router_DxE"] = jnp.zeros_like(tree["router_DxE"])  # uniform scores
  batch = with_loss_weights(random_batches(1, 4, cfg.seq_len, cfg.model.vocab_size)[0], 2)
  _, stats = model_loss(nnx.merge(spec.graphdef, params, state), batch)
  assert stats["load_E"].shape == (cfg.model.num_layers + 2, 4)
  np.testing.assert_allclose(stats["aux_loss"] / stats["forwards"], 1.0, rtol=1e-6)
  model = nnx.merge(spec.graphdef, params, state)
  routed = cfg.model.num_layers - cfg.model.moe.first_dense_layers
  assert routed * model.layers.mlp.aux_weight + 2 * model.mtp.block.mlp.aux_weight == 1
  new = spec.update_model_state(state, stats)
  for old, now, loads in ((state["layers"], new["layers"], stats["load_E"][:2]),
                          (state["mtp"]["block"], new["mtp"]["block"], stats["load_E"][2:])):
    step = 0.25 * np.sign(loads.mean(-1, keepdims=True) - loads)
    np.testing.assert_allclose(now["mlp"]["bias_E"], old["mlp"]["bias_E"] + step)


def test_model_flops_grow_with_a_module_as_the_compiled_step_does():
  """`flops.flops_per_token` counts a module as a layer of attention, its
  block's and projection's weights and one more output head: its growth from
  none to two modules is the compiled step's (its dot FLOPs, forward and
  backward, over the batch's tokens)."""
  import compiled_flops
  from meshtrain.models import flops
  from meshtrain.planner.plan import compile_step
  from meshtrain.train.setup import build

  def counts(depth):
    cfg = micro_config(**{"model.mtp_layers": depth})
    setup = build(cfg, jax.devices()[:1])
    model = flops.flops_per_token(model_config(cfg), setup.spec.abstract_params, cfg.seq_len)
    tokens = cfg.global_batch * cfg.seq_len
    return model * tokens, compiled_flops.dot_flops(compile_step(setup))
  (model_0, compiled_0), (model_2, compiled_2) = counts(0), counts(2)
  assert model_2 - model_0 == pytest.approx(compiled_2 - compiled_0, rel=1e-3)


def test_the_tables_gradient_is_reduce_scattered_as_planned_not_all_reduced_whole():
  """Read from the compiled step of fsdp=8: the embedding table, looked up
  for the tokens ahead as well, gets its gradient reduce-scattered to its
  shards (the bytes `meshtrain plan` counts); no all-reduce carries a
  table (XLA all-reduced both lookups' whole, 2 x V x D, before
  `Embed.table` pinned the gradient's layout)."""
  from conftest import step_collectives
  from meshtrain.analysis import hlo
  from meshtrain.planner.plan import compile_step, plan
  from meshtrain.train.setup import build
  cfg = micro_config(**{"mesh.data": 1, "mesh.fsdp": 8, "model.mtp_layers": 1})
  setup = build(cfg)
  compiled = compile_step(setup)
  table = f"[{cfg.model.vocab_size},{cfg.model.embed_dim}]"
  reduced = [i.shape for i in hlo._parse_module(compiled.as_text()).instructions()
             if i.opcode.startswith("all-reduce")]
  assert reduced and not [s for s in reduced if table in s], reduced
  measured = step_collectives(compiled, setup.mesh)
  planned = {(c["kind"], c["axis"]): c for c in plan(cfg, 8, False)["collectives"]}
  assert measured["reduce-scatter", "fsdp"]["bytes"] == planned["reduce-scatter", "fsdp"]["bytes"]


@pytest.mark.slow
def test_a_routed_module_trains_logs_and_resumes_bit_exactly(tmp_path):
  """A run of an MoE model with a module logs `mtp_loss` every step; the
  module's selection bias moves and lies in the checkpoint; a resume from
  step 3 gives the same losses; a restore into a pipeline (the module on its
  last stage) continues within float32 rounding. (No switch loss: the
  pipeline's is its microbatches', not the batch's.)"""
  from test_moe import moe_run_config
  from meshtrain.train.loop import train
  from meshtrain.train.setup import build
  from meshtrain.workdir import load_model_state

  def run(name, **changes):
    return train(moe_run_config(tmp_path / name, **{"model.mtp_layers": 1,
                                                     "model.moe.aux_loss_coef": 0.0, **changes}))
  straight = run("straight")
  assert all(r["mtp_loss"] > 0 for r in straight)
  setup = build(moe_run_config(tmp_path / "straight", **{"model.mtp_layers": 1}))
  state = load_model_state(tmp_path / "straight", 6, jax.eval_shape(setup.spec.init_model_state),
                           setup.shardings.model_state)
  assert np.abs(np.asarray(state["mtp"]["block"]["mlp"]["bias_E"])).max() > 0
  restore = str(tmp_path / "straight/checkpoints/3")
  resumed = run("resumed", **{"checkpoint.restore_from": restore})
  pick = lambda records: [(r["step"], r["loss"], r["mtp_loss"])  # noqa: E731
                          for r in records if r["step"] > 3]
  assert pick(resumed) == pick(straight)
  piped = run("piped", **{"checkpoint.restore_from": restore, "mesh.pipeline": 2,
                          "mesh.fsdp": 4, "pipeline.microbatches": 2})
  np.testing.assert_allclose([r["loss"] for r in piped if r["step"] > 3],
                             [r["loss"] for r in straight if r["step"] > 3], rtol=1e-5)


def test_local_sgd_with_one_inner_step_trains_the_modules_as_data_parallel_sgd():
  """Local SGD (H = 1, outer SGD at rate 1) is data-parallel SGD: each
  replica weighs its rows' depths itself, the same share of the batch."""
  from test_local_sgd import local_config, run
  from meshtrain.train.setup import build
  cfg = local_config(1, **{"mesh.data": 8, "optimizer.name": "sgd", "optimizer.learning_rate": 0.5,
                           "optimizer.weight_decay": 0.0, "optimizer.clip_norm": 0.0,
                           "local_sgd.outer_optimizer": "sgd", "local_sgd.outer_learning_rate": 1.0,
                           "model.mtp_layers": 1})
  setup = build(cfg)
  batches = random_batches(STEPS, cfg.global_batch, cfg.seq_len, cfg.model.vocab_size)
  initial, losses, state = run(setup, batches)
  sgd = optax.sgd(optax.warmup_cosine_decay_schedule(0.0, 0.5, 2, cfg.steps, 0.05))
  ref_losses, _, ref_params = plain_run(setup.spec.graphdef, initial, None, sgd, batches)
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
               jax.device_get(state.outer.params), ref_params)


def half_precision_metrics(working):
  """Each step's metrics of a routed module on fsdp=8 in `working`; asserts
  that no step overflowed."""
  batches = random_batches(STEPS, 16, 16, 64)
  cfg = micro_config(**{"mesh.data": 1, "mesh.fsdp": 8, "param_dtype": working,
                        "compute_dtype": working, "model.mtp_layers": 1})
  cfg.model.moe.update(MOE)
  *_, logged = meshtrain_run(cfg, batches, with_metrics=True)
  assert logged[-1]["nonfinite_steps"] == 0
  return logged


@pytest.fixture(scope="module")
def float32_metrics():
  """The float32 run both half precisions are compared with, trained once."""
  return half_precision_metrics("float32")


@pytest.mark.parametrize("dtype", tiered(["bfloat16", "float16"], ()))
def test_half_precision_tracks_float32(dtype, float32_metrics):
  """bfloat16, and float16 with loss scaling, with a routed module on
  fsdp=8: the losses and `mtp_loss` stay within rounding of the float32 run
  (which equals the plain loss above), and no step overflows."""
  logged = half_precision_metrics(dtype)
  for key in ("loss", "mtp_loss"):
    np.testing.assert_allclose([m[key] for m in logged],
                               [m[key] for m in float32_metrics], atol=0.03)


def test_plan_counts_the_modules_residuals_as_the_compiled_forward_saves_them():
  """The residuals `plan` traces from the train step's loss, modules
  included, against the outputs of `jax.vjp`'s forward compiled on fsdp=8
  (test_residuals.py's measure), with none and two modules; and `plan`'s
  activations grow by the modules' share, also on a pipeline's last stage,
  which keeps the head's residuals."""
  from test_residuals import compiled_residual_bytes
  import meshtrain
  from meshtrain.planner import residuals
  from meshtrain.planner.plan import llama_loss, plan
  from meshtrain.train.setup import build
  saved = {}
  for depth in (0, 2):
    cfg = micro_config(**{"mesh.data": 1, "mesh.fsdp": 8, "model.mtp_layers": depth})
    setup = build(cfg)
    batch = {k: jax.ShapeDtypeStruct((cfg.global_batch, cfg.seq_len), jnp.int32,
                                     sharding=setup.train_step.batch_sharding)
             for k in ("inputs", "targets")}
    planned = sum(x.device_bytes for x in residuals.saved_residuals(
        llama_loss(setup.spec), setup.spec.abstract_params, setup.spec.names, batch,
        setup.mesh.abstract_mesh, setup.rules))

    def train_loss(params, batch, depth=depth):  # the train step's
      return model_loss(nnx.merge(setup.spec.graphdef, params),
                        with_loss_weights(batch, depth))[0]
    measured = compiled_residual_bytes(
        train_loss, setup.spec.abstract_params,
        meshtrain.tree_shardings(setup.spec.names, setup.mesh, setup.rules.params), batch,
        setup.train_step._context)
    assert planned == pytest.approx(measured, rel=0.05), depth
    saved[depth] = planned
  assert saved[2] > saved[0]
  for mesh in ({"mesh.data": 1, "mesh.fsdp": 8},
               {"mesh.data": 1, "mesh.fsdp": 4, "mesh.pipeline": 2}):
    activations = [plan(micro_config(**mesh, **{"model.mtp_layers": depth}), 8, False)[
        "analytic"]["memory_bytes"]["activations"] for depth in (0, 2)]
    assert activations[1] - activations[0] >= saved[2] - saved[0], mesh



@pytest.mark.parametrize("remat", ["selective", "full"])
def test_under_recomputation_the_modules_keep_no_copy_of_their_weights(remat):
  """Module k's weights are sliced out of the stacked ones inside the
  recomputed function, so what the head and the modules keep for the
  backward grows with the sequences alone: nothing fixed beside it."""
  from meshtrain.planner.plan import abstract_mesh, layer_and_head_residuals
  from meshtrain.train.run import sharding_rules
  cfg = micro_config(**{"mesh.data": 1, "mesh.fsdp": 8, "model.mtp_layers": 2, "remat": remat})
  mesh = abstract_mesh(cfg.mesh, 8)
  heads = [layer_and_head_residuals(cfg, mesh, sharding_rules(cfg, mesh), rows, remat)[1]
           for rows in (8, 16)]
  assert heads[1] == 2 * heads[0]

def test_the_planner_gives_the_modules_work_to_the_last_pipeline_chunk():
  """`plan --search`'s step model: 4 layers as 2 + 2 on 2 stages of 4
  devices, with two modules: the last chunk does the first's layers, the
  head's matmuls and the modules' FLOPs (`flops.mtp_per_token`, the growth
  the compiled step confirms above) on 16 x 16 tokens over its 4 devices."""
  from meshtrain.models import flops
  from meshtrain.planner import clusters, search
  cfg = micro_config(**{"model.num_layers": 4, "model.mtp_layers": 2})
  cluster = clusters.PRESETS["h100"]
  model = search.StepModel(cfg, cluster)
  c = search.Candidate((("data", 4), ("pipeline", 2), ("fsdp", 1), ("sequence", 1),
                        ("tensor", 1)), microbatches=2)
  work = model.chunk_work(c, c.config(cfg))
  modules = flops.mtp_per_token(model.model_cfg, model.spec.abstract_params, cfg.seq_len)
  assert modules > 6 * 2 * cfg.model.vocab_size * cfg.model.embed_dim  # the heads and more
  head = 6 * cfg.model.embed_dim * cfg.model.vocab_size + modules
  seconds = 16 * 16 * head / 4 / (cluster.peak_flops * model.efficiency)
  assert work[0, 1] - seconds == pytest.approx(work[0, 0])
