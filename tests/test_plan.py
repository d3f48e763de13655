"""The analytic model of `meshtrain plan` against what a real step moves.

The measurement is one profiled step (`meshtrain.analysis.trace`): the ops that
ran, so a pipeline's conditional ticks count only the branches taken. ZeRO and
FSDP are checked in test_zero.py from the static counts, which are exact there.
"""

import collections

import jax
import pytest

from conftest import micro_config
from meshtrain.analysis import hlo, trace
from meshtrain.analysis.plan import abstract_mesh, activation_bytes, analytic
from meshtrain.data import make_iterator
from meshtrain.train.loop import to_global
from meshtrain.train.setup import build

STRATEGIES = {
    "tp": dict(mesh=dict(data=2, tensor=4)),
    "tp+sp": dict(mesh=dict(data=2, tensor=4), tensor_sequence_parallel=True),
    "tp+sp full remat": dict(mesh=dict(data=2, tensor=4), tensor_sequence_parallel=True,
                             remat="full"),
    **{f"cp {s}": dict(mesh=dict(data=2, sequence=4), attention=dict(sequence_strategy=s))
       for s in ("all_gather_kv", "ulysses", "ring")},
    "1f1b": dict(mesh=dict(data=4, pipeline=2), pipeline=dict(microbatches=2)),
    "gpipe": dict(mesh=dict(data=4, pipeline=2), pipeline=dict(schedule="gpipe", microbatches=4)),
    "3d": dict(mesh=dict(data=2, pipeline=2, tensor=2), tensor_sequence_parallel=True,
               pipeline=dict(microbatches=2)),
}


def by_axis(collectives) -> collections.Counter:
  """Bytes over each of the axes activations move on. Weight gradients are
  summed over the batch axes (checked in test_zero.py); under `sequence` the
  CPU compile sums them over `sequence`, then `data`: left out."""
  totals = collections.Counter()
  for c in collectives:
    if c["axis"] in ("tensor", "sequence", "pipeline") and (
        (c["kind"], c["axis"]) != ("all-reduce", "sequence")):
      totals[c["axis"]] += c["bytes"]
  return totals


def executed_collectives(setup) -> list[dict]:
  cfg = setup.cfg
  state = setup.init_state()
  batch = to_global(next(make_iterator(cfg.data, seq_len=cfg.seq_len, global_batch=cfg.global_batch,
                                       vocab_size=cfg.model.vocab_size, seed=0)),
                    setup.train_step.batch_sharding)
  compiled = setup.train_step.lower(state, batch).compile()
  state, metrics = setup.train_step(state, batch)
  jax.block_until_ready(metrics)
  executed = trace.executions(lambda: setup.train_step(state, batch), compiled, setup.mesh.size)
  return [vars(c) for c in hlo.collectives(compiled, setup.mesh, executed)]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_activation_traffic_matches_the_analytic_model(strategy):
  cfg = micro_config(**{"model.num_kv_heads": 4})  # kv heads split like the query heads
  cfg.update(STRATEGIES[strategy])  # nested dicts update sub-configs key by key
  setup = build(cfg)
  measured = by_axis(executed_collectives(setup))
  predicted = by_axis(analytic(cfg, setup.spec, setup.rules, setup.mesh)["collectives"])
  assert set(measured) == set(predicted) != set()
  for axis in measured:
    assert measured[axis] == pytest.approx(predicted[axis], rel=0.10), axis


def test_flash_attention_stores_no_scores():
  """Korthikanti et al.'s 5·a·s²·b bytes per layer (2-byte activations) are
  the attention scores, softmax and dropout mask; cuDNN's flash attention
  keeps none of them."""
  xla, cudnn = (micro_config(**{"attention.implementation": impl}) for impl in ("xla", "cudnn"))
  one_device = abstract_mesh(xla.mesh, 1)
  m = xla.model
  assert (activation_bytes(xla, one_device) - activation_bytes(cudnn, one_device) ==
          m.num_layers * 5 * m.num_heads * xla.seq_len**2 * xla.global_batch)
