"""`meshtrain plan` ends with a verdict: fits the device (or --cluster), or
what to try, as commands that run."""

import re

import pytest

from conftest import REPO
from meshtrain import cli
from meshtrain.planner.verdict import verdict

GIB = 2**30
H100_USABLE = 80e9 * 0.9  # the datasheet's 80 GB, of which a step plans for 90%


def meshtrain(args, capsys, monkeypatch) -> tuple[int, str]:
  monkeypatch.chdir(REPO)
  capsys.readouterr()
  with pytest.raises(SystemExit) as exit_info:
    cli.run(args)
  out = capsys.readouterr()
  assert not out.err, out.err
  return exit_info.value.code or 0, out.out


def test_a_plan_that_fits_says_so_with_the_headroom():
  result = verdict({"params": GIB, "grads": GIB, "optimizer": 6 * GIB, "total": 20 * GIB}, 8,
                   H100_USABLE, "one h100", "--config=c.py", "h100", "full")
  assert result["fits"]
  assert result["text"] == ("verdict: fits one h100: 20.0 GiB a device of the 67.1 GiB usable "
                            "(70% to spare)")


def test_a_plan_that_does_not_fit_names_the_search_recomputation_and_sharding():
  result = verdict({"params": 20 * GIB, "grads": 20 * GIB, "optimizer": 60 * GIB,
                    "total": 150 * GIB}, 8, H100_USABLE, "one h100", "--config=c.py", "h100",
                   "none")
  lines = result["text"].splitlines()
  assert not result["fits"]
  assert lines[0] == "verdict: does not fit one h100: 150.0 GiB a device, 2.2x the 67.1 GiB usable. Try:"
  assert lines[1].startswith("  meshtrain plan --config=c.py --search --devices 8 --cluster h100 ")
  assert "--config.remat=full" in lines[2]
  assert "train state alone (weights, gradients, optimizer) is 100.0 GiB" in lines[3]
  assert "(--devices 16)" in lines[3]  # 100 GiB over 67.1 usable: twice the devices


def test_the_8b_preset_on_8_devices_does_not_fit_an_h100_and_the_fix_it_names_runs(capsys,
                                                                                 monkeypatch):
  code, out = meshtrain(["plan", "--config", "configs/llama_8b.py", "--devices", "8"], capsys,
                        monkeypatch)
  assert code == 0
  total = float(re.search(r"^  total +([\d.]+)$", out, re.M).group(1)) * 2**20
  head, *tries = out.split("verdict: ")[1].splitlines()
  assert head.startswith(f"does not fit one h100 (80 GB; --cluster names another): "
                         f"{total / GIB:.1f} GiB a device, {total / H100_USABLE:.1f}x")
  search = tries[0].split("    (")[0].split()
  assert search[:2] == ["meshtrain", "plan"] and "--search" in search
  code, out = meshtrain(search[1:], capsys, monkeypatch)
  assert code == 0 and "meshtrain train --config=configs/llama_8b.py" in out


def test_a_small_model_fits_the_cluster_named(capsys, monkeypatch):
  code, out = meshtrain(["plan", "--config", "configs/tiny.py", "--devices", "8", "--cluster",
                         "a100_40gb"], capsys, monkeypatch)
  assert code == 0
  assert re.search(r"^verdict: fits one a100_40gb \(40 GB; --cluster names another\): "
                   r"0\.\d GiB a device of the 33\.5 GiB usable", out, re.M), out
