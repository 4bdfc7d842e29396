"""One file per model family, each stating its facts (checkpoint names, config keys, switches) on the shared
bases of `megatron_patch.models` (`dense.py`, `family.py`, `mappings.py`); `registry.py` names them. Adding one:
docs/adding-a-family.md."""
