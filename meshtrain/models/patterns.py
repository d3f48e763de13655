"""Logical names for models written without them: ordered path patterns.

A pattern list maps a parameter's path ("layers/0/attn/query/kernel") to the
logical names of its dimensions. The first pattern that matches wins; the last
should be the catch-all `(".*", None)`, which leaves a parameter replicated.
A pattern whose names do not fit the parameter's rank is an error, not a guess.
"""

import re
from collections.abc import Sequence

import jax

from meshtrain import rules as r

Patterns = Sequence[tuple[str, tuple[str | None, ...] | None]]

# Paths of flax's own layers (nnx.Embed, nnx.MultiHeadAttention, nnx.Linear in
# an MLP, norms and biases), as a transformer built from them names them.
FLAX_TRANSFORMER: Patterns = (
    (r"(^|/)embed\w*/embedding$", (r.VOCAB, r.EMBED)),
    (r"(^|/)(query|key|value)/kernel$", (r.EMBED, r.HEADS, r.HEAD_DIM)),
    (r"(^|/)(query|key|value)/bias$", (r.HEADS, r.HEAD_DIM)),
    (r"(^|/)out/kernel$", (r.HEADS, r.HEAD_DIM, r.EMBED)),
    (r"(^|/)(up|gate|fc1|linear1|wi\w*)/kernel$", (r.EMBED, r.MLP)),
    (r"(^|/)(up|gate|fc1|linear1|wi\w*)/bias$", (r.MLP,)),
    (r"(^|/)(down|fc2|linear2|wo)/kernel$", (r.MLP, r.EMBED)),
    (r"(^|/)(head|lm_head|unembed\w*)/kernel$", (r.EMBED, r.VOCAB)),
    (r".*", None),
)


def path_string(path) -> str:
  return "/".join(str(getattr(key, "key", getattr(key, "idx", getattr(key, "name", key))))
                  for key in path)


def names_by_path(abstract_params, patterns: Patterns):
  """A tree of logical-name tuples, one per parameter, from the first matching pattern."""
  compiled = [(re.compile(pattern), names) for pattern, names in patterns]

  def names_of(path, leaf):
    where = path_string(path)
    for pattern, names in compiled:
      if pattern.search(where):
        if names is None:
          return (None,) * leaf.ndim
        if len(names) != leaf.ndim:
          raise ValueError(f"pattern {pattern.pattern!r} names {len(names)} dimensions "
                           f"{names}, but {where} has shape {tuple(leaf.shape)}")
        return tuple(names)
    raise ValueError(f"no pattern matches {where}; end the list with the catch-all ('.*', None)")

  return jax.tree_util.tree_map_with_path(names_of, abstract_params)
