"""Other people's Flax models under meshtrain: their own logical names, mesh-axis
annotations, annotations that do not fit, and the path patterns of public model
families, each on a small model written in that family's style. Correctness is
`Trainer.verify`: the sharded step against the same step unsharded under plain
`jax.jit` on one device."""

import dataclasses
import math
import re
import runpy
import subprocess
import sys
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import meshtrain
from conftest import MICRO, REPO, micro_config, tiered
from meshtrain.analysis import selfcheck
from meshtrain.errors import ConfigError
from reference import random_batches

V, D, HEADS, KV_HEADS, HEAD_DIM, F, LAYERS = 64, 32, 4, 2, 8, 64, 1
BATCH = random_batches(1, batch=8, length=8, vocab=V)[0]


def cross_entropy(logits, targets):
  return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def linen_loss(module):
  return lambda params, batch: cross_entropy(module.apply({"params": params}, batch["inputs"]),
                                             batch["targets"])


def nnx_loss(model, batch):
  return cross_entropy(model(batch["inputs"]), batch["targets"])


def causal_attention(q_BxTxNxH, k_BxSxNxH, v_BxSxNxH):
  return jax.nn.dot_product_attention(q_BxTxNxH, k_BxSxNxH, v_BxSxNxH, is_causal=True)


def mesh_of(**sizes):
  return meshtrain.make_mesh(sizes)


# ---- a Linen model annotated with its own names (problems 1 and 2) ----------

class OwnNamesLM(nn.Module):
  """Annotated with a vocabulary of its own: 'kv' for the fused heads x head_dim.
  `stacked`: q, k, v on a leading kernel axis (DenseGeneral), still with two
  names, as flax lets one write (it annotates the flat kernel it initializes)."""
  stacked: bool = False

  @nn.compact
  def __call__(self, tokens):
    init = nn.initializers.normal(0.02)
    part = nn.with_logical_partitioning
    b, t = tokens.shape
    x = nn.Embed(V, D, embedding_init=part(init, ("vocab", "embed")))(tokens)
    qkv_init = part(init, ("embed", "kv"))
    qkv = (nn.DenseGeneral((3, HEADS * HEAD_DIM), kernel_init=qkv_init, use_bias=False)(x)
           if self.stacked else nn.Dense(3 * HEADS * HEAD_DIM, kernel_init=qkv_init,
                                         use_bias=False)(x))
    q, k, v = (qkv.reshape(b, t, 3, HEADS, HEAD_DIM)[:, :, i] for i in range(3))
    out = causal_attention(q, k, v).reshape(b, t, HEADS * HEAD_DIM)
    x = x + nn.Dense(D, kernel_init=part(init, ("kv", "embed")), use_bias=False)(out)
    h = nn.gelu(nn.Dense(F, kernel_init=part(init, ("embed", "mlp")), use_bias=False)(x))
    x = x + nn.Dense(D, kernel_init=part(init, ("mlp", "embed")), use_bias=False)(h)
    return nn.Dense(V, kernel_init=part(init, ("embed", "vocab")), use_bias=False)(x)


def test_a_models_own_names_warn_until_mapped_then_train_like_plain_jit():
  module = OwnNamesLM()
  spec = meshtrain.linen_spec(module, BATCH["inputs"])
  mesh = mesh_of(fsdp=4, tensor=2)
  with pytest.warns(UserWarning, match=r"% of weight bytes are whole on every 'tensor' shard.*"
                    r"logical name 'kv' has no rule \(on Dense_0/kernel, Dense_1/kernel\)"):
    meshtrain.Trainer(spec, linen_loss(module), optax.adamw(1e-2), mesh)
  with pytest.raises(ConfigError, match=r"rules: .*logical name 'kv' has no rule"):
    meshtrain.Trainer(spec, linen_loss(module), optax.adamw(1e-2), mesh, strict=True)

  trainer = meshtrain.Trainer(spec, linen_loss(module), optax.adamw(1e-2), mesh,
                              rules={"kv": "heads"}, strict=True)
  placement = {p.path: p for p in trainer.placement()}
  assert placement["Dense_0/kernel"].params == str(P("fsdp", "tensor"))
  assert placement["Dense_1/kernel"].params == str(P("tensor", "fsdp"))
  assert trainer.replicated == {"fsdp": 0, "tensor": 0}
  report = trainer.verify(BATCH, steps=2)
  assert report.ok(), report.format()


def test_annotations_that_do_not_fit_fail_when_the_trainer_is_built():
  module = OwnNamesLM(stacked=True)  # a 3-D kernel (32, 3, 32) labelled with two names
  spec = meshtrain.linen_spec(module, BATCH["inputs"])
  with pytest.raises(ConfigError, match=r"DenseGeneral_0/kernel: shape \(32, 3, 32\) has 3 "
                     r"dimensions but its annotation names 2: \('embed', 'kv'\)"):
    meshtrain.Trainer(spec, linen_loss(module), optax.adamw(1e-2), mesh_of(fsdp=8))


# ---- NNX annotated with mesh axis names (problem 3) --------------------------

class MeshAxesMLP(nnx.Module):
  """Annotated the way a model with its own sharding config does: mesh axes."""

  def __init__(self, rngs: nnx.Rngs):
    init = nnx.initializers.lecun_normal()
    self.embed = nnx.Embed(V, D, embedding_init=nnx.with_partitioning(
        nnx.initializers.normal(0.02), P("tensor", "fsdp")), rngs=rngs)
    self.up = nnx.Linear(D, F, kernel_init=nnx.with_partitioning(init, P("fsdp", "tensor")),
                         rngs=rngs)
    self.down = nnx.Linear(F, D, kernel_init=nnx.with_partitioning(init, ("tensor", "fsdp")),
                           rngs=rngs)
    self.head = nnx.Linear(D, V, kernel_init=nnx.with_partitioning(init, P(("fsdp", "data"), None)),
                           use_bias=False, rngs=rngs)

  def __call__(self, tokens):
    x = self.embed(tokens)
    return self.head(x + self.down(nnx.relu(self.up(x))))


@pytest.mark.parametrize("inside_set_mesh", [False, True])
def test_mesh_axis_annotations_are_honoured(inside_set_mesh):
  mesh = mesh_of(data=2, fsdp=2, tensor=2)
  create = lambda: MeshAxesMLP(nnx.Rngs(0))  # noqa: E731
  if inside_set_mesh:
    with jax.set_mesh(mesh):
      trainer = meshtrain.Trainer.for_nnx(create, nnx_loss, optax.adamw(1e-2), mesh)
  else:
    trainer = meshtrain.Trainer.for_nnx(create, nnx_loss, optax.adamw(1e-2), mesh)
  state = trainer.init()
  assert state.params["up"]["kernel"].sharding.spec == P("fsdp", "tensor")
  assert state.params["down"]["kernel"].sharding.spec == P("tensor", "fsdp")
  # one dimension's axes in mesh order (docs/partitioner_issues.md)
  assert state.params["head"]["kernel"].sharding.spec == P(("data", "fsdp"), None)
  if not inside_set_mesh:
    report = trainer.verify(BATCH, steps=2)
    assert report.ok(), report.format()


# ---- patterns of public model families (problem 4) ---------------------------

class LinenAutoBlock(nn.Module):
  activation: Callable = nn.gelu

  @nn.compact
  def __call__(self, x):
    h = nn.LayerNorm()(x)
    x = x + nn.MultiHeadDotProductAttention(num_heads=HEADS)(
        h, h, mask=nn.make_causal_mask(jnp.ones(x.shape[:2])))
    return x + nn.Dense(D)(self.activation(nn.Dense(F)(nn.LayerNorm()(x))))


class LinenAutoLM(nn.Module):
  """Linen written as flax's examples do, every layer with its automatic name."""
  activation: Callable = nn.gelu

  @nn.compact
  def __call__(self, tokens):
    x = nn.Embed(V, D)(tokens)
    for _ in range(LAYERS):
      x = LinenAutoBlock(self.activation)(x)
    return nn.Dense(V)(nn.LayerNorm()(x))


class Einsum(nnx.Module):
  def __init__(self, equation: str, shape: tuple[int, ...], *, rngs: nnx.Rngs):
    self.equation = equation
    self.w = nnx.Param(nnx.initializers.normal(0.1)(rngs.params(), shape))

  def __call__(self, x):
    return jnp.einsum(self.equation, x, self.w.value)


class GemmaStyleBlock(nnx.Module):
  """Gemma's layout (flax examples/gemma): einsum attention, gated MLP of Linears."""

  def __init__(self, rngs: nnx.Rngs):
    self.pre_attention_norm = nnx.RMSNorm(D, rngs=rngs)
    self.q_einsum = Einsum("BTD,NDH->BTNH", (HEADS, D, HEAD_DIM), rngs=rngs)
    self.kv_einsum = Einsum("BSD,CKDH->CBSKH", (2, KV_HEADS, D, HEAD_DIM), rngs=rngs)
    self.attn_vec_einsum = Einsum("BTNH,NHD->BTD", (HEADS, HEAD_DIM, D), rngs=rngs)
    self.pre_ffw_norm = nnx.RMSNorm(D, rngs=rngs)
    self.gate_proj = nnx.Linear(D, F, use_bias=False, rngs=rngs)
    self.up_proj = nnx.Linear(D, F, use_bias=False, rngs=rngs)
    self.down_proj = nnx.Linear(F, D, use_bias=False, rngs=rngs)

  def __call__(self, x):
    h = self.pre_attention_norm(x)
    k, v = (jnp.repeat(t, HEADS // KV_HEADS, axis=2) for t in self.kv_einsum(h))
    x = x + self.attn_vec_einsum(causal_attention(self.q_einsum(h), k, v))
    h = self.pre_ffw_norm(x)
    return x + self.down_proj(nnx.gelu(self.gate_proj(h)) * self.up_proj(h))


class GemmaStyleLM(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.input_embedding = nnx.Param(nnx.initializers.normal(0.1)(rngs.params(), (V, D)))
    self.layers = nnx.List([GemmaStyleBlock(rngs) for _ in range(LAYERS)])
    self.final_norm = nnx.RMSNorm(D, rngs=rngs)

  def __call__(self, tokens):
    x = self.input_embedding.value[tokens]
    for layer in self.layers:
      x = layer(x)
    return self.final_norm(x) @ self.input_embedding.value.T


class HFStyleLayer(nn.Module):
  """transformers' Flax Llama: 2-D *_proj Dense layers, grouped-query attention."""

  def setup(self):
    self.q_proj = nn.Dense(HEADS * HEAD_DIM, use_bias=False)
    self.k_proj = nn.Dense(KV_HEADS * HEAD_DIM, use_bias=False)
    self.v_proj = nn.Dense(KV_HEADS * HEAD_DIM, use_bias=False)
    self.o_proj = nn.Dense(D, use_bias=False)
    self.gate_proj = nn.Dense(F, use_bias=False)
    self.up_proj = nn.Dense(F, use_bias=False)
    self.down_proj = nn.Dense(D, use_bias=False)
    self.input_layernorm = nn.RMSNorm()
    self.post_attention_layernorm = nn.RMSNorm()

  def __call__(self, x):
    b, t, _ = x.shape
    h = self.input_layernorm(x)
    q = self.q_proj(h).reshape(b, t, HEADS, HEAD_DIM)
    k, v = (jnp.repeat(p(h).reshape(b, t, KV_HEADS, HEAD_DIM), HEADS // KV_HEADS, axis=2)
            for p in (self.k_proj, self.v_proj))
    x = x + self.o_proj(causal_attention(q, k, v).reshape(b, t, -1))
    h = self.post_attention_layernorm(x)
    return x + self.down_proj(nn.silu(self.gate_proj(h)) * self.up_proj(h))


class HFStyleLM(nn.Module):
  def setup(self):
    self.embed_tokens = nn.Embed(V, D)
    self.layers = [HFStyleLayer() for _ in range(LAYERS)]
    self.norm = nn.RMSNorm()
    self.lm_head = nn.Dense(V, use_bias=False)

  def __call__(self, tokens):
    x = self.embed_tokens(tokens)
    for layer in self.layers:
      x = layer(x)
    return self.lm_head(self.norm(x))


def family_trainer(family: str, mesh, **options) -> meshtrain.Trainer:
  adamw = optax.adamw(1e-2)
  patterns = meshtrain.FLAX_TRANSFORMER
  if family == "gemma nnx":
    return meshtrain.Trainer.for_nnx(lambda: GemmaStyleLM(nnx.Rngs(0)), nnx_loss, adamw, mesh,
                                     patterns=patterns, **options)
  module = {"linen automatic names": LinenAutoLM(), "transformers flax": HFStyleLM()}[family]
  spec = meshtrain.linen_spec(module, BATCH["inputs"], patterns=patterns)
  return meshtrain.Trainer(spec, linen_loss(module), adamw, mesh, **options)


FAMILIES = ("linen automatic names", "gemma nnx", "transformers flax")


@pytest.mark.parametrize("family", tiered(FAMILIES, ("transformers flax",)))
def test_flax_transformer_patterns_cover_a_public_family(family):
  # strict: every name known, no more than 10% of the bytes whole on fsdp or tensor.
  trainer = family_trainer(family, mesh_of(fsdp=4, tensor=2), strict=True)
  for p in trainer.placement():
    if len(p.shape) >= 2 and not p.path.endswith("bias"):  # every matrix: fsdp and tensor
      assert "fsdp" in p.params and "tensor" in p.params, p
  assert max(trainer.replicated.values()) < 0.1
  report = trainer.verify(BATCH, steps=2)
  assert report.ok(), report.format()


def test_patterns_name_the_family_layouts():
  trainer = family_trainer("gemma nnx", mesh_of(fsdp=2, tensor=4), strict=True)
  placement = {p.path: p.params for p in trainer.placement()}
  # 2 kv heads do not split 4 ways: each device keeps them all (as meshtrain's Llama does).
  assert placement["layers/0/kv_einsum/w"] == str(P(None, None, "fsdp", None))
  assert placement["layers/0/q_einsum/w"] == str(P("tensor", "fsdp", None))
  assert placement["layers/0/attn_vec_einsum/w"] == str(P("tensor", None, "fsdp"))
  assert placement["input_embedding"] == str(P("tensor", "fsdp"))


# ---- verify (problem 6) ------------------------------------------------------

class PreActivations:
  """An activation that hands the MLP's pre-activations, as a program computes
  them, to the host: each device its own shard with each element's flat index
  (a callback gathered to one device stalls the other devices' collectives).
  Only the first call of a `watch`ed function is kept."""

  def __init__(self, activation: Callable):
    self.activation, self.program, self.shards = activation, None, {}

  def __call__(self, x):
    where = jnp.arange(x.size, dtype=x.dtype).reshape(x.shape) + 0 * x  # sharded as x is
    jax.debug.callback(self._keep, jnp.stack([x, where]), partitioned=True)
    return self.activation(x)

  def _keep(self, shard):
    if self.program is not None:
      self.shards[self.program].append(np.asarray(shard))

  def watch(self, function: Callable, program: str) -> Callable:
    def watched(*args, **kwargs):
      first = program not in self.shards
      self.program = program if first else None
      self.shards.setdefault(program, [])
      try:
        return function(*args, **kwargs)
      finally:
        jax.effects_barrier()
        self.program = None
    return watched

  def take(self, program: str, shape: tuple[int, ...]) -> np.ndarray:
    """The pre-activations of `program`'s first call, each element once: a
    forward recomputed for the backward must give the same values."""
    values = np.full(math.prod(shape), np.nan)
    for value, where in self.shards.pop(program):
      where = where.astype(np.int64).ravel()
      seen = ~np.isnan(values[where])
      assert (values[where][seen] == value.ravel()[seen]).all(), "two forwards disagree"
      values[where] = value.ravel()
    assert not np.isnan(values).any(), "some pre-activations never reached the host"
    return values.reshape(shape).astype(np.float32)


UP_BIAS = ("LinenAutoBlock_0", "Dense_1", "bias")  # the MLP's first Dense (F units)


@pytest.mark.parametrize("name", tiered(("relu", "gelu"), ("relu",)))
def test_verify_flags_the_relu_case_and_its_float64_rerun_explains_it(name, monkeypatch):
  """The issue's ReLU case (docs/partitioner_issues.md), built on purpose. The
  fsdp=8 program splits the sums over `embed` (the LayerNorm statistics, the
  query, key and value projections) into partial sums on each device and an
  all-reduce, so most MLP pre-activations after them differ from one device's
  by an ulp or more. The MLP bias of one unit is set to minus the midpoint of
  the two programs' float32 values for one token: that pre-activation then lies
  on opposite sides of zero in the two programs, on any machine. ReLU's
  derivative jumps there (0 or 1), so a whole unit's contribution for that
  token is in one gradient and not in the other: verify flags it, and its
  float64 rerun, whose sums agree, explains it. GELU, smooth there, agrees
  through the same flip."""
  pre = PreActivations(getattr(nn, name))
  module = LinenAutoLM(pre)
  spec = meshtrain.linen_spec(module, BATCH["inputs"], patterns=meshtrain.FLAX_TRANSFORMER)
  adamw, mesh, shape = optax.adamw(1e-2), mesh_of(fsdp=8), (*BATCH["inputs"].shape, F)
  params = jax.tree.map(np.array, jax.device_get(spec.init()))  # writable copies
  bias = params[UP_BIAS[0]][UP_BIAS[1]][UP_BIAS[2]]
  assert bias.shape == (F,) and not bias.any()  # each pre-activation a bare sum

  # The two programs verify compares, from the same weights; the sums furthest apart.
  probe = meshtrain.Trainer(spec, linen_loss(module), adamw, mesh)
  pre.watch(selfcheck.first_gradient, "sharded")(probe.step, spec.names, probe.shardings,
                                                  params, BATCH)
  pre.watch(selfcheck.reference_run, "one device")(probe.step.loss_fn, adamw, params, BATCH, 1)
  sums = {program: pre.take(program, shape) for program in ("sharded", "one device")}
  gap = np.abs(sums["sharded"].astype(np.float64) - sums["one device"])
  assert gap.max() > 0, "both programs summed every pre-activation alike"
  kink = np.unravel_index(gap.argmax(), shape)  # (sequence, position, unit)
  bias[kink[-1]] = -np.float32((float(sums["sharded"][kink]) + float(sums["one device"][kink])) / 2)

  # verify from these weights, its two programs watched (the first call of each).
  chosen = jax.tree.map(jnp.asarray, params)
  trainer = meshtrain.Trainer(dataclasses.replace(spec, init=lambda: chosen),
                              linen_loss(module), adamw, mesh)
  for function, program in (("first_gradient", "sharded"), ("reference_run", "one device")):
    monkeypatch.setattr(selfcheck, function, pre.watch(getattr(selfcheck, function), program))
  report = trainer.verify(BATCH, steps=1)
  flipped = {program: float(pre.take(program, shape)[kink])
             for program in ("sharded", "one device")}
  assert (flipped["sharded"] > 0) != (flipped["one device"] > 0), flipped  # the flip
  assert max(map(abs, flipped.values())) < 1e-5, flipped  # within rounding of zero

  if name == "gelu":
    assert report.ok() and report.float64 is None, report.format()
    return
  what, _, worst = report.worst
  assert what == "gradient" and worst > 1e-3, report.format()  # tolerance 1e-5
  first, reference = report.losses[0]
  assert abs(first - reference) <= 1e-6 * reference, report.format()  # relu(1e-7) is no loss
  assert report.float64.computed_in_float64, report.format()
  assert report.float64.difference <= 1e-5 and "float64 rerun agrees" in report.format()


def run_repro(name: str) -> str:
  result = subprocess.run([sys.executable, str(REPO / "docs" / "repro" / f"{name}.py")],
                          capture_output=True, text=True, timeout=600, check=True)
  return result.stdout


@pytest.mark.slow
def test_the_relu_reproduction_shows_a_flip_that_float64_removes():
  lines = run_repro("relu_kink").splitlines()
  worst = {line.split(":")[0]: float(re.search(r"worst (?:gradient difference )?([0-9.e+-]+)",
                                                 line).group(1)) for line in lines[1:]}
  flips = {line.split(":")[0]: int(line.rsplit(" ", 1)[1]) for line in lines[1:]}
  assert worst["gelu"] < 1e-5 and worst["relu, jax_enable_x64, float64 weights"] < 1e-12
  assert flips["relu, jax_enable_x64, float64 weights"] == 0
  # ReLU differs exactly where a pre-activation changed sides (on this CPU: one)
  assert (worst["relu"] > 1e-4) == (flips["relu"] > 0)
  assert worst["relu, jax_enable_x64, float32 weights"] == worst["relu"]


# A layout listing one dimension's mesh axes against mesh order, with `data`
# (the batch's axis) on another: jax 0.10.2 puts the gradient's shards on the
# wrong devices (docs/repro/reversed_axes.py).
AGAINST_MESH_ORDER = {"wk": (("tensor", "pipeline"), None, "data"),
                      "head": (("pipeline", "data"), None)}


class KeyProjectionLM(nn.Module):
  """Attention with its own layouts for the key projection and the head:
  `pinned` by sharding constraints in the model, else as annotations."""
  pinned: bool

  @nn.compact
  def __call__(self, tokens):
    init = nn.initializers.lecun_normal()
    x = nn.LayerNorm()(nn.Embed(V, D)(tokens))
    w = {name: self.param(name, init if self.pinned or name not in AGAINST_MESH_ORDER
                          else nn.with_partitioning(init, AGAINST_MESH_ORDER[name]), shape)
         for name, shape in (("wq", (D, HEADS, HEAD_DIM)), ("wk", (D, HEADS, HEAD_DIM)),
                             ("wv", (D, HEADS, HEAD_DIM)), ("head", (HEADS * HEAD_DIM, V)))}
    if self.pinned and not jax.sharding.get_abstract_mesh().empty:
      w.update({name: jax.lax.with_sharding_constraint(w[name], P(*spec))
                for name, spec in AGAINST_MESH_ORDER.items()})
    q, k, v = (jnp.einsum("btd,dhk->bthk", x, w[name]) for name in ("wq", "wk", "wv"))
    return causal_attention(q, k, v).reshape(*x.shape[:2], HEADS * HEAD_DIM) @ w["head"]


@pytest.mark.slow
def test_verify_flags_a_miscompiled_layout_that_meshtrain_never_builds():
  """Pinned inside the model, the layout is miscompiled where jax has the bug
  (docs/repro/reversed_axes.py tells): verify names the key projection's
  gradient and its float64 rerun differs too. Given as annotations, meshtrain
  lists each dimension's axes in mesh order, and the step is exact."""
  miscompiled = runpy.run_path(str(REPO / "docs" / "repro" / "reversed_axes.py"))[
      "relative_error"]() > 1e-3
  mesh = mesh_of(data=2, pipeline=2, tensor=2)
  batch = random_batches(1, batch=8, length=8, vocab=V)[0]
  for pinned in (True, False):
    module = KeyProjectionLM(pinned)
    trainer = meshtrain.Trainer(meshtrain.linen_spec(module, batch["inputs"]),
                                linen_loss(module), optax.adamw(1e-2), mesh)
    report = trainer.verify(batch, steps=2)
    if pinned and miscompiled:
      assert report.worst[:2] == ("gradient", "wk") and report.worst[2] > 0.1, report.format()
      first, reference = report.losses[0]
      assert abs(first - reference) <= 1e-5 * reference  # the first loss cannot show it
      assert "float64 rerun differs too" in report.format()
    else:
      assert report.ok(), report.format()
  weights = {p.path: p.params for p in trainer.placement()}
  assert weights["wk"] == str(P(("pipeline", "tensor"), None, "data"))


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["megatron_3d"])  # pipeline, tensor + SP, ZeRO-1, data
def test_meshtrain_verify_passes_llama_on_strategy_presets(preset, tmp_path):
  result = subprocess.run(
      [sys.executable, "-m", "meshtrain.cli", "verify", "--config",
       f"{REPO / 'configs' / preset}.py:tiny", "--config.simulate_devices=8",
       *(f"--config.{key}={value}" for key, value in MICRO.items())],
      capture_output=True, text=True, timeout=900, cwd=tmp_path)
  assert result.returncode == 0, result.stdout + result.stderr
  worst = float(re.search(r"OK \(worst ([0-9.e+-]+):", result.stdout).group(1))
  assert worst <= 1e-5


@pytest.mark.slow
def test_verify_checks_a_bfloat16_config_in_float32():
  """Weights, activations and gradients of a bfloat16 config are float32 in
  both runs: bfloat16 gradients alone differ from float32 by ~1e-3."""
  cfg = micro_config(**{"mesh.data": 1, "mesh.fsdp": 8,
                        **{f"{part}_dtype": "bfloat16" for part in ("param", "compute", "grad")}})
  report = selfcheck.verify_config(cfg)
  assert report.ok(), report.format()
