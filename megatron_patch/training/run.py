"""The one launch sequence of our entry points (pretrain, sft): parse (Megatron's arguments plus ours,
the HF architecture applied), build megatron.training's config container with our model provider, train,
and export to HF when asked."""

from __future__ import annotations

from collections.abc import Callable


def run(argv: list[str] | None, datasets_provider, extra_args_provider=None, indexed_data: bool = True,
        adjust: Callable | None = None, forward_step: Callable | None = None,
        model_config: Callable[[dict], dict] | None = None) -> None:
    """`adjust(args)` settles an entry point's own arguments; `forward_step` replaces the language-model
    one; `model_config(hf_config)` the HF config the model is built from (e.g. a reward model's)."""
    from megatron.core.enums import ModelType
    from megatron.training.argument_utils import pretrain_cfg_container_from_args
    from megatron.training.training import pretrain

    from megatron_patch import patches
    from megatron_patch.training.arguments import parse_args
    from megatron_patch.training.checkpoint import describe_checkpoint, export_hf
    from megatron_patch.training import gpt
    from megatron_patch.training.model import make_model_provider

    patches.apply("prebuilt_dataset_helpers")
    args, hf_config = parse_args(argv, extra_args_provider, indexed_data=indexed_data)
    if model_config is not None:
        hf_config = model_config(hf_config)
    if adjust is not None:
        adjust(args)
    cfg = pretrain_cfg_container_from_args(args, None)
    cfg.model = None  # the model comes from our provider
    describe_checkpoint(args, hf_config)
    pretrain(cfg, datasets_provider, ModelType.encoder_or_decoder, forward_step or gpt.forward_step,
             model_provider=make_model_provider(hf_config))
    export_hf(args)
