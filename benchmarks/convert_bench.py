"""Converter benchmark: synthetic LLaMA-shaped HF checkpoints on disk, converted HF -> torch_dist
(TP=1 and TP=2 x PP=2) and back, timed next to the raw disk speed measured in the same run.

    python benchmarks/convert_bench.py --shapes 1b 3b [--workdir /tmp/convert_bench] [--keep]

The synthetic checkpoint is written shard by shard (never whole in RAM), in bf16, with real LLaMA-3.2
widths. Each conversion runs as its own process through the CLI, which reports its peak RSS.
Prints a markdown table (paste into docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

import torch
from safetensors.torch import save_file

SHAPES = {
    # Llama-3.2-1B / 3B and Llama-3.1-8B widths (vocab 128256, bf16)
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, head_dim=64, tie_word_embeddings=True),
    "3b": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
               num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128, tie_word_embeddings=False),
}
GB = 1e9


def llama_tensors(cfg: dict) -> list[tuple[str, tuple[int, ...]]]:
    h, f, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    out = [("model.embed_tokens.weight", (cfg["vocab_size"], h))]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", (h,)), (p + "self_attn.q_proj.weight", (q, h)),
                (p + "self_attn.k_proj.weight", (kv, h)), (p + "self_attn.v_proj.weight", (kv, h)),
                (p + "self_attn.o_proj.weight", (h, q)), (p + "post_attention_layernorm.weight", (h,)),
                (p + "mlp.gate_proj.weight", (f, h)), (p + "mlp.up_proj.weight", (f, h)),
                (p + "mlp.down_proj.weight", (h, f))]
    out.append(("model.norm.weight", (h,)))
    if not cfg["tie_word_embeddings"]:
        out.append(("lm_head.weight", (cfg["vocab_size"], h)))
    return out


def synthesize(shape: str, folder: str, shard_bytes: int = 2 * 10**9) -> int:
    """Write a random bf16 HF checkpoint; at most one shard is in memory. Returns its size in bytes."""
    cfg = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256, hidden_act="silu",
               max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0, torch_dtype="bfloat16",
               **SHAPES[shape])
    os.makedirs(folder)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    block = torch.randn(1 << 24, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    shards, current, size, total = [], {}, 0, 0

    def fill(n: int, offset: int) -> torch.Tensor:  # cheap pseudo-random content, distinct per tensor
        reps = -(-n // block.numel())
        return block.roll(offset % block.numel()).repeat(reps)[:n]

    for i, (name, shp) in enumerate(llama_tensors(cfg)):
        n = int(torch.Size(shp).numel())
        if current and size + 2 * n > shard_bytes:
            shards.append(current)
            _flush(folder, shards)
            current, size = {}, 0
        current[name] = fill(n, i * 7919).reshape(shp).clone()
        size += 2 * n
        total += 2 * n
    shards.append(current)
    _flush(folder, shards, final=True)
    return total


def _flush(folder: str, shards: list[dict], final: bool = False) -> None:
    i = len(shards)
    save_file(shards[-1], os.path.join(folder, f"part-{i:05d}.safetensors"), metadata={"format": "pt"})
    shards[-1] = list(shards[-1])  # keep the names only
    if final:
        weight_map = {}
        for j, names in enumerate(shards, 1):
            final_name = f"model-{j:05d}-of-{len(shards):05d}.safetensors"
            os.rename(os.path.join(folder, f"part-{j:05d}.safetensors"), os.path.join(folder, final_name))
            weight_map.update(dict.fromkeys(names, final_name))
        with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f)


def disk_ceiling(folder: str, nbytes: int = 4 * 10**9) -> tuple[float, float]:
    """(write GB/s with fsync, read GB/s) of a plain file of `nbytes`, 64 MiB at a time."""
    path = os.path.join(folder, "ceiling.bin")
    chunk = os.urandom(64 << 20)
    t = time.time()
    with open(path, "wb") as f:
        for _ in range(nbytes // len(chunk)):
            f.write(chunk)
        f.flush()
        os.fsync(f.fileno())
    write = nbytes / (time.time() - t) / GB
    t = time.time()
    with open(path, "rb") as f:
        while f.readinto(bytearray(64 << 20)):
            pass
    read = nbytes / (time.time() - t) / GB
    os.remove(path)
    return write, read


def run_cli(*args: str) -> dict:
    t = time.time()
    proc = subprocess.run([sys.executable, "-m", "megatron_patch.convert", *args],
                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    if proc.returncode:
        raise SystemExit(f"conversion failed: {' '.join(args)}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["wall"] = time.time() - t
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=["1b", "3b"], choices=sorted(SHAPES))
    p.add_argument("--workdir", default="/tmp/convert_bench")
    p.add_argument("--keep", action="store_true")
    args = p.parse_args()
    shutil.rmtree(args.workdir, ignore_errors=True)
    os.makedirs(args.workdir)
    write, read = disk_ceiling(args.workdir)
    print(f"disk ceiling: write {write:.2f} GB/s (fsync), read {read:.2f} GB/s; {os.cpu_count()} cores", flush=True)
    rows = []
    for shape in args.shapes:
        root = os.path.join(args.workdir, shape)
        hf = os.path.join(root, "hf")
        t = time.time()
        size = synthesize(shape, hf)
        print(f"{shape}: synthesized {size / GB:.2f} GB in {time.time() - t:.1f} s", flush=True)
        runs = [
            ("HF -> torch_dist TP1", ["hf-to-mcore", "--hf-dir", hf, "--out", f"{root}/tp1"]),
            ("HF -> torch_dist TP2xPP2",
             ["hf-to-mcore", "--hf-dir", hf, "--out", f"{root}/tp2pp2", "--tp", "2", "--pp", "2"]),
            ("torch_dist -> HF", ["mcore-to-hf", "--mcore-dir", f"{root}/tp1", "--out", f"{root}/back"]),
        ]
        for label, argv in runs:
            r = run_cli(*argv)
            rows.append((shape, label, size, r))
            print(f"  {label}: {r['seconds']:.1f} s, {r['gb_per_s']:.2f} GB/s, peak RSS {r['peak_rss_gb']:.2f} GB",
                  flush=True)
        if not args.keep:
            shutil.rmtree(root)
    print("\n| shape | conversion | size GB | seconds | GB/s | % of disk write ceiling | peak RSS GB |")
    print("|---|---|---|---|---|---|---|")
    for shape, label, size, r in rows:
        print(f"| {shape} | {label} | {size / GB:.2f} | {r['seconds']:.1f} | {r['gb_per_s']:.2f} | "
              f"{100 * r['gb_per_s'] / write:.0f}% | {r['peak_rss_gb']:.2f} |")
    print(f"\nDisk ceiling in the same run: write {write:.2f} GB/s (with fsync), read {read:.2f} GB/s.")


if __name__ == "__main__":
    main()
