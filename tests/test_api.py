"""The public API on models that are not meshtrain's: the README example, the
flax example, a Linen module, and path patterns; each checked against plain
single-device jit training with the same optax optimizer."""

import re
import sys

import chex
import flax.linen as nn
from flax import nnx
import jax
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import meshtrain
from conftest import REPO, micro_config
from reference import random_batches, reference_run

sys.path.insert(0, str(REPO / "examples"))
import flax_model  # noqa: E402


def test_readme_api_example_runs_as_written(capsys):
  section = (REPO / "docs/own_model.md").read_text()  # moved from the README
  code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
  exec(compile(code, "docs/own_model.md", "exec"), {"__name__": "readme"})
  out = capsys.readouterr().out.splitlines()
  assert out[0] == "P('fsdp', 'tensor')"
  assert any(re.fullmatch(r"up/kernel +\(64, 256\)( +P\('fsdp', 'tensor'\)){3}", line)
             for line in out)
  assert float(out[-1]) < 0.1  # it learned


def test_flax_example_trains_like_plain_jit_on_fsdp_x_tensor(real_text):
  steps = 5
  losses, state = flax_model.main(str(real_text), steps)
  spec = meshtrain.nnx_spec(flax_model.new_model)
  batches = [next(b) for b in [flax_model.text_batches(str(real_text))] for _ in range(steps)]
  ref_losses, ref_params = reference_run(spec.graphdef, spec.init(), optax.adamw(3e-3), batches)
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
  # Adam's first step moves every weight by +-lr, whatever its gradient's size:
  # where a gradient is rounding noise, either run's rounding picks the sign.
  # The keys' bias is all noise (softmax ignores a shift shared by all keys:
  # its gradient is zero); elsewhere a weight whose first gradient is not zero
  # but below 1e-6 of its array's largest is left out, and such weights must be
  # rare. (An exact zero, a byte the first batch lacks, is the same in both.)
  first = jax.grad(lambda p: flax_model.loss_fn(nnx.merge(spec.graphdef, p), batches[0]))(
      spec.init())
  got = jax.tree_util.tree_flatten_with_path(jax.device_get(state.params))[0]
  noise = 0
  for (path, value), want, grad in zip(got, jax.tree.leaves(ref_params), jax.tree.leaves(first)):
    name = jax.tree_util.keystr(path, simple=True, separator="/")
    if name.endswith("key/bias"):
      continue
    signal = (np.abs(grad) > 1e-6 * np.abs(grad).max()) | (grad == 0)
    noise += (~signal).sum()
    # Adam divides by sqrt(v): where a gradient is small, rounding moves a weight
    # by a small fraction of lr (3e-3), hence atol 2e-5 rather than 1e-6.
    np.testing.assert_allclose(value[signal], want[signal], rtol=1e-4, atol=2e-5, err_msg=name)
  assert noise < 1e-3 * sum(x.size for x in jax.tree.leaves(ref_params)), noise


class LinenLM(nn.Module):
  """A Linen model annotated with logical names."""

  @nn.compact
  def __call__(self, tokens):
    init = nn.initializers.normal(0.02)
    x = nn.Embed(64, 32, embedding_init=nn.with_logical_partitioning(init, ("vocab", "embed")))(tokens)
    h = nn.Dense(128, kernel_init=nn.with_logical_partitioning(init, ("embed", "mlp")))(x)
    x = x + nn.Dense(32, kernel_init=nn.with_logical_partitioning(init, ("mlp", "embed")))(nn.gelu(h))
    return nn.Dense(64, kernel_init=nn.with_logical_partitioning(init, ("embed", "vocab")))(x)


def test_linen_module_trains_like_plain_jit_with_zero3():
  module = LinenLM()
  batches = random_batches(4, batch=16, length=8, vocab=64)
  spec = meshtrain.linen_spec(module, batches[0]["inputs"])
  assert spec.names["Dense_0"]["kernel"] == ("embed", "mlp")

  def loss_fn(params, batch):
    logits = module.apply({"params": params}, batch["inputs"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

  mesh = meshtrain.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
  trainer = meshtrain.Trainer(spec, loss_fn, optax.adamw(1e-2), mesh, zero_stage=3)
  state = trainer.init()
  # ZeRO-3 on data x fsdp for the embed dimension, Megatron column split for mlp.
  assert state.params["Dense_0"]["kernel"].sharding.spec == P(("data", "fsdp"), "tensor")
  losses = []
  for batch in batches:
    state, metrics = trainer.step(state, trainer.place(batch))
    losses.append(float(metrics["loss"]))
  ref_losses, ref_params = reference_run(
      None, spec.init(), optax.adamw(1e-2), batches,
      apply=lambda p, x: module.apply({"params": p}, x))
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
  for got, want in zip(jax.tree.leaves(jax.device_get(state.params)), jax.tree.leaves(ref_params)):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)


def test_a_config_trainer_is_the_run_meshtrain_train_builds_pipeline_included():
  """`Trainer.from_config`: meshtrain's Llama of a config with a strategy
  that the model-agnostic constructor does not wire (the 1F1B pipeline on
  pipeline=2 x data=2 x fsdp=2, 2 microbatches), the same Setup the CLI's
  build makes, trained like unsharded plain jit; its placement shows the
  layers split over the stages."""
  cfg = micro_config(**{"mesh.data": 2, "mesh.fsdp": 2, "mesh.pipeline": 2,
                        "pipeline.schedule": "1f1b", "pipeline.microbatches": 2})
  trainer = meshtrain.Trainer.from_config(cfg)
  assert trainer.setup.run.pipelined and trainer.step is trainer.setup.train_step
  state = trainer.init()
  initial = jax.device_get(state.params)
  batches = random_batches(3, batch=cfg.global_batch, length=cfg.seq_len,
                           vocab=cfg.model.vocab_size)
  losses = []
  for batch in batches:
    state, metrics = trainer.step(state, trainer.place(batch))
    losses.append(float(metrics["loss"]))
  ref_losses, ref_params = reference_run(trainer.spec.graphdef, initial, trainer.optimizer, batches)
  chex.assert_trees_all_close(np.array(losses), ref_losses, rtol=1e-5, atol=1e-6)
  chex.assert_trees_all_close(jax.device_get(state.params), ref_params, rtol=1e-5,
                              atol=1e-3 * cfg.optimizer.learning_rate)
  layers = [p for p in trainer.placement() if p.path.startswith("layers/")]
  assert layers and all(p.params.startswith("P('pipeline'") for p in layers)
  # its loss_fn(params, batch): the step's loss, here of the first weights
  np.testing.assert_allclose(jax.jit(trainer.loss_fn)(initial, batches[0]), ref_losses[0],
                             rtol=1e-5)


def test_path_patterns_take_the_first_match_and_check_the_rank():
  params = {"attn": {"query": {"kernel": np.zeros((8, 2, 4))}},
            "mlp": {"up": {"kernel": np.zeros((8, 16))}, "down": {"kernel": np.zeros((16, 8))}},
            "norm": {"scale": np.zeros(8)}}
  names = meshtrain.names_by_path(params, meshtrain.FLAX_TRANSFORMER)
  assert names["attn"]["query"]["kernel"] == ("embed", "heads", "head_dim")
  assert names["mlp"]["down"]["kernel"] == ("mlp", "embed")
  assert names["norm"]["scale"] == (None,)
  with pytest.raises(ValueError, match=r"query/kernel has shape \(8, 2, 4\).* names 2 dimensions"):
    meshtrain.names_by_path(params, [(r"query/kernel", ("embed", "heads")), (".*", None)])
  with pytest.raises(ValueError, match="end the list with the catch-all"):
    meshtrain.names_by_path(params, [(r"query", None)])


def test_readme_tables_every_logical_name_with_the_axes_that_split_it():
  readme = (REPO / "docs/own_model.md").read_text()  # moved from the README
  section = readme.split("## Logical names")[1].split("\n## ")[0]
  rows = [line.split("|")[1:-1] for line in section.splitlines() if line.startswith("| `")]
  header = [cell.strip(" `") for cell in section.split("| logical name")[1].splitlines()[0]
            .split("|")[1:-1]][2:]
  assert {row[0].strip(" `") for row in rows} == set(meshtrain.LOGICAL_NAMES)
  for row in rows:
    name = row[0].strip(" `")
    assert getattr(meshtrain, row[1].strip(" `")) == name
    for axis, cell in zip(header[-5:], row[-5:]):
      splits = name in meshtrain.AXIS_RULES[axis] or (axis, name) in (
          ("data", n) for n in meshtrain.ZERO_ON_DATA) or (axis, name) in (
          ("tensor", n) for n in meshtrain.TENSOR_SEQUENCE_PARALLEL)
      assert cell.strip().startswith("split") == splits, (name, axis)


def test_placement_shows_weights_gradients_and_optimizer_state_under_zero():
  module = LinenLM()
  spec = meshtrain.linen_spec(module, np.zeros((8, 8), np.int32))
  for stage, grads in ((1, P(None, None)), (2, P("data", None))):
    trainer = meshtrain.Trainer(spec, lambda p, b: 0.0, optax.adamw(1e-2),
                                meshtrain.make_mesh({"data": 8}), zero_stage=stage)
    up = {p.path: p for p in trainer.placement()}["Dense_0/kernel"]
    assert (up.params, up.grads, up.optimizer) == (str(P(None, None)), str(grads),
                                                   str(P("data", None)))
    assert 0 < trainer.replicated["data"] < 0.02  # only the unannotated biases stay whole
  table = trainer.placement_table().splitlines()
  assert table[0].split() == ["weight", "shape", "weights", "gradients", "optimizer", "state"]
