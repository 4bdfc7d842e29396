"""What the online RL trainers (GRPO, PPO) share: sampling rollouts from the policy on megatron-core's
inference engine (`megatron_patch.inference.generate`) and putting them in a training batch, per-token
log-probabilities (and entropies) of a batch under a model at any TP, rule rewards (`--reward
module:function`) checked to be finite numbers, a gradient-norm clip that is right under TP, and writing a
trained model as an HF folder through the converter's writer."""

from __future__ import annotations

import importlib
import math
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
            seed: int, device) -> Rollouts:
    """Sample one completion per prompt on the policy itself (all of them in one call of the inference
    engine, which keeps itself for the next call while its sizes fit) and batch them for training. Every
    rank of the TP group calls this with the same arguments and gets the same rollouts."""
    from megatron_patch.inference import generate

    policy.eval()
    sampled = generate(policy, tokenizer, prompts, max_new_tokens, temperature, 0, top_p, seed=seed,
                       max_batch_size=len(prompts), stop_id=tokenizer.eod)
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


def model_outputs(model, tokens: torch.Tensor) -> torch.Tensor:
    """The model's output at every position, batch first: [rows, s, vocab / TP] logits of a causal LM, or
    [rows, s, 1] values of a reward-model-shaped one (`megatron_patch.models.reward`)."""
    from megatron_patch import patches

    pos = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
    with patches.applied("cpu_cuda_calls"):
        return model(tokens, pos, None)


def token_logps(model, tokens: torch.Tensor, labels: torch.Tensor, entropy: bool = False):
    """log p(label) per position [rows, s] (megatron's vocab-parallel cross entropy over this rank's slice
    of the logits: the gradient flows at any TP); with `entropy`, (log-probs, per-position entropy)."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    logits = model_outputs(model, tokens)
    spread = vocab_parallel_entropy(logits) if entropy else None  # first: the cross entropy works in place
    logps = -vocab_parallel_cross_entropy(logits.float(), labels)
    return (logps, spread) if entropy else logps


def clip_grad_norm(params, max_norm: float) -> float:
    """Scale the gradients so that their global norm is at most `max_norm`; returns the norm before.
    Under TP each rank holds a slice of the sharded weights and a copy of the replicated ones: the norm
    counts every slice once and every copy once (as megatron's optimizer does), so all TP ranks scale
    alike and their replicated weights stay equal."""
    import torch.distributed as dist
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

    params = [p for p in params if p.grad is not None]
    if not params:
        return 0.0
    square = torch.zeros((), dtype=torch.float32, device=params[0].grad.device)
    for p in params:
        if param_is_not_tensor_parallel_duplicate(p):
            square += p.grad.detach().float().pow(2).sum()
    norm = float(_tp_all_reduce(square, dist.ReduceOp.SUM).sqrt())
    scale = max_norm / (norm + 1e-6)
    if scale < 1:
        for p in params:
            p.grad.detach().mul_(scale)
    return norm


def save_hf(model, cfg: dict, tokenizer_dir: str, out: str, tp: int, overwrite: bool = False) -> None:
    """A trained model (policy, or a reward-model-shaped critic) as an HF folder: every TP rank's weights
    gathered on rank 0, written by the converter's writer (atomically; NaN / Inf refused; config.json =
    `cfg` stating the dtype)."""
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


def policy_and_reference(mcore_dir: str | None, hf_dir: str | None, tp: int, impl: str | None, dtype):
    """(policy, frozen reference, hf_config): two copies of the starting model in this rank's TP slice."""
    from megatron_patch.inference import load_model

    policy, cfg = load_model(mcore_dir, hf_dir, tp, 1, impl, dtype)
    reference, _ = load_model(mcore_dir, hf_dir, tp, 1, impl, dtype)
    for p in reference.parameters():
        p.requires_grad_(False)
    for p in policy.parameters():
        p.requires_grad_(True)
    return policy, reference.eval(), cfg


def check_finite(loss: torch.Tensor, step: int, what: str = "the loss") -> None:
    """A non-finite loss stops the run before the optimizer writes NaN into the weights."""
    if not torch.isfinite(loss):
        raise ValueError(f"step {step + 1}: {what} is {loss.item()} (non-finite); stopping before the model is "
                         "corrupted (lower the learning rate or check the reward)")


def add_rollout_args(parser, prompts_per_step: int, out_help: str) -> None:
    """The options GRPO and PPO share: the model, the prompts and how rollouts are sampled, the gradient clip,
    the seed and the HF export."""
    from megatron_patch.cli import positive_float, positive_int
    from megatron_patch.inference import add_model_args

    add_model_args(parser)
    parser.add_argument("--prompts", required=True, help="JSONL prompts (`prompt` text or chat `messages`)")
    parser.add_argument("--chat", action="store_true", help="render plain prompts with the chat template")
    parser.add_argument("--prompts-per-step", type=positive_int, default=prompts_per_step,
                        help="prompts sampled per step")
    parser.add_argument("--max-new-tokens", type=positive_int, default=128, help="longest completion")
    parser.add_argument("--temperature", type=positive_float, default=1.0, help="sampling temperature of the rollouts")
    parser.add_argument("--top-p", type=float, default=0.0, help="nucleus sampling of the rollouts (0: off)")
    parser.add_argument("--clip-grad", type=positive_float, default=1.0, help="gradient norm clip (each model)")
    parser.add_argument("--seed", type=int, default=1234, help="sampling seed (and a fresh value head's)")
    parser.add_argument("--out", help=out_help)
    parser.add_argument("--overwrite", action="store_true", help="replace existing output folders")
