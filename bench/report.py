"""Writes a benchmark's JSON into bench/results/ and its table into docs/benchmarks.md,
between `<!-- NAME -->` markers, with the command, machine and date."""

import datetime
import json
import platform
from pathlib import Path

import jax

REPO = Path(__file__).resolve().parents[1]
BENCHMARKS = REPO / "docs" / "benchmarks.md"


def write_section(name: str, rows: list[dict], table: str, command: str,
                  doc: Path = BENCHMARKS, measured_on: str | None = None) -> None:
  """`measured_on` (date, jax version, machine) for rows measured elsewhere;
  by default this process's."""
  (REPO / "bench" / "results").mkdir(exist_ok=True)
  (REPO / "bench" / "results" / f"{name}.json").write_text(json.dumps(rows, indent=2) + "\n")
  measured_on = measured_on or (
      f"{datetime.date.today()}, jax {jax.__version__}, {jax.devices()[0].platform} "
      f"x{jax.device_count()}, {platform.processor() or platform.machine()}")
  stamp = f"`{command}` — {measured_on}"
  section = f"<!-- {name} -->\n{stamp}\n\n{table}\n<!-- /{name} -->"
  text = doc.read_text()
  start, end = f"<!-- {name} -->", f"<!-- /{name} -->"
  if start in text:
    text = text[:text.index(start)] + section + text[text.index(end) + len(end):]
  else:
    text = text.rstrip("\n") + "\n\n" + section + "\n"
  doc.write_text(text)
