"""The kernel backends by name, apart from the kernels: the CLI lists them (`verify --backend`) without JAX."""

from __future__ import annotations

BACKENDS = ("auto", "tpu", "gpu", "cpu", "xla", "reference")


def deployment_backends() -> list[str]:
    """The backends verify takes: every one but the reference, which is no deployment kernel."""
    return [name for name in BACKENDS if name != "reference"]
