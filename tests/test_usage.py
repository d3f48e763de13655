"""What a new user meets first: `meshtrain`, `--help` and `help` list the
commands, `meshtrain COMMAND --help` its flags, `meshtrain config` the keys
(all exit 0); each preset gets its own workdir; `meshtrain plot` draws a run."""

import json
import re

import matplotlib.image
import numpy as np
import pytest

from conftest import REPO
from meshtrain import cli, config as meshtrain_config
from meshtrain.cli import common


def meshtrain(args, capsys) -> tuple[int, str, str]:
  capsys.readouterr()
  with pytest.raises(SystemExit) as exit_info:
    cli.run(args)
  out = capsys.readouterr()
  return exit_info.value.code or 0, out.out, out.err


@pytest.mark.parametrize("args", [[], ["--help"], ["-h"], ["help"], ["--helpfull"]])
def test_the_commands_are_listed_one_line_each(args, capsys):
  code, out, err = meshtrain(args, capsys)
  assert code == 0 and not err
  listed = re.findall(r"^  (\S+)  ", out, re.M)
  assert set(cli.COMMANDS) <= set(listed), out
  assert len(out.splitlines()) < 25


# The flags each command takes: "config" the --config file, "config.KEY" its
# overrides (those of a saved run's config for the commands that read one).
FLAGS = {
    "train": ("config", "config.KEY"),
    "plan": ("config", "config.KEY", "json", "compile", "devices", "target", "search", "cluster",
             "top", "global_batch", "seq_len", "mesh"),
    "schedule": ("stages", "microbatches", "schedule", "virtual", "costs", "out", "json"),
    "launch": ("num_processes", "devices_per_process", "max_restarts"),
    "prepare": ("input", "format", "tokenizer", "text_field", "split_blank_lines",
                "val_fraction", "out"),
    "eval": ("config.KEY", "workdir", "step"),
    "import-hf": ("config", "config.KEY", "from", "to"),
    "export-hf": ("config.KEY", "workdir", "step", "to", "dtype", "max_shard_mb"),
    "generate": ("config.KEY", "workdir", "step", "prompt", "prompts", "max_tokens",
                 "temperature", "top_k", "top_p", "seed", "json"),
    "verify": ("config", "config.KEY", "verify_steps"),
    "plot": ("workdir", "out"),
    "config": ("config", "config.KEY"),
}


def test_every_command_is_in_the_table_of_flags():
  assert set(FLAGS) == set(cli.COMMANDS)


@pytest.mark.parametrize("command", FLAGS)
def test_each_command_lists_its_own_flags_and_no_others(command, capsys):
  code, out, err = meshtrain([command, "--help"], capsys)
  assert code == 0 and not err
  shown = re.findall(r"^  (--[\w.]+)", out, re.M)
  assert shown == [f"--{name}" for name in FLAGS[command]], out
  assert "only_check_args" not in out and "grain" not in out  # absl's and libraries' flags


def test_help_of_a_command_is_the_same_as_its_help_flag(capsys):
  assert meshtrain(["help", "generate"], capsys) == meshtrain(["generate", "--help"], capsys)
  code, out, _ = meshtrain(["launch", "--help"], capsys)
  assert code == 0 and "--num_processes" in out


def test_config_lists_every_key_with_its_value_and_the_comment_of_config_py(capsys):
  code, out, _ = meshtrain(["config", "--config", str(REPO / "configs/llama_8b.py")], capsys)
  assert code == 0
  keys = dict(re.findall(r"^  ([\w.]+) = (.*?)(?:\s+#|$)", out, re.M))
  flat = {}

  def walk(tree, prefix=""):
    for key, value in tree.items():
      walk(value, f"{prefix}{key}.") if isinstance(value, dict) else flat.update(
          {f"{prefix}{key}": value})
  walk(meshtrain_config.get_config().to_dict())
  assert set(keys) == set(flat)
  assert keys["model.embed_dim"] == "4096"  # the preset's value, Llama 3 8B's width
  assert re.search(r"^  mesh\.data = -1 +# replicas \(batch\); -1 fills the remaining devices$",
                   out, re.M)


@pytest.mark.parametrize("given, workdir", [
    (["--config", "configs/tiny.py"], "runs/tiny"),
    (["--config=configs/megatron_3d.py:tiny"], "runs/megatron_3d_tiny"),
    (["--config", "configs/tp.py"], "runs/tp"),
    (["--config", "configs/shakespeare_bpe.py"], "runs/shakespeare_bpe"),  # set by the file
    (["--config", "configs/tiny.py", "--config.workdir=runs/default"], "runs/default"),
    ([], "runs/default"),
])
def test_each_preset_writes_to_its_own_workdir(given, workdir, monkeypatch):
  monkeypatch.chdir(REPO)
  common.parse(cli.train.COMMAND, ["train", *given])
  assert cli.train.CONFIG.value.workdir == workdir


def test_plot_draws_the_loss_eval_loss_and_learning_rate(tmp_path, capsys):
  records = [{"step": s, "loss": 5.0 / s, "learning_rate": 1e-3 * min(s, 10) / 10,
              **({"eval_loss": 6.0 / s} if s % 10 == 0 else {})} for s in range(1, 41)]
  (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records) +
                                          '{"step": 41, "lo')  # a line cut short by a kill
  code, out, _ = meshtrain(["plot", f"--workdir={tmp_path}"], capsys)
  assert code == 0 and out.strip().endswith(str(tmp_path / "metrics.png"))
  image = matplotlib.image.imread(tmp_path / "metrics.png")[..., :3]
  for color in ("#1f77b4", "#ff7f0e", "#7f7f7f"):  # loss, eval loss, learning rate
    rgb = np.array([int(color[i:i + 2], 16) / 255 for i in (1, 3, 5)])
    assert (np.abs(image - rgb).max(axis=-1) < 0.02).sum() > 50, color


def test_plot_of_a_workdir_without_metrics_is_one_error_line(tmp_path, capsys):
  code, _, err = meshtrain(["plot", f"--workdir={tmp_path}"], capsys)
  assert code == 2 and err.count("\n") == 1
  assert err.startswith(f"error: --workdir: {tmp_path / 'metrics.jsonl'} not found")
