"""Context parallelism with gradient accumulation equals one device (float32).

Under ZeRO 0/1 with `data` > 1 the accumulation keeps per-replica gradient sums
(a vmap over `data`); the sequence strategies' shard_maps run inside it.
"""

import chex
import pytest

from conftest import micro_config
from reference import random_batches, reference_run
from test_train_equivalence import STEPS, meshtrain_run

CASES = {
    f"data=2 sequence=4 zero{stage} accumulate 2 {strategy}": dict(
        mesh=dict(data=2, sequence=4), zero_stage=stage, grad_accum_steps=2,
        attention=dict(sequence_strategy=strategy))
    for strategy, stage in (("all_gather_kv", 0), ("ulysses", 1), ("ring", 0))
}


@pytest.mark.parametrize("case", CASES)
def test_sequence_with_accumulation_matches_one_device(case):
  cfg = micro_config()
  cfg.update(CASES[case])
  batches = random_batches(STEPS, cfg.global_batch, cfg.seq_len, cfg.model.vocab_size)

  setup, initial, losses, params = meshtrain_run(cfg, batches)
  ref_losses, ref_params = reference_run(setup.spec.graphdef, initial, setup.optimizer, batches)

  chex.assert_trees_all_close(losses, ref_losses, rtol=1e-5, atol=1e-6)
  chex.assert_trees_all_close(params, ref_params, rtol=1e-5,
                              atol=1e-3 * cfg.optimizer.learning_rate)
