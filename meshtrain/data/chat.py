"""Conversations for supervised fine-tuning (`meshtrain prepare --format chat`).

Input: JSONL, one conversation a line, in the OpenAI / transformers chat
format: `{"messages": [{"role": ROLE, "content": TEXT}, ...]}`, ROLE one of
`ROLES` (`tool` where the template renders it). A message's other keys
(`tool_calls`, `name`, ...) reach the template as they are; keys whose value
is null are dropped, as transformers drops them; an assistant message with
`tool_calls` may have null content.

Rendering: the tokenizer directory's own chat template (`chat_template.jinja`,
else `chat_template` in `tokenizer_config.json`, its "default" one where it
holds several), rendered as transformers' `apply_chat_template` renders it: in
jinja2's `ImmutableSandboxedEnvironment` (a template is code from a downloaded
file) with `trim_blocks` and `lstrip_blocks`, the `loopcontrols` extension,
transformers' `tojson` filter (no HTML escaping) and its `raise_exception` and
`strftime_now` globals (a template that prints today's date makes the output
depend on the day), `{% generation %}` blocks rendered as their body, the named
special tokens of tokenizer_config.json (`bos_token`, `eos_token`, ...) as
variables, `tools` and `documents` None and `add_generation_prompt` false. The
text is encoded without adding special tokens (the template wrote them), so a
conversation's ids are `apply_chat_template(messages, tokenize=True)`'s; it is
one document of the prepared corpus as it is, nothing added.

Loss mask: a token counts (1) when its characters overlap the span of an
assistant message, else 0 (the rule of transformers' assistant tokens mask,
with spans found without `{% generation %}` tags, which Llama 3's and
Qwen2.5's templates lack). Assistant message i spans the rendered text from
the end of `render(messages[:i], add_generation_prompt=True)`, that is after
its role header, to the end of `render(messages[:i + 1])` less trailing
whitespace: its content and the end-of-turn marker the template writes after
it (`<|eot_id|>`, `<|im_end|>`), not the separator that follows the marker
(Qwen's newline). Both renders must be prefixes of the whole conversation's
text; a template that renders earlier turns differently once later ones
follow (one that drops earlier reasoning, say) is refused, since its assistant
turns cannot be found this way.
"""

import datetime
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
import numpy as np

from meshtrain.data import tokenizer as tk
from meshtrain.errors import ConfigError

ROLES = ("system", "user", "assistant", "tool")
TEMPLATE_FILE = "chat_template.jinja"
CONFIG_FILE = "tokenizer_config.json"
# The special tokens transformers gives a template by name (its `special_tokens_map`).
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                       "cls_token", "mask_token")
LINE_FORMAT = '{"messages": [{"role": "user", "content": "..."}, ...]}'
# What a template's own code raises on input it refuses (besides raise_exception's TemplateError),
# or where it fails itself (a division by zero, a missing key, endless recursion).
_TEMPLATE_ERRORS = (jinja2.TemplateError, TypeError, ValueError, ArithmeticError, LookupError,
                    RecursionError)


class Conversation(NamedTuple):
  """One input line: its messages, where it is ("FILE line N") and its size in bytes."""

  messages: list[dict]
  where: str
  size: int


class ChatTemplate:
  """A tokenizer directory's chat template, compiled in the immutable sandbox."""

  def __init__(self, source: str, variables: dict[str, str], *, origin: str):
    """`variables`: the special tokens by name; `origin` names the template in errors."""
    self.origin = origin
    self._variables = variables
    try:
      self._template = _environment().from_string(source)
    except jinja2.TemplateSyntaxError as error:
      raise ConfigError("--tokenizer", f"the chat template in {origin} is not valid jinja "
                        f"({error.message}, template line {error.lineno})") from None

  def render(self, messages: list[dict], *, add_generation_prompt: bool = False) -> str:
    return self._template.render(messages=messages, tools=None, documents=None,
                                 add_generation_prompt=add_generation_prompt, **self._variables)

  def text_and_assistant_spans(self, conversation: Conversation
                               ) -> tuple[str, list[tuple[int, int]]]:
    """The conversation's text and each assistant message's character span (module docstring)."""
    messages = conversation.messages
    text = self._render(conversation, messages)
    spans = []
    for i, message in enumerate(messages):
      if message["role"] != "assistant":
        continue
      head = self._render(conversation, messages[:i], add_generation_prompt=True)
      turn = self._render(conversation, messages[:i + 1])
      if not (text.startswith(head) and text.startswith(turn)):
        raise ConfigError("--input", f"{conversation.where}: the chat template in {self.origin} "
                          "renders the start of the conversation differently once more messages "
                          "follow, so its assistant turns cannot be found; use a template that "
                          "renders a conversation's start the same whatever follows")
      spans.append((len(head), max(len(head), len(turn.rstrip()))))
    return text, spans

  def _render(self, conversation: Conversation, messages: list[dict], *,
              add_generation_prompt: bool = False) -> str:
    try:
      return self.render(messages, add_generation_prompt=add_generation_prompt)
    except _TEMPLATE_ERRORS as error:
      raise ConfigError("--input", f"{conversation.where}: the chat template in {self.origin} "
                        f"refuses the conversation ({_one_line(error)}); fix the conversation "
                        "or use a template that handles it") from None


def load(spec: str, *, key: str) -> tuple[tk.HuggingFaceTokenizer, ChatTemplate]:
  """The tokenizer and chat template of the Hugging Face tokenizer directory `spec`."""
  directory = Path(spec)
  fix = ("give the directory of a chat (instruct) model's tokenizer: tokenizer.json and "
         f"{CONFIG_FILE} with its chat_template")
  if not (directory / tk.TOKENIZER_FILE).is_file():
    raise ConfigError(key, f"{spec!r} is not a Hugging Face tokenizer directory; --format chat "
                      f"renders conversations with the tokenizer's own chat template: {fix}")
  tokenizer = tk.load(spec, key=key)
  if not isinstance(tokenizer, tk.HuggingFaceTokenizer):
    raise ConfigError(key, f"{spec} holds a byte-level corpus, not a Hugging Face tokenizer; {fix}")
  config = _config(directory, key)
  source, origin = _template_source(directory, config, key)
  if source is None:
    raise ConfigError(key, f"{directory} has no chat_template (neither in {CONFIG_FILE} nor in "
                      f"{TEMPLATE_FILE}); {fix}")
  variables = {name: _token_text(config[name]) for name in SPECIAL_TOKEN_NAMES
               if config.get(name) is not None}
  return tokenizer, ChatTemplate(source, variables, origin=str(origin))


def parse_messages(record: Any, where: str) -> list[dict]:
  """The checked messages of one parsed input line, null-valued keys dropped."""
  fix = f"give each line as {LINE_FORMAT}"
  if not isinstance(record, dict) or not isinstance(record.get("messages"), list):
    raise ConfigError("--input", f"{where} has no \"messages\" list; {fix}")
  if not record["messages"]:
    raise ConfigError("--input", f"{where} has no messages; {fix}")
  checked = []
  for number, message in enumerate(record["messages"], 1):
    if not isinstance(message, dict):
      raise ConfigError("--input", f"{where}: message {number} is not an object; {fix}")
    message = {name: value for name, value in message.items() if value is not None}
    role, content = message.get("role"), message.get("content")
    if not isinstance(role, str):
      raise ConfigError("--input", f"{where}: message {number} has no \"role\"; {fix}")
    if role not in ROLES:
      raise ConfigError("--input", f"{where}: message {number} has role {role!r}; use one of "
                        f"{', '.join(ROLES)}")
    if not isinstance(content, str) and not (content is None and message.get("tool_calls")):
      raise ConfigError("--input", f"{where}: message {number} has no \"content\" text; {fix}")
    checked.append(message)
  return checked


def encode(tokenizer: tk.HuggingFaceTokenizer, template: ChatTemplate,
           conversations: Sequence[Conversation]) -> tuple[list[np.ndarray], list[np.ndarray]]:
  """Each conversation's ids and loss mask (uint8, 1 where the token counts)."""
  rendered = [template.text_and_assistant_spans(c) for c in conversations]
  encodings = tokenizer.tokenizer.encode_batch([text for text, _ in rendered],
                                               add_special_tokens=False)
  ids = [np.asarray(encoding.ids, np.int64) for encoding in encodings]
  masks = [_token_mask(np.asarray(encoding.offsets, np.int64).reshape(-1, 2), spans)
           for encoding, (_, spans) in zip(encodings, rendered)]
  return ids, masks


def _token_mask(offsets: np.ndarray, spans: Sequence[tuple[int, int]]) -> np.ndarray:
  """1 for each token (character offsets [start, end)) that overlaps a span."""
  mask = np.zeros(len(offsets), np.uint8)
  for start, end in spans:
    mask |= (offsets[:, 0] < end) & (offsets[:, 1] > start)
  return mask


def _config(directory: Path, key: str) -> dict:
  file = directory / CONFIG_FILE
  if not file.is_file():
    return {}
  try:
    config = json.loads(file.read_text(encoding="utf-8"))
    if not isinstance(config, dict):
      raise ValueError(f"it holds {type(config).__name__}, not an object")
  except (OSError, ValueError) as error:
    raise ConfigError(key, f"{file} is unreadable ({error}); restore it from the model") from None
  return config


def _template_source(directory: Path, config: dict, key: str) -> tuple[str | None, Path]:
  """The template (None if there is none) and its file: chat_template.jinja first, as
  transformers reads it, else the config's, its "default" one where it names several."""
  jinja_file = directory / TEMPLATE_FILE
  if jinja_file.is_file():
    try:
      return jinja_file.read_text(encoding="utf-8"), jinja_file
    except (OSError, UnicodeDecodeError) as error:
      raise ConfigError(key, f"{jinja_file} is unreadable ({error}); restore it from the "
                        "model") from None
  template = config.get("chat_template")
  if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
    template = next((named.get("template") for named in template
                     if isinstance(named, dict) and named.get("name") == "default"), None)
  return (template if isinstance(template, str) and template else None), directory / CONFIG_FILE


def _token_text(token: str | dict) -> str:
  """A special token as tokenizer_config.json writes it: text, or an AddedToken object."""
  return token["content"] if isinstance(token, dict) else str(token)


def _one_line(error: Exception) -> str:
  return " ".join(str(error).split()) or type(error).__name__


class _GenerationBlocks(jinja2.ext.Extension):
  """`{% generation %}...{% endgeneration %}`, transformers' assistant-mask tags,
  render their body as they do there; the mask comes from the spans above."""

  tags = frozenset({"generation"})

  def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.CallBlock:
    lineno = next(parser.stream).lineno
    body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
    return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

  def _body(self, caller) -> str:
    return caller()


def _environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
  """The environment transformers renders chat templates in."""
  environment = jinja2.sandbox.ImmutableSandboxedEnvironment(
      trim_blocks=True, lstrip_blocks=True,
      extensions=[_GenerationBlocks, jinja2.ext.loopcontrols])
  environment.filters["tojson"] = _tojson
  environment.globals["raise_exception"] = _raise_exception
  environment.globals["strftime_now"] = _strftime_now
  return environment


def _raise_exception(message: str):
  raise jinja2.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
  return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                    sort_keys=sort_keys)


def _strftime_now(date_format: str) -> str:
  return datetime.datetime.now().strftime(date_format)
