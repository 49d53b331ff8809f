"""The device a function is compiled for: the mesh in context when there is one, else the local
devices. Kernel and implementation choice reads this, so that a CPU machine with the CUDA plugin
can compile the GPU paths for an H200 it does not have (`experiments.gpu_check --deviceless`).
"""

from __future__ import annotations

import dataclasses

import jax

# NVIDIA device kinds -> compute capability, for a target named only by its kind (an abstract
# mesh carries the kind, not the capability). First match wins, so longer names come first.
_CAPABILITIES = (
  ('GB200', 10.0),
  ('B200', 10.0),
  ('B100', 10.0),
  ('GH200', 9.0),
  ('H200', 9.0),
  ('H100', 9.0),
  ('H800', 9.0),
  ('H20', 9.0),
  ('L40', 8.9),
  ('L4', 8.9),
  ('RTX 40', 8.9),
  ('A100', 8.0),
  ('A800', 8.0),
  ('A30', 8.0),
  ('A10', 8.6),
  ('A40', 8.6),
  ('RTX 30', 8.6),
  ('T4', 7.5),
  ('V100', 7.0),
)


@dataclasses.dataclass(frozen=True)
class Target:
  """Where the code being traced will run."""

  platform: str  # 'gpu', 'tpu' or 'cpu' (jax's platform names)
  device_kind: str  # e.g. 'NVIDIA H200', 'TPU v5 lite', 'cpu'
  compute_capability: float | None  # NVIDIA GPUs only, e.g. 9.0; None elsewhere or unknown

  @property
  def nvidia(self) -> bool:
    return self.platform == 'gpu' and self.compute_capability is not None

  @property
  def compiles_kernels(self) -> bool:
    """True where Pallas kernels compile; elsewhere they run in the interpreter."""
    return self.platform in ('gpu', 'tpu')


def capability_of(device_kind: str) -> float | None:
  """Compute capability of an NVIDIA device kind such as 'NVIDIA H200'; None if unknown."""
  kind = device_kind.upper()
  for name, capability in _CAPABILITIES:
    if name in kind:
      return capability
  return None


def _platform(name: str) -> str:
  return 'gpu' if name in ('gpu', 'cuda', 'rocm') else name


def current() -> Target:
  """The target of the code being traced now.

  Under `jax.set_mesh` or `jax.sharding.use_abstract_mesh`, the mesh's device decides, whatever
  this process's own backend is; otherwise the first local device does.
  """
  mesh = jax.sharding.get_abstract_mesh()
  device = None if mesh is None or mesh.empty else getattr(mesh, 'abstract_device', None)
  if device is not None and device.platform is not None:
    kind = str(device.device_kind)
    capability = None
    if _platform(device.platform) == 'gpu':
      local = jax.local_devices()[0]  # the same kind here: its own capability beats the table
      own = getattr(local, 'compute_capability', None) if local.device_kind == kind else None
      capability = float(own) if own is not None else capability_of(kind)
    return Target(_platform(device.platform), kind, capability)
  local = jax.local_devices()[0]
  capability = getattr(local, 'compute_capability', None)
  platform = _platform(local.platform)
  capability = float(capability) if platform == 'gpu' and capability is not None else None
  return Target(platform, local.device_kind, capability)
