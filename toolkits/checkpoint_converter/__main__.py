"""python -m toolkits.checkpoint_converter {hf-to-mcore, mcore-to-hf, mcore-to-mcore, verify} ...

Formats: HF folders (safetensors, sharded or single, or pytorch_model*.bin); Megatron checkpoints in
megatron-core `torch_dist` or Megatron-LM's legacy per-rank format (`--format legacy`), with `local` or
`transformer_engine` parameter naming. Megatron checkpoints not written by this tool (e.g. by
`megatron.training`) need `--hf-config` pointing at the model's HF config.json.

Bad input (missing folders, unsupported architecture, a layout that does not divide the model, an
existing --out without --overwrite) ends with one clear `error:` line, exit status 1, and no output.
Set MEGATRON_PATCH_TRACEBACK=1 to see the traceback behind an error.
"""

from __future__ import annotations

import argparse
import sys

from megatron_patch.conversion.convert import DTYPES, hf_to_mcore, mcore_to_hf, mcore_to_mcore
from megatron_patch.conversion.mcore_io import FORMATS
from megatron_patch.conversion.hf_io import parse_size
from megatron_patch.cli import run


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m toolkits.checkpoint_converter", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)

    a = sub.add_parser("hf-to-mcore", help="HF folder -> megatron-core torch_dist checkpoint")
    a.add_argument("--hf-dir", required=True)
    a.add_argument("--out", required=True)
    a.add_argument("--tp", "--tensor-model-parallel-size", dest="tp", type=int, default=1)
    a.add_argument("--pp", "--pipeline-model-parallel-size", dest="pp", type=int, default=1)
    a.add_argument("--ep", "--expert-model-parallel-size", dest="ep", type=int, default=1,
                   help="expert parallel ranks of a mixture-of-experts model (legacy format's rank files)")
    a.add_argument("--impl", "--transformer-impl", dest="impl", choices=["local", "transformer_engine"],
                   default="local")
    a.add_argument("--dtype", choices=sorted(DTYPES), help="default: the checkpoint's own")
    a.add_argument("--format", "--ckpt-format", dest="format", choices=FORMATS, default="torch_dist")
    a.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    a.add_argument("--overwrite", action="store_true")

    b = sub.add_parser("mcore-to-hf", help="megatron-core torch_dist checkpoint -> HF folder")
    b.add_argument("--mcore-dir", required=True)
    b.add_argument("--out", required=True)
    b.add_argument("--dtype", choices=sorted(DTYPES), help="default: the checkpoint's own")
    b.add_argument("--max-shard-size", default="5GB")
    b.add_argument("--hf-config", help="HF config.json or folder, for checkpoints without an hf/ folder")
    b.add_argument("--overwrite", action="store_true")

    c = sub.add_parser("mcore-to-mcore", help="Megatron -> Megatron: other TP/PP, naming, format or dtype")
    c.add_argument("--mcore-dir", required=True)
    c.add_argument("--out", required=True)
    c.add_argument("--tp", "--tensor-model-parallel-size", dest="tp", type=int, help="default: the source's")
    c.add_argument("--pp", "--pipeline-model-parallel-size", dest="pp", type=int, help="default: the source's")
    c.add_argument("--ep", "--expert-model-parallel-size", dest="ep", type=int, help="default: the source's")
    c.add_argument("--impl", "--transformer-impl", dest="impl", choices=["local", "transformer_engine"])
    c.add_argument("--format", "--ckpt-format", dest="format", choices=FORMATS)
    c.add_argument("--dtype", choices=sorted(DTYPES))
    c.add_argument("--make-vocab-size-divisible-by", type=int)
    c.add_argument("--hf-config", help="HF config.json or folder, for checkpoints without an hf/ folder")
    c.add_argument("--overwrite", action="store_true")

    v = sub.add_parser("verify", help="compare HF and Megatron logits on fixed prompts (one JSON line)")
    v.add_argument("--hf-dir", required=True)
    v.add_argument("--mcore-dir", required=True)
    v.add_argument("--tp", type=int, default=1, help=">1 needs torchrun with TP x PP processes")
    v.add_argument("--pp", type=int, default=1)
    v.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    v.add_argument("--impl", choices=["local", "transformer_engine"],
                   help="Megatron implementation to run (default: the one used at conversion)")
    v.add_argument("--hf-config", help="HF config.json or folder, for checkpoints without an hf/ folder")
    v.add_argument("--trust-remote-code", action="store_true",
                   help="run the modeling files of a remote-code HF folder (Qwen-1, Baichuan, ChatGLM, ...)")
    v.add_argument("--tolerance", type=float, default=None,
                   help="max abs logit diff allowed (default 1e-4 in fp32; 5e-2 for Transformer "
                        "Engine in fp32, whose GEMMs run in TF32; 1.0 in bf16/fp16)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)

    def work() -> dict:
        if args.command == "hf-to-mcore":
            return hf_to_mcore(args.hf_dir, args.out, args.tp, args.pp, args.impl, args.dtype,
                               args.make_vocab_size_divisible_by, args.overwrite, args.format, args.ep)
        if args.command == "mcore-to-hf":
            return mcore_to_hf(args.mcore_dir, args.out, args.dtype, parse_size(args.max_shard_size),
                               args.overwrite, args.hf_config)
        if args.command == "mcore-to-mcore":
            return mcore_to_mcore(args.mcore_dir, args.out, args.tp, args.pp, args.impl, args.format,
                                  args.dtype, args.make_vocab_size_divisible_by, args.overwrite, args.hf_config,
                                  args.ep)
        from megatron_patch.conversion.verify import verify

        return verify(args.hf_dir, args.mcore_dir, args.tp, args.pp, DTYPES[args.dtype], args.tolerance,
                      args.impl, args.hf_config, args.trust_remote_code)

    code, result = run(work)
    if code:
        return code
    if args.command == "verify" and not result["ok"]:
        print(f"error: max abs logit diff {result['max_abs_logit_diff']:.3g} exceeds {result['tolerance']:g}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
