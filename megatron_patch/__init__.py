"""megatron_patch: a non-invasive patch layer over megatron-core (model families, HF <-> Megatron
checkpoint conversion, FP8 and recipes).

The Python API for custom trainers is `Bridge` (megatron_patch/bridge.py, docs/python-api.md), with the
`Layout` it takes; both are imported on first use, so `import megatron_patch` stays light."""

__version__ = "0.1.0"
__all__ = ["Bridge", "Layout"]


def __getattr__(name: str):
    if name == "Bridge":
        from megatron_patch.bridge import Bridge

        return Bridge
    if name == "Layout":
        from megatron_patch.models.family import Layout

        return Layout
    raise AttributeError(f"module 'megatron_patch' has no attribute {name!r}")
