"""python -m megatron_patch.rlhf.rloo: REINFORCE Leave-One-Out (Ahmadian et al., 2024), Megatron-native.

    python -m megatron_patch.rlhf.rloo --hf-dir SFT_MODEL --prompts prompts.jsonl --reward my_rules:score \\
        --group-size 4 --prompts-per-step 8 --steps 200 --max-new-tokens 256 --lr 1e-6 --out rloo_hf
    torchrun --nproc-per-node 2 -m megatron_patch.rlhf.rloo ... --tp 2            # tensor parallel

Each step samples every prompt `--group-size` times, as GRPO does. Each completion's reward is the rule's score
less `--kl-coef` x its KL to the starting model (the sum of log p - log p_ref over its tokens), and its
advantage is that reward less the mean reward of the other completions of its prompt (the leave-one-out
baseline: no critic, no normalisation by the group's spread). The loss is the clipped policy term of GRPO with
that advantage and no separate KL term (the KL is in the reward). The options, the loop, checkpoints and export
are GRPO's (`megatron_patch.rlhf.loop`); this module is the arithmetic."""

from __future__ import annotations

import argparse
import sys

import torch

from megatron_patch.rlhf.grpo import GRPO, add_group_args
from megatron_patch.rlhf.loop import Batch
from megatron_patch.rlhf.loop import main as run_main


def leave_one_out(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """[prompts * group] rewards -> each one less the mean of the others of its group."""
    r = rewards.view(-1, group_size)
    return (r - (r.sum(1, keepdim=True) - r) / (group_size - 1)).view(-1)


class RLOO(GRPO):
    name = "RLOO"

    def advantages(self, batch: Batch) -> torch.Tensor:
        from megatron_patch.rlhf.ppo_loss import sequence_kl

        a = self.loop.args
        rewards = batch.scores - a.kl_coef * sequence_kl(batch.old, batch.ref, batch.rollouts.mask)
        return leave_one_out(rewards, a.group_size)

    def loss_kl_coef(self) -> float:
        return 0.0  # the KL is in the reward


def parser() -> argparse.ArgumentParser:
    from megatron_patch.cli import HelpFormatter

    p = argparse.ArgumentParser(prog="python -m megatron_patch.rlhf.rloo", description=__doc__,
                                formatter_class=HelpFormatter)
    add_group_args(p)
    p.add_argument("--kl-coef", type=float, default=0.05,
                   help="weight of the KL to the starting model in each completion's reward")
    return p


def main(argv: list[str] | None = None) -> int:
    return run_main(argv, parser, RLOO)


if __name__ == "__main__":
    sys.exit(main())
