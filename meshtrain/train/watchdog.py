"""A job of several processes that cannot go on stops in one line, exit code 4.

Two daemon threads per process watch what the main thread cannot: it is
typically stuck in a collective that will never finish.

- Heartbeats (every job of several processes): each process bumps a counter in
  the coordination service's key-value store every second and reads its peers'.
  A peer whose counter has not moved for `config.distributed.timeout_s` is lost:
  dead, stopped, or on a host that went away.
- A deadline (`config.distributed.step_timeout_s` > 0): the loop says what must
  finish next and by when (`expect`, `phase`, `dispatched`). A step, a save or
  an evaluation still running past it is a hang: a stuck collective, or a peer
  that is stuck while its heartbeats go on. What compiles (setting up, the
  first step and what waits for it, the first evaluation) gets
  `config.distributed.compile_timeout_s` instead, and a save that waits for
  the disk (the last one, a preemption's) `config.distributed.save_timeout_s`:
  a large checkpoint on slow storage is no hang. Every thread's stack goes to
  WORKDIR/hang_stacks_processN.txt first.

Either way the process prints one line, `error: distributed: ...; newest
complete checkpoint: STEP`, and leaves with `os._exit(EXIT_CODE)`. JAX notices a
lost peer as well (its service's heartbeats, which `meshtrain.distributed` sets
to notice a death no sooner than twice `timeout_s` after it), but it ends the
process from a C++ thread with a fatal-error dump; the Python callback it takes instead cannot be called in
jaxlib 0.10 (its status argument has no Python type: std::bad_cast), so the
watchdog notices first and JAX's detection stays the backstop.

Fault injection, for tests and drills: `MESHTRAIN_FAULT="PROCESS:SIGNAL:STEP,..."`
(e.g. `1:KILL:5,1:STOP:9`) makes process PROCESS send itself SIGSTOP or SIGKILL
before step STEP, and `PROCESS:SIGNAL:STEP:save` right after checkpoint STEP's
asynchronous save has started (its writes in flight), once per workdir (a
marker file `fault-PROCESS-SIGNAL-STEP[-save]` there keeps a restarted job from
doing it again).
"""

import contextlib
import faulthandler
import math
import os
import signal
import sys
import threading
import time
from pathlib import Path

EXIT_CODE = 4  # a lost peer or a hang; `meshtrain launch --max_restarts` restarts on it
FAULT_ENV = "MESHTRAIN_FAULT"
_KEYS = "meshtrain/heartbeat/"
_DONE = "done"


def newest_checkpoint(workdir) -> int | None:
  """The newest complete step in WORKDIR/checkpoints (orbax renames a step's
  temporary folder to the bare number only once every process has written it)."""
  directory = Path(workdir) / "checkpoints"
  steps = [int(p.name) for p in directory.glob("*") if p.name.isdigit()] if directory.is_dir() else []
  return max(steps, default=None)


class Watchdog:
  """Stops the process with one line when a peer is lost or a deadline passes.

  `client` is the coordination service's key-value store (`key_value_set`,
  `key_value_dir_get`); None watches no peers. `step_timeout_s` 0 sets no
  deadlines. `exit` and `out` are replaceable for tests."""

  def __init__(self, workdir, *, step_timeout_s: float = 0, compile_timeout_s: float = 0,
               save_timeout_s: float = 0, peer_timeout_s: float = 0, client=None, process_index: int = 0,
               num_processes: int = 1, interval_s: float = 1.0, exit=os._exit, out=None):
    self.workdir = Path(workdir)
    self.step_timeout_s = step_timeout_s
    self.compile_timeout_s = max(compile_timeout_s, step_timeout_s)
    self.save_timeout_s = max(save_timeout_s, step_timeout_s) if save_timeout_s else math.inf
    self.peer_timeout_s, self.client, self.process_index = peer_timeout_s, client, process_index
    self.interval_s, self._exit, self._out = interval_s, exit, out
    self._lock = threading.Lock()
    self._publishing = threading.Lock()
    self._closed = threading.Event()
    self._what, self._step, self._deadline, self._allowed = "setting up", 0, math.inf, 0.0
    self._seen: set[str] = set()  # the kinds of `allowance` that ran once (and compiled)
    self._previous = None  # the outputs of the step dispatched last
    # key -> (its last value, when a read first returned it, when the value
    # before it was first read); peers not heard from yet count from now
    self._peers: dict[str, tuple[str | None, float, float]] = {
        self._key(p): (None, time.monotonic(), -math.inf)
        for p in range(num_processes) if p != process_index}
    self._done_peers: set[str] = set()
    self._answered = time.monotonic()  # when the key-value store last answered
    self._fired = False

  @property
  def deadlines(self) -> bool:
    return self.step_timeout_s > 0

  def start(self) -> "Watchdog":
    if self.client is not None:
      threading.Thread(target=self._heartbeats, name="meshtrain-heartbeats", daemon=True).start()
    if self.client is not None or self.deadlines:
      threading.Thread(target=self._watch, name="meshtrain-watchdog", daemon=True).start()
    return self

  def allowance(self, compiles: bool = False, kind: str | None = None, scale: float = 1,
                saves: bool = False) -> float:
    """The save timeout for a save that waits for the disk (`saves`); the
    compile timeout for work that compiles (or waits for a first step that
    does), and the first time a `kind` runs; else `scale` step timeouts."""
    if saves:
      return self.save_timeout_s
    if kind is not None and kind not in self._seen:
      self._seen.add(kind)
      compiles = True
    return self.compile_timeout_s if compiles else self.step_timeout_s * scale

  def expect(self, what: str, step: int, seconds: float | None = None) -> None:
    """`what` (at `step`) must finish within `seconds` (default: the step
    timeout). Without deadlines it only notes the step, for the messages."""
    seconds = self.step_timeout_s if seconds is None else seconds
    with self._lock:
      self._what, self._step = what, step
      if self.deadlines:
        self._allowed, self._deadline = seconds, time.monotonic() + seconds

  @contextlib.contextmanager
  def phase(self, what: str, step: int, seconds: float | None = None):
    """`expect` for the work inside, then a fresh step timeout for step `step`."""
    self.expect(what, step, seconds)
    yield
    self.expect(f"step {step}", step)

  def dispatched(self, step: int, outputs) -> None:
    """After dispatching `step`: waits for the step before it (one step stays
    queued behind the one running, so the host still prepares the next batch
    while the device works), then gives `step` the step timeout. The first
    step keeps the compile allowance until the second one is dispatched."""
    if not self.deadlines:
      self._step = step
      return
    previous, self._previous = self._previous, outputs
    if previous is None:  # the first: its compile allowance (`expect` before it) runs on
      return
    import jax
    jax.block_until_ready(previous)
    self.expect(f"step {step}", step)

  def inject_fault(self, step: int, moment: str = "step") -> None:
    """`MESHTRAIN_FAULT`'s signal for this process at `moment` of `step`
    ("step": before it; "save": its checkpoint's save started), once per workdir."""
    for process, name, at, when in faults(os.environ.get(FAULT_ENV, "")):
      marker = self.workdir / (f"fault-{process}-{name}-{at}" + ("-save" if when == "save" else ""))
      if (process == self.process_index and (at, when) == (step, moment)
          and not marker.exists()):
        marker.write_text(f"{time.time()}\n")
        sys.stdout.flush()
        sys.stderr.flush()
        os.kill(os.getpid(), getattr(signal, f"SIG{name}"))

  def await_verdict(self) -> None:
    """After a runtime error in a collective: returns once every peer has
    sent a heartbeat since (they are alive, so the error is the caller's to
    raise); a lost peer ends the process from the watch thread meanwhile.
    A peer's newest value, first read after the error, may be the last one it
    wrote before it died; the one after a value first read after the error
    was written after it."""
    if self.client is None:
      return
    since = time.monotonic()
    self.expect(f"checking the peers at step {self._step}", self._step, self.peer_timeout_s * 2 + 5)
    while time.monotonic() - since < self.peer_timeout_s * 2 + 5:
      with self._lock:
        alive = all(key in self._done_peers or before > since
                    for key, (_, _, before) in self._peers.items())
      if alive and self._peers:
        return
      time.sleep(self.interval_s / 4)

  def close(self) -> None:
    """Stops watching; peers learn this process is done, not lost."""
    with self._publishing:
      if self._closed.is_set():
        return
      self._closed.set()
      if self.client is not None:
        with contextlib.suppress(Exception):
          self.client.key_value_set(self._key(self.process_index), _DONE, allow_overwrite=True)

  def _key(self, process: int) -> str:
    return f"{_KEYS}{process}"

  def _heartbeats(self) -> None:
    count = 0
    while not self._closed.is_set():
      count += 1
      try:
        with self._publishing:  # never after `close` wrote "done"
          if self._closed.is_set():
            return
          self.client.key_value_set(self._key(self.process_index), f"{count} {self._step}",
                                    allow_overwrite=True)
        asked = time.monotonic()  # the values read were in the store at this time or later
        values = self.client.key_value_dir_get(_KEYS)
      except Exception:  # the service is away: `_watch` counts the silence
        values = None
      if self._closed.is_set() or values is None:
        self._closed.wait(self.interval_s)
        continue
      with self._lock:
        self._answered = asked
        for key, value in values:  # full keys
          if key == self._key(self.process_index):
            continue
          if value == _DONE:
            self._done_peers.add(key)
          last, changed, _ = self._peers.get(key, (None, asked, -math.inf))
          if last != value:
            self._peers[key] = (value, asked, changed)
      self._closed.wait(self.interval_s)

  def _watch(self) -> None:
    while not self._closed.wait(self.interval_s / 2) and not self._fired:
      now = time.monotonic()
      with self._lock:
        what, step, deadline, allowed = self._what, self._step, self._deadline, self._allowed
        # a peer is judged on what the store said: silent until its last answer
        silent = {key: (self._answered - changed, value)
                  for key, (value, changed, _) in self._peers.items() if key not in self._done_peers}
        unanswered = now - self._answered
      if self.client is not None and self.peer_timeout_s:
        key = max(silent, key=lambda k: silent[k][0], default=None)
        if unanswered >= self.peer_timeout_s:
          self._stop(f"coordinator lost at step {step} (its key-value store did not answer "
                     f"for {unanswered:.0f} s)")
        elif key is not None and silent[key][0] >= self.peer_timeout_s:
          seconds, value = silent[key]
          last = f"its last at its step {value.split()[-1]}" if value else "none received"
          self._stop(f"process {key.rsplit('/', 1)[-1]} lost at step {step} (no heartbeat for "
                     f"{seconds:.0f} s, {last})")
      if now > deadline and not self._fired:
        self._stop(f"{what} did not finish in {allowed:g} s (a stopped peer or a stuck "
                   f"collective; every thread's stack is in {self._dump_stacks()})")

  def _dump_stacks(self) -> Path:
    path = self.workdir.absolute() / f"hang_stacks_process{self.process_index}.txt"
    with contextlib.suppress(OSError), open(path, "w") as file:
      faulthandler.dump_traceback(file, all_threads=True)
    return path

  def _stop(self, message: str) -> None:
    if self._fired or self._closed.is_set():
      return
    self._fired = True
    step = newest_checkpoint(self.workdir)
    out = self._out or sys.stderr
    with contextlib.suppress(Exception):
      sys.stdout.flush()
    bar = "\n" if self.process_index == 0 else ""  # off the line of process 0's progress bar
    print(f"{bar}error: distributed: {message}; newest complete checkpoint: "
          f"{'none' if step is None else step}", file=out, flush=True)
    self._exit(EXIT_CODE)


class Off:
  """The watchdog of a job of one process: watches nothing."""

  deadlines = False

  def allowance(self, compiles: bool = False, kind: str | None = None, scale: float = 1,
                saves: bool = False) -> float:
    return 0

  def expect(self, what: str, step: int, seconds: float | None = None) -> None:
    pass

  def phase(self, what: str, step: int, seconds: float | None = None):
    return contextlib.nullcontext()

  def dispatched(self, step: int, outputs) -> None:
    pass

  def inject_fault(self, step: int, moment: str = "step") -> None:
    pass

  def await_verdict(self) -> None:
    pass

  def close(self) -> None:
    pass


def watchdog_for(cfg, client=None, process_index: int = 0, num_processes: int = 1):
  """The started watchdog of `cfg`'s run: peers watched with several processes,
  deadlines with `distributed.step_timeout_s` > 0 there; else one that does nothing."""
  dist = cfg.distributed
  if num_processes <= 1:
    return Off()
  return Watchdog(cfg.workdir, step_timeout_s=dist.step_timeout_s,
                  compile_timeout_s=dist.compile_timeout_s,
                  save_timeout_s=dist.save_timeout_s, peer_timeout_s=dist.timeout_s,
                  client=client, process_index=process_index,
                  num_processes=num_processes).start()


def faults(spec: str) -> list[tuple[int, str, int, str]]:
  """`MESHTRAIN_FAULT`'s (process, KILL | STOP, step, step | save) entries."""
  entries = []
  for item in filter(None, (part.strip() for part in spec.split(","))):
    process, name, step, *moment = item.split(":")
    if name.upper() not in ("KILL", "STOP"):
      raise ValueError(f"{FAULT_ENV}: {item!r}: the signal is KILL or STOP")
    if moment not in ([], ["save"]):
      raise ValueError(f"{FAULT_ENV}: {item!r}: after the step, only ':save' may follow")
    entries.append((int(process), name.upper(), int(step), moment[0] if moment else "step"))
  return entries
