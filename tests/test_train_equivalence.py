"""Sharded training equals unsharded plain-jit training (float32); the
tolerance is explained in tests/equivalence.py."""

import re

import jax
import numpy as np
import pytest

from conftest import USERS_CPU_COMPILE, micro_config, tiered
from equivalence import assert_matches_one_device
from reference import random_batches
from meshtrain.planner.plan import compile_step
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


# One case per strategy family in the quick tier.
QUICK = ("data=8 zero0", "data=8 zero3 accumulate 2", "fsdp=8", "data=2 fsdp=4 (hybrid) accumulate 2",
         "tensor=4 sequence parallel", "data=2 sequence=4 ring", "pipeline=4 data=2 1f1b",
         "data=8 remat=selective")


@pytest.mark.parametrize("case", tiered(CASES, QUICK))
def test_matches_unsharded_plain_jit(case):
  cfg = micro_config()
  cfg.update(CASES[case])  # nested dicts update sub-configs key by key
  batches = random_batches(STEPS, cfg.global_batch, cfg.seq_len, cfg.model.vocab_size)

  initial, _, params = assert_matches_one_device(cfg, batches)
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


@pytest.mark.parametrize("changes", [
    pytest.param(dict(mesh=dict(data=8)), id="dp", marks=pytest.mark.slow),
    pytest.param(dict(mesh=dict(data=8), zero_stage=1), id="zero1", marks=pytest.mark.slow),
    pytest.param(dict(mesh=dict(data=1, fsdp=8)), id="fsdp")])
def test_the_donated_state_is_updated_where_it_lies(changes):
  """Read from the compiled step: XLA copies no weight or optimizer moment
  before overwriting it (a select of new and old state once made it copy every
  moment, every step); scalar counters aside."""
  cfg = micro_config()
  cfg.update(changes)
  text = compile_step(build(cfg), USERS_CPU_COMPILE).as_text()
  entry = text[text.index("\nENTRY"):]
  copied = re.findall(r"= (\w+\[[\d,]*\])\S* copy\(%param", entry)
  assert all(shape.endswith("[]") for shape in copied), copied
