"""What the preference trainers (reward model, DPO) share: their data arguments and dataset provider."""

from __future__ import annotations


def add_preference_args(parser):
    g = parser.add_argument_group("megatron_patch preference data")
    g.add_argument("--pref-data", nargs="+", help='JSONL rows {"prompt", "chosen", "rejected"} (.jsonl[.gz])')
    g.add_argument("--chat", action="store_true", help="render plain-text rows with the tokenizer's chat template")
    return parser


def preference_settings(args) -> None:
    if not args.pref_data:
        raise ValueError("no preference data: pass --pref-data FILE.jsonl")
    args.calculate_per_token_loss = True  # loss and metrics are per pair over the global batch


def datasets_provider(train_val_test_num_samples, vp_stage: int | None = None):
    """Preference pairs (`--pref-data`); per model chunk of a virtual pipeline (`vp_stage`) the same."""
    from megatron.training import get_args

    from megatron_patch.rlhf.data import PreferenceDataset, read_preferences
    from megatron_patch.tokenizer import build_tokenizer

    args = get_args()
    tokenizer = build_tokenizer(args.tokenizer_model)
    pairs = read_preferences(args.pref_data, tokenizer, args.chat)
    return PreferenceDataset(pairs, args.seq_length, tokenizer.pad, train_val_test_num_samples[0]), None, None


datasets_provider.is_distributed = True


def pair_report(**per_pair):
    """(number of pairs, Megatron's report) for per-pair tensors: each metric as [sum, count], the form
    megatron.training averages over micro-batches and data-parallel ranks."""
    import torch

    first = next(iter(per_pair.values()))
    n = torch.tensor(first.numel(), device=first.device, dtype=torch.int)
    count = n.float().view(1)
    return n, {k: torch.cat([v.detach().sum().float().view(1), count]) for k, v in per_pair.items()}


def pair_batch(data_iterator) -> dict:
    """The next micro-batch of pairs on this rank's device, flattened to rows chosen_0, rejected_0, ..."""
    from megatron_patch.rlhf.data import flatten_pairs
    from megatron_patch.training.gpt import get_batch

    return flatten_pairs(get_batch(data_iterator))
