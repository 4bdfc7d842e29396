"""Test-only harness: run megatron-core 0.19.2 on a machine without a GPU, in gloo worlds.

Nothing here is library code. `install()` redirects the CUDA calls megatron-core makes
unconditionally; `run_world(n, fn, *args)` runs `fn(rank, *args)` in n spawned gloo processes and
returns the per-rank results, so one spawned world can run many checks.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import socket
import tempfile
import traceback
import types

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_patch import patches


class _DummyStream:
    def synchronize(self) -> None:
        pass

    def wait_stream(self, _stream) -> None:
        pass


_FAKE_CUDA_RNG = [torch.Generator().manual_seed(0).get_state()]


def _get_fake_cuda_rng(device="cuda") -> torch.Tensor:
    return _FAKE_CUDA_RNG[0].clone()


def _set_fake_cuda_rng(state: torch.Tensor, device="cuda") -> None:
    _FAKE_CUDA_RNG[0] = state.clone()


def _seed_fake_cuda_rng(seed: int) -> None:
    _FAKE_CUDA_RNG[0] = torch.Generator().manual_seed(seed).get_state()


def install() -> None:
    """Apply the CPU redirects (idempotent)."""
    # `torch.cuda.current_device` (rotary_pos_embedding.py, tensor_parallel/layers.py,
    # pipeline_parallel/p2p_communication.py) and `torch.cuda.synchronize` (p2p_communication.py,
    # dist_checkpointing/strategies/filesystem_async.py), and tensors sent to "cuda" (`.cuda()`,
    # `device="cuda"`: pipeline schedules' token counters, the tied output weight's all-reduce, the
    # inference controller): the library's named patch covers them (`patches.CudaTensorsOnCpu`).
    patches.apply("cpu_cuda_calls")
    # `torch.cuda.current_stream` / `torch.cuda.stream` (distributed/distributed_data_parallel.py,
    # param and grad buffers): no streams on CPU.
    torch.cuda.current_stream = lambda device=None: _DummyStream()  # type: ignore[assignment]
    # `torch.cuda.device_count` (parallel_state / initialize): 0 would make megatron skip
    # model-parallel initialisation; `torch.cuda.set_device` is a no-op.
    torch.cuda.device_count = lambda: 1  # type: ignore[assignment]
    torch.cuda.set_device = lambda device: None  # type: ignore[assignment]
    # CUDA RNG state (training/checkpointing.py get_rng_state, tensor_parallel/random.py
    # _set_cuda_rng_state on load, the TP RNG tracker's forks): a separate state tensor stands in for
    # the GPU generator, so forking it never touches the CPU generator that CPU initialisation uses
    torch.cuda.get_rng_state = _get_fake_cuda_rng  # type: ignore[assignment]
    torch.cuda.set_rng_state = _set_fake_cuda_rng  # type: ignore[assignment]
    from megatron.core.tensor_parallel import random as mc_random

    mc_random._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: _set_fake_cuda_rng(new_state)
    # The default causal mask of `megatron/core/transformer/utils.py` is built on "cuda": tests
    # always pass an explicit boolean mask instead (megatron_patch.conversion.verify.causal_mask).
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")


def install_training() -> None:
    """Also the redirects megatron.training's loop needs on a CPU (on top of `install`)."""
    import functools

    from megatron.training import training

    install()
    patches.CudaTensorsOnCpu.report_cuda_types = True
    # validate_args asks the device generation for TP > 1 (sequence-parallel / comm-overlap rules)
    torch.cuda.get_device_properties = lambda device=None: types.SimpleNamespace(  # type: ignore[assignment]
        major=9, minor=0, name="cpu", total_memory=0, multi_processor_count=1)
    # the training RNG tracker forks the "CUDA" generator: the CPU one stands in
    from megatron.core.tensor_parallel import random as mc_random

    mc_random._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: _get_fake_cuda_rng()
    torch.cuda.manual_seed = _seed_fake_cuda_rng  # type: ignore[assignment]
    torch.cuda.manual_seed_all = _seed_fake_cuda_rng  # type: ignore[assignment]
    # training.get_model builds DDP under a dedicated `torch.cuda.Stream()`
    torch.cuda.Stream = lambda *a, **k: _DummyStream()  # type: ignore[assignment]
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()  # type: ignore[assignment]
    if not getattr(training.initialize_megatron, "_cpu", False):
        # `initialize_megatron` asserts CUDA unless `allow_no_cuda` (pretrain() does not pass it)
        init = functools.partial(training.initialize_megatron, allow_no_cuda=True)
        init._cpu = True
        training.initialize_megatron = init


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


def init_model_parallel(tp: int = 1, pp: int = 1, seed: int = 1234, ep: int = 1, etp: int | None = None) -> None:
    """(Re)initialise megatron's model-parallel groups inside a running world, with the RNG
    tracker megatron-core needs (`tensor_parallel/random.py`: the inference tracker never touches
    CUDA RNG state)."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
    model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True, force_reset_rng=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, out_dir: str, fn, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), TORCHDYNAMO_DISABLE="1")
    torch.set_num_threads(1)
    install()
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = ("ok", fn(rank, *args))
    except BaseException:  # reported to the parent with the traceback
        result = ("error", traceback.format_exc())
    with open(os.path.join(out_dir, f"{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)
    dist.destroy_process_group()


def run_world(world: int, fn, *args) -> list:
    """Run `fn(rank, *args)` on `world` gloo processes; returns each rank's result."""
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
