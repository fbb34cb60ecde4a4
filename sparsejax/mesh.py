"""Device meshes for expert parallelism, and the shardings of the MoE layer's arrays on them.

Axis names: "data" shards tokens only; "expert" shards both tokens and experts (every device holds
its own tokens, as in GShard/Switch); an optional "expert_group" in front of "expert" makes the
expert axis two-level (hosts x devices per host) for the hierarchical all-to-all; any other axis
(e.g. "tensor") is left replicated by the MoE layer. Built with `jax.sharding.Mesh` in Auto mode
so that `jax.shard_map` takes the arrays as they come on jax 0.10 and 0.11 alike (jax.make_mesh
defaults to Explicit axes there, which shard_map would refuse to reshard).
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

DATA, EXPERT, EXPERT_GROUP = "data", "expert", "expert_group"
# The axis that expert slicing splits off the expert axis when there are fewer experts than devices.
EXPERT_SLICE = "expert_slice"


def _auto_mesh(devices: np.ndarray, names: tuple[str, ...]) -> Mesh:
  axis_type = getattr(jax.sharding, "AxisType", None)
  if axis_type is None:  # older jax: every mesh is Auto
    return Mesh(devices, names)
  return Mesh(devices, names, axis_types=(axis_type.Auto,) * len(names))


def make_expert_mesh(
    data: int,
    expert: int,
    *,
    expert_groups: int | None = None,
    tensor: int | None = None,
    devices: Sequence[jax.Device] | None = None,
) -> Mesh:
  """A (data, [expert_group,] expert[, tensor]) mesh of data * [groups *] expert [* tensor] devices.

  expert_groups=G gives the two-level expert axis of the hierarchical all-to-all: G groups (hosts)
  of `expert` devices each, so the experts are spread over G * expert devices. Devices are laid out
  in jax.devices() order, so on several hosts the inner axes stay within a host.
  """
  for name, n in (("data", data), ("expert", expert), ("expert_groups", expert_groups), ("tensor", tensor)):
    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
      raise ValueError(f"make_expert_mesh: {name} must be a positive int; got {n!r}.")
  devices = list(jax.devices() if devices is None else devices)
  shape, names = [data], [DATA]
  if expert_groups is not None:
    shape.append(expert_groups)
    names.append(EXPERT_GROUP)
  shape.append(expert)
  names.append(EXPERT)
  if tensor is not None:
    shape.append(tensor)
    names.append("tensor")
  n = int(np.prod(shape))
  if n > len(devices):
    raise ValueError(f"mesh {dict(zip(names, shape))} needs {n} devices; only {len(devices)} are visible.")
  return _auto_mesh(np.array(devices[:n]).reshape(shape), tuple(names))


@dataclasses.dataclass(frozen=True)
class ExpertLayout:
  """How the MoE layer's arrays lie on a mesh (static; computed by `expert_layout`).

  mesh: the mesh shard_map runs on; with expert slicing it is the user's mesh with its expert axis
    split in two, (..., "expert", "expert_slice", ...), same devices in the same order.
  token_axes: mesh axes that shard the token dimension (every device gets distinct tokens).
  expert_axes: mesh axes that shard the expert dimension (one, or two for the hierarchical exchange).
  slice_axis: the axis that shards each expert's d_ff (None without expert slicing).
  num_peers: devices along expert_axes, i.e. the all-to-all group size P.
  num_slices: M, devices sharing one expert's d_ff (1 without slicing).
  """
  mesh: Mesh
  token_axes: tuple[str, ...]
  expert_axes: tuple[str, ...]
  slice_axis: str | None
  num_peers: int
  num_slices: int

  @property
  def tokens(self) -> P:
    return P(self.token_axes)

  def w_in(self) -> P:
    """[E, d_model, d_ff]: experts on the expert axes, d_ff on the slice axis."""
    return P(self.expert_axes, None, self.slice_axis)

  def w_out(self) -> P:
    """[E, d_ff, d_model]."""
    return P(self.expert_axes, self.slice_axis, None)

  def sharding(self, spec: P) -> NamedSharding:
    return NamedSharding(self.mesh, spec)


def expert_layout(
    mesh: Mesh,
    num_experts: int,
    *,
    data_axis: str | tuple[str, ...] | None = DATA,
    expert_axis: str | tuple[str, ...] = EXPERT,
) -> ExpertLayout:
  """The layout of an E-expert layer on mesh. E >= P: E/P experts per device (E % P == 0).

  E < P (one expert axis only): expert slicing, each expert's d_ff split over M = P/E devices
  (P % E == 0); the expert axis is split into ("expert": E, "expert_slice": M).
  """
  if not isinstance(mesh, Mesh):
    raise TypeError(f"mesh must be a jax.sharding.Mesh, e.g. sparsejax.make_expert_mesh(data, expert); got "
                    f"{type(mesh).__name__}.")
  data_axes = () if data_axis is None else ((data_axis,) if isinstance(data_axis, str) else tuple(data_axis))
  expert_axes = (expert_axis,) if isinstance(expert_axis, str) else tuple(expert_axis)
  for name in data_axes + expert_axes:
    if name not in mesh.shape:
      raise ValueError(f"axis {name!r} is not in the mesh {dict(mesh.shape)}.")
  peers = int(np.prod([mesh.shape[a] for a in expert_axes]))
  if num_experts % peers == 0:
    return ExpertLayout(mesh, data_axes + expert_axes, expert_axes, None, peers, 1)
  if peers % num_experts != 0:
    raise ValueError(
        f"num_experts={num_experts} and the expert axes' {peers} devices must divide one another.")
  if len(expert_axes) != 1:
    raise ValueError("expert slicing (fewer experts than devices) needs a single expert axis.")
  slices = peers // num_experts
  (name,) = expert_axes
  i = mesh.axis_names.index(name)
  devices = mesh.devices.reshape(mesh.devices.shape[:i] + (num_experts, slices) + mesh.devices.shape[i + 1:])
  names = mesh.axis_names[:i] + (name, EXPERT_SLICE) + mesh.axis_names[i + 1:]
  sliced = _auto_mesh(devices, names)
  return ExpertLayout(sliced, data_axes + (name, EXPERT_SLICE), (name,), EXPERT_SLICE, num_experts, slices)


def logical_to_mesh(names: tuple, layout: ExpertLayout) -> P:
  """Map the modules' logical axis names onto the layout: "expert" -> expert axes, "mlp" -> the slice
  axis (None without slicing), anything else ("embed", None) -> replicated."""
  rules = {"expert": layout.expert_axes, "mlp": layout.slice_axis}
  return P(*(rules.get(n) for n in names))


def param_shardings(logical_specs, layout: ExpertLayout):
  """NamedShardings for a pytree of logical PartitionSpecs (e.g. nnx.get_partition_spec(state))."""
  return jax.tree.map(lambda s: layout.sharding(logical_to_mesh(tuple(s), layout)), logical_specs,
                      is_leaf=lambda s: isinstance(s, P))
