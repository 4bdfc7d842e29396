"""python -m megatron_patch.sft: supervised fine-tuning of any registered family on megatron.training.

    torchrun --nproc_per_node 8 -m megatron_patch.sft --load-hf Qwen2.5-7B-Instruct --sft-data chats.jsonl \\
        --tensor-model-parallel-size 2 --seq-length 4096 --micro-batch-size 1 --global-batch-size 64 \\
        --train-iters 1000 --lr 1e-5 --precision bf16 --save ckpt_sft --save-hf sft_hf

Data: JSONL in chat form ({"messages": [...]}) or instruction form ({"instruction", "input", "output"}),
rendered with the tokenizer's chat template (--tokenizer-model, an HF folder; default the --load-hf one),
loss on assistant tokens only, conversations packed into --seq-length samples with per-document attention
(`megatron_patch.training.sft_data`). The loss is per token over the global batch
(`--calculate-per-token-loss` is always on): every assistant token weighs the same, whatever the
packing and the micro-batch it lands in.
"""

from __future__ import annotations

import sys


def add_sft_args(parser):
    g = parser.add_argument_group("megatron_patch sft")
    g.add_argument("--sft-data", nargs="+", help="JSONL conversations (chat or instruction form), .jsonl[.gz]")
    return parser


def datasets_provider(train_val_test_num_samples, vp_stage: int | None = None):
    """Packed SFT conversations (`--sft-data`); per model chunk of a virtual pipeline (`vp_stage`) the same."""
    from megatron.training import get_args

    from megatron_patch.tokenizer import build_tokenizer
    from megatron_patch.training.sft_data import PackedSFTDataset, read_conversations

    args = get_args()
    tokenizer = build_tokenizer(args.tokenizer_model)
    train = PackedSFTDataset(read_conversations(args.sft_data), tokenizer, args.seq_length, args.seed,
                             num_samples=train_val_test_num_samples[0])
    return train, None, None


datasets_provider.is_distributed = True


def _sft_settings(args) -> None:
    if not args.sft_data:
        raise ValueError("no SFT data: pass --sft-data FILE.jsonl")
    args.calculate_per_token_loss = True


def main(argv: list[str] | None = None) -> int:
    from megatron_patch.training.run import main as run_main

    return run_main("sft", __doc__, argv, datasets_provider, extra_args_provider=add_sft_args, indexed_data=False,
                    adjust=_sft_settings)


if __name__ == "__main__":
    sys.exit(main())
