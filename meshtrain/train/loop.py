"""The training loop: data in, steps dispatched asynchronously, metrics and checkpoints out.

The loop syncs with the device only when it logs (every `log_every` steps) and
when a save copies the state to the host; between those, steps queue up while
the host prepares the next batches. A run starts where `resume.start_state`
says, so rerunning the same command after a stop continues the run.
"""

import json
import math
import time
from pathlib import Path

import jax
from tqdm import tqdm

from meshtrain import rules as r
from meshtrain.models.flops import flops_per_token
from meshtrain.data import make_iterator
from meshtrain.data.placement import process_rows, to_global
from meshtrain.errors import TrainingHalted
from meshtrain.train.evaluate import evaluator_for
from meshtrain.mesh import make_mesh
from meshtrain.train.metrics import MetricsWriter
from meshtrain.train.preemption import PreemptionRequest
from meshtrain.train.resume import start_state
from meshtrain.train.setup import Setup, build
from meshtrain.train.parallelize import model_config


def describe(setup: Setup) -> str:
  mesh = setup.mesh
  params = sum(math.prod(x.shape) for x in jax.tree.leaves(setup.spec.abstract_params))
  shape = " x ".join(f"{axis}={size}" for axis, size in mesh.shape.items() if size > 1)
  lines = [f"meshtrain: {params / 1e6:.2f}M parameters on {mesh.size} "
           f"{jax.devices()[0].platform} devices, mesh {shape or 'single device'}"]
  for axis, share in r.replicated_share(setup.spec.abstract_params, setup.spec.names, mesh,
                                        setup.rules.params).items():
    lines.append(f"  {share:.1%} of parameter bytes are not split over '{axis}'")
  return "\n".join(lines)


def padded_vocab(cfg):
  """The config with `model.vocab_size` rounded up to a multiple of the mesh's
  `tensor` size where the data is a prepared corpus: the rows past the
  tokenizer's ids are padding (never a target), and `vocab` splits evenly."""
  tensor = make_mesh(cfg.mesh, jax.devices()).shape["tensor"]
  if cfg.data.source != "tokens" or not cfg.model.vocab_size % tensor:
    return cfg
  cfg = cfg.copy_and_resolve_references()
  padded = -(-cfg.model.vocab_size // tensor) * tensor
  if jax.process_index() == 0:
    print(f"model.vocab_size {cfg.model.vocab_size} -> {padded}, a multiple of mesh.tensor = "
          f"{tensor}", flush=True)
  cfg.model.vocab_size = padded
  return cfg


def train(cfg) -> list[dict]:
  """Runs up to step `cfg.steps` and returns the records logged by this call."""
  cfg = padded_vocab(cfg)
  setup = build(cfg)
  evaluator = evaluator_for(cfg, setup)
  sharding = setup.train_step.batch_sharding
  batch_shape = (cfg.global_batch, cfg.seq_len)
  batches = make_iterator(cfg.data, seq_len=cfg.seq_len, global_batch=cfg.global_batch,
                          vocab_size=cfg.model.vocab_size, seed=cfg.seed,
                          rows=process_rows(sharding, batch_shape))
  workdir = Path(cfg.workdir)
  state, checkpoints, origin = start_state(cfg, setup, batches)
  first = int(state.step) + 1
  workdir.mkdir(parents=True, exist_ok=True)
  if jax.process_count() > 1:
    print(f"process {jax.process_index()} of {jax.process_count()}: devices "
          f"{[d.id for d in jax.local_devices()]}, batch rows {process_rows(sharding, batch_shape)}",
          flush=True)
  if jax.process_index() == 0:
    (workdir / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2))
    print(describe(setup), f"\n  {origin} at step {first - 1}", flush=True)
  tokens_per_step = cfg.global_batch * cfg.seq_len
  model_flops = flops_per_token(model_config(cfg), setup.spec.abstract_params, cfg.seq_len)
  peak = cfg.peak_flops * setup.mesh.size

  writer = MetricsWriter(workdir, resumed_step=first - 1)
  records = []
  bar = tqdm(initial=first - 1, total=cfg.steps, desc="train", unit="step",
             disable=jax.process_index() != 0)
  last_step, last_time = first - 1, time.perf_counter()
  try:
    with PreemptionRequest() as preemption:
      for step in range(first, cfg.steps + 1):
        state, metrics = setup.train_step(state, to_global(next(batches), sharding, batch_shape))
        bar.update(1)
        if checkpoints.due(step):
          checkpoints.save(step, state, batches, cfg)
        evaluating = evaluator is not None and evaluator.due(step)
        logging = not step % cfg.log_every or step in (first, cfg.steps) or evaluating
        preempted = preemption.agreed() if logging or jax.process_count() == 1 else None
        if not (logging or preempted):
          continue
        metrics = jax.device_get(metrics)  # the only host sync
        now = time.perf_counter()
        step_time = (now - last_time) / (step - last_step)
        tokens_per_sec = tokens_per_step / step_time
        record = {"step": step, **{k: v.item() for k, v in metrics.items()},
                  "tokens_per_sec": tokens_per_sec, "step_time_s": step_time,
                  "mfu": tokens_per_sec * model_flops / peak if peak else None}
        if step == first:  # the first step includes compilation: report it apart
          record["compile_time_s"] = record.pop("step_time_s")
          record["tokens_per_sec"] = record["mfu"] = None
        if evaluating:
          record.update(evaluator(state.params))
        writer.write(record)
        records.append(record)
        bar.set_postfix(loss=f"{record['loss']:.4f}",
                        tok_s=f"{record['tokens_per_sec'] or 0:,.0f}",
                        **({"eval_loss": f"{record['eval_loss']:.4f}"} if evaluating else {}))
        last_step, last_time = step, time.perf_counter()  # not counting the evaluation
        if record["nonfinite_steps"] and cfg.nan_policy == "stop":
          good = int(state.step)
          checkpoints.save(good, state, batches, cfg)
          raise TrainingHalted(
              "config.nan_policy", f"loss or gradients not finite at step {good + 1}; the last "
              f"good state (step {good}) is in {checkpoints.directory / str(good)}. Lower "
              "config.optimizer.learning_rate or set config.nan_policy=skip, then rerun to resume")
        if preempted:
          checkpoints.save(step, state, batches, cfg)
          checkpoints.wait()
          if jax.process_index() == 0:
            print(f"\n{preempted}: stopped after step {step}, checkpoint in "
                  f"{checkpoints.directory / str(step)}; run the same command to resume", flush=True)
          return records
      checkpoints.save(int(state.step), state, batches, cfg)
  finally:
    bar.close()
    writer.close()
    checkpoints.close()  # waits for the saves in flight
  return records
