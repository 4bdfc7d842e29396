"""megatron_patch: a non-invasive patch layer over megatron-core (model families, HF <-> Megatron
checkpoint conversion, FP8 and recipes)."""

__version__ = "0.1.0"
