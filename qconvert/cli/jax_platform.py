"""The JAX environment a run asks for: a JAX_PLATFORMS this host cannot start, or an XLA_FLAGS that XLA refuses,
is a usage error (exit 2, one line) before anything is read or written, not a crash halfway."""

from __future__ import annotations

import os
import subprocess
import sys

from qconvert.formats.errors import UsageError

# How long the XLA_FLAGS probe may take (it starts JAX's CPU backend in a child process: about a second).
PROBE_TIMEOUT_S = 120


def check_jax_platforms() -> None:
    """Check XLA_FLAGS, then start JAX's backends now when JAX_PLATFORMS is set; UsageError if either fails.

    JAX raises a RuntimeError (tpu without libtpu) or a bare AssertionError (cuda
    without its plugin) at the first device use, deep inside a conversion;
    checked here, the line names the setting and what to do.
    """
    check_jax_environment()
    check_xla_flags()
    requested = os.environ.get("JAX_PLATFORMS", "").strip()
    if not requested:
        return
    import jax

    try:
        jax.devices()
    except (RuntimeError, AssertionError):
        raise UsageError(f"JAX_PLATFORMS={requested} names a platform JAX cannot start on this host; unset "
                         "JAX_PLATFORMS to let JAX choose, or set JAX_PLATFORMS=cpu") from None


def check_jax_environment() -> None:
    """UsageError when JAX refuses one of its JAX_* variables: it reads them as it is imported, and a value it
    cannot parse (JAX_ENABLE_X64=maybe, JAX_NUM_CPU_DEVICES=abc) raises from inside that import."""
    if "jax" in sys.modules:
        return
    try:
        import jax  # noqa: F401
    except Exception as err:  # noqa: BLE001 - JAX raises ValueError, but any failure here is its environment's
        from qconvert.formats.outside import shown

        sys.modules.pop("jax", None)
        read = ", ".join(f"{name}={shown(value)!r}" for name, value in sorted(os.environ.items())
                         if name.startswith(("JAX_", "XLA_")) and name != "XLA_FLAGS") or "none set"
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise UsageError(f"JAX cannot start with this environment ({shown(first)}); its variables: {read}; fix "
                         "or unset the one it names") from None


def check_xla_flags() -> None:
    """UsageError when XLA_FLAGS holds a flag XLA refuses.

    XLA reads XLA_FLAGS when JAX first starts a backend and, on a flag it does not
    know, aborts the whole process from C++: no Python handler runs, so a run that
    had begun writing would leave its temporary folder behind. A child process
    starts JAX with the same environment first, and its refusal becomes one line.
    """
    flags = os.environ.get("XLA_FLAGS", "").strip()
    if not flags:
        return
    env = dict(os.environ, JAX_PLATFORMS="cpu")  # the flags are parsed alike for every platform
    try:
        probe = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=env, timeout=PROBE_TIMEOUT_S,
                               stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    except (OSError, subprocess.TimeoutExpired):
        return  # no verdict: the run itself will find out
    if probe.returncode == 0:
        return
    reason = _xla_refusal(probe.stderr.decode(errors="replace"))
    if reason is not None:
        raise UsageError(f"XLA_FLAGS={flags}: XLA refuses it ({reason}); fix or unset XLA_FLAGS")


def _xla_refusal(stderr: str) -> str | None:
    """XLA's own fatal line about its flags (glog's 'F... ] Unknown flag in XLA_FLAGS: ...'), or None."""
    for line in stderr.splitlines():
        if "XLA_FLAGS" in line and "]" in line:
            return line.split("]", 1)[1].strip()
    return None
