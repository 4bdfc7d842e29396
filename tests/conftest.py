import os

import pytest

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")


@pytest.fixture(scope="session")
def cpu_megatron():
    """megatron-core in this process: CPU redirects + a gloo world of one at TP=PP=1."""
    from megatron_patch.runtime.parallel import ensure_model_parallel
    from tests import _cpu

    _cpu.install()
    ensure_model_parallel(1, 1)
    return True


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """The first 400 documents of the bundled corpus as a Megatron indexed dataset (its prefix)."""
    from tests.helpers import corpus_dataset

    return corpus_dataset(str(tmp_path_factory.mktemp("corpus")))


@pytest.fixture(scope="session")
def tiny_lm(tmp_path_factory):
    """A tiny random causal LM (HF folder with the tiny tokenizer's files) to start training from."""
    from tests.helpers import tiny_lm_folder

    return tiny_lm_folder(str(tmp_path_factory.mktemp("tiny_lm") / "hf"))
