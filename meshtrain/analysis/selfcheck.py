"""verify: a sharded train step against the same step unsharded under plain `jax.jit`.

XLA's partitioners (GSPMD, Shardy) have bugs that no test of meshtrain's own
model can catch in another model (docs/partitioner_issues.md): the sharded
program computes a wrong gradient while plain jit with the same shardings
agrees with it. The only independent check is the unsharded program, so
`verify` runs the step both ways from the same weights and batch:

- sharded: meshtrain's gradient function and train step on the mesh;
- reference: one device, plain `jax.jit`, `jax.value_and_grad` of the same loss,
  the same optax optimizer.

It compares the loss of every step and the first step's gradients, per
parameter path, as relative differences in the 2-norm (|sharded - reference| /
|reference| over the whole array): reordered float32 sums leave about 1e-7, a
partitioner bug 1e-3 and more. The first gradients come from the step's own
gradient function compiled alone; the train step, a program of its own (the
gradient fused with the optimizer's layout and update), is judged by its loss
and gradient norm at every step. The weights after the last step are reported
beside them but not judged: Adam's normalized update turns the rounding of a
near-zero gradient element into a move of up to the learning rate (seen:
5.7e-5 on a kv projection whose gradient agreed to 7e-7), while the next
step's loss shows whether the weights still compute the same model.

A gradient beyond tolerance is measured once more from float64 weights, both
ways. Rounding that crossed a discontinuity vanishes there: a ReLU
pre-activation within an ulp of zero lands on the other side in a reordered
float32 sum, and its unit's whole contribution changes (the ReLU case of
docs/partitioner_issues.md, 1e-2 on a small model). A program that computes
something else differs in float64 as much as in float32.
Run it first on a new model, a new mesh or a new jax version.
"""

import dataclasses

import jax
import numpy as np
import optax
from flax import nnx

from meshtrain import rules as r
from meshtrain.data import make_iterator
from meshtrain.errors import ConfigError
from meshtrain.train.setup import build
from meshtrain.train.state import ModelSpec, TrainState, in_memory, init_state
from meshtrain.train.step import TrainStep

TOLERANCE = 1e-5  # float32: reordered sums differ by ~1e-7, partitioner bugs by >= 1e-3
# Gradients are measured against at least this share of the largest gradient's
# norm: one that is zero but for rounding (a key bias, which softmax ignores)
# would otherwise read as all error. A bug of 1e-3 in a gradient 100x smaller
# than the largest still reads 1e-5.
GRADIENT_FLOOR = 1e-2


@dataclasses.dataclass(frozen=True)
class PathDifference:
  path: str
  grads: float    # relative difference of the first step's gradient
  params: float   # relative difference of the weights after the last step (not judged)


@dataclasses.dataclass(frozen=True)
class Float64Rerun:
  """The first gradients again, sharded and unsharded, from float64 weights."""
  path: str                  # the worst gradient's path
  difference: float          # its relative difference
  computed_in_float64: bool  # False: the float64 loss equals the float32 one, bit for bit

  def format(self, tolerance: float) -> str:
    if not self.computed_in_float64:
      return ("float64 rerun: the model computes in float32 from float64 weights too (a "
              "module fixes its dtype), so it cannot tell rounding from a miscompile")
    if self.difference <= tolerance:
      return (f"float64 rerun agrees (worst {self.difference:.1e}): float32 rounding, "
              "amplified where the model jumps or is ill-conditioned (a ReLU pre-activation "
              "within an ulp of zero, a LayerNorm of a constant row); both programs are right "
              "to float32, not a partitioner bug (docs/partitioner_issues.md)")
    return (f"float64 rerun differs too (worst {self.difference:.1e}: gradient of {self.path}): "
            "the sharded program computes something else, a partitioner bug "
            "(docs/partitioner_issues.md)")


@dataclasses.dataclass(frozen=True)
class Report:
  losses: list[tuple[float, float]]      # (sharded, reference) per step
  grad_norms: list[tuple[float, float]]  # the train step's gradient norm, (sharded, reference)
  paths: list[PathDifference]
  float64: Float64Rerun | None = None  # run only when a gradient is beyond tolerance

  @property
  def loss(self) -> float:
    return _largest_relative(self.losses)

  @property
  def grad_norm(self) -> float:
    return _largest_relative(self.grad_norms)

  @property
  def worst(self) -> tuple[str, str, float]:
    """(what, path, relative difference) of the largest difference in the loss,
    the train step's gradient norm or a gradient."""
    candidates = [("loss", "", self.loss), ("gradient norm", "", self.grad_norm)]
    candidates += [("gradient", p.path, p.grads) for p in self.paths]
    return max(candidates, key=lambda c: c[2])

  def ok(self, tolerance: float = TOLERANCE) -> bool:
    return self.worst[2] <= tolerance

  def format(self, tolerance: float = TOLERANCE, rows: int = 8) -> str:
    what, path, value = self.worst
    verdict = "OK" if value <= tolerance else "MISMATCH"
    lines = [f"verify: {len(self.losses)} steps, sharded vs plain jax.jit on one device: "
             f"{verdict} (worst {value:.1e}: {what}{' of ' + path if path else ''}; "
             f"tolerance {tolerance:.0e})",
             "  loss   " + ", ".join(f"{a:.6f} vs {b:.6f}" for a, b in self.losses) +
             f"  (relative {self.loss:.1e})",
             "  grad norm " + ", ".join(f"{a:.6f} vs {b:.6f}" for a, b in self.grad_norms) +
             f"  (relative {self.grad_norm:.1e})"]
    ranked = sorted(self.paths, key=lambda p: p.grads, reverse=True)
    width = max(len(p.path) for p in ranked[:rows])
    lines.append(f"  {'path'.ljust(width)}  gradient  weights after step {len(self.losses)}")
    for p in ranked[:rows]:
      lines.append(f"  {p.path.ljust(width)}  {p.grads:8.1e}  {p.params:.1e}")
    if len(ranked) > rows:
      lines.append(f"  ... {len(ranked) - rows} more, gradients within the last row's")
    if self.float64 is not None:
      lines.append("  " + self.float64.format(tolerance))
    return "\n".join(lines)

  def __str__(self) -> str:
    return self.format()


def _largest_relative(pairs: list[tuple[float, float]]) -> float:
  return max(abs(a - b) / max(abs(b), 1e-30) for a, b in pairs)


def relative_difference(got: np.ndarray, want: np.ndarray, scale: float | None = None) -> float:
  """|got - want| / |want| in the 2-norm of the whole array (or / `scale`)."""
  want = np.asarray(want, np.float64)
  diff = float(np.linalg.norm(np.asarray(got, np.float64) - want))
  scale = float(np.linalg.norm(want)) if scale is None else scale
  return diff / scale if scale else diff


def gradient_differences(grads, ref_grads) -> dict[str, float]:
  """Path -> relative difference of each gradient, against at least
  GRADIENT_FLOOR of the largest reference gradient's norm."""
  floor = GRADIENT_FLOOR * max(float(np.linalg.norm(g)) for g in jax.tree.leaves(ref_grads))
  return {jax.tree_util.keystr(path, simple=True, separator="/"):
          relative_difference(g, g_ref, max(float(np.linalg.norm(g_ref)), floor))
          for (path, g), g_ref in zip(jax.tree_util.tree_flatten_with_path(grads)[0],
                                      jax.tree.leaves(ref_grads))}


def first_gradient(step: TrainStep, names, shardings: TrainState, params, batch: dict,
                   model_state=None):
  """The step's own gradient function compiled alone, in the step's layouts."""
  working = r.tree_shardings(names, step.mesh, step.rules.params)

  def gradient(params, batch):
    return step.grads_fn(jax.lax.with_sharding_constraint(params, working), batch,
                         model_state)[2]

  on_device = in_memory(shardings, "device").params  # offloaded weights too (the steps offload)
  with jax.set_mesh(step.mesh), nnx.logical_axis_rules(step.rules.params):
    grads = jax.jit(gradient, in_shardings=(on_device, step.batch_sharding),
                    out_shardings=on_device)(jax.device_put(params, on_device),
                                             jax.device_put(batch, step.batch_sharding))
  return jax.device_get(grads)


def sharded_run(step: TrainStep, names, shardings: TrainState, state: TrainState,
                batch: dict, steps: int):
  """The first gradient (`first_gradient`), then `steps` train steps (their
  losses and gradient norms); `state` is consumed."""
  grads = first_gradient(step, names, shardings, state.params, batch, state.model_state)
  placed = jax.device_put(batch, step.batch_sharding)
  losses, grad_norms = [], []
  for _ in range(steps):
    state, metrics = step(state, placed)
    losses.append(float(metrics["loss"]))
    grad_norms.append(float(metrics["grad_norm"]))
  return losses, grad_norms, grads, jax.device_get(state.params)


def reference_run(loss_fn, optimizer: optax.GradientTransformation, params, batch: dict,
                  steps: int, model_state=None, update_model_state=None):
  """The same, unsharded: one device, plain jit, the same optax optimizer (and
  the model state moved as the step moves it)."""
  device = jax.devices()[0]
  params, batch, model_state = jax.device_put((params, batch, model_state), device)

  @jax.jit
  def train_step(params, opt_state, model_state):
    (loss, stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch, model_state)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    if update_model_state is not None:
      model_state = update_model_state(model_state, stats)
    return (optax.apply_updates(params, updates), opt_state, model_state, loss, grads,
            optax.tree.norm(grads))

  opt_state = optimizer.init(params)
  losses, grad_norms, first_grads = [], [], None
  for _ in range(steps):
    params, opt_state, model_state, loss, grads, grad_norm = train_step(params, opt_state,
                                                                        model_state)
    losses.append(float(loss))
    grad_norms.append(float(grad_norm))
    first_grads = grads if first_grads is None else first_grads
  return losses, grad_norms, jax.device_get(first_grads), jax.device_get(params)


def float64_rerun(step: TrainStep, names, shardings: TrainState,
                  optimizer: optax.GradientTransformation, initial, batch: dict,
                  float32_loss: float, model_state=None) -> Float64Rerun:
  """`first_gradient` and the reference gradient from `initial` in float64."""
  with jax.enable_x64(True):
    params = jax.tree.map(lambda x: np.asarray(x, np.float64), initial)
    grads = first_gradient(step, names, shardings, params, batch, model_state)
    losses, _, ref_grads, _ = reference_run(step.loss_fn, optimizer, params, batch, steps=1,
                                            model_state=model_state)
  differences = gradient_differences(grads, ref_grads)
  worst = max(differences, key=differences.get)
  return Float64Rerun(worst, differences[worst], computed_in_float64=losses[0] != float32_loss)


def verify(spec: ModelSpec, optimizer: optax.GradientTransformation, step: TrainStep,
           shardings: TrainState, batch: dict, steps: int = 2) -> Report:
  """Fresh weights, `steps` steps on `batch` (a host batch, float32 weights)
  both ways; the report of their differences per parameter path, with a
  float64 rerun when a gradient differs beyond tolerance."""
  state = init_state(spec, optimizer, shardings)
  initial, model_state = jax.device_get((state.params, state.model_state))
  losses, norms, grads, params = sharded_run(step, spec.names, shardings, state, batch, steps)
  ref_losses, ref_norms, ref_grads, ref_params = reference_run(
      step.loss_fn, optimizer, initial, batch, steps, model_state, spec.update_model_state)
  differences = gradient_differences(grads, ref_grads)
  paths = [PathDifference(path, difference, relative_difference(p, p_ref))
           for (path, difference), p, p_ref in zip(differences.items(), jax.tree.leaves(params),
                                                   jax.tree.leaves(ref_params))]
  rerun = (float64_rerun(step, spec.names, shardings, optimizer, initial, batch, ref_losses[0],
                         model_state)
           if max(differences.values()) > TOLERANCE else None)
  return Report(list(zip(losses, ref_losses)), list(zip(norms, ref_norms)), paths, rerun)


def verify_config(cfg, steps: int = 2) -> Report:
  """`meshtrain verify`: the config's model, mesh and strategy on the first
  batch of its data, in float32 (a bfloat16 config is checked as float32, its
  gradients too), with no warmup so that the first step moves the weights."""
  if cfg.local_sgd.inner_steps:
    raise ConfigError("config.local_sgd.inner_steps", "verify compares the step with one "
                      "optimizer on one device, but local SGD trains each `data` replica alone "
                      "until the sync; verify the same mesh with --config.local_sgd.inner_steps=0 "
                      "(tests/test_local_sgd.py checks the sync against DiLoCo written out)")
  if cfg.model.moe.num_experts and cfg.mesh.pipeline > 1 and cfg.pipeline.stage_layers.strip():
    raise ConfigError("config.pipeline.stage_layers", "verify runs the plain model on the "
                      "state's layer slots, and an MoE router routes tokens through the empty "
                      "ones; verify this mesh with even stages (tests/test_moe.py checks uneven "
                      "stages against the model without its empty slots)")
  cfg = cfg.copy_and_resolve_references()
  cfg.param_dtype = cfg.compute_dtype = cfg.grad_dtype = "float32"
  cfg.optimizer.warmup_steps = 0
  setup = build(cfg)
  batch = next(make_iterator(cfg.data, seq_len=cfg.seq_len, global_batch=cfg.global_batch,
                             vocab_size=cfg.model.vocab_size, seed=cfg.seed))
  return verify(setup.spec, setup.optimizer, setup.train_step, setup.shardings, batch, steps)
