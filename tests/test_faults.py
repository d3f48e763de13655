"""Filesystem and process faults: a real small disk (a tmpfs mounted in a
private mount namespace with `unshare -rm`, no root needed) read-only, then full
during a save, then given room again; a metrics line cut short by a kill."""

import pytest
import json
import shlex
import subprocess
import sys

from conftest import micro_flags
from meshtrain.train.metrics import MetricsWriter

FLAGS = micro_flags(steps=6, **{"checkpoint.every_steps": 1, "checkpoint.keep": 0,
                                "simulate_devices": 1, "mesh.data": 1})


@pytest.mark.slow
def test_read_only_and_full_disk_are_one_line_and_the_last_checkpoint_resumes(tmp_path):
  disk, out = tmp_path / "disk", tmp_path / "out"
  disk.mkdir()
  out.mkdir()
  train = shlex.join([sys.executable, "-m", "meshtrain.cli", "train", *FLAGS,
                      f"--config.workdir={disk}/run"])
  # 900 KiB holds two checkpoints of this model (~370 KiB each), not six.
  script = f"""
    mount -t tmpfs -o size=900k tmpfs {disk} && mount -o remount,ro {disk} || exit 9
    {train} > {out}/ro.out 2> {out}/ro.err; echo $? > {out}/ro.rc
    mount -o remount,rw {disk} || exit 9
    {train} > {out}/full.out 2> {out}/full.err; echo $? > {out}/full.rc
    ls {disk}/run/checkpoints > {out}/full.ls
    mount -o remount,size=64m {disk} || exit 9
    {train} > {out}/again.out 2> {out}/again.err; echo $? > {out}/again.rc
    ls {disk}/run/checkpoints > {out}/again.ls
  """
  subprocess.run(["unshare", "-rm", "sh", "-c", script], check=True, timeout=600, cwd=tmp_path)
  read = {name: (out / name).read_text() for name in
          ("ro.rc", "ro.err", "full.rc", "full.err", "full.ls", "again.rc", "again.out", "again.ls")}

  assert read["ro.rc"].strip() == "2"
  assert read["ro.err"].strip().splitlines() == [
      f"error: config.workdir: {disk} is not writable (read-only filesystem or no permission); "
      "choose a writable config.workdir"]

  assert read["full.rc"].strip() == "2", read["full.err"]
  assert "Traceback" not in read["full.err"] and "Event loop" not in read["full.err"]
  errors = [line for line in read["full.err"].splitlines() if "error" in line.lower()]
  assert len(errors) == 1 and errors[0].startswith(
      "error: config.workdir: "), read["full.err"]
  assert "No space left on device" in errors[0]
  complete = sorted(int(name) for name in read["full.ls"].split() if name.isdigit())
  assert 1 <= len(complete) < 6 and f"step {complete[-1]} in " in errors[0]

  assert read["again.rc"].strip() == "0", read["again.out"]
  assert f"resumed from {disk}/run/checkpoints/{complete[-1]} at step {complete[-1]}" in \
      read["again.out"]
  assert "done: step 6" in read["again.out"]
  assert read["again.ls"].split() == [str(step) for step in range(1, 7)]  # leftover removed


@pytest.mark.slow
def test_a_metrics_line_cut_short_by_a_kill_does_not_stop_a_resume(tmp_path):
  records = [json.dumps({"step": step, "loss": 1.0 / step}) for step in (1, 2, 3)]
  (tmp_path / "metrics.jsonl").write_text("\n".join(records) + '\n{"step": 4, "lo')
  MetricsWriter(tmp_path, resumed_step=2).close()  # a resume from the checkpoint at step 2
  assert (tmp_path / "metrics.jsonl").read_text() == records[0] + "\n" + records[1] + "\n"
