"""python -m megatron_patch.rlhf.reward_model: a reward model on megatron.training.

    torchrun --nproc_per_node 8 -m megatron_patch.rlhf.reward_model --load-hf SFT_MODEL --pref-data prefs.jsonl \\
        --seq-length 2048 --micro-batch-size 4 --global-batch-size 64 --train-iters 500 --lr 5e-6 --bf16 \\
        --tensor-model-parallel-size 2 --save ckpt --save-hf rm_hf

Any registered family's decoder with a scalar head (`megatron_patch.models.reward`: the value at the last
real token, HF's `<Family>ForSequenceClassification` with num_labels=1). `--load-hf` may be a causal LM (the
head starts fresh) or a reward model. Loss: Bradley-Terry, -log sigmoid(r_chosen - r_rejected), averaged over
the pairs of the global batch; logged with `accuracy` (r_chosen > r_rejected) and `margin` (mean r_chosen -
r_rejected). `--save-hf` / `toolkits.checkpoint_converter mcore-to-hf` export an HF reward model
(`AutoModelForSequenceClassification`)."""

from __future__ import annotations

from functools import partial

import torch


def pairwise_loss(lengths: torch.Tensor, output: torch.Tensor):
    """Megatron's loss-function protocol: (sum over pairs, number of pairs, metrics as [sum, count])."""
    from megatron_patch.models.reward import sequence_values
    from megatron_patch.rlhf.common import pair_report

    values = sequence_values(output.float(), lengths).view(-1, 2)
    diff = values[:, 0] - values[:, 1]
    per_pair = -torch.nn.functional.logsigmoid(diff)
    n, report = pair_report(**{"rm loss": per_pair, "accuracy": diff > 0, "margin": diff})
    return per_pair.sum(), n, report


def forward_step(data_iterator, model):
    from megatron_patch.rlhf.common import pair_batch

    batch = pair_batch(data_iterator)
    values = model(batch["tokens"], batch["position_ids"], None)
    return values, partial(pairwise_loss, batch["lengths"])


def main(argv: list[str] | None = None) -> None:
    from megatron_patch.models.reward import as_reward_config
    from megatron_patch.rlhf.common import add_preference_args, datasets_provider, preference_settings
    from megatron_patch.training.run import run

    run(argv, datasets_provider, add_preference_args, indexed_data=False, adjust=preference_settings,
        forward_step=forward_step, model_config=as_reward_config)


if __name__ == "__main__":
    main()
