"""python -m megatron_patch.rlhf.reward_model: a reward model on megatron.training.

    torchrun --nproc_per_node 8 -m megatron_patch.rlhf.reward_model --load-hf sft_hf --pref-data prefs.jsonl \\
        --tensor-model-parallel-size 2 --seq-length 2048 --micro-batch-size 4 --global-batch-size 64 \\
        --train-iters 500 --lr 5e-6 --precision bf16 --save ckpt_rm --save-hf rm_hf

Any registered family's decoder with a scalar head (`megatron_patch.models.reward`: the value at the last
real token, HF's `<Family>ForSequenceClassification` with num_labels=1). `--load-hf` may be a causal LM (the
head starts fresh) or a reward model. Loss: Bradley-Terry, -log sigmoid(r_chosen - r_rejected), averaged over
the pairs of the global batch; logged with `accuracy` (r_chosen > r_rejected) and `margin` (mean r_chosen -
r_rejected). `--save-hf` / `megatron-patch convert mcore-to-hf` export an HF reward model
(`AutoModelForSequenceClassification`)."""

from __future__ import annotations

import sys
from functools import partial

import torch


def reward_config(hf_config: dict) -> dict:
    """The model trained: `hf_config` as a one-label sequence classifier (its pad_token_id decides the
    scored token, as in HF; the model's scalar head carries it)."""
    from megatron_patch.models.reward import as_reward_config

    return as_reward_config(hf_config)


def pairwise_loss(tokens: torch.Tensor, lengths: torch.Tensor, pad_token_id: int | None, output: torch.Tensor):
    """Megatron's loss-function protocol: (sum over pairs, number of pairs, metrics as [sum, count]).
    `pad_token_id`: the reward model's, which decides the scored token (`models.reward.score_positions`)."""
    from megatron_patch.models.reward import scored_values
    from megatron_patch.rlhf.common import pair_report

    values = scored_values(output.float(), tokens, lengths, pad_token_id).view(-1, 2)
    diff = values[:, 0] - values[:, 1]
    per_pair = -torch.nn.functional.logsigmoid(diff)
    n, report = pair_report(**{"rm loss": per_pair, "accuracy": diff > 0, "margin": diff})
    return per_pair.sum(), n, report


def scalar_head(model):
    """The reward model's scalar head under megatron's wrappers (DDP, Float16Module), or None on a pipeline
    stage without one."""
    from megatron.core.utils import unwrap_model

    return getattr(unwrap_model(model), "output_layer", None)


def forward_step(data_iterator, model):
    from megatron_patch.rlhf.common import pair_batch

    batch = pair_batch(data_iterator)
    values = model(batch["tokens"], batch["position_ids"], None)
    pad = getattr(scalar_head(model), "pad_token_id", None)
    return values, partial(pairwise_loss, batch["tokens"], batch["lengths"], pad)


def main(argv: list[str] | None = None) -> int:
    from megatron_patch.rlhf.common import add_preference_args, datasets_provider, preference_settings
    from megatron_patch.training.run import main as run_main

    return run_main("rlhf.reward_model", __doc__, argv, datasets_provider, extra_args_provider=add_preference_args,
                    indexed_data=False, adjust=preference_settings, forward_step=forward_step,
                    model_config=reward_config, lm_head=False)


if __name__ == "__main__":
    sys.exit(main())
