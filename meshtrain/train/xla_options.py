"""The XLA options a train step compiles with, by the platform of its devices.

On GPUs a collective overlaps compute only where XLA's scheduler may issue it
ahead of its use. Inside the layers' loop a layer's weight all-gather (and its
gradient's reduce-scatter) feeds (is fed by) the same iteration's matmuls, so
nothing of that iteration can run under it: the collective pipeliner moves it
into the previous (next) iteration, and the scheduler may keep several
collectives in flight at once. Read from the program XLA's GPU compiler
builds for 8 H100s (`meshtrain plan --target`, docs/gpu_program.md): the
share of the 1B preset's FSDP collective bytes with matmuls scheduled under
them, 0% with XLA's defaults, is the figure these options are chosen by.

A pipeline's tick runs each op in a two-way conditional whose other branch
hands the state back untouched (`parallel.pipeline.runtime`). XLA:GPU's copy
insertion, unlike XLA:CPU's, copies every buffer such a branch passes
through (every stash and cut slot, twice the pipeline's activations) unless
it analyses the conditionals' regions: the 70B preset on 256 GPUs held
235 GiB a device without it, 174 GiB with it. Only pipelined steps take
that option: in the others it left fewer gradient reduce-scatters under
matmuls (the 1B preset over fsdp=8: 99% -> 78%).
"""

from jax.sharding import Mesh

GPU = {
    "xla_gpu_enable_pipelined_all_gather": True,
    "xla_gpu_enable_pipelined_reduce_scatter": True,
    "xla_gpu_enable_pipelined_all_reduce": True,
    "xla_gpu_experimental_parallel_collective_overlap_limit": 4,
}
PIPELINED_GPU = {**GPU, "xla_gpu_copy_insertion_use_region_analysis": True}


def for_mesh(mesh: Mesh) -> dict | None:
  """The options for a step over `mesh`'s devices (None: XLA's defaults)."""
  if mesh.devices.flat[0].platform != "gpu":
    return None
  return dict(PIPELINED_GPU if mesh.shape["pipeline"] > 1 else GPU)
