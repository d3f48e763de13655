"""The training loop: data in, steps dispatched asynchronously, metrics and checkpoints out.

The loop syncs with the device only when it logs (every `log_every` steps) and
when a save copies the state to the host; between those, steps queue up while
the host prepares the next batches. A run starts where `resume.start_state`
says, so rerunning the same command after a stop continues the run.
"""

import json
import math
from pathlib import Path

import jax
from tqdm import tqdm

from meshtrain import distributed, rules as r
from meshtrain.train.state_memory import check_fits
from meshtrain.data import make_iterator
from meshtrain.data.placement import process_rows, to_global
from meshtrain.errors import TrainingHalted
from meshtrain.models.flops import flops_per_token
from meshtrain.train.evaluate import evaluator_for
from meshtrain.train.metrics import MetricsWriter, Throughput
from meshtrain.train.parallelize import from_stage_slots
from meshtrain.train.preemption import PreemptionRequest
from meshtrain.train.resume import start_state
from meshtrain.train.run import Run
from meshtrain.train.setup import Setup, build
from meshtrain.train.watchdog import watchdog_for


def model_params(setup: Setup):
  """The shapes of the model's own weights (without a pipeline's empty slots)."""
  return from_stage_slots(setup.run.layout, setup.spec.abstract_params)


def describe(setup: Setup) -> str:
  mesh = setup.mesh
  params = sum(math.prod(x.shape) for x in jax.tree.leaves(model_params(setup)))
  shape = " x ".join(f"{axis}={size}" for axis, size in mesh.shape.items() if size > 1)
  lines = [f"meshtrain: {params / 1e6:.2f}M parameters on {mesh.size} "
           f"{jax.devices()[0].platform} devices, mesh {shape or 'single device'}"]
  for axis, share in r.replicated_share(setup.spec.abstract_params, setup.spec.names, mesh,
                                        setup.rules.params).items():
    lines.append(f"  {share:.1%} of parameter bytes are not split over '{axis}'")
  model, tensor = setup.cfg.model, mesh.shape["tensor"]
  if model.num_kv_heads % tensor:
    lines.append(f"  kv heads kept whole: tensor={tensor} does not divide model.num_kv_heads="
                 f"{model.num_kv_heads} (each device keeps every kv head, its share of the "
                 "query heads)")
  lines += [f"  layout: {note}" for note in r.layout_changes(setup.spec.names, mesh,
                                                             setup.rules.params)]
  return "\n".join(lines)


def announce_resolved(given, run: Run) -> None:
  """Prints what resolving the run (`meshtrain.train.run.resolve`) changed of
  the config as given: the vocabulary padded, "auto" packing as segments."""
  if jax.process_index():
    return
  resolved = run.cfg
  if resolved.model.vocab_size != given.model.vocab_size:
    print(f"model.vocab_size {given.model.vocab_size} -> {resolved.model.vocab_size}, a multiple "
          f"of mesh.tensor = {run.mesh.shape['tensor']} (the rows past the data's ids are padding)",
          flush=True)
  if resolved.data.packing != given.data.packing and resolved.data.packing == "segments":
    print("data.packing auto -> segments: the corpus carries a loss mask, so each document "
          "(conversation) attends only to itself", flush=True)


def _announce(cfg, setup: Setup, workdir: Path, origin: str, start: int, rows: range) -> None:
  """The run's config into the workdir, and what runs where on the terminal."""
  if jax.process_count() > 1:
    print(f"process {jax.process_index()} of {jax.process_count()}: devices "
          f"{[d.id for d in jax.local_devices()]}, batch rows {rows}", flush=True)
  if jax.process_index() == 0:
    (workdir / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2))
    print(describe(setup), f"\n  {origin} at step {start}", flush=True)


def _halt(cfg, state, checkpoints, batches) -> None:
  """Saves the last good state (a non-finite step changed nothing) and stops
  the run with `config.nan_policy`'s message."""
  good = int(state.step)
  checkpoints.save(good, state, batches, cfg)
  raise TrainingHalted(
      "config.nan_policy", f"loss or gradients not finite at step {good + 1}; the last good "
      f"state (step {good}) is in {checkpoints.directory / str(good)}. Lower "
      "config.optimizer.learning_rate or set config.nan_policy=skip, then rerun to resume")


def _stop_preempted(cfg, state, checkpoints, batches, step: int, why: str, watchdog) -> None:
  with watchdog.phase(f"saving checkpoint {step}", step, watchdog.allowance(saves=True)):
    checkpoints.save(step, state, batches, cfg)
    checkpoints.wait()
  if jax.process_index() == 0:
    print(f"\n{why}: stopped after step {step}, checkpoint in "
          f"{checkpoints.directory / str(step)}; run the same command to resume", flush=True)


def train(cfg) -> list[dict]:
  """Runs up to step `cfg.steps` and returns the records logged by this call.

  Each step is dispatched without waiting; then whatever is due after it
  happens, in this order: a checkpoint (`checkpoints.due`), an evaluation
  (`evaluator.due`), a log record (every `log_every`, the first and last
  steps, and with an evaluation: the only host sync), a stop on a
  non-finite step (`nan_policy=stop`) or on a preemption signal.

  With several processes a watchdog (`meshtrain.train.watchdog`) ends the
  process in one line (exit 4) when a peer is lost or something hangs; it
  also waits for each step before the next one is dispatched, one behind."""
  watchdog = watchdog_for(cfg, distributed.client(), jax.process_index(), jax.process_count())
  watchdog.expect("setting up", 0, watchdog.allowance(compiles=True))
  try:
    return _train(cfg, watchdog)
  except jax.errors.JaxRuntimeError:  # a collective that failed as its peer went away?
    watchdog.await_verdict()  # a lost peer ends the process here in one line
    raise
  finally:
    watchdog.close()


def _train(cfg, watchdog) -> list[dict]:
  setup = build(cfg)
  announce_resolved(cfg, setup.run)
  cfg = setup.cfg
  check_fits(setup)
  evaluator = evaluator_for(setup)
  sharding = setup.train_step.batch_sharding
  batch_shape = (cfg.global_batch, cfg.seq_len)
  rows = process_rows(sharding, batch_shape)
  batches = make_iterator(cfg.data, seq_len=cfg.seq_len, global_batch=cfg.global_batch,
                          vocab_size=cfg.model.vocab_size, seed=cfg.seed, rows=rows)
  workdir = Path(cfg.workdir)
  state, checkpoints, origin = start_state(setup, batches)
  first = int(state.step) + 1
  if first > cfg.steps:  # this config's run, finished (start_state refuses another's)
    checkpoints.close()
    return []
  workdir.mkdir(parents=True, exist_ok=True)
  _announce(cfg, setup, workdir, origin, first - 1, rows)
  throughput = Throughput(first, cfg.global_batch * cfg.seq_len,
                          flops_per_token(setup.run.model, model_params(setup),
                                          cfg.seq_len), cfg.peak_flops * setup.mesh.size)
  writer = MetricsWriter(workdir, resumed_step=first - 1)
  records = []
  bar = tqdm(initial=first - 1, total=cfg.steps, desc="train", unit="step",
             disable=jax.process_index() != 0)
  watchdog.expect(f"step {first}", first, watchdog.allowance(compiles=True))
  try:
    with PreemptionRequest(distributed.client(), jax.process_index(), jax.process_count(),
                           lockstep=watchdog.deadlines) as preemption:
      for step in range(first, cfg.steps + 1):
        watchdog.inject_fault(step)
        state, metrics = setup.train_step(state, to_global(next(batches), sharding, batch_shape))
        watchdog.dispatched(step, metrics)
        bar.update(1)
        if checkpoints.due(step):
          with watchdog.phase(f"saving checkpoint {step}", step,  # waits for the step
                              watchdog.allowance(compiles=step == first)):
            checkpoints.save(step, state, batches, cfg)
          watchdog.inject_fault(step, "save")
        evaluating = evaluator is not None and evaluator.due(step)
        logging = not step % cfg.log_every or step in (first, cfg.steps) or evaluating
        preempted = preemption.agreed(step, logging)
        if not (logging or preempted):
          continue
        record = {"step": step, **{k: v.item() for k, v in jax.device_get(metrics).items()},
                  **throughput.record(step)}
        if evaluating:
          with watchdog.phase(f"evaluation at step {step}", step, watchdog.allowance(
              compiles=step == first, kind="evaluation", scale=cfg.eval.batches)):
            record.update(evaluator(state.params, state.model_state))
        writer.write(record)
        records.append(record)
        bar.set_postfix(loss=f"{record['loss']:.4f}",
                        tok_s=f"{record['tokens_per_sec'] or 0:,.0f}",
                        **({"eval_loss": f"{record['eval_loss']:.4f}"} if evaluating else {}))
        throughput.restart(step)
        if record["nonfinite_steps"] and cfg.nan_policy == "stop":
          _halt(cfg, state, checkpoints, batches)
        if preempted:
          _stop_preempted(cfg, state, checkpoints, batches, step, preempted, watchdog)
          return records
      with watchdog.phase(f"saving checkpoint {int(state.step)}", int(state.step),
                          watchdog.allowance(saves=True)):
        checkpoints.save(int(state.step), state, batches, cfg)
  finally:
    bar.close()
    try:
      writer.close()  # a full disk fails here too: the saves in flight still finish
    finally:
      with watchdog.phase("saving the last checkpoints", cfg.steps, watchdog.allowance(saves=True)):
        checkpoints.close()  # waits for the saves in flight
  return records
