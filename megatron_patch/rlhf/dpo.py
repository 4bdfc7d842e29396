"""python -m megatron_patch.rlhf.dpo: Direct Preference Optimization on megatron.training.

    torchrun --nproc_per_node 8 -m megatron_patch.rlhf.dpo --load-hf sft_hf --pref-data prefs.jsonl --beta 0.1 \\
        --tensor-model-parallel-size 2 --seq-length 2048 --micro-batch-size 2 --global-batch-size 64 \\
        --train-iters 500 --lr 5e-7 --precision bf16 --save ckpt_dpo --save-hf dpo_hf

The policy is any registered family; the frozen reference is a second copy of the starting weights
(`--load-hf`, or `--ref-load-hf` / `--ref-load` for another model or a Megatron checkpoint), run on the fly
in the same forward step, in the same TP layout (pipeline parallelism is not supported: the reference has
no pipeline of its own). Sequence log-probabilities sum the answer tokens (the prompt is context only).

Loss per pair (sigmoid DPO): -log sigmoid(beta * ((pi_c - ref_c) - (pi_r - ref_r))), plus `--sft-weight` x
the chosen answer's mean token NLL; averaged over the pairs of the global batch. Logged: `dpo loss`,
`reward accuracy` (implicit reward of chosen > rejected), `reward margin`, `chosen nll` and `rejected nll`
(the answers' summed negative log-probabilities: megatron.training prints only positive averages, so a
negative margin, early on, is missing from its log line but not from the returned metrics).
"""

from __future__ import annotations

import math
import sys
from functools import partial

import torch

_REFERENCE: dict = {}


def add_dpo_args(parser):
    from megatron_patch.rlhf.common import add_preference_args

    add_preference_args(parser)
    g = parser.add_argument_group("megatron_patch dpo")
    g.add_argument("--beta", type=float, default=0.1, help="DPO temperature (default 0.1)")
    g.add_argument("--sft-weight", type=float, default=0.0, help="add this x the chosen answers' token NLL")
    g.add_argument("--ref-load-hf", help="reference model, an HF folder (default: --load-hf)")
    g.add_argument("--ref-load", help="reference model, a Megatron checkpoint (converted or saved by us)")
    return parser


def dpo_settings(args) -> None:
    from megatron_patch.rlhf.common import preference_settings

    preference_settings(args)
    if not math.isfinite(args.beta) or args.beta <= 0:
        raise ValueError(f"--beta must be a finite number > 0, got {args.beta}")
    if not math.isfinite(args.sft_weight) or args.sft_weight < 0:
        raise ValueError(f"--sft-weight must be a finite number >= 0, got {args.sft_weight}")
    if args.pipeline_model_parallel_size > 1:
        raise ValueError("DPO runs the reference model inside the policy's forward step: pipeline parallelism is "
                         "not supported (use TP / DP / CP)")
    if not (args.ref_load_hf or args.ref_load or args.load_hf):
        raise ValueError("DPO needs reference weights: --load-hf (policy start and reference), --ref-load-hf DIR or "
                         "--ref-load CKPT")


def reference_model(args):
    """The frozen reference, built once per process in the policy's TP layout."""
    if "model" not in _REFERENCE:
        from megatron_patch.inference import load_model
        from megatron_patch.models import Layout

        dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32
        hf_dir = None if args.ref_load else (args.ref_load_hf or args.load_hf)
        model, _ = load_model(args.ref_load, hf_dir, layout=Layout(args.tensor_model_parallel_size),
                              impl=args.transformer_impl, dtype=dtype)
        for p in model.parameters():
            p.requires_grad_(False)
        _REFERENCE["model"] = model.eval()
    return _REFERENCE["model"]


def sequence_logps(token_loss: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Per-token losses (-log p of each label) [rows, s] -> summed log-probability of the masked tokens."""
    return -(token_loss.float() * loss_mask).sum(-1)


def dpo_loss(policy: torch.Tensor, reference: torch.Tensor, beta: float):
    """[pairs, 2] log-probs (chosen, rejected) -> (loss per pair, chosen reward, rejected reward)."""
    chosen = beta * (policy[:, 0] - reference[:, 0])
    rejected = beta * (policy[:, 1] - reference[:, 1])
    return -torch.nn.functional.logsigmoid(chosen - rejected), chosen.detach(), rejected.detach()


def loss_func(loss_mask: torch.Tensor, reference: torch.Tensor, beta: float, sft_weight: float,
              output: torch.Tensor):
    """Megatron's loss-function protocol: (sum over pairs, number of pairs, metrics as [sum, count])."""
    from megatron_patch.rlhf.common import pair_report

    logps = sequence_logps(output, loss_mask).view(-1, 2)
    loss, chosen, rejected = dpo_loss(logps, reference.view(-1, 2), beta)
    total = loss.sum()
    if sft_weight:
        m = loss_mask[0::2]
        total = total + sft_weight * ((output[0::2].float() * m).sum(-1) / m.sum(-1).clamp(min=1)).sum()
    n, report = pair_report(**{"dpo loss": loss, "reward accuracy": chosen > rejected,
                               "reward margin": chosen - rejected, "chosen nll": -logps[:, 0],
                               "rejected nll": -logps[:, 1]})
    return total, n, report


def forward_step(data_iterator, model):
    from megatron.training import get_args

    from megatron_patch.rlhf.common import pair_batch

    args = get_args()
    batch = pair_batch(data_iterator)
    inputs = (batch["tokens"], batch["position_ids"], None)
    with torch.no_grad():
        ref = sequence_logps(reference_model(args)(*inputs, labels=batch["labels"]), batch["loss_mask"])
    output = model(*inputs, labels=batch["labels"])
    return output, partial(loss_func, batch["loss_mask"], ref, args.beta, args.sft_weight)


def main(argv: list[str] | None = None) -> int:
    from megatron_patch.rlhf.common import datasets_provider
    from megatron_patch.training.run import main as run_main

    return run_main("rlhf.dpo", __doc__, argv, datasets_provider, extra_args_provider=add_dpo_args,
                    indexed_data=False, adjust=dpo_settings, forward_step=forward_step)


if __name__ == "__main__":
    sys.exit(main())
