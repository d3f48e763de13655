"""SIGTERM and SIGINT ask the loop to stop cleanly: finish the step, save, exit 0.

Schedulers (Slurm, Kubernetes, cloud spot VMs) send SIGTERM some seconds before
they kill a job (Slurm's and Kubernetes' default grace: 30 s). A second SIGINT
(Ctrl-C twice) interrupts at once. With several processes the signal may reach
them at different steps, and a save needs all of them at the same one.

They stop within three steps of the signal, agreed through the coordination service's
key-value store, without a collective (`agreed`): a process that has a signal,
or sees a peer's proposal, writes its own proposal, its step + 2; once every
process has proposed, each stops at the largest proposal. That is sound while
the processes run in lock step one step apart: the watchdog's deadlines make
each wait for its step before last (`Watchdog.dispatched`), so when a process
is at step t every process has dispatched step t - 1. Then a proposal written
at step t is seen by every process by its step t + 2, before it passes any
proposal. Without deadlines (`distributed.step_timeout_s=0`) nothing bounds
how far ahead a process dispatches, and they agree at the steps where they
already sync to log, as a collective.
"""

import signal
import sys
import threading

import numpy as np
from jax.experimental import multihost_utils


_KEYS = "meshtrain/preemption/"
MARGIN = 2  # steps between a proposal and the stop: the lock step's lag, plus one
ANOTHER = "SIGTERM (another process)"


class PreemptionRequest:
  """A context in which the first SIGTERM / SIGINT sets `requested` instead of exiting.

  `client` is the coordination service's key-value store (`key_value_set`,
  `key_value_dir_get`), None in a job of one process; `lockstep` says that
  the processes run at most a step apart (the watchdog's deadlines are on)."""

  SIGNALS = (signal.SIGTERM, signal.SIGINT)

  def __init__(self, client=None, process_index: int = 0, num_processes: int = 1,
               lockstep: bool = False):
    self.requested = None  # the name of the signal received
    self._previous = {}
    self.client, self.process_index, self.num_processes = client, process_index, num_processes
    self.lockstep = lockstep and client is not None and num_processes > 1
    self._proposed = False
    self._stop_at = None  # the step every process stops at, once all have proposed

  def _handle(self, signum, frame):
    if self.requested and signum == signal.SIGINT:
      signal.default_int_handler(signum, frame)
    self.requested = signal.Signals(signum).name
    print(f"\n{self.requested} received: finishing the current step and saving a checkpoint "
          "(Ctrl-C again to stop at once)", file=sys.stderr, flush=True)

  def __enter__(self):
    if threading.current_thread() is threading.main_thread():  # signals reach the main thread only
      self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
    return self

  def agreed(self, step: int, logging: bool) -> str | None:
    """The signal's name at the step where every process stops (any process
    may have got it), else None. Call it after each step is dispatched (and,
    in lock step, waited for one behind); `logging` says that this step syncs
    to log, on every process alike (the collective's steps without lock step)."""
    if self.num_processes == 1:
      return self.requested
    if not self.lockstep:
      if not logging:
        return None
      anywhere = multihost_utils.process_allgather(np.int32(bool(self.requested))).any()
      return (self.requested or ANOTHER) if anywhere else None
    if self._stop_at is None:
      proposals = dict(self.client.key_value_dir_get(_KEYS))
      if not self._proposed and (self.requested or proposals):
        own = f"{step + MARGIN} {self.requested or ANOTHER}"
        self.client.key_value_set(f"{_KEYS}{self.process_index}", own)
        proposals[f"{_KEYS}{self.process_index}"], self._proposed = own, True
      if len(proposals) == self.num_processes:
        self._stop_at = max(int(value.split()[0]) for value in proposals.values())
    if self._stop_at is not None and step >= self._stop_at:
      return self.requested or ANOTHER
    return None

  def __exit__(self, *exc):
    for s, handler in self._previous.items():
      signal.signal(s, handler)
