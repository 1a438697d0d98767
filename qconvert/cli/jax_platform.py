"""The JAX platform a run asks for: a JAX_PLATFORMS this host cannot start is a usage error, not a crash."""

from __future__ import annotations

import os

from qconvert.formats.errors import UsageError


def check_jax_platforms() -> None:
    """Start JAX's backends now when JAX_PLATFORMS is set; UsageError (exit 2, one line) if it cannot.

    JAX raises a RuntimeError (tpu without libtpu) or a bare AssertionError (cuda
    without its plugin) at the first device use, deep inside a conversion;
    checked here, the line names the setting and what to do.
    """
    requested = os.environ.get("JAX_PLATFORMS", "").strip()
    if not requested:
        return
    import jax

    try:
        jax.devices()
    except (RuntimeError, AssertionError):
        raise UsageError(f"JAX_PLATFORMS={requested} names a platform JAX cannot start on this host; unset "
                         "JAX_PLATFORMS to let JAX choose, or set JAX_PLATFORMS=cpu") from None
