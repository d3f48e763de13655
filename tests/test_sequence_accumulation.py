"""Context parallelism with gradient accumulation equals one device (float32).

Under ZeRO 0/1 with `data` > 1 the accumulation keeps per-replica gradient sums
(a vmap over `data`); the sequence strategies' shard_maps run inside it.
"""

import pytest

from conftest import micro_config, tiered
from equivalence import assert_matches_one_device
from reference import random_batches
from test_train_equivalence import STEPS

CASES = {
    f"data=2 sequence=4 zero{stage} accumulate 2 {strategy}": dict(
        mesh=dict(data=2, sequence=4), zero_stage=stage, grad_accum_steps=2,
        attention=dict(sequence_strategy=strategy))
    for strategy, stage in (("all_gather_kv", 0), ("ulysses", 1), ("ring", 0))
}


@pytest.mark.parametrize("case", tiered(CASES, ()))
def test_sequence_with_accumulation_matches_one_device(case):
  cfg = micro_config()
  cfg.update(CASES[case])
  batches = random_batches(STEPS, cfg.global_batch, cfg.seq_len, cfg.model.vocab_size)

  assert_matches_one_device(cfg, batches)
