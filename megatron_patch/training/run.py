"""The one launch sequence of our training entry points (pretrain, sft, reward model, DPO): parse (Megatron's
arguments plus ours, the HF architecture applied), build megatron.training's config container with our
model provider, train, and export to HF when asked; `main` gives it the command-line behaviour of every
tool of the package (`megatron_patch.cli`): bad input is one `error: ...` line and exit status 1."""

from __future__ import annotations

import os
import socket
import sys
import traceback
from collections.abc import Callable

from megatron_patch.cli import USER_ERRORS
from megatron_patch.cli import run as run_tool


def run(argv: list[str] | None, datasets_provider, extra_args_provider=None, indexed_data: bool = True,
        adjust: Callable | None = None, forward_step: Callable | None = None,
        model_config: Callable[[dict], dict] | None = None, prog: str | None = None,
        description: str | None = None, lm_head: bool = True) -> None:
    """`adjust(args)` settles an entry point's own arguments; `forward_step` replaces the language-model
    one; `model_config(hf_config)` the HF config the model is built from (e.g. a reward model's);
    `prog` / `description` head `--help`; `lm_head`: the model's output layer is the vocabulary's (False: a
    reward model's one-label head, which FP8 GEMMs do not take)."""
    _prepare_process(sys.argv[1:] if argv is None else argv)
    from megatron.core.enums import ModelType
    from megatron.training.argument_utils import pretrain_cfg_container_from_args
    from megatron.training.training import pretrain

    from megatron_patch import patches
    from megatron_patch.training import gpt
    from megatron_patch.training.arguments import parse_args
    from megatron_patch.training.checkpoint import describe_checkpoint, export_hf
    from megatron_patch.training.model import make_model_provider

    patches.apply("prebuilt_dataset_helpers")
    patches.apply("first_log_interval_reset")
    args, hf_config = parse_args(argv, extra_args_provider, indexed_data=indexed_data, prog=prog,
                                 description=description, adjust=adjust, lm_head=lm_head)
    if args.lean_cross_entropy:
        patches.apply("lean_cross_entropy")
    if args.wgrad_fusion_without_apex and args.gradient_accumulation_fusion:
        patches.apply("apex_free_wgrad_fusion")
    if args.fp8_output_layer and args.fp8_output_layer_impl == "transformer_engine":
        patches.require("fp8_output_layer", "--fp8-output-layer-impl transformer_engine")
    if model_config is not None:
        hf_config = model_config(hf_config)
    cfg = pretrain_cfg_container_from_args(args, None)
    cfg.model = None  # the model comes from our provider
    describe_checkpoint(args, hf_config)
    # by keyword: megatron-core 0.19 moved model_provider behind model_type and forward_step_func
    pretrain(cfg, train_valid_test_dataset_provider=datasets_provider, model_type=ModelType.encoder_or_decoder,
             forward_step_func=forward_step or gpt.forward_step, model_provider=make_model_provider(hf_config))
    export_hf(args)


def main(module: str, doc: str | None, argv: list[str] | None, datasets_provider, **kwargs) -> int:
    """`python -m megatron_patch.<module>`: `run`, with bad input (ours, megatron's assertions) reported
    as one `error: ...` line and exit status 1 (MEGATRON_PATCH_TRACEBACK=1 adds the traceback)."""
    kwargs.setdefault("prog", f"python -m megatron_patch.{module}")
    kwargs.setdefault("description", doc)

    def work() -> None:
        try:
            run(argv, datasets_provider, **kwargs)
        except AssertionError as e:
            raise AssertionError(assertion_text(e)) from e

    return run_tool(work, summary=None, errors=USER_ERRORS + (AssertionError,))[0]


def assertion_text(e: AssertionError) -> str:
    """megatron-core checks its arguments with `assert`, often without a message: the failed check's
    source line and place stand in for it."""
    frames = traceback.extract_tb(e.__traceback__)
    if not frames:
        return str(e) or "AssertionError"
    last = frames[-1]
    where = last.filename.split("site-packages" + os.sep)[-1]
    check = (last.line or "assert").strip()
    return f"{e} ({where}:{last.lineno})" if str(e) else f"failed check `{check}` ({where}:{last.lineno})"


def _prepare_process(argv: list[str]) -> None:
    """Before torch looks for a GPU: `--cpu` hides the GPUs; a plain process (no torchrun) gets the
    rendezvous of a world of one."""
    if "--cpu" in argv:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    if "WORLD_SIZE" not in os.environ:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if "MASTER_PORT" not in os.environ:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                os.environ["MASTER_PORT"] = str(s.getsockname()[1])
