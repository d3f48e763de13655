"""Logical names for models written without them: ordered path patterns.

A pattern list maps a parameter's path ("layers/0/attn/query/kernel") to the
logical names of its dimensions. The first pattern that matches both the path
and the parameter's rank wins; the last should be the catch-all `(".*", None)`,
which leaves a parameter replicated. A path that matches only patterns of
another rank is an error, not a guess.

The tables below cover the naming conventions of public Flax model families;
`FLAX_TRANSFORMER` is all of them with the catch-all. Put your own patterns in
front: `[(r"my_proj/kernel$", ("embed", "mlp")), *FLAX_TRANSFORMER]`.
"""

import re
from collections.abc import Sequence

import jax

from meshtrain import rules as r

Patterns = Sequence[tuple[str, tuple[str | None, ...] | None]]

_ATTN_IN = (r.EMBED, r.HEADS, r.HEAD_DIM)
_ATTN_OUT = (r.HEADS, r.HEAD_DIM, r.EMBED)

# flax's own layers with the attribute names their docs and examples use:
# nnx.Embed, nnx.MultiHeadAttention / nn.MultiHeadDotProductAttention
# (query/key/value/out, DenseGeneral 3-D kernels), an MLP of Linear/Dense
# layers, T5X/MaxText-style wi/wo, and a language-model head.
FLAX_LAYERS: Patterns = (
    (r"(^|/)(embed\w*|wte|tok\w*_embeddings?|word_embeddings)/embedding$", (r.VOCAB, r.EMBED)),
    (r"(^|/)(pos\w*_embed\w*|wpe)(/embedding)?$", (None, r.EMBED)),
    (r"(^|/)(pos\w*_embed\w*|wpe)(/embedding)?$", (None, None, r.EMBED)),
    (r"(^|/)(query|key|value)/kernel$", _ATTN_IN),
    (r"(^|/)(query|key|value)/kernel$", (r.EMBED, r.HEADS)),
    (r"(^|/)(query|key|value)/bias$", (r.HEADS, r.HEAD_DIM)),
    (r"(^|/)(query|key|value)/bias$", (r.HEADS,)),
    (r"(^|/)out/kernel$", _ATTN_OUT),
    (r"(^|/)out/kernel$", (r.HEADS, r.EMBED)),
    (r"(^|/)(up|gate|fc1|linear1|wi\w*)/kernel$", (r.EMBED, r.MLP)),
    (r"(^|/)(up|gate|fc1|linear1|wi\w*)/bias$", (r.MLP,)),
    (r"(^|/)(down|fc2|linear2|wo)/kernel$", (r.MLP, r.EMBED)),
    (r"(^|/)(head|lm_head|unembed\w*|logit\w*)/kernel$", (r.EMBED, r.VOCAB)),
    (r"(^|/)(head|lm_head|unembed\w*|logit\w*)/bias$", (r.VOCAB,)),
)

# Linen's automatic names (`nn.Dense(...)` inside `@nn.compact` without a
# name): Embed_0, Dense_0, ... Inside an MLP block, or a transformer block
# whose attention is its own submodule, Dense_0 is the up projection and
# Dense_1 the down one; a Dense at the top of the model is the head.
LINEN_AUTO_NAMES: Patterns = (
    (r"(^|/)Embed_\d+/embedding$", (r.VOCAB, r.EMBED)),
    (r"(^|/)\w*(Mlp|MLP|FeedForward|FFN|Ffn|Block|Layer)\w*/Dense_0/kernel$", (r.EMBED, r.MLP)),
    (r"(^|/)\w*(Mlp|MLP|FeedForward|FFN|Ffn|Block|Layer)\w*/Dense_0/bias$", (r.MLP,)),
    (r"(^|/)\w*(Mlp|MLP|FeedForward|FFN|Ffn|Block|Layer)\w*/Dense_1/kernel$", (r.MLP, r.EMBED)),
    (r"^Dense_\d+/kernel$", (r.EMBED, r.VOCAB)),
    (r"^Dense_\d+/bias$", (r.VOCAB,)),
)

# Gemma (google-deepmind/gemma, flax's examples/gemma in NNX): Einsum weights
# `w` of shape (heads, embed, head_dim), kv and qkv stacked on a leading axis.
GEMMA_NAMES: Patterns = (
    (r"(^|/)input_embedding$", (r.VOCAB, r.EMBED)),
    (r"(^|/)q_einsum/w$", (r.HEADS, r.EMBED, r.HEAD_DIM)),
    (r"(^|/)kv_einsum/w$", (None, r.KV_HEADS, r.EMBED, r.HEAD_DIM)),
    (r"(^|/)qkv_einsum/w$", (None, r.HEADS, r.EMBED, r.HEAD_DIM)),
    (r"(^|/)attn_vec_einsum/w$", (r.HEADS, r.HEAD_DIM, r.EMBED)),
    (r"(^|/)gating_einsum(/w)?$", (None, r.EMBED, r.MLP)),
    (r"(^|/)mlp/linear(/w)?$", (r.MLP, r.EMBED)),
)

# Hugging Face transformers' Flax ports (Llama, Mistral, Gemma, GPT-NeoX, ...)
# and NNX models written in their style: 2-D projections named *_proj.
HF_FLAX_NAMES: Patterns = (
    (r"(^|/)q_proj/kernel$", (r.EMBED, r.HEADS)),
    (r"(^|/)(k_proj|v_proj)/kernel$", (r.EMBED, r.KV_HEADS)),
    (r"(^|/)q_proj/bias$", (r.HEADS,)),
    (r"(^|/)(k_proj|v_proj)/bias$", (r.KV_HEADS,)),
    (r"(^|/)o_proj/kernel$", (r.HEADS, r.EMBED)),
    (r"(^|/)(gate_proj|up_proj)/kernel$", (r.EMBED, r.MLP)),
    (r"(^|/)(gate_proj|up_proj)/bias$", (r.MLP,)),
    (r"(^|/)down_proj/kernel$", (r.MLP, r.EMBED)),
)

CATCH_ALL = (".*", None)
FLAX_TRANSFORMER: Patterns = (*FLAX_LAYERS, *GEMMA_NAMES, *HF_FLAX_NAMES, *LINEN_AUTO_NAMES,
                              CATCH_ALL)


def path_string(path) -> str:
  return "/".join(str(getattr(key, "key", getattr(key, "idx", getattr(key, "name", key))))
                  for key in path)


def names_by_path(abstract_params, patterns: Patterns):
  """A tree of logical-name tuples, one per parameter, from the first pattern
  that matches its path and its rank."""
  compiled = [(re.compile(pattern), names) for pattern, names in patterns]

  def names_of(path, leaf):
    where = path_string(path)
    misfits = []
    for pattern, names in compiled:
      if not pattern.search(where):
        continue
      if names is None and misfits:
        break
      if names is None:
        return (None,) * leaf.ndim
      if len(names) == leaf.ndim:
        return tuple(names)
      misfits.append(f"{pattern.pattern!r} names {len(names)} dimensions {names}")
    if misfits:
      raise ValueError(f"{where} has shape {tuple(leaf.shape)}, but the patterns that match "
                       f"it do not fit its rank: {'; '.join(misfits)}")
    raise ValueError(f"no pattern matches {where}; end the list with the catch-all ('.*', None)")

  return jax.tree_util.tree_map_with_path(names_of, abstract_params)
