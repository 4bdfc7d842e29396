"""The torchtitan row of `train_bench.py`: torchtitan's own Llama-3 trainer on the benchmark's shapes.

How it is driven (and why not the `torchtitan.train` CLI): the row builds torchtitan's `Trainer` in-process
from a `JobConfig` parsed by torchtitan's `ConfigManager` from the CLI flags below (`titan_flags`), with a
train spec that is torchtitan's Llama-3 spec (`Transformer`, `parallelize_llama`, `build_optimizers`,
`build_lr_schedulers`, `build_cross_entropy_loss`) except for the model flavors (the benchmark's widths) and
the data: fixed random tokens, as ours (`--mock-data`) and HF's rows use, instead of its C4 loader, which
would need the dataset and a tokenizer on a machine without network. Each optimizer step is then
`Trainer.train_step` itself (gradient accumulation over the micro-batches, loss scaled by the step's token
count, AMP context, gradient clipping, fused AdamW, LR schedule), timed here exactly as the HF rows are
(CUDA-synchronised wall time per optimizer step, median over the second half, peak
`torch.cuda.max_memory_allocated` after the trainer is built: `train_step` logs every step and torchtitan's log
resets CUDA's peak statistics as it ends, so the peak is read before each of its resets, `keep_peaks`; before
2026-12-05 it was read after the last one, i.e. only what the trainer held after its last step, its resident
memory). The CLI would have needed the same two
replacements (data, flavors) through `--experimental.custom_import`, and it reports its own tokens/s
averaged over a log window with data loading and logging included: not the quantity the other rows
measure. torchtitan's own log line (loss, tps, its MFU) is kept in the output for comparison.

What a torchtitan user gets on one GPU (torchtitan 0.2.x): no FSDP wrapping (a data-parallel degree of 1
disables it), so fp32 parameters and AdamW state with bf16 autocast (`training.mixed_precision_param`);
per-block `torch.compile` plus the compiled loss; AdamW `implementation = "fused"` (torchtitan's default);
activation checkpointing off (as every other row) or torchtitan's per-op selective policy (its Llama-3 8B
preset, row `torchtitan-sac`).

Runs as its own process (`python -m torch.distributed.run --standalone --nproc_per_node 1
benchmarks/titan_peer.py ...`): torchtitan initialises a process group, disables Python's GC and compiles;
none of that leaks into the other rows. It prints one line `TITAN_RESULT {json}`; when torchtitan is missing
or does not import against this torch, the JSON is an error saying so, and the benchmark prints that row
instead of failing.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import os
import sys
import tempfile
import time
import types

HERE = os.path.dirname(os.path.abspath(__file__))
VERSION = "0.2"  # the release line whose Trainer / train-spec API this file drives (0.2.2 runs on torch 2.11)
SPEC, FLAVOR = "train_bench_llama3", "bench"  # the train spec registered here and its one flavor
# row name -> (torch.compile, activation checkpointing mode)
TITAN_RUNS = {
    "torchtitan": (True, "none"),
    "torchtitan-eager": (False, "none"),
    "torchtitan-sac": (True, "selective"),  # torchtitan's Llama-3 8B preset: per-op selective AC
    "torchtitan-fp8": (True, "none"),  # + FLOAT8
}
# torchtitan's FP8 training (torchao's Float8Linear, tensorwise dynamic scaling: its documented single-node
# recipe, compiled) on every linear but the output layer, which our FP8 runs keep in bf16 too (megatron-core's
# output layer is not a TE module). Needs torchao (`benchmarks/stage_wheels.sh titan` stages it).
FLOAT8 = {"torchtitan-fp8": ["--model.converters", "quantize.linear.float8",
                             "--quantize.linear.float8.recipe_name", "tensorwise",
                             "--quantize.linear.float8.filter_fqns", "output"]}
# (hidden, FFN) -> torchtitan's (ffn_dim_multiplier, multiple_of): Llama-3.2 1B's and Llama-3.1 8B's flavors
FFN = {(2048, 8192): (1.5, 256), (4096, 14336): (1.3, 1024)}
MISSING = "torchtitan not installed / incompatible"


def ffn_hidden(dim: int, multiple_of: int, multiplier: float | None) -> int:
    """torchtitan's Llama-3 `FeedForward` width (`hidden_dim=4*dim`, two thirds of it, times the multiplier,
    rounded up to a multiple)."""
    hidden = int(2 * (4 * dim) / 3)
    if multiplier is not None:
        hidden = int(multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


def model_args(s: dict, vocab: int) -> dict:
    """`TransformerModelArgs` of a shape (an entry of `train_bench.SHAPES`): the widths of the HF config and
    of our runs."""
    multiplier, multiple_of = FFN[(s["hidden_size"], s["intermediate_size"])]
    assert ffn_hidden(s["hidden_size"], multiple_of, multiplier) == s["intermediate_size"]
    # (torchtitan always applies Llama-3.1 RoPE scaling to its precomputed frequencies: no cost per step)
    return dict(dim=s["hidden_size"], n_layers=s["num_hidden_layers"], n_heads=s["num_attention_heads"],
                n_kv_heads=s["num_key_value_heads"], vocab_size=vocab, multiple_of=multiple_of,
                ffn_dim_multiplier=multiplier, norm_eps=1e-5, rope_theta=500000.0, max_seq_len=s["seq"])


def titan_flags(s: dict, run: str, iters: int, micro_batches: int, dump_folder: str) -> list[str]:
    """torchtitan's CLI flags for one run: the shape's micro-batch and sequence, `micro_batches` of them per
    optimizer step (global batch = local batch x micro-batches on one GPU), the same LR warm-up as ours."""
    compiled, ac = TITAN_RUNS[run]
    return ["--model.name", SPEC, "--model.flavor", FLAVOR, "--model.hf_assets_path", dump_folder,
            "--job.dump_folder", dump_folder, "--training.local_batch_size", str(s["mbs"]),
            "--training.global_batch_size", str(s["mbs"] * micro_batches), "--training.seq_len", str(s["seq"]),
            "--training.steps", str(iters), "--training.mixed_precision_param", "bfloat16",
            "--optimizer.name", "AdamW", "--optimizer.lr", "1e-4", "--optimizer.implementation", "fused",
            "--lr_scheduler.warmup_steps", "2", "--activation_checkpoint.mode", ac,
            "--activation_checkpoint.selective_ac_option", "op", "--metrics.log_freq", "1",
            "--metrics.disable_color_printing", "--debug.seed", "1234",
            *(["--compile.enable", "--compile.components", "model,loss"] if compiled else ["--compile.no-enable"]),
            *FLOAT8.get(run, [])]


def command(s: dict, vocab: int, run: str, iters: int, micro_batches: int) -> list[str]:
    """The worker process of one torchtitan row (the shape travels as JSON: this file needs nothing of
    train_bench's)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
            os.path.join(HERE, "titan_peer.py"), "--shape", json.dumps({**s, "vocab": vocab}), "--row", run,
            "--iters", str(iters), "--micro-batches", str(micro_batches)]


def unavailable() -> str | None:
    """Why torchtitan's trainer cannot run here (None when it can): not installed, a release line other than
    the one this file drives, or an import failing against this torch (0.3.0 needs torch APIs newer than
    2.11: `torch.distributed.fsdp.DataParallelMeshDims`)."""
    if importlib.util.find_spec("torchtitan") is None:
        return f"{MISSING}: no module named torchtitan"
    try:
        import torchtitan
        from torchtitan.models.llama3 import TransformerModelArgs, get_train_spec  # noqa: F401
        from torchtitan.train import Trainer  # noqa: F401
    except Exception as e:  # ImportError, AttributeError on a missing torch API, ...
        return f"{MISSING}: {type(e).__name__}: {e}"
    version = getattr(torchtitan, "__version__", "?")
    if not version.startswith(VERSION + "."):
        return f"{MISSING}: torchtitan {version}; this benchmark drives the {VERSION}.x Trainer (0.2.2 on torch 2.11)"
    return None


def _placeholder_datasets() -> None:
    """torchtitan's Llama-3 spec imports `datasets` for its C4 loader, which this benchmark never builds (its
    data are random tokens); where `datasets` (pyarrow, pandas, ...) is not installed, a module that raises on
    use stands in for it, so that the GPU machine needs only small wheels."""

    def unused(*args, **kwargs):
        raise RuntimeError("datasets is not installed: the torchtitan benchmark row feeds random tokens")

    top, dist = types.ModuleType("datasets"), types.ModuleType("datasets.distributed")
    top.Dataset, top.load_dataset, top.IterableDataset, top.distributed = unused, unused, unused, dist
    dist.split_dataset_by_node = unused
    sys.modules.setdefault("datasets", top)
    sys.modules.setdefault("datasets.distributed", dist)


def keep_peaks(monitor, read) -> list:
    """Make `monitor.reset_peak_stats()` (torchtitan's `DeviceMemoryMonitor`, which its `MetricsProcessor.log`
    calls at the end of every logged step) first append `read()` (the peak so far) to the list returned, so
    that the run's peak is the largest of them and the last `read()`."""
    peaks, reset = [], monitor.reset_peak_stats

    def reset_keeping_the_peak(*args, **kwargs):
        peaks.append(read())
        return reset(*args, **kwargs)

    monitor.reset_peak_stats = reset_keeping_the_peak
    return peaks


def measure(s: dict, vocab: int, run: str, iters: int, micro_batches: int) -> dict:
    """Build torchtitan's trainer for one run and time `iters` optimizer steps (see the module docstring)."""
    if importlib.util.find_spec("datasets") is None:  # imported by its Llama-3 train spec for the C4 loader only
        _placeholder_datasets()
    problem = unavailable()
    if problem:
        return {"error": problem}
    import dataclasses

    import torch
    from torchtitan.config import ConfigManager
    from torchtitan.models.llama3 import TransformerModelArgs, get_train_spec
    from torchtitan.protocols.train_spec import register_train_spec
    from torchtitan.tools.logging import init_logger
    from torchtitan.train import Trainer

    init_logger()  # its log lines, as its CLI prints them
    register_train_spec(SPEC, dataclasses.replace(
        get_train_spec(), model_args={FLAVOR: TransformerModelArgs(**model_args(s, vocab))},
        build_dataloader_fn=None, build_tokenizer_fn=None, build_validator_fn=None))
    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    trainer, times = None, []
    with tempfile.TemporaryDirectory() as tmp:
        try:
            trainer = Trainer(ConfigManager().parse_args(titan_flags(s, run, iters, micro_batches, tmp)))
            assert trainer.gradient_accumulation_steps == micro_batches, trainer.gradient_accumulation_steps
            tokens = torch.randint(0, vocab, (s["mbs"], s["seq"] + 1), generator=torch.Generator().manual_seed(0))
            # its dataloader's convention: labels are the inputs shifted by one; a fresh dict per micro-batch
            # (train_step moves the tensors to the GPU in place)
            batches = trainer.batch_generator(({"input": tokens[:, :-1]}, tokens[:, 1:]) for _ in itertools.count())
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            peaks = keep_peaks(trainer.metrics_processor.device_memory_monitor,
                               torch.cuda.max_memory_allocated if cuda else (lambda: 0))
            for step in range(1, iters + 1):  # Trainer.train's loop, less checkpointing and profiling
                trainer.step = step
                trainer.gc_handler.run(step)
                sync()
                t = time.perf_counter()
                trainer.train_step(batches)
                sync()
                times.append(time.perf_counter() - t)
            peak = max(peaks + [torch.cuda.max_memory_allocated()]) / 2**30 if cuda else None
            # after train_step (which zeroes the gradients first): weights, gradients, optimizer state
            resident = torch.cuda.memory_allocated() / 2**30 if cuda else None
        except Exception as e:  # e.g. out of memory or a compile failure: a row saying so
            return {"error": f"{type(e).__name__}: {e}"[-2000:]}
        finally:
            if trainer is not None:
                trainer.close()
            if torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()
    half = sorted(times[len(times) // 2:])
    return {"s_per_iter": half[len(half) // 2], "peak_gb": peak, "resident_gb": resident,
            "samples": micro_batches * s["mbs"]}


def run(s: dict, vocab: int, name: str, iters: int, micro_batches: int) -> dict:
    """One torchtitan row, in its own process: the worker's result, or an error row (never an exception)."""
    import re
    import subprocess

    if importlib.util.find_spec("torchtitan") is None:  # no process to start
        return {"error": f"{MISSING}: no module named torchtitan"}
    p = subprocess.run(command(s, vocab, name, iters, micro_batches), capture_output=True, text=True,
                       cwd=os.path.dirname(HERE))
    text = p.stdout + p.stderr
    found = re.findall(r"^TITAN_RESULT (.*)$", text, re.M)
    if not found:
        return {"error": text[-2000:] or f"exit status {p.returncode}"}
    result = json.loads(found[-1])
    logged = re.findall(r"step:\s*\d+\s+loss:\s*([0-9.]+).*?tps:\s*([0-9,]+).*?mfu:\s*([0-9.]+)%", text)
    if logged and "error" not in result:  # torchtitan's own last log line: loss, its tokens/s, its MFU
        loss, tps, mfu = logged[-1]
        result["titan_log"] = {"loss": float(loss), "tps": int(tps.replace(",", "")), "mfu_pct": float(mfu)}
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description="one torchtitan row of train_bench.py (its worker process)")
    ap.add_argument("--shape", required=True, help="JSON: an entry of train_bench.SHAPES plus its vocab")
    ap.add_argument("--row", default="torchtitan", choices=sorted(TITAN_RUNS))  # (torchrun takes --run*)
    ap.add_argument("--iters", type=int, default=12)
    ap.add_argument("--micro-batches", type=int, default=8)
    a = ap.parse_args()
    s = json.loads(a.shape)
    result = measure(s, s.pop("vocab"), a.row, a.iters, a.micro_batches)
    print("TITAN_RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
