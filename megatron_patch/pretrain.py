"""python -m megatron_patch.pretrain: Megatron-LM pretraining of any registered family.

    torchrun --nproc_per_node 8 -m megatron_patch.pretrain --hf-config Llama-3.1-8B \\
        --tensor-model-parallel-size 2 --data-path my_text_document --tokenizer-type HuggingFaceTokenizer \\
        --tokenizer-model Llama-3.1-8B --seq-length 4096 --micro-batch-size 1 --global-batch-size 256 \\
        --train-iters 1000 --lr 3e-4 --bf16 --save ckpt ...

Every Megatron-LM argument works; ours: --hf-config / --load-hf / --save-hf (see training/arguments.py).
"""

from __future__ import annotations


def main(argv: list[str] | None = None) -> None:
    from megatron.core.enums import ModelType
    from megatron.training.argument_utils import pretrain_cfg_container_from_args
    from megatron.training.training import pretrain

    from megatron_patch import patches
    from megatron_patch.training.arguments import parse_args
    from megatron_patch.training.checkpoint import describe_checkpoint, export_hf
    from megatron_patch.training.gpt import datasets_provider, forward_step
    from megatron_patch.training.model import make_model_provider

    patches.apply("prebuilt_dataset_helpers")
    args, hf_config = parse_args(argv)
    cfg = pretrain_cfg_container_from_args(args, None)
    cfg.model = None
    describe_checkpoint(args)
    pretrain(cfg, datasets_provider, ModelType.encoder_or_decoder, forward_step,
             model_provider=make_model_provider(hf_config))
    export_hf(args)


if __name__ == "__main__":
    main()
