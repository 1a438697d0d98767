"""A module's conversions compiled once: JAX's persistent compilation cache in a temporary folder of the module's
own, for test modules whose conversions run the same layer programs in pairs (`from compile_cache import
compiled_once` makes it autouse there)."""

import pytest


@pytest.fixture(scope="module", autouse=True)
def compiled_once(tmp_path_factory):
    """Each pair of conversions below runs the same layer programs: JAX's persistent compilation cache (in a
    temporary folder, for this module only) compiles them once instead of once a conversion."""
    import jax

    try:  # the cache's in-memory state, set up on first use: reset so the folder given here is read
        from jax._src.compilation_cache import reset_cache
    except ImportError:  # another JAX: the conversions compile twice, slower and the same
        yield
        return

    keys = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
            "jax_persistent_cache_min_entry_size_bytes")
    saved = {key: getattr(jax.config, key) for key in keys}
    for key, value in zip(keys, (str(tmp_path_factory.mktemp("jax-cache")), 0.0, -1)):
        jax.config.update(key, value)
    reset_cache()
    yield
    for key, value in saved.items():
        jax.config.update(key, value)
    reset_cache()
