"""The residuals `plan` derives from the model (shapes and the rules alone)
against the compiled program: the forward of `jax.vjp` compiled on the mesh,
whose outputs are the residuals in the layouts XLA's partitioner chose."""

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import meshtrain
from conftest import micro_config
from test_mla import MLA
from meshtrain.planner import residuals
from meshtrain.train.loss import cross_entropy
from meshtrain.train.setup import build

STRATEGIES = {
    "tp": dict(mesh=dict(data=2, tensor=4)),
    "tp+sp": dict(mesh=dict(data=2, tensor=4), tensor_sequence_parallel=True),
    "sequence": dict(mesh=dict(data=2, sequence=4)),
    "fsdp": dict(mesh=dict(data=1, fsdp=8)),
}


def compiled_residual_bytes(loss_fn, abstract_params, param_shardings, batch, context) -> int:
  """Per-device bytes of the residuals in the compiled forward."""
  params = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                        abstract_params, param_shardings)
  with context():
    compiled = jax.jit(residuals.residual_outputs(loss_fn)).lower(params, batch).compile()
  return compiled.memory_analysis().output_size_in_bytes


@pytest.mark.parametrize("attention", [
    "grouped-query", pytest.param("latent", marks=pytest.mark.slow)])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_llama_residual_bytes_match_the_compiled_program(strategy, attention):
  for remat in ("none", "selective", "full"):
    cfg = micro_config(**{"model.num_kv_heads": 4, "remat": remat,
                          **(MLA if attention == "latent" else {})})
    cfg.update(STRATEGIES[strategy])
    setup = build(cfg)

    def loss_fn(params, batch):
      logits = nnx.merge(setup.spec.graphdef, params)(batch["inputs"])
      return cross_entropy(logits, batch["targets"])

    batch = {k: jax.ShapeDtypeStruct((cfg.global_batch, cfg.seq_len), jnp.int32,
                                     sharding=setup.train_step.batch_sharding)
             for k in ("inputs", "targets")}
    planned = residuals.saved_residuals(loss_fn, setup.spec.abstract_params, setup.spec.names,
                                        batch, setup.mesh.abstract_mesh, setup.rules)
    measured = compiled_residual_bytes(
        loss_fn, setup.spec.abstract_params,
        meshtrain.tree_shardings(setup.spec.names, setup.mesh, setup.rules.params), batch,
        setup.train_step._context)
    predicted = sum(r.device_bytes for r in planned)
    assert predicted == pytest.approx(measured, rel=0.05), remat


def test_remat_policies_save_less_and_full_saves_only_layer_inputs():
  """Independent of any compile: `full` keeps each layer's input, one
  [batch, length, embed] per layer, plus what embedding and head keep."""
  sizes = {}
  for remat in ("none", "selective", "full"):
    cfg = micro_config(remat=remat)
    setup = build(cfg)

    def loss_fn(params, batch):
      return cross_entropy(nnx.merge(setup.spec.graphdef, params)(batch["inputs"]),
                           batch["targets"])

    batch = {k: jax.ShapeDtypeStruct((cfg.global_batch, cfg.seq_len), jnp.int32)
             for k in ("inputs", "targets")}
    sizes[remat] = residuals.saved_residuals(loss_fn, setup.spec.abstract_params,
                                             setup.spec.names, batch, setup.mesh.abstract_mesh,
                                             setup.rules)
  m = cfg.model
  layer_inputs = [r for r in sizes["full"] if r.shape == (m.num_layers, cfg.global_batch,
                                                           cfg.seq_len, m.embed_dim)]
  assert len(layer_inputs) == 1
  total = {k: sum(r.bytes for r in v) for k, v in sizes.items()}
  assert total["none"] > total["selective"] > total["full"]


class Mixer(nnx.Module):
  """Not a Llama: a LayerNorm, a GELU MLP over features and a token-mixing matmul."""

  def __init__(self, vocab: int, dim: int, length: int, hidden: int, *, rngs: nnx.Rngs):
    self.embed = nnx.Embed(vocab, dim, rngs=rngs)
    self.norm = nnx.LayerNorm(dim, rngs=rngs)
    self.up = nnx.Linear(dim, hidden, rngs=rngs)
    self.down = nnx.Linear(hidden, dim, rngs=rngs)
    self.mix = nnx.Param(jnp.eye(length))
    self.head = nnx.Linear(dim, vocab, use_bias=False, rngs=rngs)

  def __call__(self, tokens):
    x = self.embed(tokens)
    x = x + self.down(nnx.gelu(self.up(self.norm(x))))
    x = x + jnp.einsum("ts,bsd->btd", self.mix[...], x)
    return self.head(x)


def test_a_foreign_nnx_model_through_trainer_matches_the_compiled_program():
  def loss_fn(model, batch):
    return optax.softmax_cross_entropy_with_integer_labels(
        model(batch["inputs"]), batch["targets"]).mean()

  mesh = meshtrain.make_mesh({"data": 4, "tensor": 2})
  trainer = meshtrain.Trainer.for_nnx(lambda: Mixer(64, 32, 16, 128, rngs=nnx.Rngs(0)), loss_fn,
                                      optax.adamw(1e-3), mesh, patterns=meshtrain.FLAX_TRANSFORMER)
  batch = {k: jax.ShapeDtypeStruct((8, 16), jnp.int32, sharding=trainer.step.batch_sharding)
           for k in ("inputs", "targets")}
  report = trainer.plan(batch)
  measured = compiled_residual_bytes(trainer.loss_fn, trainer.spec.abstract_params,
                                     trainer.param_shardings(), batch, trainer.step._context)
  assert report["memory_bytes"]["activations"] == pytest.approx(measured, rel=0.05)
