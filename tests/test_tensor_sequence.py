"""Tensor, Megatron sequence and context parallelism: the collectives each one
compiles to. Equality with unsharded training is in test_train_equivalence.py,
and each sequence strategy's attention against plain attention in test_sequence.py."""

import collections

import pytest

from conftest import micro_config, step_collectives
from meshtrain.analysis import hlo
from meshtrain.planner.plan import analytic, compile_step
from meshtrain.train.setup import build


def compiled_ops(**changes):
  cfg, setup, compiled = compiled_step(**changes)
  return cfg, hlo.collective_ops(compiled, setup.mesh)


def compiled_step(**changes):
  cfg = micro_config()
  cfg.update(changes)  # nested dicts update sub-configs key by key
  setup = build(cfg)
  return cfg, setup, compile_step(setup)


def in_loop_bytes(ops):
  totals = collections.Counter()
  for op in ops:
    if op.in_loop:
      totals[(op.kind, op.axis)] += op.bytes
  return totals


def test_tensor_parallel_all_reduces_inside_the_layers_and_never_gathers_logits():
  cfg, ops = compiled_ops(mesh=dict(data=2, tensor=4))
  per_layer = in_loop_bytes(ops)
  assert per_layer[("all-reduce", "tensor")] > 0
  assert per_layer[("reduce-scatter", "tensor")] == 0
  logits_bytes = cfg.global_batch // 2 * cfg.seq_len * cfg.model.vocab_size * 4
  gathered = [op for op in ops if op.kind == "all-gather" and op.axis == "tensor"]
  assert all(op.operand_bytes * op.group_size < logits_bytes for op in gathered)


def test_sequence_parallel_turns_the_all_reduces_into_gathers_and_scatters():
  _, tp = compiled_ops(mesh=dict(data=2, tensor=4))
  _, sp = compiled_ops(mesh=dict(data=2, tensor=4), tensor_sequence_parallel=True)
  tp, sp = in_loop_bytes(tp), in_loop_bytes(sp)
  assert sp[("all-gather", "tensor")] > 0 and sp[("reduce-scatter", "tensor")] > 0
  assert sp[("all-reduce", "tensor")] < 0.2 * tp[("all-reduce", "tensor")]


@pytest.mark.parametrize("mesh, sequence_parallel, vocab", [
    (dict(data=2, tensor=4), False, 512), (dict(data=2, tensor=4), True, 512),
    (dict(data=1, fsdp=4, tensor=2), True, 64)])
def test_the_embedding_moves_its_rows_over_tensor_never_its_table(mesh, sequence_parallel, vocab):
  """A lookup in the vocabulary-split table sums the looked-up rows over
  `tensor` (reduce-scattered along the length under Megatron-SP, whose
  backward gathers the rows' gradient along it), and `plan` counts
  `tensor`'s gathers and scatters as compiled, to the byte. No collective
  carries the [vocab, embed] table or its gradient. When the lookup came out
  in the residual's split, XLA chose by size: for a table no larger than a
  device's rows (vocab 64) it all-gathered the table forward and all-reduced
  its whole gradient backward; for a larger one it gathered the tokens and
  moved rows by collective-permutes that `plan` does not have."""
  cfg, setup, compiled = compiled_step(mesh=mesh, model=dict(vocab_size=vocab, num_kv_heads=4),
                                       tensor_sequence_parallel=sequence_parallel)
  table = f"[{cfg.model.vocab_size},{cfg.model.embed_dim}]"
  module = hlo._parse_module(compiled.as_text())
  moved = [i.shape for i in module.instructions()
           if i.opcode.startswith(("all-gather", "all-reduce", "reduce-scatter"))]
  assert not [shape for shape in moved if table in shape], moved
  measured = step_collectives(compiled, setup.mesh)
  planned = {(c["kind"], c["axis"]): c["bytes"]
             for c in analytic(cfg, setup.spec, setup.rules, setup.mesh)["collectives"]}
  kinds = ("all-gather", "reduce-scatter") if sequence_parallel else ("all-gather",)
  for kind in kinds:
    assert measured[kind, "tensor"]["bytes"] == planned.get((kind, "tensor"), 0), kind


@pytest.mark.parametrize("strategy, kind", [("ulysses", "all-to-all"),
                                            ("ring", "collective-permute"),
                                            ("all_gather_kv", "all-gather")])
def test_each_sequence_strategy_compiles_to_its_collective(strategy, kind):
  _, ops = compiled_ops(mesh=dict(data=2, sequence=4),
                        attention=dict(sequence_strategy=strategy))
  kinds = {op.kind for op in ops if op.in_loop and op.axis == "sequence"}
  assert kind in kinds
  assert kinds <= {kind, "all-reduce", "reduce-scatter"}  # + gradient sums over tokens
