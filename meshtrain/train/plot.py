"""`meshtrain plot --workdir W`: a run's loss, eval loss and learning rate
from its `metrics.jsonl`, drawn with matplotlib into one PNG (or PDF, SVG)."""

from pathlib import Path

from meshtrain.errors import ConfigError
from meshtrain.train import metrics

FORMATS = ("png", "pdf", "svg")


def read_metrics(workdir) -> list[dict]:
  """The records of WORKDIR/metrics.jsonl (a line cut short by a kill is skipped)."""
  path = Path(workdir) / "metrics.jsonl"
  if not path.is_file():
    raise ConfigError("--workdir", f"{path} not found; give the workdir of a run that has "
                      "logged a step (meshtrain train writes it)")
  records = [record for _, record in metrics.records(path)]
  if not records:
    raise ConfigError("--workdir", f"{path} holds no step yet; plot it once the run has logged one")
  return records


def series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
  """(steps, values) of the records that carry a number under `key`."""
  points = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float))]
  return [s for s, _ in points], [v for _, v in points]


def draw(workdir, out) -> Path:
  """Draws the loss (and eval loss) over the learning rate into `out`; returns it."""
  import matplotlib
  matplotlib.use("Agg")
  from matplotlib import pyplot as plt

  out = Path(out)
  if out.suffix.removeprefix(".").lower() not in FORMATS:
    raise ConfigError("--out", f"{out.name} has no image extension; end it with one of "
                      f"{', '.join('.' + f for f in FORMATS)}")
  records = read_metrics(workdir)
  figure, (loss_axes, lr_axes) = plt.subplots(2, 1, figsize=(7, 5.5), sharex=True,
                                               height_ratios=(3, 1))
  loss_axes.plot(*series(records, "loss"), label="train loss")
  steps, eval_loss = series(records, "eval_loss")
  if steps:
    loss_axes.plot(steps, eval_loss, "o-", label="eval loss")
  loss_axes.set_ylabel("loss")
  loss_axes.legend()
  loss_axes.grid(alpha=0.3)
  loss_axes.set_title(str(workdir))
  lr_axes.plot(*series(records, "learning_rate"), color="tab:gray")
  lr_axes.set_ylabel("learning rate")
  lr_axes.set_xlabel("step")
  lr_axes.grid(alpha=0.3)
  figure.tight_layout()
  try:
    figure.savefig(out, dpi=120)
  except OSError as error:
    raise ConfigError("--out", f"cannot write {out} ({error.strerror or error}); write the "
                      "picture elsewhere") from None
  finally:
    plt.close(figure)
  return out
