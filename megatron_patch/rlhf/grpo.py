"""python -m megatron_patch.rlhf.grpo: Group Relative Policy Optimization, Megatron-native.

    python -m megatron_patch.rlhf.grpo --hf-dir SFT_MODEL --prompts prompts.jsonl --reward my_rules:score \\
        --group-size 8 --prompts-per-step 8 --steps 200 --max-new-tokens 256 --lr 1e-6 --out grpo_hf
    torchrun --nproc-per-node 2 -m megatron_patch.rlhf.grpo ... --tp 2            # tensor parallel

Each step: `--prompts-per-step` prompts (JSONL `prompt` text or chat `messages`, cycled) are each sampled
`--group-size` times on the policy itself, all of them in one call of megatron-core's dynamic inference
engine (`megatron_patch.inference.generate`: continuous batching, CUDA graphs on a GPU; the engine is kept
for the next step while its sizes fit), temperature `--temperature`; a reward per completion comes from a
Python function (`--reward module:function`, called as fn(prompt, completion) -> float); advantages are the
rewards normalised within each prompt's group ((r - mean) / (std + 1e-4)); then `--epochs` passes of the
clipped policy loss

    -min(ratio * A, clip(ratio, 1 - eps, 1 + eps) * A) + kl_coef * KL(policy || reference)

per completion token (ratio against the policy that sampled, the k3 KL estimator against the frozen starting
model), averaged over each completion's tokens and then over completions, with AdamW. The policy is a
megatron-core GPTModel of any registered family (TP under torchrun; one data-parallel replica); the final
policy is written to `--out` as an HF folder. One JSON line per step (mean reward, KL, loss), then a summary.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import statistics
import sys
import time
from collections.abc import Callable

import torch


def load_reward(spec: str) -> Callable[[str, str], float]:
    module, _, name = spec.partition(":")
    if not name:
        raise ValueError(f"--reward {spec!r}: expected module:function")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"--reward {spec}: {e}") from e
    if not callable(fn):
        raise ValueError(f"--reward {spec} is not a function")
    return fn


def group_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """[prompts * group] rewards -> advantages normalised within each prompt's group."""
    r = rewards.view(-1, group_size)
    return ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True, unbiased=False) + 1e-4)).view(-1)


def token_logps(model, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log p(label) per position [rows, s] (vocab-parallel cross entropy, gathered over TP)."""
    from megatron_patch import patches

    pos = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
    with patches.applied("cpu_cuda_calls"):
        return -model(tokens, pos, None, labels=labels).float()


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


def with_end_token(completions: list[list[int]], max_new_tokens: int, eod: int) -> list[list[int]]:
    """The sampled completions as trained on: one that ended before `max_new_tokens` ended by sampling
    the end-of-document token, which generation leaves out; it is put back, so that the policy is
    trained on (and credited or blamed for) stopping there."""
    return [c + [eod] if len(c) < max_new_tokens else c for c in completions]


def batch_of(prompts: list[list[int]], completions: list[list[int]], pad: int, device) -> tuple:
    """Right-padded prompt + completion rows: tokens, labels and the completion-token mask."""
    rows = [p + c for p, c in zip(prompts, completions)]
    s = max(len(r) for r in rows)
    tokens = torch.full((len(rows), s), pad, dtype=torch.long)
    mask = torch.zeros(len(rows), s)
    for i, (p, r) in enumerate(zip(prompts, rows)):
        tokens[i, : len(r)] = torch.tensor(r)
        mask[i, len(p) - 1: len(r) - 1] = 1  # positions whose label is a completion token
    labels = torch.cat([tokens[:, 1:], torch.full((len(rows), 1), pad)], 1)
    return tokens.to(device), labels.to(device), mask.to(device)


def save_hf(model, cfg: dict, tokenizer_dir: str, out: str, tp: int, overwrite: bool = False) -> None:
    """The policy as an HF folder: every TP rank's weights gathered on rank 0, written by the converter's
    writer (atomically; NaN / Inf refused)."""
    import torch.distributed as dist

    from megatron_patch.conversion.convert import save_hf_state
    from megatron_patch.conversion.engine import make_plan, megatron_to_hf
    from megatron_patch.models import Layout

    mine = {k: v.detach().cpu() for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    states = [None] * tp
    if tp > 1:
        dist.all_gather_object(states, mine)  # TP ranks are the whole world here
    else:
        states = [mine]
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    hf = megatron_to_hf(make_plan(cfg, Layout(tp, 1), model.config.transformer_impl),
                        {(t, 0, 0): sd for t, sd in enumerate(states)})
    save_hf_state(hf, cfg, out, side_dir=tokenizer_dir, overwrite=overwrite)


def rewards_of(reward_fn: Callable[[str, str], float], spec: str, texts: list[str], rows: list[int],
               completions: list[str], group_size: int) -> torch.Tensor:
    """The reward of each completion; anything but a finite number is refused, naming the prompt and
    sample (a NaN reward would turn the whole policy into NaN)."""
    values = []
    for n, (i, completion) in enumerate(zip(rows, completions)):
        value = reward_fn(texts[i], completion)
        try:
            number = float(value)
        except (TypeError, ValueError):
            number = None
        if number is None or isinstance(value, bool) or not math.isfinite(number):
            raise ValueError(f"--reward {spec} returned {value!r} for prompt {i + 1} ({texts[i][:40]!r}), sample "
                             f"{n % group_size + 1} of its group: a reward must be a finite number")
        values.append(number)
    return torch.tensor(values)


def train(args) -> dict:
    from megatron_patch.cli import is_first_rank
    from megatron_patch.conversion.atomic import check_output
    from megatron_patch.inference import generate, load_model, model_folder, read_prompts
    from megatron_patch.names import torch_dtype
    from megatron_patch.tokenizer import build_tokenizer

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
    dtype = torch_dtype(args.dtype)
    policy, cfg = load_model(args.mcore_dir, args.hf_dir, args.tp, 1, args.impl, dtype)
    reference, _ = load_model(args.mcore_dir, args.hf_dir, args.tp, 1, args.impl, dtype)
    for p in reference.parameters():
        p.requires_grad_(False)
    for p in policy.parameters():
        p.requires_grad_(True)
    opt = torch.optim.AdamW([p for p in policy.parameters()], lr=args.lr, weight_decay=0.0)
    device = next(policy.parameters()).device
    history, start = [], time.time()
    for step in range(args.steps):
        # each prompt `group_size` times in a row: the groups whose rewards are normalised together
        rows = [(step * args.prompts_per_step + i) % len(prompt_ids) for i in range(args.prompts_per_step)
                for _ in range(args.group_size)]
        prompts = [prompt_ids[i] for i in rows]
        policy.eval()
        completions = generate(policy, tokenizer, prompts, args.max_new_tokens, args.temperature, 0, args.top_p,
                               seed=args.seed + step, max_batch_size=len(prompts), stop_id=tokenizer.eod)
        rewards = rewards_of(reward_fn, args.reward, texts, rows, [tokenizer.detokenize(c) for c in completions],
                             args.group_size)
        completions = with_end_token(completions, args.max_new_tokens, tokenizer.eod)
        advantages = group_advantages(rewards, args.group_size).to(device)
        tokens, labels, mask = batch_of(prompts, completions, tokenizer.pad, device)
        with torch.no_grad():
            old = token_logps(policy, tokens, labels)
            ref = token_logps(reference, tokens, labels)
        policy.train()
        for _ in range(args.epochs):
            loss, kl = grpo_loss(token_logps(policy, tokens, labels), old, ref, advantages, mask, args.clip,
                                 args.kl_coef)
            if not torch.isfinite(loss):
                raise ValueError(f"step {step + 1}: the loss is {loss.item()} (non-finite); stopping before the "
                                 "policy is corrupted (lower --lr or check the reward)")
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(policy.parameters(), args.clip_grad)
            opt.step()
        row = {"step": step + 1, "reward": round(float(rewards.mean()), 4), "kl": round(kl, 5),
               "loss": round(loss.item(), 5)}
        history.append(row)
        if is_first_rank():
            print(json.dumps(row), file=sys.stderr, flush=True)
    if args.out:
        save_hf(policy, cfg, tok_dir, args.out, args.tp, args.overwrite)
    k = max(1, len(history) // 5)
    return {"steps": len(history), "reward_first": round(statistics.mean(r["reward"] for r in history[:k]), 4),
            "reward_last": round(statistics.mean(r["reward"] for r in history[-k:]), 4),
            "seconds": round(time.time() - start, 1), "out": args.out, "history": history}


def main(argv: list[str] | None = None) -> int:
    from megatron_patch.cli import HelpFormatter, positive_float, positive_int
    from megatron_patch.cli import run as run_tool
    from megatron_patch.inference import add_model_args

    p = argparse.ArgumentParser(prog="python -m megatron_patch.rlhf.grpo", description=__doc__,
                                formatter_class=HelpFormatter)
    add_model_args(p)
    p.add_argument("--prompts", required=True, help="JSONL prompts (`prompt` text or chat `messages`)")
    p.add_argument("--chat", action="store_true", help="render plain prompts with the chat template")
    p.add_argument("--reward", required=True, help="module:function, called as fn(prompt, completion) -> float")
    p.add_argument("--steps", type=positive_int, default=100, help="optimisation steps")
    p.add_argument("--prompts-per-step", type=positive_int, default=8, help="prompts sampled per step")
    p.add_argument("--group-size", type=positive_int, default=8, help="completions per prompt (>= 2)")
    p.add_argument("--max-new-tokens", type=positive_int, default=128, help="longest completion")
    p.add_argument("--temperature", type=positive_float, default=1.0, help="sampling temperature of the rollouts")
    p.add_argument("--top-p", type=float, default=0.0, help="nucleus sampling of the rollouts (0: off)")
    p.add_argument("--lr", type=positive_float, default=1e-6, help="AdamW learning rate")
    p.add_argument("--epochs", type=positive_int, default=1, help="policy updates per batch of rollouts")
    p.add_argument("--clip", type=positive_float, default=0.2, help="PPO-style ratio clip")
    p.add_argument("--kl-coef", type=float, default=0.04, help="weight of the KL penalty to the starting model")
    p.add_argument("--clip-grad", type=positive_float, default=1.0, help="gradient norm clip")
    p.add_argument("--seed", type=int, default=1234, help="sampling seed")
    p.add_argument("--out", help="write the final policy here as an HF folder")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    args = p.parse_args(argv)
    return run_tool(lambda: train(args))[0]


if __name__ == "__main__":
    sys.exit(main())
