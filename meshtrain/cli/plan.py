"""`meshtrain plan`: a config's memory per device and collectives, with a
verdict; `--compile` reads them from the compiled step, `--target` from the
program XLA's GPU compiler builds for a cluster, `--search` ranks layouts."""

import dataclasses
import json
import shlex

import jax
from absl import flags, logging

from meshtrain import gpu_targets, validate
from meshtrain.cli import common, flag_parsing
from meshtrain.errors import ConfigError
from meshtrain.planner import clusters, on_target, search, verdict
from meshtrain.planner.plan import format_plan, plan, usable_memory
from meshtrain.train.state_memory import device_memory

FLAGS = flags.FlagValues()
CONFIG = flag_parsing.define_config(FLAGS)
_JSON = flags.DEFINE_bool("json", False, "print JSON instead of tables", flag_values=FLAGS)
_COMPILE = flags.DEFINE_bool("compile", False, "also compile the step and read its memory "
                             "and collectives (on --devices simulated CPU devices if set)",
                             flag_values=FLAGS)
_DEVICES = flags.DEFINE_integer("devices", None, "devices to plan for (default: the "
                                "config's simulate_devices, else the devices present)",
                                flag_values=FLAGS)
_TARGET = flags.DEFINE_string("target", None, "compile the step here for a GPU cluster "
                              "and read its program (--search: compile its first candidates "
                              "and drop those that do not fit), KIND:HOSTSxDEVICES (e.g. "
                              "h100:1x8, h200:8x8; "
                              f"KIND: {', '.join(gpu_targets.KINDS)} or a GpuTargetConfigProto "
                              ".txtpb file)", flag_values=FLAGS)
_SEARCH = flags.DEFINE_bool("search", False, "search meshes, ZeRO stage, recomputation and "
                            "microbatches for --devices of --cluster, fastest first",
                            flag_values=FLAGS)
_CLUSTER = flags.DEFINE_string("cluster", "h100", "the devices to judge the plan against "
                               "(default: the accelerators present, else h100); --search: to "
                               "search for; a preset "
                               f"({', '.join(clusters.PRESETS)}) or a JSON file with the "
                               "same fields", flag_values=FLAGS)
_TOP = flags.DEFINE_integer("top", 5, "--search: how many configurations to print",
                            flag_values=FLAGS)
_GLOBAL_BATCH = flags.DEFINE_integer("global_batch", None, "--search: sequences per step "
                                     "(default: the config's)", flag_values=FLAGS)
_SEQ_LEN = flags.DEFINE_integer("seq_len", None, "--search: tokens per sequence "
                                "(default: the config's)", flag_values=FLAGS)
_MESH = flags.DEFINE_string("mesh", None, "--search: explain one layout, e.g. "
                            "data=64,pipeline=16,tensor=8: its prediction, rank and what the "
                            "first choice does differently", flag_values=FLAGS)


def main(argv: list[str]) -> None:
  del argv
  logging.set_verbosity(logging.WARNING)
  cfg = common.checked_config(CONFIG)
  if _DEVICES.value is not None and _DEVICES.value < 1:
    raise ConfigError("--devices", f"is {_DEVICES.value}; give the number of devices to plan for")
  if _SEARCH.value:
    _search(cfg)
    return
  if _TARGET.value is not None:
    _plan_target(cfg)
    return
  searching = [f"--{flag.name}" for flag in (_MESH, _TOP, _GLOBAL_BATCH, _SEQ_LEN)
               if flag.present]
  if searching:
    raise ConfigError(searching[0], "is read by plan --search only; add --search, or plan the "
                      "config's own layout with --config.mesh.* and --config.global_batch")
  if _COMPILE.value and _DEVICES.value:
    common.check_as_config("--devices", "simulate_devices", _DEVICES.value,
                           "; or plan more devices without --compile, which only does arithmetic")
    validate.check_devices(cfg, _DEVICES.value)  # before simulating that many devices
    cfg.simulate_devices = _DEVICES.value
  common.use_simulated_devices(cfg)
  devices = _DEVICES.value or cfg.simulate_devices or jax.device_count()
  validate.check_devices(cfg, devices, jax.devices()[0].platform if _COMPILE.value else None)
  report = plan(cfg, devices, _COMPILE.value)
  report["verdict"] = _verdict(cfg, report)
  print(json.dumps(report, indent=2) if _JSON.value else
        f"{format_plan(report)}\n\n{report['verdict']['text']}")


def _verdict(cfg, report: dict) -> dict:
  """`verdict.verdict` against --cluster when given, else the devices present
  where they are accelerators, else an H100 (--cluster's default)."""
  local = jax.devices()[0]
  memory = None if _CLUSTER.present else device_memory(local)
  if memory and local.platform != "cpu":
    capacity, device = memory, f"one {local.device_kind}"
  else:
    cluster = clusters.load(_CLUSTER.value)
    capacity = cluster.hbm_bytes * cluster.usable_memory
    device = f"one {cluster.name} ({cluster.hbm_bytes / 1e9:.0f} GB; --cluster names another)"
  return verdict.verdict(report["analytic"]["memory_bytes"], report["devices"], capacity, device,
                         _planned_config_args(cfg), _CLUSTER.value, cfg.remat)


def _plan_target(cfg) -> None:
  """plan --target: the step compiled for a GPU cluster on this machine."""
  if _COMPILE.value:
    raise ConfigError("--compile", "plan --target compiles for the target's GPUs itself; remove "
                      "--compile (which compiles for simulated CPU devices)")
  target = _checked_target("judges against")
  validate.check_devices(cfg, target.num_devices, "gpu")
  report = plan(cfg, target.num_devices, compile_step=False, target=target)
  measured = report["measured"]
  report["verdict"] = verdict.verdict(
      measured["memory_bytes"], target.num_devices, measured["usable_memory_bytes"],
      f"one {target.device_kind} (by the compiled program)", _planned_config_args(cfg),
      target.name if target.name in clusters.PRESETS else "h100", cfg.remat)
  print(json.dumps(report, indent=2) if _JSON.value else
        f"{format_plan(report)}\n\n{report['verdict']['text']}")


def _planned_config_args(cfg) -> str:
  """The `train` flags of the config a search plans: the --config file, the
  --config.* overrides given (the search's own come after them) and the
  batch and length it planned for."""
  overrides = {**CONFIG.overrides(), "global_batch": cfg.global_batch, "seq_len": cfg.seq_len}
  return " ".join([f"--config={CONFIG.filename()}",
                   *(f"--config.{key}={shlex.quote(str(value))}"
                     for key, value in overrides.items())])


def _search(cfg) -> None:
  target = None if _TARGET.value is None else _checked_target("searches for")
  devices = target.num_devices if target else _DEVICES.value
  if not devices or devices < 1:
    raise ConfigError("--devices", "plan --search needs the number of devices to plan for, "
                      "e.g. --devices 1024 (or a --target cluster to compile for)")
  if _COMPILE.present:
    raise ConfigError("--compile", "is read by plan without --search (it compiles the "
                      "config's own layout on simulated CPU devices); remove it, or compile "
                      "the search's candidates for GPUs with --target")
  chosen = [name for name in FLAGS if name.startswith("config.") and
            FLAGS[name].present and search.chooses(name.removeprefix("config."))]
  if chosen:
    raise ConfigError(chosen[0], "plan --search chooses it itself (with the mesh, ZeRO, "
                      "recomputation, accumulation, the pipeline and the expert and sequence "
                      "layouts), so this would do nothing; remove it, or plan this one layout "
                      "without --search (--search --mesh=data=8,... ranks one mesh among the "
                      "search's)")
  if _TOP.value < 1:
    raise ConfigError("--top", f"is {_TOP.value}; give a positive number")
  for flag in (_GLOBAL_BATCH, _SEQ_LEN):  # they replace the config keys of their names
    common.check_as_config(f"--{flag.name}", flag.name, flag.value)
  with cfg.unlocked():
    cfg.global_batch = _GLOBAL_BATCH.value or cfg.global_batch
    cfg.seq_len = _SEQ_LEN.value or cfg.seq_len
  cluster = on_target.cluster_of(target) if target else clusters.load(_CLUSTER.value)
  config_arg = _planned_config_args(cfg)
  if _MESH.value is not None:
    if target:
      raise ConfigError("--mesh", "explains one layout by the search's arithmetic; remove "
                        "--target, or compile that layout with plan --target --config.mesh.*")
    explained = search.explain(cfg, devices, cluster, search.parse_mesh(_MESH.value, devices))
    if _JSON.value:
      print(json.dumps({key: value.as_dict(config_arg) if isinstance(value, search.Estimate)
                        else value for key, value in explained.items()}, indent=2))
    else:
      print(explained["text"])
    return
  if target:
    _search_compiled(cfg, target, cluster, config_arg)
    return
  results, fitting, _ = search.search(cfg, devices, cluster, _TOP.value)
  if _JSON.value:
    print(json.dumps({"cluster": dataclasses.asdict(cluster), "devices": devices,
                      "fitting": fitting,
                      "kernel_efficiency": search.calibration.KERNEL_EFFICIENCY,
                      "results": [e.as_dict(config_arg) for e in results]}, indent=2))
  elif not results:
    print(f"nothing fits: no mesh of {devices} x {cluster.name} holds this model at "
          f"global_batch={cfg.global_batch}, seq_len={cfg.seq_len}")
  else:
    print(search.format_search(results, fitting, cluster, devices, config_arg))


def _checked_target(does: str) -> gpu_targets.Target:
  """--target, which names the GPUs plan `does` itself: --cluster refused,
  --devices only as many as it has."""
  target = gpu_targets.parse(_TARGET.value)
  if _CLUSTER.present:
    raise ConfigError("--cluster", f"plan {'--search ' * _SEARCH.value}--target {does} the "
                      f"target's own GPUs ({target}); remove --cluster")
  if _DEVICES.value is not None and _DEVICES.value != target.num_devices:
    raise ConfigError("--devices", f"is {_DEVICES.value}, but --target {target} has "
                      f"{target.num_devices} devices; remove --devices")
  gpu_targets.devices(target)  # before anything starts a backend on this machine
  return target


def _search_compiled(cfg, target: gpu_targets.Target, cluster, config_arg: str) -> None:
  """The search's first candidates compiled for `target`, those that do not
  fit by their programs dropped (`planner.on_target`)."""
  results, fitting, _ = search.search(cfg, target.num_devices, cluster,
                                      _TOP.value * on_target.COMPILED_PER_SHOWN)
  compiled = on_target.compiled_candidates(cfg, results, target, _TOP.value)
  if _JSON.value:
    print(json.dumps({"target": str(target), "cluster": dataclasses.asdict(cluster),
                      "devices": target.num_devices, "fitting": fitting,
                      "usable_memory_bytes": usable_memory(target),
                      "results": [c.as_dict(config_arg) for c in compiled if c.fits],
                      "dropped": [c.as_dict(config_arg) for c in compiled if not c.fits]},
                     indent=2))
  else:
    print(on_target.format_compiled(compiled, fitting, target, config_arg))


COMMAND = common.Command("plan", FLAGS, main, CONFIG,
                         paths=lambda: [("--cluster", _CLUSTER.value, False)])
