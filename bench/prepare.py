"""`meshtrain prepare` throughput against the tokenizer's own `encode_batch`, and its peak memory.

  python bench/prepare.py [--megabytes 100]

Builds a JSONL corpus of at least `--megabytes` MB from the shared play (its
paragraphs, repeated, one document each: many short documents, so the
per-document work around the tokenizer shows), trains a 1024-id BPE on the
play, then in fresh processes, one after the other:
  - `prepare` of the corpus with that tokenizer (reads, encodes, writes);
  - the bare `encode_batch` of the same documents, already in memory, in the
    same batches (only the encode calls are timed).
Reports MB/s of each, their ratio, and each process's peak resident memory.
Writes bench/results/prepare.json and the table between the markers in
docs/benchmarks.md.
"""

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
from report import write_section  # noqa: E402

SHAKESPEARE = REPO.parent / "shared" / "data" / "tinyshakespeare.txt"

PREPARE = """
import json, resource, sys, time
from meshtrain.data.prepare import prepare
start = time.perf_counter()
meta = prepare([sys.argv[1]], sys.argv[2], sys.argv[3], val_fraction=0.01)
print(json.dumps({"seconds": time.perf_counter() - start, "tokens": meta["tokens"],
                  "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""

ENCODE_BATCH = """
import json, resource, sys, time
from meshtrain.data import prepare as p, tokenizer as tk
tokenizer = tk.load(sys.argv[2], key="tokenizer")
texts = [json.loads(line)["text"] for line in open(sys.argv[1])]
batches, batch, size = [], [], 0
for text in texts:  # prepare's batches: BATCH_CHARS characters each
  batch.append(text)
  size += len(text)
  if size >= p.BATCH_CHARS:
    batches.append(batch)
    batch, size = [], 0
batches.append(batch)
seconds = tokens = 0
for batch in batches:
  start = time.perf_counter()
  ids = tokenizer.tokenizer.encode_batch_fast(batch, add_special_tokens=False)
  seconds += time.perf_counter() - start
  tokens += sum(len(e.ids) + 1 for e in ids)
print(json.dumps({"seconds": seconds, "tokens": tokens,
                  "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def build_corpus(directory: Path, megabytes: int) -> Path:
  paragraphs = [p for p in re.split(r"\n\s*\n", SHAKESPEARE.read_text()) if p.strip()]
  lines = "".join(json.dumps({"text": p}) + "\n" for p in paragraphs)
  copies = -(-megabytes * 10**6 // len(lines.encode()))
  corpus = directory / "corpus.jsonl"
  with open(corpus, "w") as out:
    for _ in range(copies):
      out.write(lines)
  return corpus


def run(script: str, *args) -> dict:
  """Runs `script` in a fresh process; its JSON result (seconds, tokens, peak memory)."""
  result = subprocess.run([sys.executable, "-c", script, *map(str, args)], capture_output=True,
                          text=True, check=True, cwd=REPO)
  return json.loads(result.stdout.strip().splitlines()[-1])


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--megabytes", type=int, default=100)
  args = parser.parse_args()
  from meshtrain.data import tokenizer as tk  # noqa: E402
  with tempfile.TemporaryDirectory() as tmp:
    tmp = Path(tmp)
    corpus = build_corpus(tmp, args.megabytes)
    size_mb = corpus.stat().st_size / 1e6
    tk.train_bpe([SHAKESPEARE.read_text()], 1024, key="bench").save(tmp)
    encode = run(ENCODE_BATCH, corpus, tmp / "tokenizer.json")
    prepared = run(PREPARE, corpus, tmp / "tokenizer.json", tmp / "out")
  assert prepared["tokens"] == encode["tokens"], (prepared, encode)
  row = {"corpus_mb": size_mb, "tokens": prepared["tokens"],
         "prepare_mb_s": size_mb / prepared["seconds"], "encode_batch_mb_s": size_mb / encode["seconds"],
         "prepare_peak_rss_mib": prepared["peak_rss_mib"], "encode_peak_rss_mib": encode["peak_rss_mib"]}
  row["ratio"] = row["prepare_mb_s"] / row["encode_batch_mb_s"]
  table = "\n".join([
      "| corpus | tokens | prepare | encode_batch alone | prepare / encode_batch | peak memory: prepare, encode_batch alone (whole corpus in memory) |",
      "|---|---|---|---|---|---|",
      f"| {size_mb:.0f} MB JSONL, {row['tokens'] / size_mb / 1e6:.2f} tokens/byte | "
      f"{row['tokens']:,} | {row['prepare_mb_s']:.2f} MB/s | {row['encode_batch_mb_s']:.2f} MB/s | "
      f"{row['ratio']:.2f} | {row['prepare_peak_rss_mib']:.0f} MiB, "
      f"{row['encode_peak_rss_mib']:.0f} MiB |"])
  write_section("prepare", [row], table, command=f"python bench/prepare.py --megabytes {args.megabytes}")
  print(table)


if __name__ == "__main__":
  main()
