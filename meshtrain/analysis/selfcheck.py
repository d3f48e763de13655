"""verify: a sharded train step against the same step unsharded under plain `jax.jit`.

XLA's partitioners (GSPMD, Shardy) have bugs that no test of meshtrain's own
model can catch in another model (docs/partitioner_issues.md): the sharded
program computes a wrong gradient while plain jit with the same shardings
agrees with it. The only independent check is the unsharded program, so
`verify` runs the step both ways from the same weights and batch:

- sharded: meshtrain's gradient function and train step on the mesh;
- reference: one device, plain `jax.jit`, `jax.value_and_grad` of the same loss,
  the same optax optimizer.

It compares the loss of every step, the gradients of the first step and the
weights after the last, per parameter path, as relative differences:
max |sharded - reference| / max |reference| of each array. Differences from
the order of float32 sums stay near 1e-7; a partitioner bug shows as 1e-3 and
more. Run it first on a new model, a new mesh or a new jax version.
"""

import dataclasses

import jax
import numpy as np
import optax
from flax import nnx

from meshtrain import rules as r
from meshtrain.train.state import ModelSpec, TrainState, init_state
from meshtrain.train.step import TrainStep

TOLERANCE = 1e-5  # float32: reordered sums differ by ~1e-7, partitioner bugs by >= 1e-3
# A gradient whose largest element is below this share of the largest
# gradient is zero but for rounding (a bias that softmax ignores): its
# difference is measured against the largest gradient, and its weights are not
# compared (Adam turns the rounding noise into full-size steps).
ZERO_GRADIENT = 1e-5


@dataclasses.dataclass(frozen=True)
class PathDifference:
  path: str
  grads: float    # relative difference of the first step's gradient
  params: float   # relative difference of the weights after the last step
  zero_gradient: bool


@dataclasses.dataclass(frozen=True)
class Report:
  losses: list[tuple[float, float]]  # (sharded, reference) per step
  paths: list[PathDifference]

  @property
  def loss(self) -> float:
    return max(abs(a - b) / max(abs(b), 1e-30) for a, b in self.losses)

  @property
  def worst(self) -> tuple[str, str, float]:
    """(what, path, relative difference) of the largest difference."""
    candidates = [("loss", "", self.loss)]
    for row in self.paths:
      candidates.append(("gradient", row.path, row.grads))
      if not row.zero_gradient:
        candidates.append(("weights", row.path, row.params))
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
             f"  (relative {self.loss:.1e})"]
    ranked = sorted(self.paths, key=lambda p: max(p.grads, 0 if p.zero_gradient else p.params),
                    reverse=True)
    width = max(len(p.path) for p in ranked[:rows])
    lines.append(f"  {'path'.ljust(width)}  gradient  weights")
    for p in ranked[:rows]:
      weights = "zero grad" if p.zero_gradient else f"{p.params:.1e}"
      lines.append(f"  {p.path.ljust(width)}  {p.grads:8.1e}  {weights}")
    if len(ranked) > rows:
      lines.append(f"  ... {len(ranked) - rows} more, each within the last row's")
    return "\n".join(lines)

  def __str__(self) -> str:
    return self.format()


def _largest(x: np.ndarray) -> float:
  return float(np.max(np.abs(x))) if x.size else 0.0


def relative_difference(got: np.ndarray, want: np.ndarray, scale: float | None = None) -> float:
  """|got - want| / |want| in the 2-norm of the whole array (or / `scale`)."""
  want = np.asarray(want, np.float64)
  diff = float(np.linalg.norm(np.asarray(got, np.float64) - want))
  scale = float(np.linalg.norm(want)) if scale is None else scale
  return diff / scale if scale else diff


def sharded_run(step: TrainStep, names, shardings: TrainState, state: TrainState,
                batch: dict, steps: int):
  """The first gradient from the step's own gradient function, in the step's
  layouts, then `steps` train steps; `state` is consumed."""
  working = r.tree_shardings(names, step.mesh, step.rules.params)

  def first_gradient(params, batch):
    return step.grads_fn(jax.lax.with_sharding_constraint(params, working), batch)

  placed = jax.device_put(batch, step.batch_sharding)
  with jax.set_mesh(step.mesh), nnx.logical_axis_rules(step.rules.params):
    _, grads = jax.jit(first_gradient, in_shardings=(shardings.params, step.batch_sharding),
                       out_shardings=(None, shardings.params))(state.params, placed)
  grads = jax.device_get(grads)
  losses = []
  for _ in range(steps):
    state, metrics = step(state, placed)
    losses.append(float(metrics["loss"]))
  return losses, grads, jax.device_get(state.params)


def reference_run(loss_fn, optimizer: optax.GradientTransformation, params, batch: dict,
                  steps: int):
  """The same, unsharded: one device, plain jit, the same optax optimizer."""
  device = jax.devices()[0]
  params, batch = jax.device_put((params, batch), device)
  grad_fn = jax.jit(jax.value_and_grad(loss_fn))

  @jax.jit
  def train_step(params, opt_state):
    loss, grads = grad_fn(params, batch)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  grads = jax.device_get(grad_fn(params, batch)[1])
  opt_state = jax.jit(optimizer.init)(params)
  losses = []
  for _ in range(steps):
    params, opt_state, loss = train_step(params, opt_state)
    losses.append(float(loss))
  return losses, grads, jax.device_get(params)


def verify(spec: ModelSpec, optimizer: optax.GradientTransformation, step: TrainStep,
           shardings: TrainState, batch: dict, steps: int = 2) -> Report:
  """Fresh weights, `steps` steps on `batch` (a host batch, float32 weights)
  both ways; the report of their differences per parameter path."""
  state = init_state(spec, optimizer, shardings)
  initial = jax.device_get(state.params)
  losses, grads, params = sharded_run(step, spec.names, shardings, state, batch, steps)
  ref_losses, ref_grads, ref_params = reference_run(step.loss_fn, optimizer, initial, batch, steps)
  largest = max(_largest(g) for g in jax.tree.leaves(ref_grads))
  largest_norm = max(float(np.linalg.norm(g)) for g in jax.tree.leaves(ref_grads))
  paths = []
  for (path, g), g_ref, p, p_ref in zip(jax.tree_util.tree_flatten_with_path(grads)[0],
                                        jax.tree.leaves(ref_grads), jax.tree.leaves(params),
                                        jax.tree.leaves(ref_params)):
    zero = _largest(g_ref) <= ZERO_GRADIENT * largest
    paths.append(PathDifference(jax.tree_util.keystr(path, simple=True, separator="/"),
                                relative_difference(g, g_ref, largest_norm if zero else None),
                                relative_difference(p, p_ref), zero))
  return Report(list(zip(losses, ref_losses)), paths)
