"""python -m megatron_patch.pretrain: Megatron-LM pretraining of any registered family.

    torchrun --nproc_per_node 8 -m megatron_patch.pretrain --hf-config Llama-3.1-8B \\
        --tensor-model-parallel-size 2 --data-path my_text_document --tokenizer-type HuggingFaceTokenizer \\
        --tokenizer-model Llama-3.1-8B --seq-length 4096 --micro-batch-size 1 --global-batch-size 256 \\
        --train-iters 1000 --lr 3e-4 --bf16 --save ckpt ...

Every Megatron-LM argument works; ours: --hf-config / --load-hf / --save-hf (see training/arguments.py).
"""

from __future__ import annotations


def main(argv: list[str] | None = None) -> None:
    from megatron_patch.training.gpt import datasets_provider
    from megatron_patch.training.run import run

    run(argv, datasets_provider)


if __name__ == "__main__":
    main()
