"""The tools' HF loading reads a rank's slices, as `Bridge.load_hf_weights` does: `inference.load_model` from an
HF folder (generate, evaluate, the RL loops' policy and reference) and training's `--load-hf`
(`training/model.py`) pass the checkpoint as the engine's `reader`. At TP2 each rank of a dense LLaMA reads about
half of the checkpoint (before: all of it), and its model equals the one filled from whole tensors bit for bit."""

from __future__ import annotations

import pytest
import torch

from tests import _cpu
from tests.models import case, save_case


def _load(rank: int, hf_dir: str) -> dict:
    from megatron_patch.conversion import hf_io
    from megatron_patch.conversion.engine import hf_to_megatron, make_plan
    from megatron_patch.inference import load_model
    from megatron_patch.models import Layout, load_hf_config

    read = [0]
    get, get_slice = hf_io.HFCheckpoint.get, hf_io.HFCheckpoint.get_slice

    def counted(fn):
        def wrapper(self, *a):
            t = fn(self, *a)
            read[0] += t.numel() * t.element_size()
            return t
        return wrapper

    hf_io.HFCheckpoint.get, hf_io.HFCheckpoint.get_slice = counted(get), counted(get_slice)
    _cpu.init_model_parallel(2, 1)
    model, cfg = load_model(None, hf_dir, layout=Layout(2))
    bytes_read = read[0]
    hf_io.HFCheckpoint.get, hf_io.HFCheckpoint.get_slice = get, get_slice
    ckpt = hf_io.HFCheckpoint(hf_dir)
    whole = hf_to_megatron(make_plan(load_hf_config(hf_dir), Layout(2)), ckpt.get, ckpt.keys(), stages=[0],
                           tp_ranks=[rank])[(rank, 0, 0)]
    own = model.state_dict()
    unequal = sorted(k for k, v in whole.items() if not torch.equal(own[k], v.to(own[k].dtype)))
    return {"read": bytes_read, "total": ckpt.nbytes(), "unequal": unequal, "compared": len(whole)}


@pytest.mark.parametrize("variant", ["gqa"])
def test_load_model_from_hf_reads_its_tp_slices(cpu_megatron, tmp_path, variant):
    hf_dir = save_case(case(variant), str(tmp_path / variant))
    results = _cpu.run_world(2, _load, hf_dir)
    for rank, r in enumerate(results):
        assert r["compared"] > 10 and r["unequal"] == [], (rank, r["unequal"])
        assert r["read"] <= 0.55 * r["total"], (rank, r["read"], r["total"])  # whole tensors: 100 %
    assert sum(r["read"] for r in results) >= results[0]["total"]  # together: all of it
