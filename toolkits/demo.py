"""`make demo`: the converter's whole promise on a tiny LLaMA, on CPU, in about a minute.

1. write a tiny random LLaMA (megatron_patch/assets/tiny_llama.json, seed 0) as a real HF folder;
2. convert it to a megatron-core torch_dist checkpoint for TP=2 x PP=2 with the CLI;
3. verify logits of the Megatron model against HF transformers;
4. convert back to HF with the CLI and check every tensor is bitwise identical;
5. print a summary.
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

from megatron_patch.conversion.hf_io import read_all
from megatron_patch.models.registry import load_hf_config
from megatron_patch.testing import TINY_LLAMA, random_hf_model


def _cli(*args: str) -> dict:
    # the console script beside this interpreter (pip install puts it there), else the same as a module
    script = os.path.join(os.path.dirname(sys.executable), "megatron-patch")
    cmd = [script] if os.access(script, os.X_OK) else [sys.executable, "-m", "megatron_patch"]
    cmd += ["convert", *args]
    print("$ megatron-patch convert", " ".join(args), flush=True)  # as a user types it (with the venv active)
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"demo failed: {' '.join(args[:1])} exited {proc.returncode}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", default="demo_out")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--pp", type=int, default=2)
    args = p.parse_args()
    start = time.time()
    shutil.rmtree(args.workdir, ignore_errors=True)
    os.makedirs(args.workdir)
    hf_dir, mc_dir, back_dir = (os.path.join(args.workdir, n) for n in ("hf", "mcore", "hf_roundtrip"))

    cfg = load_hf_config(TINY_LLAMA)
    random_hf_model(cfg, seed=0).save_pretrained(hf_dir)
    print(f"wrote tiny LLaMA to {hf_dir}", flush=True)
    conv = _cli("hf-to-mcore", "--hf-dir", hf_dir, "--out", mc_dir, "--tp", str(args.tp), "--pp", str(args.pp))
    ver = _cli("verify", "--hf-dir", hf_dir, "--mcore-dir", mc_dir)
    _cli("mcore-to-hf", "--mcore-dir", mc_dir, "--out", back_dir)
    a, b = read_all(hf_dir), read_all(back_dir)
    identical = set(a) == set(b) and all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)

    params = sum(t.numel() for t in a.values())
    print("\n== megatron_patch demo summary ==")
    print(f"model               tiny LLaMA: {cfg['num_hidden_layers']} layers, hidden {cfg['hidden_size']}, "
          f"{cfg['num_attention_heads']} heads / {cfg['num_key_value_heads']} kv heads, {params:,} parameters")
    print(f"HF -> Megatron      torch_dist for TP={args.tp} x PP={args.pp}, padded vocab "
          f"{conv['padded_vocab_size']} ({conv['seconds']} s)")
    print(f"verify (fp32)       max |logit diff| {ver['max_abs_logit_diff']:.2e}, KL {ver['kl']:.1e}, "
          f"top-1 agreement {ver['top1_agreement']:.0%}")
    print(f"Megatron -> HF      {len(b)} tensors, bitwise identical: {'yes' if identical else 'NO'}")
    print(f"total               {time.time() - start:.1f} s; outputs in {args.workdir}/")
    return 0 if identical and ver["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
