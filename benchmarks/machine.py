"""What the benchmarks say about where they ran: the machine (host and GPU, `machine`), its GPU memory's bandwidth
for the bandwidth bounds of decode steps (`hbm_tb_s`, by the GPU's name) and the code measured (`code_hash`)."""

from __future__ import annotations

import hashlib
import os
import socket

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCES = ("megatron_patch", "benchmarks")
# HBM bandwidth by GPU (NVIDIA's data sheets, TB/s): the first name found in the device's name wins
HBM_TB_S = (("H200", 4.8), ("H100 NVL", 3.9), ("H100 PCIe", 2.0), ("H100", 3.35), ("H800", 3.35), ("H20", 4.0),
            ("GH200", 4.0), ("A100-SXM4-80GB", 2.039), ("A100 80GB PCIe", 1.935), ("A100", 1.555))
DEFAULT_TB_S = 4.8  # the H200 most rows of docs/benchmarks.md were measured on


def code_hash(root: str = ROOT) -> str:
    """sha256 (first 16 hex digits) of the project's Python sources (`SOURCES`), paths and contents: the same on
    the GPU machine's copy of the working tree as here, where git's commit is not at hand there."""
    digest = hashlib.sha256()
    for top in SOURCES:
        for folder, dirs, files in os.walk(os.path.join(root, top)):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            for name in sorted(f for f in files if f.endswith(".py")):
                path = os.path.join(folder, name)
                digest.update(os.path.relpath(path, root).encode() + b"\0")
                with open(path, "rb") as f:
                    digest.update(f.read() + b"\0")
    return digest.hexdigest()[:16]


def machine() -> dict:
    """The host name and, where there is a GPU, its name, UUID (the same card across calls) and count."""
    out = {"host": socket.gethostname()}
    try:
        import torch

        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            out.update(gpu=props.name, gpu_uuid=str(getattr(props, "uuid", "")), gpus=torch.cuda.device_count())
    except ImportError:
        pass
    return out


def hbm_tb_s(gpu_name: str | None) -> float:
    """The HBM bandwidth of the GPU named `gpu_name` (TB/s), DEFAULT_TB_S for a name not in HBM_TB_S (or none:
    a CPU run, whose bound is arithmetic only)."""
    for key, tb_s in HBM_TB_S:
        if gpu_name and key in gpu_name:
            return tb_s
    return DEFAULT_TB_S


def bandwidth_tb_s(given: float | None, on_gpu: bool = True) -> float:
    """The bandwidth a bound divides by: `given` (a script's --bandwidth-tb-s), else this machine's GPU's
    (`hbm_tb_s`; DEFAULT_TB_S off a GPU)."""
    if given:
        return given
    import torch

    return hbm_tb_s(torch.cuda.get_device_name() if on_gpu and torch.cuda.is_available() else None)
