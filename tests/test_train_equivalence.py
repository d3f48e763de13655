"""Sharded training equals unsharded plain-jit training (float32).

Tolerance: losses and parameters after 5 AdamW steps agree to rtol 1e-5;
what differs is only the order of float32 reductions. Absolute: losses 1e-6,
parameters 1e-3 x the peak learning rate (3e-6 here, against moves of up to
8e-3): Adam divides each gradient by its running RMS, so where an element's
gradients nearly cancel, a reordered float32 sum changes its update by more
than float32's epsilon (seen: 1.3e-6 once in 16,384 weights of the 8-layer
interleaved pipeline on one x86 CPU), while a wrong gradient changes updates by
the order of the learning rate.
"""

import re

import chex
import jax
import numpy as np
import pytest

from conftest import micro_config
from reference import random_batches, reference_run
from meshtrain.analysis.plan import compile_step
from meshtrain.train.setup import build

STEPS = 5

CASES = {
    **{f"data=8 zero{stage}{accumulate}": dict(mesh=dict(data=8), zero_stage=stage,
                                             grad_accum_steps=2 if accumulate else 1)
       for stage in (0, 1, 2, 3) for accumulate in ("", " accumulate 2")},
    "fsdp=8": dict(mesh=dict(data=1, fsdp=8)),
    "fsdp=8 accumulate 2": dict(mesh=dict(data=1, fsdp=8), grad_accum_steps=2),
    "data=2 fsdp=4 (hybrid)": dict(mesh=dict(data=2, fsdp=4)),
    "data=2 fsdp=4 (hybrid) accumulate 2": dict(mesh=dict(data=2, fsdp=4), grad_accum_steps=2),
    "data=2 fsdp=2 tensor=2 accumulate 2": dict(mesh=dict(data=2, fsdp=2, tensor=2),
                                                grad_accum_steps=2),
    **{f"data=2 sequence=4 {strategy}": dict(mesh=dict(data=2, sequence=4),
                                            attention=dict(sequence_strategy=strategy))
       for strategy in ("all_gather_kv", "ulysses", "ring")},
    "tensor=8 (kv heads whole)": dict(mesh=dict(data=1, tensor=8),
                                      model=dict(num_heads=8, head_dim=4)),
    "tensor=4 sequence parallel": dict(mesh=dict(data=2, tensor=4), tensor_sequence_parallel=True),
    "tensor=2 sequence=2 fsdp=2": dict(mesh=dict(data=1, tensor=2, sequence=2, fsdp=2)),
    **{f"pipeline=4 data=2 {schedule}": dict(
        mesh=dict(data=2, pipeline=4), model=dict(num_layers=8 if virtual > 1 else 4),
        pipeline=dict(schedule=schedule, microbatches=4, virtual_stages=virtual))
       for schedule, virtual in (("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2))},
    "pipeline=2 tensor=2 fsdp=2 1f1b": dict(mesh=dict(data=1, pipeline=2, tensor=2, fsdp=2),
                                           pipeline=dict(microbatches=2)),
    "data=8 remat=full tied": dict(mesh=dict(data=8), remat="full",
                                   model=dict(tie_embeddings=True)),
    "data=8 remat=selective": dict(mesh=dict(data=8), remat="selective"),
}


def meshtrain_run(cfg, batches):
  setup = build(cfg)
  state = setup.init_state()
  initial = jax.device_get(state.params)
  losses = []
  for batch in batches:
    global_batch = {k: jax.device_put(v, setup.train_step.batch_sharding) for k, v in batch.items()}
    state, metrics = setup.train_step(state, global_batch)
    losses.append(float(metrics["loss"]))
  return setup, initial, np.array(losses), jax.device_get(state.params)


@pytest.mark.parametrize("case", CASES)
def test_matches_unsharded_plain_jit(case):
  cfg = micro_config()
  cfg.update(CASES[case])  # nested dicts update sub-configs key by key
  batches = random_batches(STEPS, cfg.global_batch, cfg.seq_len, cfg.model.vocab_size)

  setup, initial, losses, params = meshtrain_run(cfg, batches)
  ref_losses, ref_params = reference_run(setup.spec.graphdef, initial, setup.optimizer, batches)

  chex.assert_trees_all_close(losses, ref_losses, rtol=1e-5, atol=1e-6)
  chex.assert_trees_all_close(params, ref_params, rtol=1e-5,
                              atol=1e-3 * cfg.optimizer.learning_rate)
  moved = jax.tree.map(lambda a, b: float(np.max(np.abs(a - b))), params, initial)
  assert min(jax.tree.leaves(moved)) > 0  # every weight was updated


def test_parameters_are_created_in_shards():
  cfg = micro_config()
  cfg.mesh.update(data=1, fsdp=8)
  state = build(cfg).init_state()
  wq = state.params["layers"]["attn"]["wq_DxNxH"]
  expected = jax.sharding.NamedSharding(wq.sharding.mesh, jax.sharding.PartitionSpec(None, "fsdp"))
  assert wq.sharding.is_equivalent_to(expected, wq.ndim)
  assert {s.data.shape for s in wq.addressable_shards} == {(2, 32 // 8, 4, 8)}
  mu = state.opt_state[1][0].mu["layers"]["attn"]["wq_DxNxH"]
  assert mu.sharding.is_equivalent_to(wq.sharding, wq.ndim)


@pytest.mark.parametrize("changes", [dict(mesh=dict(data=8)),
                                     dict(mesh=dict(data=8), zero_stage=1),
                                     dict(mesh=dict(data=1, fsdp=8))], ids=["dp", "zero1", "fsdp"])
def test_the_donated_state_is_updated_where_it_lies(changes):
  """Read from the compiled step: XLA copies no weight or optimizer moment
  before overwriting it (a select of new and old state once made it copy every
  moment, every step); scalar counters aside."""
  cfg = micro_config()
  cfg.update(changes)
  text = compile_step(build(cfg)).as_text()
  entry = text[text.index("\nENTRY"):]
  copied = re.findall(r"= (\w+\[[\d,]*\])\S* copy\(%param", entry)
  assert all(shape.endswith("[]") for shape in copied), copied
