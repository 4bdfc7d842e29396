"""python -m megatron_patch.rlhf.ppo: Proximal Policy Optimization with a critic, Megatron-native.

    python -m megatron_patch.rlhf.ppo --hf-dir sft_hf --reward-model rm_hf --prompts prompts.jsonl \\
        --steps 200 --prompts-per-step 16 --max-new-tokens 256 --lr 1e-6 --critic-lr 5e-6 \\
        --out ppo_hf --critic-out critic_hf --save ppo_ckpt
    torchrun --nproc-per-node 2 -m megatron_patch.rlhf.ppo ... --tp 2             # tensor parallel
    torchrun --nproc-per-node 4 -m megatron_patch.rlhf.ppo ... --tp 2 --pp 2      # and pipeline parallel

Four megatron-core GPTModels, colocated on the same ranks in one TP x PP layout (at PP > 1 each runs through
megatron-core's pipeline schedule, `megatron_patch.runtime.pipeline`): the actor (the policy, trained),
a frozen reference (the starting policy), a frozen reward model (`--reward-model`, a
`<Family>ForSequenceClassification` trained by `megatron_patch.rlhf.reward_model`; or a rule, `--reward
module:function` called as fn(prompt, completion) -> float) and the critic (trained): a value head on any
family's decoder (`megatron_patch.models.reward`'s scalar head, read at every token), started from
`--critic` (default: the reward model, else the policy; a causal LM's head starts fresh).

Each step: `--prompts-per-step` prompts (JSONL `prompt` text or chat `messages`, cycled) are sampled once
each on the actor with megatron-core's inference engine (`megatron_patch.rlhf.rollout`), scored by the
reward model at the completion's last token; per-token rewards are -kl_coef x (log p - log p_ref) plus the
score at the last token (`--whiten-rewards`: rescaled to unit variance over the batch); advantages by GAE
(`--gamma`, `--lam`), whitened over the batch; then `--epochs` passes over `--mini-batches` of the clipped
policy loss (`--clip`) and the clipped value loss (`--value-clip`), each model with its own AdamW and
gradient clip. The KL coefficient is fixed (`--kl-coef`) or adaptive (`--kl-target`, `--kl-horizon`). The
arithmetic is `megatron_patch.rlhf.ppo_loss`.

One JSON line per step on stderr: reward, kl (per completion), kl_coef, policy_loss, value_loss, clip_frac,
value_clip_frac, entropy (per token), response_length; a summary on stdout. `--save DIR` keeps checkpoints (actor,
critic, optimizers, KL coefficient, history; every `--save-interval` steps and at the end;
`megatron_patch.rlhf.checkpoint`); `--load DIR` resumes from its latest, exactly (`--load DIR --save DIR`: rerunning
the command continues the run). A `--save` folder that already holds a checkpoint is refused unless `--load` names
it, or `--overwrite` starts again (the old checkpoints are removed at the first save). `--out` writes the actor as
an HF causal LM and `--critic-out` the critic as an HF `<Family>ForSequenceClassification` folder (num_labels=1)
whose per-token values are `model.score(model.base_model(ids).last_hidden_state)` (its `logits` are the value at the
last token).
The loop (set-up, rollouts, checkpoints, export) is `megatron_patch.rlhf.loop`'s; this module adds the critic,
the reward model and the KL controller.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

from megatron_patch.rlhf.loop import Algorithm, Batch, add_loop_args, frozen, save_hf, update
from megatron_patch.rlhf.loop import main as run_main


class PPO(Algorithm):
    """The critic (trained), an optional reward model (frozen) and the KL controller beside the loop's policy."""

    name = "PPO"

    @staticmethod
    def check_args(args) -> None:
        if bool(args.reward_model) == bool(args.reward):
            raise ValueError("pass one of --reward-model DIR (a reward model) or --reward module:function (a rule)")
        if args.mini_batches > args.prompts_per_step:
            raise ValueError(f"--mini-batches {args.mini_batches} is more than --prompts-per-step "
                             f"{args.prompts_per_step} (rollouts per step)")
        if args.kl_coef < 0 or not 0 <= args.gamma <= 1 or not 0 <= args.lam <= 1:
            raise ValueError("--kl-coef must be >= 0, --gamma and --lam in [0, 1]")

    @staticmethod
    def sources(args) -> dict:
        return {"--reward-model": args.reward_model, "--critic": args.critic}

    @staticmethod
    def outputs(args) -> dict:
        return {"--critic-out": args.critic_out}

    def check_inputs(self, policy_cfg: dict) -> None:
        """The reward model and critic read the policy's token ids and hold the prompts and completions."""
        from megatron_patch.models import get_family
        from megatron_patch.models.reward import is_reward_config
        from megatron_patch.rlhf.critic import check_same_vocabulary

        args, tokenizer, contexts = self.loop.args, self.loop.tokenizer, []
        if args.reward_model:
            cfg = check_same_vocabulary("--reward-model", args.reward_model, "reward model", policy_cfg, tokenizer)
            if not is_reward_config(cfg):
                raise ValueError(f"--reward-model {args.reward_model} is a {', '.join(cfg.get('architectures') or [])}"
                                 ", not a reward model (a ...ForSequenceClassification): train one with python -m "
                                 "megatron_patch.rlhf.reward_model")
            contexts.append(("reward model", args.reward_model, get_family(cfg).max_sequence_length(cfg)))
        if args.critic:
            cfg = check_same_vocabulary("--critic", args.critic, "critic", policy_cfg, tokenizer)
            contexts.append(("critic", args.critic, get_family(cfg).max_sequence_length(cfg)))
        for who, path, context in contexts:
            self.loop.check_fits(context, f"of the {who} {path}")

    def setup(self) -> None:
        from megatron_patch.inference import load_model
        from megatron_patch.models import Layout
        from megatron_patch.rlhf.critic import load_critic, model_paths
        from megatron_patch.rlhf.ppo_loss import KLController

        loop, args = self.loop, self.loop.args
        self.reward_model = self.reward_cfg = None
        if args.reward_model:
            model, self.reward_cfg = load_model(*model_paths(args.reward_model), layout=Layout(args.tp, args.pp),
                                                impl=args.impl, dtype=loop.dtype)
            self.reward_model = frozen(model)
        critic_from = args.critic or args.reward_model or args.hf_dir or args.mcore_dir
        self.critic, self.critic_cfg = load_critic(critic_from, layout=Layout(args.tp, args.pp), impl=args.impl,
                                                   dtype=loop.dtype, seed=args.seed)
        for p in self.critic.parameters():
            p.requires_grad_(True)
        self.critic_opt = torch.optim.AdamW(self.critic.parameters(), lr=args.critic_lr, weight_decay=0.0)
        self.kl = KLController(args.kl_coef, args.kl_target, args.kl_horizon)

    def values(self, tokens: torch.Tensor) -> torch.Tensor:
        """The critic's value at every position [rows, s], without gradient, on every rank."""
        from megatron_patch.runtime import pipeline

        return pipeline.forward_everywhere(self.critic, tokens, tuple(tokens.shape), lambda out: out[..., 0])

    def scores(self, rows: list[int], r) -> torch.Tensor:
        """The reward of each completion: the reward model's value at the sequence's scored token (its last
        real token, as the reward model was trained and as HF scores it), or the rule's."""
        from megatron_patch.models.reward import scored_values
        from megatron_patch.runtime import pipeline

        if self.reward_model is not None:
            values = pipeline.forward_everywhere(self.reward_model, r.tokens, (*r.tokens.shape, 1))
            return scored_values(values, r.tokens, r.lengths, self.reward_cfg.get("pad_token_id"))
        return super().scores(rows, r)

    def train_step(self, batch: Batch) -> dict:
        from megatron_patch.rlhf.logprobs import logps_of
        from megatron_patch.rlhf.ppo_loss import (
            gae,
            masked_mean,
            policy_loss,
            sequence_kl,
            token_rewards,
            value_loss,
            whiten,
        )

        loop, a, r, old = self.loop, self.loop.args, batch.rollouts, batch.old
        self.critic.eval()
        old_values = self.values(r.tokens)
        kl = sequence_kl(old, batch.ref, r.mask)
        rewards = token_rewards(batch.scores, old, batch.ref, r.mask, self.kl.value)
        if a.whiten_rewards:
            rewards = whiten(rewards, r.mask, shift_mean=False)
        advantages, returns = gae(rewards, old_values, r.mask, a.gamma, a.lam)
        advantages = whiten(advantages, r.mask)
        stats: dict[str, list[float]] = {k: [] for k in ("policy_loss", "value_loss", "clip_frac",
                                                          "value_clip_frac", "entropy")}
        self.critic.train()
        for _ in range(a.epochs):
            for mb in torch.arange(len(batch.rows)).chunk(a.mini_batches):
                tokens, mask = r.tokens[mb], r.mask[mb]

                def actor_loss(logits, mb=mb, mask=mask):
                    logps, entropy = logps_of(logits, r.labels[mb], loop.vocab, entropy=True)
                    pg, clip_frac = policy_loss(logps, old[mb], advantages[mb], mask, a.clip)
                    return pg, {"policy_loss": pg.item(), "clip_frac": clip_frac,
                                "entropy": float(masked_mean(entropy, mask))}

                def critic_loss(out, mb=mb, mask=mask):
                    vf, value_clip_frac = value_loss(out[..., 0].float(), old_values[mb], returns[mb], mask,
                                                     a.value_clip)
                    return vf, {"value_loss": vf.item(), "value_clip_frac": value_clip_frac}

                metrics = update(loop.policy, loop.policy_opt, tokens, actor_loss, batch.step, a.clip_grad,
                                 "policy_loss", "the policy loss")
                metrics |= update(self.critic, self.critic_opt, tokens, critic_loss, batch.step, a.clip_grad,
                                  "value_loss", "the value loss")
                for k in stats:
                    stats[k].append(metrics[k])
        row = {"reward": float(batch.scores.mean()), "kl": float(kl.mean()), "kl_coef": self.kl.value,
               **{k: statistics.mean(v) for k, v in stats.items()},
               "response_length": statistics.mean(r.completion_lengths)}
        self.kl.update(row["kl"], len(batch.rows))
        return row

    def rank_state(self) -> dict:
        return {"critic": self.critic.state_dict(), "critic_optimizer": self.critic_opt.state_dict()}

    def run_state(self) -> dict:
        return {"kl_coef": self.kl.value}

    def load_state(self, rank_state: dict, run_state: dict) -> None:
        self.critic.load_state_dict(rank_state["critic"])
        self.critic_opt.load_state_dict(rank_state["critic_optimizer"])
        self.kl.value = run_state["kl_coef"]

    def export(self, tokenizer_dir: str) -> None:
        a = self.loop.args
        if a.critic_out:
            save_hf(self.critic, self.critic_cfg, tokenizer_dir, a.critic_out, a.overwrite)

    def summary(self, history: list[dict]) -> dict:
        return {"kl_max": round(max(r["kl"] for r in history), 4) if history else None,
                "critic_out": self.loop.args.critic_out}


def parser() -> argparse.ArgumentParser:
    from megatron_patch.cli import HelpFormatter, positive_float, positive_int

    p = argparse.ArgumentParser(prog="python -m megatron_patch.rlhf.ppo", description=__doc__,
                                formatter_class=HelpFormatter)
    add_loop_args(p, prompts_per_step=16, out_help="write the final actor here as an HF causal LM",
                  seed_help="sampling seed (and a fresh value head's)",
                  clip_grad_help="gradient norm clip (actor and critic, each)", lr_help="actor AdamW learning rate")
    p.add_argument("--reward-model", help="a reward model (HF ...ForSequenceClassification folder or Megatron "
                                          "checkpoint) sharing the policy's tokenizer")
    p.add_argument("--reward", help="or a rule: module:function, called as fn(prompt, completion) -> float")
    p.add_argument("--critic", help="start the critic from this model (HF folder or Megatron checkpoint; default: the "
                                    "reward model, else the policy)")
    p.add_argument("--steps", type=positive_int, default=100, help="PPO steps (rollout + update)")
    p.add_argument("--critic-lr", type=positive_float, default=5e-6, help="critic AdamW learning rate")
    p.add_argument("--epochs", type=positive_int, default=1, help="passes over each batch of rollouts")
    p.add_argument("--mini-batches", type=positive_int, default=1, help="optimizer steps per pass")
    p.add_argument("--clip", type=positive_float, default=0.2, help="policy ratio clip")
    p.add_argument("--value-clip", type=positive_float, default=0.2, help="value clip around the rollout's values")
    p.add_argument("--gamma", type=float, default=1.0, help="discount")
    p.add_argument("--lam", type=float, default=0.95, help="GAE lambda")
    p.add_argument("--kl-coef", type=float, default=0.05, help="KL penalty coefficient (the start, if adaptive)")
    p.add_argument("--kl-target", type=positive_float, help="adaptive KL: the per-completion KL aimed at (off: fixed)")
    p.add_argument("--kl-horizon", type=positive_int, default=10000, help="adaptive KL: horizon in rollouts")
    p.add_argument("--whiten-rewards", action="store_true", help="rescale token rewards to unit variance per batch")
    p.add_argument("--critic-out", help="write the final critic here as an HF ...ForSequenceClassification")
    return p


def main(argv: list[str] | None = None) -> int:
    return run_main(argv, parser, PPO)


if __name__ == "__main__":
    sys.exit(main())
