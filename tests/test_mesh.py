import jax
import numpy as np
import pytest

from meshtrain.errors import ConfigError
from meshtrain.mesh import AXES, axis_sizes, make_mesh


def sizes(**kw):
  return {axis: kw.get(axis, 1) for axis in AXES}


def test_minus_one_fills_the_remaining_devices():
  assert axis_sizes(sizes(data=-1, tensor=2), 8) == sizes(data=4, tensor=2)
  assert axis_sizes(sizes(fsdp=-1), 8) == sizes(fsdp=8)


@pytest.mark.parametrize("mesh, key, words", [
    (sizes(data=4), "config.mesh", "makes 4 devices but 8 are available"),
    (sizes(data=-1, tensor=3), "config.mesh.data", "does not divide 8"),
    (sizes(data=-1, fsdp=-1), "config.mesh.fsdp", "only one axis may be -1"),
    (sizes(tensor=0), "config.mesh.tensor", "positive size"),
    *((sizes(data=2, **{axis: -1}), f"config.mesh.{axis}", "only a batch axis")
      for axis in ("pipeline", "sequence", "tensor")),
])
def test_impossible_meshes_name_the_key(mesh, key, words):
  with pytest.raises(ConfigError, match=words) as error:
    axis_sizes(mesh, 8)
  assert error.value.key == key


@pytest.mark.parametrize("preset, devices, key, needed, simulated", [
    ("pp_1f1b.py", 1, "config.mesh.pipeline", "the pipeline needs 2 devices", 8),
    ("megatron_3d.py", 2, "config.mesh.pipeline", "the pipeline needs 4 devices", 8),
    ("tp.py", 1, "config.mesh.tensor", "tensor parallelism needs 2 devices", 8),
])
def test_a_mesh_larger_than_the_devices_names_its_axis_and_the_fix(preset, devices, key, needed,
                                                                   simulated):
  """A preset run on too few devices (one CPU device, say) is told to simulate more."""
  from conftest import REPO
  from meshtrain import config, validate
  cfg = config.load(REPO / "configs" / preset, "tiny")
  with pytest.raises(ConfigError, match=f"{needed} .*, {devices} found: add "
                     f"--config.simulate_devices={simulated} ") as error:
    validate.check_devices(cfg, devices)
  assert error.value.key == key
  cfg.simulate_devices = simulated
  validate.check_devices(cfg, simulated)  # the fix it names runs


def test_tensor_is_innermost_and_data_outermost():
  mesh = make_mesh(sizes(data=2, fsdp=2, tensor=2))
  assert mesh.axis_names == AXES
  ids = np.vectorize(lambda d: d.id)(mesh.devices).reshape(2, 2, 2)  # data, fsdp, tensor
  assert abs(ids[0, 0, 1] - ids[0, 0, 0]) == 1    # tensor neighbours are adjacent devices
  assert abs(ids[1, 0, 0] - ids[0, 0, 0]) == 4    # data replicas are farthest apart
  assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)
