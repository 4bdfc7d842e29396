"""`training.device.select_device` on a GPU with torch.compile turned off: one warning line, on rank 0 only."""

import argparse

import pytest
import torch

from megatron_patch import patches
from megatron_patch.training import device


def _select(monkeypatch, capsys, env: dict[str, str]) -> str:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for key in ("TORCHDYNAMO_DISABLE", "RANK"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(patches, "is_active", lambda name: False)
    device.select_device(argparse.Namespace(cpu=False), set())
    return capsys.readouterr().err


@pytest.mark.parametrize("env, warned", [({"TORCHDYNAMO_DISABLE": "1"}, True),
                                         ({"TORCHDYNAMO_DISABLE": "1", "RANK": "3"}, False),
                                         ({"TORCHDYNAMO_DISABLE": "0"}, False), ({}, False)])
def test_a_gpu_run_without_torch_compile_is_warned_once(monkeypatch, capsys, env, warned):
    """megatron-core's SwiGLU and bias-dropout-add fusions are torch.compile'd (jit_fuser): TORCHDYNAMO_DISABLE=1
    made an 8B bf16 step ~12% slower on an H200 without a word (2026-12-02). torch reads only "1" as off."""
    err = _select(monkeypatch, capsys, env)
    assert err == (device.DYNAMO_OFF_WARNING + "\n" if warned else "")
    assert not warned or err.startswith("warning: TORCHDYNAMO_DISABLE=1")
