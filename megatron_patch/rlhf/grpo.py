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
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time

import torch


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
    from megatron_patch.rlhf.rollout import logps_of

    loss, kl = grpo_loss(logps_of(logits, labels, vocab_size), old, ref, advantages, mask, clip, kl_coef)
    return loss, {"loss": loss.item(), "kl": kl}


def train(args) -> dict:
    from megatron_patch.cli import is_first_rank
    from megatron_patch.conversion.atomic import check_output
    from megatron_patch.inference import model_folder, read_prompts
    from megatron_patch.models import pipeline, vocab_size
    from megatron_patch.names import torch_dtype
    from megatron_patch.rlhf.rollout import (
        check_finite,
        check_layout,
        load_reward,
        optimizer_step,
        policy_and_reference,
        reward_summary,
        rewards_of,
        rollout,
        save_hf,
        token_logps,
    )
    from megatron_patch.tokenizer import build_tokenizer

    check_layout(args, "GRPO")
    if args.group_size < 2:
        raise ValueError("--group-size must be >= 2: advantages are normalised within each prompt's group, so a "
                         "group of one always has advantage 0 and nothing is learned")
    if args.out:
        check_output(args.out, args.overwrite, [args.hf_dir, args.mcore_dir])
    elif is_first_rank():
        print("warning: no --out: the trained policy will not be saved", file=sys.stderr)
    reward_fn = load_reward(args.reward)
    tok_dir = args.tokenizer or model_folder(args.mcore_dir, args.hf_dir)
    tokenizer = build_tokenizer(tok_dir)
    texts, prompt_ids = read_prompts(args.prompts, tokenizer, args.chat)
    torch.manual_seed(args.seed)
    policy, reference, cfg = policy_and_reference(args.mcore_dir, args.hf_dir, args.tp, args.pp, args.impl,
                                                  torch_dtype(args.dtype))
    opt = torch.optim.AdamW([p for p in policy.parameters()], lr=args.lr, weight_decay=0.0)
    device = next(policy.parameters()).device
    vocab = vocab_size(cfg)
    history, start = [], time.time()
    for step in range(args.steps):
        # each prompt `group_size` times in a row: the groups whose rewards are normalised together
        rows = [(step * args.prompts_per_step + i) % len(prompt_ids) for i in range(args.prompts_per_step)
                for _ in range(args.group_size)]
        r = rollout(policy, tokenizer, [prompt_ids[i] for i in rows], args.max_new_tokens, args.temperature,
                    args.top_p, args.seed + step, device, args.engine)
        rewards = rewards_of(reward_fn, args.reward, texts, rows, r.texts, args.group_size)
        advantages = group_advantages(rewards, args.group_size).to(device)
        tokens, labels, mask = r.tokens, r.labels, r.mask
        old = token_logps(policy, tokens, labels, vocab)
        ref = token_logps(reference, tokens, labels, vocab)

        loss_fn = functools.partial(_logits_loss, labels=labels, old=old, ref=ref, advantages=advantages, mask=mask,
                                    clip=args.clip, kl_coef=args.kl_coef, vocab_size=vocab)
        policy.train()
        for _ in range(args.epochs):
            opt.zero_grad(set_to_none=True)
            metrics = pipeline.forward_backward(policy, tokens, loss_fn)
            check_finite(metrics["loss"], step)
            optimizer_step(policy, opt, args.clip_grad)
        row = {"step": step + 1, "reward": round(float(rewards.mean()), 4), "kl": round(metrics["kl"], 5),
               "loss": round(metrics["loss"], 5)}
        history.append(row)
        if is_first_rank():
            print(json.dumps(row), file=sys.stderr, flush=True)
    if args.out:
        save_hf(policy, cfg, tok_dir, args.out, args.tp, args.pp, args.overwrite)
    return {"steps": len(history), **reward_summary(history), "seconds": round(time.time() - start, 1),
            "out": args.out, "history": history}


def parser() -> argparse.ArgumentParser:
    from megatron_patch.cli import HelpFormatter, positive_float, positive_int
    from megatron_patch.rlhf.rollout import add_rollout_args

    p = argparse.ArgumentParser(prog="python -m megatron_patch.rlhf.grpo", description=__doc__,
                                formatter_class=HelpFormatter)
    add_rollout_args(p, prompts_per_step=8, out_help="write the final policy here as an HF folder",
                     seed_help="sampling seed", clip_grad_help="gradient norm clip")
    p.add_argument("--reward", required=True, help="module:function, called as fn(prompt, completion) -> float")
    p.add_argument("--steps", type=positive_int, default=100, help="optimisation steps")
    p.add_argument("--group-size", type=positive_int, default=8, help="completions per prompt (>= 2)")
    p.add_argument("--lr", type=positive_float, default=1e-6, help="AdamW learning rate")
    p.add_argument("--epochs", type=positive_int, default=1, help="policy updates per batch of rollouts")
    p.add_argument("--clip", type=positive_float, default=0.2, help="PPO-style ratio clip")
    p.add_argument("--kl-coef", type=float, default=0.04, help="weight of the KL penalty to the starting model")
    return p


def main(argv: list[str] | None = None) -> int:
    from megatron_patch.cli import run as run_tool

    args = parser().parse_args(argv)
    return run_tool(lambda: train(args))[0]


if __name__ == "__main__":
    sys.exit(main())
