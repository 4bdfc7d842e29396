"""The models PPO runs beside its policy: a model given by one path (an HF folder or a Megatron checkpoint),
the check that such a model reads the policy's token ids (same vocabulary, same tokenizer) before any of its
weights is read, and the critic: a value head on any family's decoder, the scalar head of
`megatron_patch.models.reward` read at every token (a reward model as it is, or a causal LM's backbone with a
fresh head)."""

from __future__ import annotations

import os

import torch


def model_paths(path: str) -> tuple[str | None, str | None]:
    """(mcore_dir, hf_dir) for a model given by one path: an HF folder (config.json in it) or a Megatron
    checkpoint (with its hf/ folder)."""
    if not os.path.exists(path):
        raise ValueError(f"{path} does not exist")
    return (None, path) if os.path.isfile(os.path.join(path, "config.json")) else (path, None)


def _tokenizer_difference(mine, theirs) -> str | None:
    if mine.vocab == theirs.vocab:
        return None
    if len(mine.vocab) != len(theirs.vocab):
        return f"{len(theirs.vocab)} tokens there, {len(mine.vocab)} in the policy's"
    token = next(t for t, i in sorted(mine.vocab.items(), key=lambda x: x[1]) if theirs.vocab.get(t) != i)
    return f"{token!r} is token {theirs.vocab.get(token)} there and {mine.vocab[token]} in the policy's"


def check_same_vocabulary(flag: str, path: str, role: str, policy_cfg: dict, tokenizer) -> dict:
    """The HF config of the model at `path`, after checking that it reads the policy's token ids: the
    same vocabulary size, and the same tokenizer where the folder has one. Before any weight is read."""
    from megatron_patch.inference import model_folder
    from megatron_patch.models import load_hf_config, vocab_size
    from megatron_patch.tokenizer import build_tokenizer

    if not os.path.exists(path):
        raise ValueError(f"{flag} {path} does not exist")
    folder = model_folder(*model_paths(path))
    cfg = load_hf_config(folder)
    theirs, mine = vocab_size(cfg), vocab_size(policy_cfg)
    why = f"{theirs} tokens in its config.json, {mine} in the policy's" if theirs != mine else None
    if why is None and any(os.path.isfile(os.path.join(folder, f)) for f in ("tokenizer.json", "tokenizer.model")):
        why = _tokenizer_difference(tokenizer, build_tokenizer(folder))
    if why:
        raise ValueError(f"{flag} {path}: its vocabulary differs from the policy's ({why}); the {role} reads the "
                         "policy's token ids, so it must use the policy's tokenizer")
    return cfg


def load_critic(path: str, *, layout, impl: str | None, dtype, seed: int):
    """(critic, its HF config): the model at `path` with the scalar head of a reward model. A reward model
    is used as it is; a causal LM gives its backbone, and the head (on the last pipeline stage) starts from a
    seeded normal draw (init_method_std; the same on every TP rank and at every TP x PP)."""
    from megatron_patch.conversion.engine import load_rank_state_dict
    from megatron_patch.inference import load_model
    from megatron_patch.models import build_model
    from megatron_patch.models.reward import as_reward_config, is_reward_config

    source, cfg = load_model(*model_paths(path), layout=layout, impl=impl, dtype=dtype)
    if is_reward_config(cfg):
        return source, cfg
    cfg = as_reward_config(cfg)
    critic = build_model(cfg, layout=layout, impl=impl or source.config.transformer_impl, dtype=dtype,
                         padded_vocab_size=source.vocab_size, perform_initialization=False)
    state = {k: v for k, v in source.state_dict().items() if not k.startswith("output_layer.")}
    if critic.post_process:
        head = critic.output_layer.weight
        g = torch.Generator().manual_seed(seed)
        state["output_layer.weight"] = (torch.randn(head.shape, generator=g) * critic.config.init_method_std).to(head)
    load_rank_state_dict(critic, state)
    return critic.eval(), cfg
