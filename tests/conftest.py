import os

import pytest

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")


@pytest.fixture(scope="session")
def cpu_megatron():
    """megatron-core in this process: CPU redirects + a gloo world of one at TP=PP=1."""
    from megatron_patch.models.parallel import ensure_model_parallel
    from tests import _cpu

    _cpu.install()
    ensure_model_parallel(1, 1)
    return True
