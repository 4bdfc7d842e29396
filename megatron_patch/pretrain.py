"""python -m megatron_patch.pretrain: Megatron-LM pretraining of any registered family.

    torchrun --nproc_per_node 8 -m megatron_patch.pretrain --hf-config Llama-3.1-8B \\
        --data-path data/corpus_text_document --tensor-model-parallel-size 2 --seq-length 4096 \\
        --micro-batch-size 1 --global-batch-size 256 --train-iters 10000 --lr 3e-4 --min-lr 3e-5 \\
        --lr-decay-style cosine --lr-warmup-iters 100 --precision bf16 --save ckpt_pretrain

Every Megatron-LM argument works; ours: --hf-config / --load-hf / --save-hf / --precision / --cpu (see
megatron_patch/training/arguments.py). The tokenizer defaults to the --hf-config (or --load-hf) folder's;
--split defaults to 99,1,0 (a split too small to hold a document is an error); with --save and no
--save-interval, the checkpoint is written at the end. --cpu trains a tiny model without a GPU.
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from megatron_patch.training.gpt import datasets_provider
    from megatron_patch.training.run import main as run_main

    return run_main("pretrain", __doc__, argv, datasets_provider)


if __name__ == "__main__":
    sys.exit(main())
