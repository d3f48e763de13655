"""Tests for `meshtrain prepare`: inputs, tokens against the tokenizer, split, determinism, bad input."""

import json
import re

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import tokenizers

from conftest import cli_in_process
from meshtrain.data import prepare as p
from meshtrain.data import tokenizer as tk
from meshtrain.data.tokens import PreparedCorpus
from meshtrain.errors import ConfigError

DOCS = ["First document,\nwith two lines.\n", "Ünïcödé — second.", "third\n\n  indented\n"]


def prepared_documents(out) -> list[np.ndarray]:
  """The documents of a prepared directory, read with numpy alone."""
  meta = json.loads((out / "meta.json").read_text())
  tokens = np.fromfile(out / "tokens.bin", meta["dtype"])
  starts = np.fromfile(out / "documents.bin", "<i8")
  assert len(tokens) == meta["tokens"] == starts[-1] and len(starts) == meta["documents"] + 1
  return [tokens[a:b] for a, b in zip(starts[:-1], starts[1:])]


def write_inputs(directory):
  """The same three documents as JSONL, Parquet and one text file each."""
  directory.mkdir()
  (directory / "a.jsonl").write_text("".join(json.dumps({"text": d, "id": i}) + "\n"
                                             for i, d in enumerate(DOCS)))
  pq.write_table(pa.table({"text": DOCS}), directory / "b.parquet")
  for i, doc in enumerate(DOCS):
    (directory / f"c{i}.txt").write_text(doc)
  return directory


def test_bytes_round_trip_every_format_glob_and_directory(tmp_path):
  inputs = write_inputs(tmp_path / "in")
  meta = p.prepare([str(inputs / "*.jsonl"), str(inputs / "b.parquet"), str(inputs)], "bytes",
                   str(tmp_path / "out"), val_fraction=0)
  docs = prepared_documents(tmp_path / "out")
  # Sorted files, each once: a.jsonl, b.parquet, c0..c2.txt.
  assert meta["documents"] == len(docs) == 9 and meta["dtype"] == "uint16"
  for doc, text in zip(docs, DOCS * 3):
    assert doc[-1] == 0 and bytes(doc[:-1].astype(np.uint8)) == text.encode("utf-8")


def test_huggingface_tokens_equal_the_tokenizers_own_encoding_despite_pieces(tmp_path, monkeypatch,
                                                                           real_text):
  monkeypatch.setattr(p, "PIECE_CHARS", 5_000)  # cut the play into ~200 pieces
  monkeypatch.setattr(p, "BATCH_CHARS", 50_000)
  text = real_text.read_text()[:200_000]
  (tmp_path / "play.txt").write_text(text)
  meta = p.prepare([str(tmp_path / "play.txt")], "train:300", str(tmp_path / "out"), val_fraction=0)
  [doc] = prepared_documents(tmp_path / "out")
  reference = tokenizers.Tokenizer.from_file(str(tmp_path / "out/tokenizer.json"))
  eos = reference.token_to_id(tk.TRAINED_EOS)
  assert meta["eos_id"] == eos and meta["vocab_size"] == reference.get_vocab_size() == 300
  np.testing.assert_array_equal(doc, reference.encode(text, add_special_tokens=False).ids + [eos])


def test_blank_lines_split_documents(tmp_path, real_text):
  text = real_text.read_text()[:20_000]
  (tmp_path / "play.txt").write_text(text)
  p.prepare([str(tmp_path / "play.txt")], "bytes", str(tmp_path / "out"), split_blank_lines=True)
  docs = prepared_documents(tmp_path / "out")
  paragraphs = [par for par in re.split(r"\n\s*\n", text) if par.strip()]
  assert len(docs) == len(paragraphs) > 50
  assert bytes(docs[1][:-1].astype(np.uint8)).decode().strip() == paragraphs[1].strip()


def test_output_is_deterministic(tmp_path):
  inputs = write_inputs(tmp_path / "in")
  for out in ("one", "two"):
    p.prepare([str(inputs)], "train:280", str(tmp_path / out))
  for name in ("tokens.bin", "documents.bin", "meta.json", "tokenizer.json"):
    assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes(), name


def test_split_cuts_at_a_document_start_or_inside_one_long_document(tmp_path):
  (tmp_path / "many.jsonl").write_text("".join(json.dumps({"text": "x" * 99}) + "\n"
                                               for _ in range(100)))  # 100 tokens each
  meta = p.prepare([str(tmp_path / "many.jsonl")], "bytes", str(tmp_path / "many"),
                   val_fraction=0.123)
  assert meta["split"] == {"train": [0, 8800], "val": [8800, 10000]}
  (tmp_path / "one.txt").write_text("y" * 999)
  meta = p.prepare([str(tmp_path / "one.txt")], "bytes", str(tmp_path / "one"), val_fraction=0.1)
  assert meta["split"] == {"train": [0, 900], "val": [900, 1000]}


def test_a_half_written_directory_is_refused(tmp_path, real_text):
  p.prepare([str(real_text)], "bytes", str(tmp_path / "out"))
  tokens = tmp_path / "out/tokens.bin"
  tokens.write_bytes(tokens.read_bytes()[:1000])
  with pytest.raises(ConfigError, match="tokens.bin has 1000 bytes where meta.json says"):
    PreparedCorpus(str(tmp_path / "out"))
  (tmp_path / "out/meta.json").unlink()
  with pytest.raises(ConfigError, match="no meta.json"):
    PreparedCorpus(str(tmp_path / "out"))


def test_a_text_corpus_has_no_mask_and_a_format_1_directory_still_loads(tmp_path):
  p.prepare([str(write_inputs(tmp_path / "in") / "a.jsonl")], "bytes", str(tmp_path / "out"))
  meta_file = tmp_path / "out/meta.json"
  meta = json.loads(meta_file.read_text())
  assert (meta["format"], meta["input_format"], meta["loss_mask"]) == (2, "text", False)
  assert not (tmp_path / "out/loss_mask.bin").exists()
  version_1 = {key: value for key, value in meta.items()
               if key not in ("input_format", "loss_mask")}
  meta_file.write_text(json.dumps({**version_1, "format": 1}))
  windows = PreparedCorpus(str(tmp_path / "out")).windows("train", seq_len=8, vocab_size=256,
                                                          key="config.data.path")
  assert windows.num_windows and windows.loss_mask(np.arange(2)) is None
  meta_file.write_text(json.dumps({**meta, "format": 3}))
  with pytest.raises(ConfigError, match="format 3"):
    PreparedCorpus(str(tmp_path / "out"))


def bad_tokenizer(tmp_path):
  file = tmp_path / "tokenizer.json"
  file.write_text("{not json")
  return str(file)


@pytest.mark.parametrize("case, key", [
    ("missing tokenizer", "--tokenizer"), ("invalid tokenizer", "--tokenizer"),
    ("bad train size", "--tokenizer"), ("no text field", "--text_field"),
    ("no parquet column", "--text_field"), ("empty corpus", "--input"),
    ("no such input", "--input"), ("out exists", "--out")])
def test_bad_input_names_the_flag_and_writes_nothing(tmp_path, case, key):
  inputs = write_inputs(tmp_path / "in")
  (tmp_path / "in/empty.txt").write_text("\n \n")
  args = {"inputs": [str(inputs / "a.jsonl")], "tokenizer_spec": "bytes",
          "out": str(tmp_path / "new/sub/out")}
  args.update({
      "missing tokenizer": {"tokenizer_spec": str(tmp_path / "nope.json")},
      "invalid tokenizer": {"tokenizer_spec": bad_tokenizer(tmp_path)},
      "bad train size": {"tokenizer_spec": "train:many"},
      "no text field": {"text_field": "body"},
      "no parquet column": {"inputs": [str(inputs / "b.parquet")], "text_field": "body"},
      "empty corpus": {"inputs": [str(inputs / "empty.txt")]},
      "no such input": {"inputs": [str(inputs / "*.csv")]},
      "out exists": {"out": str(inputs)}}[case])
  before = sorted(tmp_path.rglob("*"))
  with pytest.raises(ConfigError) as error:
    p.prepare(**args)
  assert error.value.key == key and "\n" not in str(error.value)
  assert sorted(tmp_path.rglob("*")) == before


def test_cli_reports_bad_input_on_one_line_and_writes_nothing(tmp_path, capfd):
  inputs = write_inputs(tmp_path / "in")
  code, _, err = cli_in_process(["prepare", "--input", str(inputs / "b.parquet"),
                                 str(inputs / "a.jsonl"), "--out", str(tmp_path / "out"),
                                 "--text_field=body"], capfd)
  assert code == 2
  assert err.strip().splitlines() == [
      f"error: --text_field: {inputs / 'a.jsonl'} line 1 has no field 'body'; set --text_field to "
      "the field that holds the text"]  # the paths after --input are inputs, read in sorted order
  assert sorted(tmp_path.iterdir()) == [tmp_path / "in"]
