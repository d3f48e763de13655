"""Which layers each pipeline chunk runs, and the stack of slots that holds them.

A layout gives chunk c = v*P + s (on stage s) `counts[c]` consecutive layers
of the model, in model order: even (every chunk the same) or uneven, as
Llama 3 405B ran 126 layers on 16 stages (one fewer on the first and the last,
which also run the embedding and the head). A stack of layers splits evenly
over `pipeline` only if every chunk has as many, so an uneven layout stores
the layers in slots: S = max(counts) per chunk, chunk c's layer l in slot
c*S + l, zeros in the slots after its last layer. `runtime.to_stages` then
splits the P*V*S slots into [V, P, S] with P over `pipeline` as it does the
layers of an even layout (where the slots are the layers themselves), and
each stage runs only its chunks' own layers.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np


def chunk_loads(counts, first: float = 0.0, last: float = 0.0) -> list[float]:
  """Each chunk's work in layers: its `counts` layers, and `first` layers'
  worth more on the first chunk, `last` more on the last."""
  loads = list(counts)
  loads[0] += first
  loads[-1] += last
  return loads


def balanced_counts(layers: int, chunks: int, first: float = 0.0,
                    last: float = 0.0) -> tuple[int, ...]:
  """Layers per chunk in model order, `layers` in all, that leave the busiest
  chunk (`chunk_loads`: the first also does `first`, such as an MoE model's
  leading dense layers, the last `last`, such as the head) the least work:
  a layer at a time to an empty chunk while there is one, else to the chunk
  it leaves least loaded; of equals, the one nearest the middle of the
  model, so that the chunks at the ends, which also embed and run the head,
  keep fewer. Every chunk gets a layer where there are as many; with no
  extra work, the layers go as evenly as they go, the spare ones (or, with
  fewer layers than chunks, the layers) on the chunks nearest the middle."""
  counts = [0] * chunks
  order = sorted(range(chunks), key=lambda c: abs(2 * c - (chunks - 1)))
  for _ in range(layers):
    loads = chunk_loads(counts, first, last)
    counts[min(order, key=lambda c: (counts[c] > 0, loads[c]))] += 1
  return tuple(counts)


@dataclasses.dataclass(frozen=True)
class StageLayout:
  counts: tuple[int, ...]  # layers of chunk c = v*P + s, in model order
  num_stages: int          # P

  @classmethod
  def even(cls, num_layers: int, num_stages: int, num_chunks: int) -> "StageLayout":
    chunks = num_stages * num_chunks
    if num_layers % chunks:
      raise ValueError(f"{num_layers} layers do not split evenly into {num_stages} stages x "
                       f"{num_chunks} chunks")
    return cls((num_layers // chunks,) * chunks, num_stages)

  @classmethod
  def balanced(cls, num_layers: int, num_stages: int, num_chunks: int) -> "StageLayout":
    """`balanced_counts` of the layers over the stages' chunks, with no work
    beyond the layers: even where they divide."""
    return cls(balanced_counts(num_layers, num_stages * num_chunks), num_stages)

  @classmethod
  @functools.lru_cache(maxsize=4096)  # a planner's search reads the same few layouts
  def parse(cls, text: str, num_layers: int, num_stages: int, num_chunks: int) -> "StageLayout":
    """`text` ("7,8,8,7": the layers of each chunk in model order; "": even)
    as a layout of `num_layers` layers; ValueError says what does not fit."""
    if not text.strip():
      return cls.even(num_layers, num_stages, num_chunks)
    try:
      counts = tuple(int(part) for part in text.split(","))
    except ValueError:
      raise ValueError(f"{text!r} is not a comma-separated list of layer counts") from None
    chunks = num_stages * num_chunks
    if len(counts) != chunks:
      raise ValueError(f"{len(counts)} counts for {num_stages} stages x {num_chunks} chunks: "
                       f"give {chunks}, one per chunk in model order")
    if min(counts) < 1:
      raise ValueError(f"every chunk needs at least one layer, got {text!r}")
    if sum(counts) != num_layers:
      raise ValueError(f"the counts add up to {sum(counts)} layers, the model has {num_layers}")
    return cls(counts, num_stages)

  @property
  def num_chunks(self) -> int:
    """V, chunks per stage."""
    return len(self.counts) // self.num_stages

  @property
  def num_layers(self) -> int:
    return sum(self.counts)

  @property
  def slots(self) -> int:
    """S, slots per chunk."""
    return max(self.counts)

  @property
  def even_split(self) -> bool:
    return len(set(self.counts)) == 1

  def stores_like(self, other: "StageLayout") -> bool:
    """Whether both put every layer in the same slot of as many."""
    return (self.even_split and other.even_split) or self.counts == other.counts

  def counts_VxP(self) -> np.ndarray:
    return np.asarray(self.counts).reshape(self.num_chunks, self.num_stages)

  def slot_of_layer(self) -> np.ndarray:
    """[L]: the slot each layer of the model sits in."""
    return np.concatenate([c * self.slots + np.arange(n) for c, n in enumerate(self.counts)])

  def to_slots(self, layers):
    """[L, ...] leaves -> [P*V*S, ...], zeros in the empty slots."""
    if self.even_split:
      return layers
    slot = self.slot_of_layer()
    total = len(self.counts) * self.slots
    return jax.tree.map(
        lambda x: jnp.zeros((total, *x.shape[1:]), x.dtype).at[slot].set(x), layers)

  def from_slots(self, slotted):
    """The inverse of `to_slots`: [P*V*S, ...] leaves -> [L, ...]."""
    if self.even_split:
      return slotted
    slot = self.slot_of_layer()
    return jax.tree.map(lambda x: x[slot], slotted)
