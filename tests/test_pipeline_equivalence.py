"""The pipeline composed with the other axes and options trains like one
device (float32), at test_train_equivalence's tolerance: the new schedules,
tied embeddings, ZeRO 1-3, gradient accumulation, remat and `sequence` with
all_gather_kv and ulysses (ring is refused: tests/test_pipeline.py). Cases
combine options to keep compiles few;
each option appears at least once. Also the forward-only pipelined loss."""

import jax
import numpy as np
import pytest
from flax import nnx

from conftest import micro_config, tiered
from equivalence import assert_matches_one_device
from reference import random_batches
from meshtrain.analysis import hlo
from meshtrain.parallel.pipeline import schedule as schedules
from meshtrain.train.loss import cross_entropy
from meshtrain.train.pipelined import pipelined_loss
from meshtrain.train.setup import build

STEPS = 3
CASES = {
    "pipeline=2 data=4 zb_h1 remat=selective": dict(
        mesh=dict(data=4, pipeline=2), remat="selective", pipeline=dict(schedule="zb_h1")),
    "pipeline=4 data=2 zb_h2": dict(mesh=dict(data=2, pipeline=4), model=dict(num_layers=4),
                                    pipeline=dict(schedule="zb_h2")),
    "pipeline=2 data=4 zero3 tied": dict(mesh=dict(data=4, pipeline=2), zero_stage=3,
                                         model=dict(tie_embeddings=True)),
    "pipeline=2 data=2 tensor=2 zero2 interleaved accumulate 2": dict(
        mesh=dict(data=2, pipeline=2, tensor=2), zero_stage=2, grad_accum_steps=2,
        model=dict(num_layers=4),
        pipeline=dict(schedule="interleaved_1f1b", virtual_stages=2, microbatches=2)),
    "pipeline=2 data=4 zero1 remat=full accumulate 2 tied": dict(
        mesh=dict(data=4, pipeline=2), zero_stage=1, remat="full", grad_accum_steps=2,
        model=dict(tie_embeddings=True), pipeline=dict(microbatches=2)),
    "pipeline=2 data=2 sequence=2 all_gather_kv zb_h1 remat=selective": dict(
        mesh=dict(data=2, pipeline=2, sequence=2), remat="selective",
        pipeline=dict(schedule="zb_h1")),
    "pipeline=2 sequence=2 tensor=2 ulysses interleaved zero3": dict(
        mesh=dict(data=1, pipeline=2, sequence=2, tensor=2), zero_stage=3,
        attention=dict(sequence_strategy="ulysses"), model=dict(num_layers=4),
        pipeline=dict(schedule="interleaved_1f1b", virtual_stages=2, microbatches=2)),
    # Uneven stages (Llama 3 405B's shape: a layer fewer on the first and last).
    "pipeline=4 data=2 uneven 1,2,2,1 zb_h2 remat=selective": dict(
        mesh=dict(data=2, pipeline=4), model=dict(num_layers=6), remat="selective",
        pipeline=dict(schedule="zb_h2", stage_layers="1,2,2,1")),
    "pipeline=2 fsdp=2 tensor=2 uneven interleaved zero3 accumulate 2 tied": dict(
        mesh=dict(data=1, fsdp=2, pipeline=2, tensor=2), zero_stage=3, grad_accum_steps=2,
        model=dict(num_layers=5, tie_embeddings=True),
        pipeline=dict(schedule="interleaved_1f1b", virtual_stages=2, microbatches=2,
                      stage_layers="1,2,1,1")),
}


@pytest.mark.parametrize("case", tiered(CASES, ("pipeline=2 data=2 sequence=2 all_gather_kv zb_h1 "
                                                 "remat=selective",)))
def test_pipeline_compositions_match_unsharded_plain_jit(case):
  cfg = micro_config()
  cfg.update(CASES[case])
  batches = random_batches(STEPS, cfg.global_batch, cfg.seq_len, cfg.model.vocab_size)
  assert_matches_one_device(cfg, batches)


def test_forward_only_pipelined_loss_matches_the_plain_model():
  cfg = micro_config()
  cfg.update(dict(mesh=dict(data=2, pipeline=4), model=dict(num_layers=4)))
  setup = build(cfg)
  params = setup.init_state().params
  (batch,) = random_batches(1, cfg.global_batch, cfg.seq_len, cfg.model.vocab_size, seed=3)
  loss_fn = pipelined_loss(setup.spec, cfg.pipeline, setup.mesh, setup.rules)
  with jax.set_mesh(setup.mesh), nnx.logical_axis_rules(setup.rules.params):
    lowered = jax.jit(loss_fn).lower(params, jax.device_put(batch, setup.train_step.batch_sharding))
    compiled = lowered.compile()
    loss = compiled(params, jax.device_put(batch, setup.train_step.batch_sharding))
  plain = cross_entropy(nnx.merge(setup.spec.graphdef, jax.device_get(params))(batch["inputs"]),
                        batch["targets"])
  np.testing.assert_allclose(loss, plain, rtol=1e-5)
  # Forward only: one permute per tick (activations right), no gradient goes left.
  ticks = schedules.forward_only(4, cfg.pipeline.microbatches).num_ticks
  permutes = [c for c in hlo.collectives(compiled, setup.mesh) if c.kind == "collective-permute"]
  assert [(c.axis, c.count) for c in permutes] == [("pipeline", ticks)], permutes
