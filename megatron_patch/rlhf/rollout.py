"""What the online RL trainers (GRPO, PPO) share: sampling rollouts from the policy on megatron-core's
inference engine (`megatron_patch.inference.generate`) and putting them in a training batch, per-token
log-probabilities (and entropies) of a batch under a model at any TP x PP (`megatron_patch.models.pipeline`
runs the stages), rule rewards (`--reward module:function`) checked to be finite numbers, the optimizer step
(tied embeddings shared across stages, a gradient-norm clip over all model-parallel ranks), and writing a
trained model as an HF folder through the converter's writer."""

from __future__ import annotations

import importlib
import math
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch


def load_reward(spec: str) -> Callable[[str, str], float]:
    """`--reward module:function` -> the function, called as fn(prompt, completion) -> float."""
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


def rewards_of(reward_fn: Callable[[str, str], float], spec: str, texts: list[str], rows: list[int],
               completions: list[str], group_size: int = 1) -> torch.Tensor:
    """The reward of each completion (`rows[n]`: the index of its prompt in `texts`); anything but a finite
    number is refused, naming the prompt (and the sample of its group): a NaN reward would turn the whole
    policy into NaN."""
    values = []
    for n, (i, completion) in enumerate(zip(rows, completions)):
        value = reward_fn(texts[i], completion)
        try:
            number = float(value)
        except (TypeError, ValueError):
            number = None
        if number is None or isinstance(value, bool) or not math.isfinite(number):
            sample = f", sample {n % group_size + 1} of its group" if group_size > 1 else ""
            raise ValueError(f"--reward {spec} returned {value!r} for prompt {i + 1} ({texts[i][:40]!r}){sample}: a "
                             "reward must be a finite number")
        values.append(number)
    return torch.tensor(values)


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


@dataclass
class Rollouts:
    """One batch of sampled completions, as the reward and the losses see it."""

    prompts: list[list[int]]
    completions: list[list[int]]  # as trained on: with the end token where the generation stopped
    texts: list[str]  # the completions' text, without the end token (what a reward function reads)
    tokens: torch.Tensor  # [rows, s] prompt + completion, right-padded
    labels: torch.Tensor  # [rows, s] the next token
    mask: torch.Tensor  # [rows, s] 1 at positions whose label is a completion token
    lengths: torch.Tensor  # [rows] real tokens of each row

    @property
    def completion_lengths(self) -> list[int]:
        return [len(c) for c in self.completions]


def rollout(policy, tokenizer, prompts: list[list[int]], max_new_tokens: int, temperature: float, top_p: float,
            seed: int, device, engine: str = "auto") -> Rollouts:
    """Sample one completion per prompt on the policy itself (all of them in one call of the inference
    engine, which keeps itself for the next call while its sizes fit) and batch them for training. Every
    rank of the TP x PP group calls this with the same arguments and gets the same rollouts."""
    from megatron_patch.inference import generate

    policy.eval()
    sampled = generate(policy, tokenizer, prompts, max_new_tokens, temperature, 0, top_p, seed=seed,
                       max_batch_size=len(prompts), stop_id=tokenizer.eod, engine=engine)
    texts = [tokenizer.detokenize(c) for c in sampled]
    completions = with_end_token(sampled, max_new_tokens, tokenizer.eod)
    tokens, labels, mask = batch_of(prompts, completions, tokenizer.pad, device)
    lengths = torch.tensor([len(p) + len(c) for p, c in zip(prompts, completions)], device=device)
    return Rollouts(prompts, completions, texts, tokens, labels, mask, lengths)


def _tp_all_reduce(t: torch.Tensor, op) -> torch.Tensor:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if ps.get_tensor_model_parallel_world_size() > 1:
        dist.all_reduce(t, op=op, group=ps.get_tensor_model_parallel_group())
    return t


def vocab_parallel_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the softmax over the vocabulary at each position, from this TP rank's slice of the
    logits ([..., vocab / TP]); no gradient (a metric)."""
    import torch.distributed as dist

    with torch.no_grad():
        logits = logits.detach().float()
        top = _tp_all_reduce(logits.max(-1, keepdim=True).values, dist.ReduceOp.MAX)
        e = torch.exp(logits - top)
        z = _tp_all_reduce(e.sum(-1), dist.ReduceOp.SUM)
        expected = _tp_all_reduce((e * logits).sum(-1), dist.ReduceOp.SUM) / z
        return torch.log(z) + top.squeeze(-1) - expected


def without_padding(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """This TP rank's slice of the logits [..., padded vocab / TP] with megatron's padded vocabulary columns (ids
    >= `vocab_size`: zero rows in a converted model, so logit 0) at the dtype's lowest value: no token of the
    model, so no share of its softmax (transformers' model has no such columns; measured on an H200: with them,
    a trained tiny LLaMA's log-probabilities were off by 6e-3)."""
    from megatron.core import parallel_state as ps

    width = logits.shape[-1]
    start = ps.get_tensor_model_parallel_rank() * width
    if start + width <= vocab_size:
        return logits
    ids = torch.arange(start, start + width, device=logits.device)
    return logits.masked_fill(ids >= vocab_size, torch.finfo(logits.dtype).min)


def logps_of(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int, entropy: bool = False):
    """log p(label) per position [rows, s] from this TP rank's slice of the logits, over the model's
    `vocab_size` tokens (megatron's vocab-parallel cross entropy: the gradient flows at any TP); with
    `entropy`, (log-probs, per-position entropy)."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    logits = without_padding(logits.float(), vocab_size)
    spread = vocab_parallel_entropy(logits) if entropy else None  # first: the cross entropy works in place
    logps = -vocab_parallel_cross_entropy(logits, labels)
    return (logps, spread) if entropy else logps


def token_logps(model, tokens: torch.Tensor, labels: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """log p(label) per position [rows, s] under `model` (over its `vocab_size` tokens), without gradient, on
    every rank at any TP x PP, on the tokens' device."""
    from megatron_patch.models import pipeline

    return pipeline.forward_everywhere(model, tokens, tuple(tokens.shape),
                                       lambda logits: logps_of(logits, labels, vocab_size))


def optimizer_step(model, optimizer, max_norm: float) -> float:
    """After a backward pass: the tied embedding's gradient shared by the first and last stages, the gradients
    clipped to norm `max_norm` over all model-parallel ranks, the optimizer's step; returns the norm before
    clipping."""
    from megatron_patch.models import pipeline

    pipeline.share_embedding_grads(model)
    norm = pipeline.clip_grad_norm(model, max_norm)
    optimizer.step()
    return norm


def save_hf(model, cfg: dict, tokenizer_dir: str, out: str, tp: int, pp: int = 1, overwrite: bool = False) -> None:
    """A trained model (policy, or a reward-model-shaped critic) as an HF folder: every TP x PP rank's
    weights gathered on rank 0, written by the converter's writer (atomically; NaN / Inf refused;
    config.json = `cfg` stating the dtype)."""
    import torch.distributed as dist

    from megatron_patch.conversion.convert import save_hf_state
    from megatron_patch.conversion.engine import make_plan, megatron_to_hf
    from megatron_patch.models import Layout
    from megatron_patch.models.parallel import current_rank

    rank = current_rank()
    mine = ((rank.tp, rank.pp, 0), {k: v.detach().cpu() for k, v in model.state_dict().items()
                                    if not k.endswith("_extra_state")})
    states = [None] * (tp * pp)
    if tp * pp > 1:
        dist.all_gather_object(states, mine)  # the TP x PP ranks are the whole world here
    else:
        states = [mine]
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    hf = megatron_to_hf(make_plan(cfg, Layout(tp, pp), model.config.transformer_impl), dict(states))
    save_hf_state(hf, cfg, out, side_dir=tokenizer_dir, overwrite=overwrite)


def policy_and_reference(mcore_dir: str | None, hf_dir: str | None, tp: int, pp: int, impl: str | None, dtype):
    """(policy, frozen reference, hf_config): two copies of the starting model in this rank's TP x PP slice."""
    from megatron_patch.inference import load_model

    policy, cfg = load_model(mcore_dir, hf_dir, tp, pp, impl, dtype)
    reference, _ = load_model(mcore_dir, hf_dir, tp, pp, impl, dtype)
    for p in reference.parameters():
        p.requires_grad_(False)
    for p in policy.parameters():
        p.requires_grad_(True)
    return policy, reference.eval(), cfg


def check_finite(loss: torch.Tensor | float, step: int, what: str = "the loss") -> None:
    """A non-finite loss stops the run before the optimizer writes NaN into the weights."""
    value = float(loss)
    if not math.isfinite(value):
        raise ValueError(f"step {step + 1}: {what} is {value} (non-finite); stopping before the model is "
                         "corrupted (lower the learning rate or check the reward)")


def check_layout(args, tool: str) -> None:
    """One replica on TP x PP ranks (the whole world); no expert parallelism."""
    import torch.distributed as dist

    if args.ep != 1:
        raise ValueError(f"{tool} runs its models on one TP x PP group: --ep must be 1 (expert parallelism is not "
                         "supported yet)")
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    if world != args.tp * args.pp:
        raise ValueError(f"{tool} runs one replica: start {args.tp * args.pp} process(es) for --tp {args.tp} x --pp "
                         f"{args.pp} (found {world})")


def reward_summary(history: list[dict]) -> dict:
    """The mean reward over the first and the last fifth of a run's steps (None for a run of no step)."""
    import statistics

    k = max(1, len(history) // 5)
    return {"reward_first": round(statistics.mean(r["reward"] for r in history[:k]), 4) if history else None,
            "reward_last": round(statistics.mean(r["reward"] for r in history[-k:]), 4) if history else None}


def add_rollout_args(parser, prompts_per_step: int, out_help: str, seed_help: str, clip_grad_help: str) -> None:
    """The options GRPO and PPO share: the model, the prompts and how rollouts are sampled, the gradient clip,
    the seed and the HF export (what the seed and the clip apply to is each trainer's to say)."""
    from megatron_patch.cli import positive_float, positive_int
    from megatron_patch.inference import ENGINES, add_model_args

    add_model_args(parser)
    parser.add_argument("--engine", choices=ENGINES, default="auto",
                        help="inference engine of the rollouts (auto: static at PP = 1, dynamic at PP > 1; "
                             "samples are reproducible for the same engine)")
    parser.add_argument("--prompts", required=True, help="JSONL prompts (`prompt` text or chat `messages`)")
    parser.add_argument("--chat", action="store_true", help="render plain prompts with the chat template")
    parser.add_argument("--prompts-per-step", type=positive_int, default=prompts_per_step,
                        help="prompts sampled per step")
    parser.add_argument("--max-new-tokens", type=positive_int, default=128, help="longest completion")
    parser.add_argument("--temperature", type=positive_float, default=1.0, help="sampling temperature of the rollouts")
    parser.add_argument("--top-p", type=float, default=0.0, help="nucleus sampling of the rollouts (0: off)")
    parser.add_argument("--clip-grad", type=positive_float, default=1.0, help=clip_grad_help)
    parser.add_argument("--seed", type=int, default=1234, help=seed_help)
    parser.add_argument("--out", help=out_help)
    parser.add_argument("--overwrite", action="store_true", help="replace existing output folders")
