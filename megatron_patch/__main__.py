"""megatron-patch COMMAND [ARGS ...]   (or python -m megatron_patch COMMAND ...)

The package's command-line tools under one name; `megatron-patch COMMAND --help` lists a command's options.
Each command is also its module (`python -m megatron_patch.convert ...`), which is what torchrun starts for a
run on several GPUs or nodes: `torchrun --nproc_per_node 8 -m megatron_patch.pretrain ...` (or the launchers in
examples/). The older `python -m toolkits.checkpoint_converter` and `python -m toolkits.preprocess_data` still
work, with a deprecation note."""

from __future__ import annotations

import importlib
import sys

# command: (module, what it does)
COMMANDS = {
    "convert": ("megatron_patch.convert", "HF <-> Megatron checkpoints: hf-to-mcore, mcore-to-hf, mcore-to-mcore, "
                                          "verify"),
    "preprocess-data": ("megatron_patch.preprocess_data", "JSONL text -> Megatron's indexed dataset (.bin / .idx)"),
    "pretrain": ("megatron_patch.pretrain", "pretraining (megatron.training, the model from an HF config)"),
    "sft": ("megatron_patch.sft", "supervised fine-tuning on chat / instruction JSONL (packed)"),
    "generate": ("megatron_patch.generate", "text generation from a Megatron checkpoint or an HF folder"),
    "evaluate": ("megatron_patch.evaluate", "perplexity and multiple-choice accuracy"),
    "lm-eval": ("megatron_patch.lm_eval_model", "lm-evaluation-harness with the megatron_patch model"),
    "lora-export": ("megatron_patch.lora.export", "a LoRA run's adapter as PEFT, or merged into HF weights"),
    "reward-model": ("megatron_patch.rlhf.reward_model", "RLHF: a reward model on preference pairs"),
    "dpo": ("megatron_patch.rlhf.dpo", "RLHF: direct preference optimisation"),
    "ppo": ("megatron_patch.rlhf.ppo", "RLHF: PPO with a reward model or a reward function"),
    "grpo": ("megatron_patch.rlhf.grpo", "RLHF: GRPO (group-relative advantages)"),
    "rloo": ("megatron_patch.rlhf.rloo", "RLHF: RLOO (leave-one-out baselines)"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    rows = "\n".join(f"  {name:<{width}}  {text}" for name, (_, text) in COMMANDS.items())
    return f"{__doc__.strip()}\n\ncommands:\n{rows}\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage(), end="", file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"error: unknown command '{name}' (commands: {', '.join(COMMANDS)}; megatron-patch --help)",
              file=sys.stderr)
        return 2
    return importlib.import_module(COMMANDS[name][0]).main(rest)


if __name__ == "__main__":
    sys.exit(main())
