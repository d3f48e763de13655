"""Processes agree on a preemption within three steps of the signal, through the
key-value store and without a collective: every one stops at the same step,
not at the next logging step (which could come after a scheduler's grace)."""

import threading

from meshtrain.train.preemption import ANOTHER, MARGIN, PreemptionRequest
from test_watchdog import Store

LOG_EVERY = 50  # the next logging step, far behind the signal


def run_job(num_processes: int, signal_at: dict[int, int],
            steps: int = 40) -> dict[int, tuple[int, str]]:
  """`num_processes` threads stepping in lock step (a barrier per step, as the
  step's collectives); process p receives SIGTERM before step `signal_at[p]`.
  Returns each process's (stop step, signal name); one left waiting for a
  peer that stopped elsewhere is missing."""
  store, stopped = Store(), {}
  barrier = threading.Barrier(num_processes)

  def process(index):
    request = PreemptionRequest(store, index, num_processes, lockstep=True)
    for step in range(1, steps + 1):
      barrier.wait(timeout=10)  # the step's collectives
      if signal_at.get(index) == step:
        request.requested = "SIGTERM"
      agreed = request.agreed(step, logging=not step % LOG_EVERY)
      if agreed:
        stopped[index] = (step, agreed)
        return

  threads = [threading.Thread(target=process, args=(i,)) for i in range(num_processes)]
  for thread in threads:
    thread.start()
  for thread in threads:
    thread.join(30)
  return stopped


def test_every_process_stops_at_the_same_step_soon_after_one_got_the_signal():
  for _ in range(20):  # the threads' order within a step varies
    stopped = run_job(4, {2: 7})
    assert len(stopped) == 4 and len({step for step, _ in stopped.values()}) == 1, stopped
    step = stopped[0][0]
    assert 7 + MARGIN <= step <= 7 + MARGIN + 1 < LOG_EVERY  # a peer sees it a step later
    assert {i: name for i, (_, name) in stopped.items()} == {0: ANOTHER, 1: ANOTHER,
                                                            2: "SIGTERM", 3: ANOTHER}


def test_signals_at_different_steps_stop_together_at_the_latest_proposal():
  for _ in range(20):
    stopped = run_job(2, {0: 5, 1: 9})
    assert len(stopped) == 2 and len({step for step, _ in stopped.values()}) == 1, stopped
    assert 5 + MARGIN <= stopped[0][0] <= 5 + MARGIN + 1


def test_without_lock_step_they_agree_at_logging_steps_only():
  """No deadlines, no bound on how far a process runs ahead: the collective
  of the logging steps (not called here: no step logs before the signal)."""
  request = PreemptionRequest(Store(), 0, 2, lockstep=False)
  request.requested = "SIGTERM"
  assert request.agreed(7, logging=False) is None
