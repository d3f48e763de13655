"""SIGTERM and SIGINT ask the loop to stop cleanly: finish the step, save, exit 0.

Schedulers (Slurm, Kubernetes, cloud spot VMs) send SIGTERM some seconds before
they kill a job. A second SIGINT (Ctrl-C twice) interrupts at once. With several
processes the signal may reach them at different steps, and a save needs all of
them: they agree at the steps where they already sync to log.
"""

import signal
import sys
import threading

import jax
import numpy as np
from jax.experimental import multihost_utils


class PreemptionRequest:
  """A context in which the first SIGTERM / SIGINT sets `requested` instead of exiting."""

  SIGNALS = (signal.SIGTERM, signal.SIGINT)

  def __init__(self):
    self.requested = None  # the name of the signal received
    self._previous = {}

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

  def agreed(self) -> str | None:
    """The signal's name once any process got one; with several processes, a
    collective: call it at the same steps on every process."""
    if jax.process_count() == 1:
      return self.requested
    anywhere = multihost_utils.process_allgather(np.int32(bool(self.requested))).any()
    return (self.requested or "SIGTERM (another process)") if anywhere else None

  def __exit__(self, *exc):
    for s, handler in self._previous.items():
      signal.signal(s, handler)
