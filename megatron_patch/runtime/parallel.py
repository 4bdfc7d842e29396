"""This process's place in megatron-core's parallel layout (`Rank`, `current_rank`) and the model-parallel
setup the tools (converter, verify, generate, evaluate) make when no trainer made one."""

from __future__ import annotations

import os
from typing import NamedTuple

import torch


class Rank(NamedTuple):
    """A process's place in a TP x PP x EP layout: the key of its state dict in the conversion engine."""

    tp: int
    pp: int
    ep: int = 0


def current_rank() -> Rank:
    """This process's rank in megatron-core's model-parallel groups."""
    from megatron.core import parallel_state as ps

    return Rank(ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(),
                ps.get_expert_model_parallel_rank())


def current_etp_rank() -> int:
    """This process's rank among the expert-tensor-parallel shards of its experts."""
    from megatron.core import parallel_state as ps

    return ps.get_expert_tensor_parallel_rank()


def join_launcher_world() -> bool:
    """Under torchrun (WORLD_SIZE > 1), join its world once (NCCL on GPUs, gloo on CPUs); whether this process
    is in a world of several."""
    import torch.distributed as dist

    if dist.is_initialized():
        return dist.get_world_size() > 1
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return False
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return True


def ensure_model_parallel(tp: int, pp: int, ep: int = 1, etp: int | None = None, vpp: int | None = None) -> None:
    """Initialise a gloo world of one and TP=PP=1 model parallelism when nothing is set up yet
    (converter and verification tools; training sets up its own world). The RNG tracker is the
    inference one: these models only run forward passes."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if not dist.is_initialized() and not join_launcher_world():
        if tp * pp * ep != 1:
            raise RuntimeError(f"TP={tp} x PP={pp} x EP={ep} needs at least {tp * pp * ep} processes: run under "
                               f"torchrun --nproc-per-node {tp * pp * ep}")
        else:
            # an in-memory store: no port, nothing inherited by child processes
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    if not ps.model_parallel_is_initialized():
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                     virtual_pipeline_model_parallel_size=vpp, expert_model_parallel_size=ep,
                                     expert_tensor_parallel_size=etp)
        model_parallel_cuda_manual_seed(0, inference_rng_tracker=True, force_reset_rng=True)
