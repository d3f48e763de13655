"""config.offload.optimizer: float32 master weights and optimizer state live in
pinned host memory between steps; training is unchanged."""

import math
import re

import chex
import jax

from conftest import micro_config
from reference import random_batches
from equivalence import meshtrain_run
from meshtrain.analysis.plan import compile_step


def host_input_bytes(compiled) -> int:
  """Bytes of the compiled step's per-device inputs placed in host memory (S(5))."""
  layout = compiled.as_text().splitlines()[0]
  inputs = layout[layout.index("entry_computation_layout={(") :].split(")->")[0]
  shapes = re.findall(r"([a-z]+\d+)\[([\d,]*)\]\{[^}]*S\(5\)[^}]*\}", inputs)
  return sum(int(dtype[1:]) // 8 * math.prod(map(int, filter(None, dims.split(","))))
             for dtype, dims in shapes)


def test_offloaded_state_lies_on_the_host_and_trains_the_same():
  runs = {}
  for offload in (False, True):
    cfg = micro_config(**{"mesh.data": 1, "mesh.fsdp": 8, "offload.optimizer": offload})
    batches = random_batches(3, cfg.global_batch, cfg.seq_len, cfg.model.vocab_size)
    setup, _, losses, params = meshtrain_run(cfg, batches)
    runs[offload] = losses, params
    state = setup.init_state()
    kinds = {x.sharding.memory_kind for x in jax.tree.leaves((state.params, state.opt_state))}
    assert kinds == {"pinned_host" if offload else "device"}
    state_bytes = sum(x.addressable_shards[0].data.nbytes
                      for x in jax.tree.leaves((state.params, state.opt_state)))
    assert host_input_bytes(compile_step(setup)) == (state_bytes if offload else 0)
  chex.assert_trees_all_close(runs[True], runs[False], rtol=1e-6, atol=0)
