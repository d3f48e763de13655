"""A dot whose output lists one dimension's mesh axes against mesh order gets
its shards on the wrong devices: jax 0.10.2 on CPU, Shardy and GSPMD alike.

  python docs/repro/reversed_axes.py            # Shardy (the default)
  python docs/repro/reversed_axes.py --gspmd

x and y are split over `a` along the contracted batch; x^T y comes out split
over ('c', 'b') x 'a'. It is wrong (relative error ~1) for exactly the layouts
that put two axes of one dimension the other way round against the third
(6 of 196 two-dimensional layouts on this mesh); ('b', 'c') x 'a' is exact.
"""
import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402


def relative_error(out_spec=P(("c", "b"), "a")) -> float:
  """|sharded - numpy| / |numpy| of einsum('btd,btk->dk') laid out as `out_spec`."""
  mesh = jax.make_mesh((2, 2, 2), ("a", "b", "c"), axis_types=(AxisType.Auto,) * 3)
  rng = np.random.default_rng(0)
  x = rng.normal(size=(8, 2, 16)).astype(np.float32)
  y = rng.normal(size=(8, 2, 8)).astype(np.float32)
  batch = NamedSharding(mesh, P("a"))
  product = jax.jit(lambda x, y: jnp.einsum("btd,btk->dk", x, y), in_shardings=(batch, batch),
                    out_shardings=NamedSharding(mesh, out_spec))(x, y)
  want = np.einsum("btd,btk->dk", x, y)
  return float(np.linalg.norm(np.asarray(product) - want) / np.linalg.norm(want))


if __name__ == "__main__":
  if "--gspmd" in sys.argv:
    jax.config.update("jax_use_shardy_partitioner", False)
  print(f"jax {jax.__version__}, {jax.devices()[0].platform} x{jax.device_count()}, "
        f"{'GSPMD' if '--gspmd' in sys.argv else 'Shardy'}")
  for spec in (P(("c", "b"), "a"), P(("b", "c"), "a")):
    print(f"x, y split over 'a' -> x^T y as {spec}: relative error {relative_error(spec):.1e}")
