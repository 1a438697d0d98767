"""qconvert: quantize Hugging Face checkpoints and verify the result."""

__version__ = "0.3.0"

# Loading pulls in JAX; resolve these names on first use so `import qconvert` stays light.
_LAZY = {"load": "qconvert.loading", "load_config": "qconvert.loading", "flatten_params": "qconvert.loading",
         "unflatten_params": "qconvert.loading", "prepare_params": "qconvert.loading"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'qconvert' has no attribute {name!r}")
