"""`meshtrain prepare`: text, JSONL, Parquet or chat files tokenized into a corpus."""

from absl import flags

from meshtrain.cli import common
from meshtrain.data.prepare import INPUT_FORMATS, TEXT_FIELD, prepare
from meshtrain.errors import ConfigError

FLAGS = flags.FlagValues()
_INPUT = flags.DEFINE_multi_string("input", [], "text, JSONL or Parquet files, globs or "
                                   "directories (more paths may follow)", flag_values=FLAGS)
_FORMAT = flags.DEFINE_enum("format", "text", INPUT_FORMATS, "text: documents; chat: "
                            "JSONL conversations ({\"messages\": [...]} a line) rendered with the "
                            "--tokenizer directory's chat template, the assistant's turns masked "
                            "in for the loss", flag_values=FLAGS)
_TOKENIZER = flags.DEFINE_string("tokenizer", "bytes", "bytes | PATH to a tokenizer.json "
                                 "(or its directory, or a prepared corpus) | train:N (a BPE of N "
                                 "ids); --format chat: a Hugging Face tokenizer directory",
                                 flag_values=FLAGS)
_TEXT_FIELD = flags.DEFINE_string("text_field", TEXT_FIELD, "the JSONL field / Parquet "
                                  "column holding the text", flag_values=FLAGS)
_SPLIT_BLANK_LINES = flags.DEFINE_bool("split_blank_lines", False, "blank lines separate "
                                       "documents in text files (default: one document per "
                                       "file)", flag_values=FLAGS)
_VAL_FRACTION = flags.DEFINE_float("val_fraction", 0.05, "share of the tokens held out "
                                   "for evaluation", flag_values=FLAGS)
_OUT = flags.DEFINE_string("out", None, "the directory to create", flag_values=FLAGS)


def main(argv: list[str]) -> None:
  inputs = _INPUT.value + argv[1:]  # `--input a b c`, as a shell glob expands
  if not inputs:
    raise ConfigError("--input", "give the text, JSONL or Parquet files to prepare")
  if not _OUT.value:
    raise ConfigError("--out", "give the directory to write the prepared corpus into")
  meta = prepare(inputs, _TOKENIZER.value, _OUT.value, input_format=_FORMAT.value,
                 text_field=_TEXT_FIELD.value, split_blank_lines=_SPLIT_BLANK_LINES.value,
                 val_fraction=_VAL_FRACTION.value)
  print(f"prepared {_OUT.value}: {meta['documents']:,} documents, {meta['tokens']:,} tokens "
        f"({meta['dtype']}, vocabulary {meta['vocab_size']}); validation tokens "
        f"{meta['split']['val'][1] - meta['split']['val'][0]:,}")


COMMAND = common.Command("prepare", FLAGS, main, positional=True,
                         paths=lambda: [("--out", _OUT.value, True)])
