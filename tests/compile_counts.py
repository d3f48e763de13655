"""A pytest plugin: what the run spent on XLA, printed after the tests.

Every test process (each xdist worker) counts from jax's monitoring events
the programs XLA compiled (a compile is a persistent-cache miss: with the
cache shared by the whole run, about the distinct programs), those read
from the cache instead, and the seconds of lowering and backend
compilation (jax reports tracing only outside other traces: not summed); the controller sums the workers' counts. CLI subprocesses and
notebook kernels are not counted. tests/README.md reads these figures.
"""

import collections

import jax
import pytest

EVENTS = {"/jax/core/compile/jaxpr_to_mlir_module_duration": "lowering",
          "/jax/core/compile/backend_compile_duration": "compiling"}
CACHE_HITS = "/jax/compilation_cache/cache_hits"

_seconds = collections.Counter()
_counts = collections.Counter()


def _on_duration(event: str, duration: float, **_) -> None:
  if event in EVENTS:
    _seconds[EVENTS[event]] += duration
    _counts[EVENTS[event]] += 1


def _on_event(event: str, **_) -> None:
  if event == CACHE_HITS:
    _counts["from the cache"] += 1


jax.monitoring.register_event_duration_secs_listener(_on_duration)
jax.monitoring.register_event_listener(_on_event)


def pytest_sessionfinish(session):
  workeroutput = getattr(session.config, "workeroutput", None)
  if workeroutput is not None:  # an xdist worker: hand the counts to the controller
    workeroutput["xla_seconds"], workeroutput["xla_counts"] = dict(_seconds), dict(_counts)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
  _seconds.update(node.workeroutput.get("xla_seconds", {}))
  _counts.update(node.workeroutput.get("xla_counts", {}))


def pytest_terminal_summary(terminalreporter):
  if not _counts["compiling"] and not _counts["from the cache"]:
    return
  terminalreporter.write_line(
      f"XLA in the test processes: {_counts['compiling']:,} programs compiled "
      f"({_seconds['compiling']:,.0f} s), {_counts['from the cache']:,} read from the "
      f"persistent cache; lowering {_seconds['lowering']:,.0f} s")
