"""Test-only harness: run megatron-core (each supported version: megatron_patch.compat) on a machine without a
GPU, in gloo worlds.

Nothing here is library code. `install()` applies the library's patches that redirect the CUDA calls
megatron-core makes unconditionally (`megatron_patch/patches.py`, one place for each redirect);
`run_world(n, fn, *args)` runs `fn(rank, *args)` in n spawned gloo processes and returns the per-rank
results, so one spawned world can run many checks.
"""

from __future__ import annotations

import os
import pickle
import socket
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_patch import patches


def install() -> None:
    """Apply the CPU redirects megatron-core needs for forward passes, checkpoints and model-parallel
    groups in gloo worlds (idempotent): the library's named patches (`megatron_patch.patches`), which
    list every redirected call."""
    patches.apply("cpu_cuda_calls")
    patches.apply("cpu_parallel_state")


def install_training() -> None:
    """Also the redirects megatron.training's loop needs on a CPU: the `cpu_training` patch, what
    `--cpu` of the training entry points applies."""
    install()
    patches.apply("cpu_training")


def record_train_steps() -> list[dict]:
    """The metrics megatron.training's `train_step` returns, one dict per iteration (the loss megatron
    reduced over the global batch; its printed log averages the first two iterations together), appended
    to the returned list as training runs in this process."""
    from megatron.training import training

    logged, train_step = [], training.train_step

    def record_step(*args, **kwargs):
        out = train_step(*args, **kwargs)
        logged.append({k: float(v) for k, v in out[0].items()})
        return out

    training.train_step = record_step
    return logged


def init_model_parallel(tp: int = 1, pp: int = 1, seed: int = 1234, ep: int = 1, etp: int | None = None,
                        vpp: int | None = None) -> None:
    """(Re)initialise megatron's model-parallel groups inside a running world, with the RNG
    tracker megatron-core needs (`tensor_parallel/random.py`: the inference tracker never touches
    CUDA RNG state)."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 virtual_pipeline_model_parallel_size=vpp, expert_model_parallel_size=ep,
                                 expert_tensor_parallel_size=etp)
    model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True, force_reset_rng=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, out_dir: str, fn, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), TORCHDYNAMO_DISABLE="1")
    # one intra-op thread: CPU kernels split their sums by thread count, so a world's arithmetic is then the
    # same on every machine, whatever its cores (tests compare worlds of different sizes bit for bit)
    torch.set_num_threads(1)
    install()
    # rendezvous through a file, not a TCP port: a port probed free can be taken by another process (a second
    # suite on the machine) before rank 0 listens on it; gloo's own connections take ports the OS assigns
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(out_dir, 'rendezvous')}", rank=rank,
                            world_size=world)
    try:
        result = ("ok", fn(rank, *args))
    except BaseException:  # reported to the parent with the traceback
        result = ("error", traceback.format_exc())
    with open(os.path.join(out_dir, f"{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)
    dist.destroy_process_group()


def run_world(world: int, fn, *args) -> list:
    """Run `fn(rank, *args)` on `world` gloo processes; returns each rank's result. MASTER_ADDR / MASTER_PORT
    are set for code that reads them; the world itself meets through a file in a fresh folder."""
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(_worker, args=(world, free_port(), out_dir, fn, args), nprocs=world,
                           start_method="spawn", join=True)
        results = []
        for rank in range(world):
            with open(os.path.join(out_dir, f"{rank}.pkl"), "rb") as f:
                status, value = pickle.load(f)
            if status == "error":
                raise AssertionError(f"rank {rank} failed:\n{value}")
            results.append(value)
        return results
