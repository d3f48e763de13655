"""A random tiny chat model and conversations to fine-tune it on, offline: the
stand-in for a downloaded Hugging Face chat model in docs/huggingface.md's walkthrough.

  python examples/tiny_chat_model.py OUT

Writes OUT/model: a Qwen2-architecture model (random weights) with a byte-level
BPE tokenizer that knows ChatML's special tokens and a ChatML `chat_template`
in tokenizer_config.json, as Qwen's instruct models ship; and
OUT/conversations.jsonl: 2000 conversations in the chat format
(`{"messages": [...]}`) where the assistant adds two small numbers, for the
loss to fall on.
"""

import json
import random
import sys
from pathlib import Path

import tokenizers
import transformers

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
          "message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt "
          "%}{{ '<|im_start|>assistant\\n' }}{% endif %}")
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def conversations(count: int, seed: int = 0) -> list[dict]:
  rng = random.Random(seed)
  lines = []
  for _ in range(count):
    a, b = rng.randrange(50), rng.randrange(50)
    lines.append({"messages": [
        {"role": "system", "content": "You add numbers."},
        {"role": "user", "content": f"What is {a} + {b}?"},
        {"role": "assistant", "content": f"{a} + {b} = {a + b}."}]})
  return lines


def save_tokenizer(directory: Path, texts: list[str]) -> int:
  """A byte-level BPE trained on `texts`; returns its vocabulary size."""
  tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE())
  tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.decoder = tokenizers.decoders.ByteLevel()
  trainer = tokenizers.trainers.BpeTrainer(
      vocab_size=384, special_tokens=SPECIAL, show_progress=False,
      initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
  tokenizer.train_from_iterator(texts, trainer=trainer)
  tokenizer.save(str(directory / "tokenizer.json"))
  (directory / "tokenizer_config.json").write_text(json.dumps(
      {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHATML,
       "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None}, indent=2))
  return tokenizer.get_vocab_size()


def main(out: Path) -> None:
  model_dir = out / "model"
  model_dir.mkdir(parents=True)
  lines = conversations(2000)
  vocab = save_tokenizer(model_dir, [m["content"] for line in lines for m in line["messages"]])
  eos = SPECIAL.index("<|im_end|>")
  config = transformers.Qwen2Config(
      vocab_size=vocab, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
      num_key_value_heads=2, intermediate_size=128, tie_word_embeddings=True,
      eos_token_id=eos, bos_token_id=None, pad_token_id=0)
  transformers.Qwen2ForCausalLM(config).save_pretrained(model_dir)
  (out / "conversations.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
  print(f"wrote {model_dir} ({vocab} ids) and {out / 'conversations.jsonl'}")


if __name__ == "__main__":
  main(Path(sys.argv[1]))
