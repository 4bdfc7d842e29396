"""megatron-patch convert {hf-to-mcore, mcore-to-hf, mcore-to-mcore, verify} ...   (or python -m megatron_patch.convert)

Converts between HF folders (safetensors, sharded or single, or pytorch_model*.bin) and Megatron
checkpoints in both of Megatron's formats: megatron-core `torch_dist` (the default; reshardable) and
Megatron-LM's legacy per-rank files (`--format legacy`), each in `local` or `transformer_engine`
parameter naming, at any TP x PP (x EP) layout; `verify` compares the two models' logits. Megatron
checkpoints not written by this tool (e.g. by `megatron.training`) need `--hf-config` pointing at the
model's HF config.json. `megatron-patch convert COMMAND --help` lists a command's options.

Outputs are written to a temporary folder beside --out and renamed at the end. Bad input (missing
folders, unsupported architecture, a layout that does not divide the model, an existing --out without
--overwrite, NaN / Inf weights without --allow-nonfinite) ends with one `error:` line, exit status 1,
and no output; Ctrl-C and SIGTERM leave nothing behind either (exit 130 / 143).
Set MEGATRON_PATCH_TRACEBACK=1 to see the traceback behind an error.
"""

from __future__ import annotations

import argparse
import sys

from megatron_patch.cli import HelpFormatter, positive_float, positive_int, run
from megatron_patch.names import DTYPE_NAMES, FORMATS, IMPLS


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megatron-patch convert", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, text: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=text, description=text,
                              formatter_class=HelpFormatter)

    def layout(c: argparse.ArgumentParser, default: int | None, keep: str = "") -> None:
        c.add_argument("--tp", "--tensor-model-parallel-size", dest="tp", type=positive_int, default=default,
                       metavar="N", help="tensor parallel ranks" + keep)
        c.add_argument("--pp", "--pipeline-model-parallel-size", dest="pp", type=positive_int, default=default,
                       metavar="N", help="pipeline parallel ranks (stages)" + keep)
        c.add_argument("--ep", "--expert-model-parallel-size", dest="ep", type=positive_int, default=default,
                       metavar="N", help="expert parallel ranks of a mixture-of-experts model" + keep)

    def common(c: argparse.ArgumentParser, dtype_help: str) -> None:
        c.add_argument("--dtype", choices=DTYPE_NAMES, help=dtype_help)
        c.add_argument("--allow-nonfinite", action="store_true",
                       help="write tensors holding NaN / Inf (with a warning) instead of refusing them")
        c.add_argument("--overwrite", action="store_true", help="replace an existing --out")

    a = command("hf-to-mcore", "HF folder -> Megatron checkpoint (torch_dist or legacy)")
    a.add_argument("--hf-dir", required=True, help="HF model folder (config.json + weights)")
    a.add_argument("--out", required=True, help="Megatron checkpoint folder to write")
    layout(a, 1)
    a.add_argument("--impl", "--transformer-impl", dest="impl", choices=IMPLS, default="local",
                   help="parameter naming of the model that will load it")
    a.add_argument("--format", "--ckpt-format", dest="format", choices=FORMATS, default="torch_dist",
                   help="torch_dist: megatron-core's reshardable format; legacy: Megatron-LM's per-rank files")
    a.add_argument("--make-vocab-size-divisible-by", type=positive_int, default=128, metavar="N",
                   help="vocab padding unit (x TP), as Megatron's option of the same name")
    common(a, "dtype of the written weights (default: the HF checkpoint's own)")

    b = command("mcore-to-hf", "Megatron checkpoint (ours or megatron.training's) -> HF folder")
    b.add_argument("--mcore-dir", required=True, help="Megatron checkpoint folder")
    b.add_argument("--out", required=True, help="HF folder to write (sharded safetensors)")
    b.add_argument("--max-shard-size", default="5GB", help="largest safetensors shard (e.g. 500MB, 5GB)")
    b.add_argument("--hf-config", help="HF config.json or folder, for checkpoints without an hf/ folder")
    common(b, "dtype of the written weights (default: the checkpoint's own)")

    c = command("mcore-to-mcore", "Megatron -> Megatron: other TP/PP/EP, naming, format or dtype")
    c.add_argument("--mcore-dir", required=True, help="Megatron checkpoint folder")
    c.add_argument("--out", required=True, help="Megatron checkpoint folder to write")
    layout(c, None, " (default: the source's)")
    c.add_argument("--impl", "--transformer-impl", dest="impl", choices=IMPLS,
                   help="parameter naming (default: the source's)")
    c.add_argument("--format", "--ckpt-format", dest="format", choices=FORMATS, help="default: the source's")
    c.add_argument("--make-vocab-size-divisible-by", type=positive_int, metavar="N", help="default: the source's")
    c.add_argument("--hf-config", help="HF config.json or folder, for checkpoints without an hf/ folder")
    common(c, "dtype of the written weights (default: the source's)")

    v = command("verify", "compare HF and Megatron logits on fixed prompts (one JSON line; exit 1 on mismatch)")
    v.add_argument("--hf-dir", required=True, help="HF model folder (the reference)")
    v.add_argument("--mcore-dir", required=True, help="Megatron checkpoint folder")
    v.add_argument("--tp", type=positive_int, default=1, help="run the Megatron side at this TP (>1: under torchrun "
                                                              "with TP x PP processes)")
    v.add_argument("--pp", type=positive_int, default=1, help="and this PP")
    v.add_argument("--dtype", choices=DTYPE_NAMES,
                   help="compute dtype of both models (default: the checkpoint's dtype); the HF weights are "
                        "first rounded to the checkpoint's dtype, so fp32 checks a bf16 conversion exactly")
    v.add_argument("--impl", choices=IMPLS,
                   help="Megatron implementation to run (default: the one used at conversion)")
    v.add_argument("--hf-config", help="HF config.json or folder, for checkpoints without an hf/ folder")
    v.add_argument("--trust-remote-code", action="store_true",
                   help="run the modeling files of a remote-code HF folder (Qwen-1, Baichuan, ChatGLM, ...)")
    v.add_argument("--tolerance", type=positive_float, default=None,
                   help="max abs logit diff allowed (default: 1e-4 in fp32, 5e-2 for Transformer Engine in fp32, "
                        "whose GEMMs run in TF32; 1.0 in bf16/fp16)")
    return p


def _layout(args: argparse.Namespace, base):
    """`base` (a Layout) with the layout options given on the command line; the others keep base's value."""
    import dataclasses

    given = {field: getattr(args, field, None) for field in ("tp", "pp", "ep", "make_vocab_size_divisible_by")}
    return dataclasses.replace(base, **{k: v for k, v in given.items() if v is not None})


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)

    def work() -> dict:
        # imported here: --help and argument errors must not wait for torch and megatron-core
        from megatron_patch.conversion import convert
        from megatron_patch.conversion.hf_io import parse_size
        from megatron_patch.models import Layout

        if args.command == "hf-to-mcore":
            return convert.hf_to_mcore(args.hf_dir, args.out, layout=_layout(args, Layout()), impl=args.impl,
                                       dtype=args.dtype, fmt=args.format, overwrite=args.overwrite,
                                       allow_nonfinite=args.allow_nonfinite)
        if args.command == "mcore-to-hf":
            return convert.mcore_to_hf(args.mcore_dir, args.out, dtype=args.dtype,
                                       max_shard_size=parse_size(args.max_shard_size), overwrite=args.overwrite,
                                       hf_config=args.hf_config, allow_nonfinite=args.allow_nonfinite)
        if args.command == "mcore-to-mcore":
            return convert.mcore_to_mcore(args.mcore_dir, args.out, layout=lambda src: _layout(args, src),
                                          impl=args.impl, fmt=args.format, dtype=args.dtype,
                                          overwrite=args.overwrite, hf_config=args.hf_config,
                                          allow_nonfinite=args.allow_nonfinite)
        from megatron_patch.conversion.verify import verify
        from megatron_patch.names import torch_dtype

        return verify(args.hf_dir, args.mcore_dir, layout=_layout(args, Layout()),
                      dtype=torch_dtype(args.dtype) if args.dtype else None, tolerance=args.tolerance,
                      impl=args.impl, hf_config=args.hf_config, trust_remote_code=args.trust_remote_code)

    code, result = run(work)
    if code:
        return code
    if args.command == "verify" and not result["ok"]:
        print(f"error: {result['problem']}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
