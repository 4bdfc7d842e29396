"""Forward step, loss and dataset provider for GPT-style pretraining on megatron.training.

Loss normalisation: `loss_func` returns (sum of token losses, number of loss tokens, report), the form
megatron-core's schedules understand. Without `--calculate-per-token-loss` megatron divides each
micro-batch by its own token count (a mean of per-micro-batch means); with it, the sums and counts are
added over the whole global batch (all micro-batches and data-parallel ranks) and divided once, so
every loss token weighs the same — what SFT with packing or loss masks wants."""

from __future__ import annotations

from functools import partial

import torch


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    losses = output_tensor.view(-1).float()
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    report = torch.cat([loss.clone().detach().view(1), num_tokens.view(1).float()])
    return loss, num_tokens, {"lm loss": report}


def get_batch(data_iterator) -> dict:
    """The next micro-batch on this rank's device (every rank reads its own iterator: TP peers share
    a data-parallel rank, so they read the same samples)."""
    batch = next(data_iterator)
    device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    return {k: (v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}


def packed_for_te(batch: dict) -> dict:
    """Packed SFT samples for Transformer Engine: the micro-batch becomes one THD sequence whose
    documents are delimited by `PackedSeqParams` (cu_seqlens), instead of a [b, 1, s, s] mask."""
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = batch.pop("cu_seqlens")
    b, s = batch["tokens"].shape
    bounds = torch.cat([row[row >= 0] + i * s for i, row in enumerate(cu)]).unique().to(torch.int32)
    longest = int((bounds[1:] - bounds[:-1]).max())
    out = {k: v.reshape(1, -1) for k, v in batch.items() if k in ("tokens", "labels", "loss_mask", "position_ids")}
    out["packed_seq_params"] = PackedSeqParams(qkv_format="thd", cu_seqlens_q=bounds, cu_seqlens_kv=bounds,
                                               max_seqlen_q=longest, max_seqlen_kv=longest)
    return out


def forward_step(data_iterator, model):
    from megatron.training import get_args

    batch = get_batch(data_iterator)
    if "cu_seqlens" in batch:
        if get_args().transformer_impl == "transformer_engine":
            batch = packed_for_te(batch)
        else:
            batch.pop("cu_seqlens")  # the local implementation takes the block-diagonal mask
    output = model(batch["tokens"], batch["position_ids"], batch.get("attention_mask"), labels=batch["labels"],
                   packed_seq_params=batch.get("packed_seq_params"))
    return output, partial(loss_func, batch["loss_mask"])


def dataset_config_from_args(args):
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig
    from megatron.training import get_tokenizer
    from megatron.training.utils.common_utils import get_blend_and_blend_per_split

    blend, blend_per_split = get_blend_and_blend_per_split(args)
    return GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=blend,
        blend_per_split=blend_per_split,
        split=args.split,
        num_dataset_builder_threads=args.num_dataset_builder_threads,
        path_to_cache=args.data_cache_path,
        mmap_bin_files=args.mmap_bin_files,
        tokenizer=get_tokenizer(),
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=args.create_attention_mask_in_dataloader,
    )


def datasets_provider(train_val_test_num_samples, vp_stage: int | None = None):
    """Megatron's blended GPT datasets (indexed `.bin`/`.idx` from `--data-path`, or `--mock-data`). With a
    virtual pipeline megatron.training asks once per model chunk (`vp_stage`): each chunk gets its own loader
    over the same samples, in the same order."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, MockGPTDataset
    from megatron.training import get_args

    args = get_args()
    config = dataset_config_from_args(args)
    cls = MockGPTDataset if args.mock_data else GPTDataset
    return BlendedMegatronDatasetBuilder(cls, train_val_test_num_samples, lambda: True, config).build()


datasets_provider.is_distributed = True  # every rank builds its loader (see get_batch)
