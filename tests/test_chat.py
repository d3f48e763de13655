"""Tests for `meshtrain prepare --format chat`: ids against transformers on real chat
templates, the assistant loss mask, the prepared directory and its batches, bad input."""

import json
from typing import NamedTuple

import ml_collections
import numpy as np
import pytest
import tokenizers

from conftest import cli_in_process
from meshtrain.data import chat, make_iterator
from meshtrain.data import prepare as p
from meshtrain.data.tokens import PreparedCorpus
from meshtrain.errors import ConfigError

# The chat_template of Llama 3 Instruct and of Qwen2.5 Instruct exactly as their
# tokenizer_config.json ship it (huggingface.co/meta-llama/Meta-Llama-3-70B-Instruct at
# a5a71a7, the same in 8B; huggingface.co/Qwen/Qwen2.5-72B-Instruct, the same in every size).
LLAMA3_INSTRUCT = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim "
    "+ '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif "
    "%}{{ content }}{% endfor %}{% if add_generation_prompt %}{{ "
    "'<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")

QWEN2_5_INSTRUCT = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user \
query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" \
}}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and \
arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \
\\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful \
assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or \
(message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""
# transformers' assistant mask comes from these tags: a ChatML template with them.
CHATML_WITH_GENERATION_TAGS = """\
{%- for message in messages %}
    {%- if message.role == "assistant" %}
        {{- '<|im_start|>assistant\\n' }}
        {%- generation %}
            {{- message.content + '<|im_end|>' }}
        {%- endgeneration %}
        {{- '\\n' }}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""


class Family(NamedTuple):
  """A model family's chat template, special tokens and tokenizer_config.json entries."""

  template: str
  special_tokens: list[str]
  config: dict
  end_of_turn: str
  trims_content: bool  # the template strips each message's content


FAMILIES = {
    "llama3": Family(LLAMA3_INSTRUCT, ["<|begin_of_text|>", "<|end_of_text|>",
                                       "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
                     {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
                     "<|eot_id|>", trims_content=True),
    "qwen2.5": Family(QWEN2_5_INSTRUCT, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                      {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
                      "<|im_end|>", trims_content=False),
    "chatml_tags": Family(CHATML_WITH_GENERATION_TAGS, ["<|endoftext|>", "<|im_start|>",
                                                        "<|im_end|>"],
                          {"eos_token": "<|im_end|>"}, "<|im_end|>", trims_content=False),
}


def user(content):
  return {"role": "user", "content": content}


def assistant(content):
  return {"role": "assistant", "content": content}


CONVERSATIONS = [
    [user("What is the capital of France?"), assistant("Paris.")],
    [{"role": "system", "content": "You answer in a few words."}, user("Colour of the sky?"),
     assistant("Blue"), user("And grass?"), assistant("Green, mostly.\nSometimes brown.")],
    [user("Traduis « bonjour » en japonais."), assistant("こんにちは — konnichiwa 👋"),
     user("Merci !"), assistant("  De rien. ")],
]
WEATHER_CALL = {"type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
# Qwen2.5's template renders tool calls and results; Llama 3's first template does not.
TOOL_CONVERSATION = [
    user("Weather in Paris?"), {"role": "assistant", "content": None, "tool_calls": [WEATHER_CALL]},
    {"role": "tool", "content": "{\"celsius\": 21}"}, assistant("21 °C and sunny.")]
TOOL_CALL_TURN = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
                  "</tool_call><|im_end|>")


def conversations_of(family: str) -> list[list[dict]]:
  return CONVERSATIONS + ([TOOL_CONVERSATION] if family == "qwen2.5" else [])


def save_tokenizer(directory, family: Family, **config):
  """A byte-level BPE that knows the family's special tokens, as a Hugging Face
  directory transformers loads offline; `config` changes tokenizer_config.json."""
  directory.mkdir()
  tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE())
  tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.decoder = tokenizers.decoders.ByteLevel()
  trainer = tokenizers.trainers.BpeTrainer(
      vocab_size=400, special_tokens=family.special_tokens, show_progress=False,
      initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
  texts = [m.get("content") or "" for c in CONVERSATIONS + [TOOL_CONVERSATION] for m in c]
  tokenizer.train_from_iterator(texts + [family.template], trainer=trainer)
  tokenizer.save(str(directory / "tokenizer.json"))
  (directory / "tokenizer_config.json").write_text(json.dumps(
      {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": family.template,
       **family.config, **config}))
  return directory


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
  """A family's name and its tokenizer directory."""
  name = request.param
  return name, save_tokenizer(tmp_path_factory.mktemp("tokenizers") / name, FAMILIES[name])


def encoded(directory, conversations):
  """Our ids and masks of the conversations."""
  tokenizer, template = chat.load(str(directory), key="--tokenizer")
  batch = [chat.Conversation(chat.parse_messages({"messages": c}, where), where, 0)
           for where, c in ((f"conversation {i}", c) for i, c in enumerate(conversations))]
  return chat.encode(tokenizer, template, batch)


def test_ids_equal_transformers_apply_chat_template(family):
  transformers = pytest.importorskip("transformers")
  name, directory = family
  reference = transformers.AutoTokenizer.from_pretrained(str(directory))
  conversations = conversations_of(name)
  ids, _ = encoded(directory, conversations)
  for conversation, got in zip(conversations, ids):
    expected = reference.apply_chat_template(conversation, tokenize=True, return_dict=False)
    assert got.tolist() == list(expected)


def test_a_template_saved_by_transformers_beside_the_config_is_read(family, tmp_path):
  """transformers >= 4.50 saves the template as chat_template.jinja."""
  transformers = pytest.importorskip("transformers")
  name, directory = family
  resaved = tmp_path / "resaved"
  transformers.AutoTokenizer.from_pretrained(str(directory)).save_pretrained(str(resaved))
  if not (resaved / chat.TEMPLATE_FILE).is_file():
    pytest.skip("this transformers keeps the template in tokenizer_config.json")
  config = json.loads((resaved / "tokenizer_config.json").read_text())
  assert "chat_template" not in config
  got, want = (encoded(d, conversations_of(name)) for d in (resaved, directory))
  assert [a.tolist() for arrays in got for a in arrays] == [
      a.tolist() for arrays in want for a in arrays]


def test_the_mask_holds_exactly_the_assistant_turns_and_their_end_markers(family):
  name, directory = family
  end_of_turn, trims_content = FAMILIES[name].end_of_turn, FAMILIES[name].trims_content
  decoder = tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
  conversations = conversations_of(name)
  for conversation, ids, mask in zip(conversations, *encoded(directory, conversations)):
    assert mask.dtype == np.uint8 and len(mask) == len(ids) and set(mask.tolist()) <= {0, 1}
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask, [0]])))
    turns = [decoder.decode(ids[a:b].tolist(), skip_special_tokens=False)
             for a, b in zip(edges[::2], edges[1::2])]
    expected = [TOOL_CALL_TURN if m.get("tool_calls") else
                (m["content"].strip() if trims_content else m["content"]) + end_of_turn
                for m in conversation if m["role"] == "assistant"]
    assert turns == expected


def test_the_mask_equals_transformers_assistant_mask_from_generation_tags(tmp_path):
  transformers = pytest.importorskip("transformers")
  directory = save_tokenizer(tmp_path / "tags", FAMILIES["chatml_tags"])
  reference = transformers.AutoTokenizer.from_pretrained(str(directory))
  for conversation, ids, mask in zip(CONVERSATIONS, *encoded(directory, CONVERSATIONS)):
    expected = reference.apply_chat_template(conversation, tokenize=True, return_dict=True,
                                             return_assistant_tokens_mask=True)
    assert ids.tolist() == list(expected["input_ids"])
    assert mask.tolist() == list(expected["assistant_masks"])


def test_the_default_of_named_templates_is_used(tmp_path):
  """A tokenizer_config.json may list templates by name, as [{"name", "template"}]."""
  named = [{"name": "tool_use", "template": "{{ raise_exception('not this one') }}"},
           {"name": "default", "template": QWEN2_5_INSTRUCT}]
  plain, listed = (save_tokenizer(tmp_path / name, FAMILIES["qwen2.5"], chat_template=template)
                   for name, template in (("plain", QWEN2_5_INSTRUCT), ("listed", named)))
  assert [a.tolist() for a in encoded(listed, CONVERSATIONS)[0]] == [
      a.tolist() for a in encoded(plain, CONVERSATIONS)[0]]


def write_conversations(file, conversations):
  file.write_text("".join(json.dumps({"messages": c}, ensure_ascii=False) + "\n"
                          for c in conversations))
  return file


def numbered_conversations(count: int) -> list[list[dict]]:
  """`count` conversations, each told apart by its number."""
  return [[{**m, "content": f"{m['content']} #{n}"} for m in CONVERSATIONS[n % 3]]
          for n in range(count)]


@pytest.fixture(scope="module")
def prepared(family, tmp_path_factory):
  """40 conversations prepared with the family's tokenizer, 20% held out."""
  _, directory = family
  inputs = write_conversations(tmp_path_factory.mktemp("chat") / "chat.jsonl",
                               numbered_conversations(40))
  out = inputs.parent / "out"
  meta = p.prepare([str(inputs)], str(directory), str(out), input_format="chat", val_fraction=0.2)
  return directory, out, meta


def test_each_conversation_is_one_document_with_its_mask_beside_it(prepared):
  directory, out, meta = prepared
  assert meta["format"] == p.FORMAT_VERSION == 2 and meta["loss_mask"] is True
  assert meta["input_format"] == "chat" and meta["documents"] == 40
  tokens = np.fromfile(out / "tokens.bin", meta["dtype"])
  mask = np.fromfile(out / "loss_mask.bin", np.uint8)
  starts = np.fromfile(out / "documents.bin", "<i8")
  assert len(tokens) == len(mask) == meta["tokens"] == starts[-1]
  ids, masks = encoded(directory, numbered_conversations(40))
  np.testing.assert_array_equal(starts[:-1], np.cumsum([0] + [len(i) for i in ids[:-1]]))
  np.testing.assert_array_equal(tokens, np.concatenate(ids))
  np.testing.assert_array_equal(mask, np.concatenate(masks))
  start, end = meta["split"]["val"]
  assert start in starts and end == len(tokens)  # the split cuts between conversations


def data_config(out, packing):
  return ml_collections.ConfigDict({"source": "tokens", "path": str(out), "packing": packing})


SEQ_LEN, GLOBAL_BATCH = 16, 8


@pytest.mark.parametrize("packing", ["concat", "segments"])
@pytest.mark.parametrize("split", ["train", "val"])
def test_batches_carry_the_mask_of_their_targets(prepared, packing, split):
  """A row's mask is that of the targets of a window of the split with the row's
  tokens (some windows of the repeated conversations have the same tokens)."""
  _, out, meta = prepared
  start, end = meta["split"][split]
  tokens = np.fromfile(out / "tokens.bin", meta["dtype"])[start:end]
  mask = np.fromfile(out / "loss_mask.bin", np.uint8)[start:end]
  window_starts_W = np.arange((len(tokens) - 1) // SEQ_LEN) * SEQ_LEN
  windows_WxL = tokens[window_starts_W[:, None] + np.arange(SEQ_LEN + 1)]
  target_masks_WxL = mask[window_starts_W[:, None] + np.arange(1, SEQ_LEN + 1)]
  batches = make_iterator(data_config(out, packing), seq_len=SEQ_LEN, global_batch=GLOBAL_BATCH,
                          vocab_size=meta["vocab_size"], seed=0, split=split)
  for batch in (next(batches) for _ in range(3)):
    assert batch["loss_mask"].dtype == np.int32
    assert batch["loss_mask"].shape == batch["targets"].shape == (GLOBAL_BATCH, SEQ_LEN)
    for inputs, targets, row_mask in zip(batch["inputs"], batch["targets"], batch["loss_mask"]):
      row = np.concatenate([inputs, targets[-1:]])
      same_tokens = (windows_WxL == row).all(axis=1)
      assert same_tokens.any() and (target_masks_WxL[same_tokens] == row_mask).all(axis=1).any()
    assert 0 < batch["loss_mask"].sum() < batch["loss_mask"].size


def test_a_resumed_iterator_gives_the_same_masks(prepared):
  _, out, meta = prepared

  def iterator():
    return make_iterator(data_config(out, "segments"), seq_len=SEQ_LEN,
                         global_batch=GLOBAL_BATCH, vocab_size=meta["vocab_size"], seed=1)

  batches = iterator()
  next(batches)
  state = json.loads(json.dumps(batches.get_state()))
  expected = next(batches)
  resumed = iterator()
  resumed.set_state(state)
  got = next(resumed)
  assert set(got) == {"inputs", "targets", "segment_ids", "positions", "loss_mask"}
  for key in got:
    np.testing.assert_array_equal(got[key], expected[key])


def test_a_truncated_mask_is_refused(prepared, tmp_path):
  _, out, _ = prepared
  copy = tmp_path / "copy"
  copy.mkdir()
  for file in out.iterdir():
    (copy / file.name).write_bytes(file.read_bytes())
  (copy / "loss_mask.bin").write_bytes((out / "loss_mask.bin").read_bytes()[:100])
  with pytest.raises(ConfigError, match="loss_mask.bin has 100 bytes where meta.json says"):
    PreparedCorpus(str(copy))


# A template that refuses system messages, the way several models' templates do.
NO_SYSTEM_TEMPLATE = ("{% for message in messages %}{% if message['role'] == 'system' %}"
                      "{{ raise_exception('System role not supported') }}{% endif %}"
                      "{{ message['role'] + ': ' + message['content'] + eos_token }}{% endfor %}")
GOOD_LINE = json.dumps({"messages": CONVERSATIONS[0]})
BAD_LINES = {
    "not json": ("{\"messages\": [", "line 2 is not JSON"),
    "no messages": (json.dumps({"conversation": CONVERSATIONS[0]}),
                    "line 2 has no \"messages\" list"),
    "messages not a list": (json.dumps({"messages": "hello"}), "line 2 has no \"messages\" list"),
    "no message": (json.dumps({"messages": []}), "line 2 has no messages"),
    "no role": (json.dumps({"messages": [{"content": "hi"}]}), "line 2: message 1 has no \"role\""),
    "no content": (json.dumps({"messages": [user("hi"), {"role": "assistant"}]}),
                   "line 2: message 2 has no \"content\""),
    "unknown role": (json.dumps({"messages": [{"role": "bot", "content": "hi"}]}),
                     "line 2: message 1 has role 'bot'; use one of system, user, assistant, tool"),
    "template raises": (json.dumps({"messages": CONVERSATIONS[1]}),
                        "line 2: the chat template in {tokenizer}/tokenizer_config.json refuses "
                        "the conversation (System role not supported)"),
}


@pytest.fixture
def chat_inputs(tmp_path):
  """A tokenizer directory whose template refuses system messages, and a good conversation."""
  tokenizer = save_tokenizer(tmp_path / "tokenizer", FAMILIES["qwen2.5"],
                             chat_template=NO_SYSTEM_TEMPLATE)
  return tokenizer, write_conversations(tmp_path / "good.jsonl", [CONVERSATIONS[0]])


def assert_refused(call, key, message, tmp_path):
  before = sorted(tmp_path.rglob("*"))
  with pytest.raises(ConfigError) as error:
    call()
  assert error.value.key == key and "\n" not in str(error.value)
  assert message in str(error.value)
  assert sorted(tmp_path.rglob("*")) == before


@pytest.mark.parametrize("case", list(BAD_LINES))
def test_a_bad_line_names_its_file_and_line_and_writes_nothing(chat_inputs, tmp_path, case):
  tokenizer, _ = chat_inputs
  line, message = BAD_LINES[case]
  file = tmp_path / "chat.jsonl"
  file.write_text(f"{GOOD_LINE}\n{line}\n")
  assert_refused(lambda: p.prepare([str(file)], str(tokenizer), str(tmp_path / "new/out"),
                                   input_format="chat"),
                 "--input", f"{file} " + message.format(tokenizer=tokenizer), tmp_path)


@pytest.mark.parametrize("case, message", [
    ("bytes", "'bytes' is not a Hugging Face tokenizer directory"),
    ("no template", "has no chat_template"),
    ("tokenizer.json file", "is not a Hugging Face tokenizer directory")])
def test_a_tokenizer_without_a_chat_template_is_refused(chat_inputs, tmp_path, case, message):
  tokenizer, good = chat_inputs
  if case == "no template":
    config = tokenizer / "tokenizer_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "chat_template": None}))
  spec = {"bytes": "bytes", "no template": str(tokenizer),
          "tokenizer.json file": str(tokenizer / "tokenizer.json")}[case]
  assert_refused(lambda: p.prepare([str(good)], spec, str(tmp_path / "out"), input_format="chat"),
                 "--tokenizer", message, tmp_path)


def test_a_template_that_renders_earlier_turns_differently_is_refused(chat_inputs, tmp_path):
  """Where the text of the first messages changes once more follow, the
  assistant's turns cannot be found from prefixes."""
  tokenizer, good = chat_inputs
  config = tokenizer / "tokenizer_config.json"
  config.write_text(json.dumps({**json.loads(config.read_text()), "chat_template":
                                "{{ messages | length }}{% for m in messages %}{{ m.content }}"
                                "{% endfor %}"}))
  assert_refused(lambda: p.prepare([str(good)], str(tokenizer), str(tmp_path / "out"),
                                   input_format="chat"),
                 "--input", f"{good} line 1: the chat template in {config} renders the start of "
                 "the conversation differently once more messages follow", tmp_path)


@pytest.mark.parametrize("template, reason", [
    ("{{ (messages | length) // 0 }}", "integer division or modulo by zero"),
    ("{{ 10.0 ** 100000 }}", "(34, 'Numerical result out of range')"),
    ("{% for m in messages %}{{ m.content.encode('x') }}{% endfor %}", "unknown encoding: x"),
    ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "maximum recursion depth exceeded")])
def test_a_template_that_fails_itself_is_refused(chat_inputs, tmp_path, template, reason):
  """Whatever a template's own code raises (it is a downloaded file) is one line."""
  tokenizer, good = chat_inputs
  config = tokenizer / "tokenizer_config.json"
  config.write_text(json.dumps({**json.loads(config.read_text()), "chat_template": template}))
  assert_refused(lambda: p.prepare([str(good)], str(tokenizer), str(tmp_path / "out"),
                                   input_format="chat"),
                 "--input", f"refuses the conversation ({reason}", tmp_path)


@pytest.mark.parametrize("name, body", [("chat_template.jinja", b"\xff\xfe{{ messages }}"),
                                        ("tokenizer_config.json", b"[1, 2]")])
def test_an_unreadable_template_or_config_is_refused(chat_inputs, tmp_path, name, body):
  tokenizer, good = chat_inputs
  (tokenizer / name).write_bytes(body)
  assert_refused(lambda: p.prepare([str(good)], str(tokenizer), str(tmp_path / "out"),
                                   input_format="chat"),
                 "--tokenizer", f"{tokenizer / name} is unreadable", tmp_path)


def test_chat_reads_only_jsonl(chat_inputs, tmp_path):
  tokenizer, _ = chat_inputs
  (tmp_path / "chat.txt").write_text("user: hi\n")
  assert_refused(lambda: p.prepare([str(tmp_path / "chat.txt")], str(tokenizer),
                                   str(tmp_path / "out"), input_format="chat"),
                 "--input", "is not a JSONL file", tmp_path)


def test_a_corpus_without_an_assistant_turn_is_refused(chat_inputs, tmp_path):
  """Every token's mask would be 0: a run on it learns nothing."""
  tokenizer, _ = chat_inputs
  file = write_conversations(tmp_path / "chat.jsonl", [[user("hi")], [user("and you?")]])
  assert_refused(lambda: p.prepare([str(file)], str(tokenizer), str(tmp_path / "out"),
                                   input_format="chat"),
                 "--input", "no conversation has an assistant turn", tmp_path)


def test_cli_reports_a_refusing_template_on_one_line_and_writes_nothing(chat_inputs, tmp_path,
                                                                         capfd):
  tokenizer, _ = chat_inputs
  file = write_conversations(tmp_path / "chat.jsonl", [CONVERSATIONS[0], CONVERSATIONS[1]])
  before = sorted(tmp_path.rglob("*"))
  code, _, err = cli_in_process(["prepare", "--format", "chat", "--input", str(file),
                                 "--tokenizer", str(tokenizer), "--out", str(tmp_path / "out")],
                                capfd)
  assert code == 2
  assert err.strip().splitlines() == [
      f"error: --input: {file} line 2: the chat template in {tokenizer}/tokenizer_config.json "
      "refuses the conversation (System role not supported); fix the conversation or use a "
      "template that handles it"]
  assert sorted(tmp_path.rglob("*")) == before


def test_a_corpus_with_a_loss_mask_keeps_conversations_apart_by_default(prepared, tmp_path):
  """The default packing ("auto") of a chat corpus is `segments`: a
  conversation does not attend to the one before it; a text corpus stays
  `concat`. The run's config holds the choice."""
  from meshtrain.config import get_config
  from meshtrain.train.run import with_packing
  _, out, meta = prepared
  cfg = get_config()
  cfg.data.update(source="tokens", path=str(out))
  assert cfg.data.packing == "auto" and with_packing(cfg).data.packing == "segments"
  batch = next(make_iterator(cfg.data, seq_len=SEQ_LEN, global_batch=GLOBAL_BATCH,
                             vocab_size=meta["vocab_size"], seed=0))
  assert batch.keys() == {"inputs", "targets", "loss_mask", "segment_ids", "positions"}
  text = tmp_path / "a.txt"
  text.write_text("plain text, no conversation " * 40)
  p.prepare([str(text)], "bytes", str(tmp_path / "text"))
  cfg.data.path = str(tmp_path / "text")
  assert with_packing(cfg).data.packing == "concat"
  batch = next(make_iterator(cfg.data, seq_len=SEQ_LEN, global_batch=GLOBAL_BATCH,
                             vocab_size=256, seed=0))
  assert batch.keys() == {"inputs", "targets"}
