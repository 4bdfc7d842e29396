"""python -m megatron_patch.rlhf.grpo: Group Relative Policy Optimization, Megatron-native.

    python -m megatron_patch.rlhf.grpo --hf-dir SFT_MODEL --prompts prompts.jsonl --reward my_rules:score \\
        --group-size 8 --prompts-per-step 8 --steps 200 --max-new-tokens 256 --lr 1e-6 --out grpo_hf
    torchrun --nproc-per-node 2 -m megatron_patch.rlhf.grpo ... --tp 2            # tensor parallel
    torchrun --nproc-per-node 4 -m megatron_patch.rlhf.grpo ... --tp 2 --pp 2     # and pipeline parallel

Each step: `--prompts-per-step` prompts (JSONL `prompt` text or chat `messages`, cycled) are each sampled
`--group-size` times on the policy itself, all of them in one call of megatron-core's inference engine
(`megatron_patch.inference.generate`, `--engine`: the dynamic one batches continuously with CUDA graphs on a GPU
and is kept for the next step while its sizes fit), temperature `--temperature`; a reward per completion comes from a
Python function (`--reward module:function`, called as fn(prompt, completion) -> float); advantages are the
rewards normalised within each prompt's group ((r - mean) / (std + 1e-4)); then `--epochs` passes of the
clipped policy loss

    -min(ratio * A, clip(ratio, 1 - eps, 1 + eps) * A) + kl_coef * KL(policy || reference)

per completion token (ratio against the policy that sampled, the k3 KL estimator against the frozen starting
model), averaged over each completion's tokens and then over completions, with AdamW. The policy is a
megatron-core GPTModel of any registered family (TP and PP under torchrun; one data-parallel replica); the final
policy is written to `--out` as an HF folder. One JSON line per step (mean reward, KL, loss), then a summary.
`--save DIR` keeps checkpoints (every `--save-interval` steps and at the end) and `--load DIR` resumes the latest
exactly, as PPO's (`megatron_patch.rlhf.checkpoint`). The loop is `megatron_patch.rlhf.loop`'s; this module is
GRPO's arithmetic.
"""

from __future__ import annotations

import argparse
import functools
import sys

import torch

from megatron_patch.rlhf.loop import Algorithm, Batch, add_loop_args, update
from megatron_patch.rlhf.loop import main as run_main


def group_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """[prompts * group] rewards -> advantages normalised within each prompt's group."""
    r = rewards.view(-1, group_size)
    return ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True, unbiased=False) + 1e-4)).view(-1)


def grpo_loss(logps, old, ref, advantages, mask, clip: float, kl_coef: float):
    """(loss, mean KL) of a batch of completions; all per-token tensors [rows, s], mask on completion tokens."""
    ratio = torch.exp(logps - old)
    a = advantages[:, None]
    policy = -torch.minimum(ratio * a, torch.clamp(ratio, 1 - clip, 1 + clip) * a)
    kl = torch.exp(ref - logps) - (ref - logps) - 1
    per_token = policy + kl_coef * kl
    n = mask.sum(1).clamp(min=1)
    loss = ((per_token * mask).sum(1) / n).mean()
    return loss, ((kl.detach() * mask).sum(1) / n).mean().item()


def _logits_loss(logits, labels, old, ref, advantages, mask, clip: float, kl_coef: float, vocab_size: int):
    """`grpo_loss` from the policy's logits, with its metrics (`pipeline.forward_backward`'s loss function)."""
    from megatron_patch.rlhf.logprobs import logps_of

    loss, kl = grpo_loss(logps_of(logits, labels, vocab_size), old, ref, advantages, mask, clip, kl_coef)
    return loss, {"loss": loss.item(), "kl": kl}


class GRPO(Algorithm):
    """Group-normalised advantages and the clipped policy loss with a KL penalty (`grpo_loss`)."""

    name = "GRPO"

    @staticmethod
    def check_args(args) -> None:
        if args.group_size < 2:
            raise ValueError("--group-size must be >= 2: advantages are normalised within each prompt's group, so "
                             "a group of one always has advantage 0 and nothing is learned")

    @staticmethod
    def group_size(args) -> int:
        return args.group_size

    def advantages(self, batch: Batch) -> torch.Tensor:
        """[rows] advantage of each completion."""
        return group_advantages(batch.scores, self.loop.args.group_size)

    def loss_kl_coef(self) -> float:
        """The weight of the KL term in the loss."""
        return self.loop.args.kl_coef

    def loss_fn(self, batch: Batch, advantages: torch.Tensor):
        """The policy's loss from its logits with its metrics (`pipeline.forward_backward`'s loss function)."""
        r = batch.rollouts
        return functools.partial(_logits_loss, labels=r.labels, old=batch.old, ref=batch.ref, advantages=advantages,
                                 mask=r.mask, clip=self.loop.args.clip, kl_coef=self.loss_kl_coef(),
                                 vocab_size=self.loop.vocab)

    def train_step(self, batch: Batch) -> dict:
        loop, a = self.loop, self.loop.args
        loss_fn = self.loss_fn(batch, self.advantages(batch))
        for _ in range(a.epochs):
            metrics = update(loop.policy, loop.policy_opt, batch.rollouts.tokens, loss_fn, batch.step, a.clip_grad)
        return {"reward": round(float(batch.scores.mean()), 4), "kl": round(metrics["kl"], 5),
                "loss": round(metrics["loss"], 5)}


def parser() -> argparse.ArgumentParser:
    from megatron_patch.cli import HelpFormatter

    p = argparse.ArgumentParser(prog="python -m megatron_patch.rlhf.grpo", description=__doc__,
                                formatter_class=HelpFormatter)
    add_group_args(p)
    p.add_argument("--kl-coef", type=float, default=0.04, help="weight of the KL penalty to the starting model")
    return p


def add_group_args(p: argparse.ArgumentParser) -> None:
    """The options of the group-sampling trainers (GRPO, RLOO): the loop's, a rule reward, the steps, the group
    size, the ratio clip and the epochs (each adds its --kl-coef)."""
    from megatron_patch.cli import positive_float, positive_int

    add_loop_args(p, prompts_per_step=8, out_help="write the final policy here as an HF folder",
                  seed_help="sampling seed", clip_grad_help="gradient norm clip")
    p.add_argument("--reward", required=True, help="module:function, called as fn(prompt, completion) -> float")
    p.add_argument("--steps", type=positive_int, default=100, help="optimisation steps")
    p.add_argument("--group-size", type=positive_int, default=8, help="completions per prompt (>= 2)")
    p.add_argument("--clip", type=positive_float, default=0.2, help="PPO-style ratio clip")
    p.add_argument("--epochs", type=positive_int, default=1, help="policy updates per batch of rollouts")


def main(argv: list[str] | None = None) -> int:
    return run_main(argv, parser, GRPO)


if __name__ == "__main__":
    sys.exit(main())
