"""The environment of a subprocess that sees several CPU devices.

XLA reads ``--xla_force_host_platform_device_count`` when JAX is imported, so a
multi-device test runs its code in a fresh interpreter; the suite's own
``XLA_FLAGS`` (conftest.py's fast-compile flags, a user's flags) are kept.
"""

import os


def host_devices_env(devices: int, **extra: str) -> dict[str, str]:
  """``os.environ`` plus ``JAX_PLATFORMS=cpu`` and ``devices`` forced host devices."""
  flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}"
  return {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": flags.strip(), **extra}
