"""fastddpm: train DDPM diffusion models at the speed of the GPU.

From Python: fastddpm.train(...), fastddpm.load(...).sample(...), fastddpm.evaluate(...) (fastddpm.api)."""

__version__ = "0.1.0"

__all__ = ["train", "load", "evaluate", "Model", "__version__"]


def __getattr__(name: str):
    # imported on first use: `import fastddpm` (and `fastddpm --version`) stays free of torch
    if name in __all__:
        from fastddpm import api

        return getattr(api, name)
    raise AttributeError(f"module 'fastddpm' has no attribute {name!r}")


def __dir__() -> list[str]:
    # the lazy names too, for tab completion in a notebook
    return sorted(set(globals()) | set(__all__))
