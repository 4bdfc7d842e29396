"""Checkpoint conversion: the resharding engine, HF and megatron-core I/O, and verification."""
