"""python -m megatron_patch.rlhf.ppo: Proximal Policy Optimization with a critic, Megatron-native.

    python -m megatron_patch.rlhf.ppo --hf-dir sft_hf --reward-model rm_hf --prompts prompts.jsonl \\
        --steps 200 --prompts-per-step 16 --max-new-tokens 256 --lr 1e-6 --critic-lr 5e-6 \\
        --out ppo_hf --critic-out critic_hf --save ppo_ckpt
    torchrun --nproc-per-node 2 -m megatron_patch.rlhf.ppo ... --tp 2             # tensor parallel
    torchrun --nproc-per-node 4 -m megatron_patch.rlhf.ppo ... --tp 2 --pp 2      # and pipeline parallel

Four megatron-core GPTModels, colocated on the same ranks in one TP x PP layout (at PP > 1 each runs through
megatron-core's pipeline schedule, `megatron_patch.models.pipeline`): the actor (the policy, trained),
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

One JSON line per step on stderr: reward, kl (per completion), kl_coef, policy_loss, value_loss,
clip_frac, value_clip_frac, entropy (per token), response_length; a summary on stdout. `--save DIR` keeps
checkpoints (actor, critic, optimizers, KL coefficient, history; every `--save-interval` steps and at the
end); `--load DIR` resumes from its latest, exactly (`--load DIR --save DIR`: rerunning the command continues the
run). A `--save` folder that already holds a checkpoint is refused unless `--load` names it, or `--overwrite`
starts again (the old checkpoints are removed at the first save). `--out` writes the actor as an HF causal LM
and `--critic-out` the critic as an HF `<Family>ForSequenceClassification` folder (num_labels=1) whose per-token
values are `model.score(model.base_model(ids).last_hidden_state)` (its `logits` are the value at the last token).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

STATE, TRACKER = "state.json", "latest"


def check_inputs(args, policy_cfg: dict, tokenizer, prompt_ids: list[list[int]]) -> None:
    """Everything that can be wrong with the models and prompts, before any weight is read."""
    from megatron_patch.inference import check_lengths, context_length_of
    from megatron_patch.models import get_family
    from megatron_patch.models.reward import is_reward_config
    from megatron_patch.rlhf.critic import check_same_vocabulary

    contexts = [("policy", None, context_length_of(args.mcore_dir, args.hf_dir))]
    if args.reward_model:
        cfg = check_same_vocabulary("--reward-model", args.reward_model, "reward model", policy_cfg, tokenizer)
        if not is_reward_config(cfg):
            raise ValueError(f"--reward-model {args.reward_model} is a {', '.join(cfg.get('architectures') or [])}, "
                             "not a reward model (a ...ForSequenceClassification): train one with python -m "
                             "megatron_patch.rlhf.reward_model")
        contexts.append(("reward model", args.reward_model, get_family(cfg).max_sequence_length(cfg)))
    if args.critic:
        cfg = check_same_vocabulary("--critic", args.critic, "critic", policy_cfg, tokenizer)
        contexts.append(("critic", args.critic, get_family(cfg).max_sequence_length(cfg)))
    for who, path, context in contexts:
        if context is not None:
            try:
                check_lengths(prompt_ids, args.max_new_tokens, context, "--max-new-tokens")
            except ValueError as e:
                raise ValueError(f"{e}{f' of the {who} {path}' if path else ''}; shorten the prompt or lower "
                                 "--max-new-tokens") from None


def frozen(model):
    for p in model.parameters():
        p.requires_grad_(False)
    return model.eval()


class Trainer:
    """The four models, the two optimizers and the KL controller of one PPO run on this rank."""

    replace_saved = False  # --overwrite into a --save folder of another run: its checkpoints go at the first save

    def __init__(self, args, tokenizer, prompt_texts: list[str], prompt_ids: list[list[int]]):
        from megatron_patch.inference import load_model
        from megatron_patch.names import torch_dtype
        from megatron_patch.rlhf.critic import load_critic, model_paths
        from megatron_patch.rlhf.ppo_loss import KLController
        from megatron_patch.rlhf.rollout import load_reward, policy_and_reference

        self.args, self.tokenizer, self.texts, self.prompt_ids = args, tokenizer, prompt_texts, prompt_ids
        dtype = torch_dtype(args.dtype)
        self.policy, self.reference, self.cfg = policy_and_reference(args.mcore_dir, args.hf_dir, args.tp, args.pp,
                                                                     args.impl, dtype)
        self.reward_fn = load_reward(args.reward) if args.reward else None
        self.reward_model = self.reward_cfg = None
        if args.reward_model:
            model, self.reward_cfg = load_model(*model_paths(args.reward_model), args.tp, args.pp, args.impl, dtype)
            self.reward_model = frozen(model)
        critic_from = args.critic or args.reward_model or args.hf_dir or args.mcore_dir
        self.critic, self.critic_cfg = load_critic(critic_from, args.tp, args.pp, args.impl, dtype, args.seed)
        for p in self.critic.parameters():
            p.requires_grad_(True)
        self.policy_opt = torch.optim.AdamW(self.policy.parameters(), lr=args.lr, weight_decay=0.0)
        self.critic_opt = torch.optim.AdamW(self.critic.parameters(), lr=args.critic_lr, weight_decay=0.0)
        self.kl = KLController(args.kl_coef, args.kl_target, args.kl_horizon)
        self.device = next(self.policy.parameters()).device
        self.history: list[dict] = []

    def values(self, tokens: torch.Tensor) -> torch.Tensor:
        """The critic's value at every position [rows, s], without gradient, on every rank."""
        from megatron_patch.models import pipeline

        return pipeline.forward_everywhere(self.critic, tokens, tuple(tokens.shape), lambda out: out[..., 0])

    def scores(self, rows: list[int], r) -> torch.Tensor:
        """The reward of each completion: the reward model's value at the sequence's scored token (its last
        real token, as the reward model was trained and as HF scores it), or the rule's."""
        from megatron_patch.models import pipeline
        from megatron_patch.models.reward import scored_values
        from megatron_patch.rlhf.rollout import rewards_of

        if self.reward_model is not None:
            values = pipeline.forward_everywhere(self.reward_model, r.tokens, (*r.tokens.shape, 1))
            return scored_values(values, r.tokens, r.lengths, self.reward_cfg.get("pad_token_id"))
        return rewards_of(self.reward_fn, self.args.reward, self.texts, rows, r.texts).to(self.device)

    def step(self, step: int):
        """One PPO step: (its metrics, the rollouts it trained on)."""
        from megatron_patch.models import pipeline, vocab_size
        from megatron_patch.rlhf.ppo_loss import (
            gae,
            masked_mean,
            policy_loss,
            sequence_kl,
            token_rewards,
            value_loss,
            whiten,
        )
        from megatron_patch.rlhf.rollout import check_finite, logps_of, optimizer_step, rollout, token_logps

        a = self.args
        rows = [(step * a.prompts_per_step + i) % len(self.prompt_ids) for i in range(a.prompts_per_step)]
        r = rollout(self.policy, self.tokenizer, [self.prompt_ids[i] for i in rows], a.max_new_tokens,
                    a.temperature, a.top_p, a.seed + step, self.device, a.engine)
        self.critic.eval()
        vocab = vocab_size(self.cfg)
        old = token_logps(self.policy, r.tokens, r.labels, vocab)
        ref = token_logps(self.reference, r.tokens, r.labels, vocab)
        old_values = self.values(r.tokens)
        scores = self.scores(rows, r)
        kl = sequence_kl(old, ref, r.mask)
        rewards = token_rewards(scores, old, ref, r.mask, self.kl.value)
        if a.whiten_rewards:
            rewards = whiten(rewards, r.mask, shift_mean=False)
        advantages, returns = gae(rewards, old_values, r.mask, a.gamma, a.lam)
        advantages = whiten(advantages, r.mask)
        stats: dict[str, list[float]] = {k: [] for k in ("policy_loss", "value_loss", "clip_frac",
                                                          "value_clip_frac", "entropy")}
        self.policy.train()
        self.critic.train()
        for _ in range(a.epochs):
            for mb in torch.arange(len(rows)).chunk(a.mini_batches):
                tokens, mask = r.tokens[mb], r.mask[mb]

                def actor_loss(logits, mb=mb, mask=mask):
                    logps, entropy = logps_of(logits, r.labels[mb], vocab, entropy=True)
                    pg, clip_frac = policy_loss(logps, old[mb], advantages[mb], mask, a.clip)
                    return pg, {"policy_loss": pg.item(), "clip_frac": clip_frac,
                                "entropy": float(masked_mean(entropy, mask))}

                def critic_loss(out, mb=mb, mask=mask):
                    vf, value_clip_frac = value_loss(out[..., 0].float(), old_values[mb], returns[mb], mask,
                                                     a.value_clip)
                    return vf, {"value_loss": vf.item(), "value_clip_frac": value_clip_frac}

                self.policy_opt.zero_grad(set_to_none=True)
                metrics = pipeline.forward_backward(self.policy, tokens, actor_loss)
                check_finite(metrics["policy_loss"], step, "the policy loss")
                optimizer_step(self.policy, self.policy_opt, a.clip_grad)
                self.critic_opt.zero_grad(set_to_none=True)
                metrics |= pipeline.forward_backward(self.critic, tokens, critic_loss)
                check_finite(metrics["value_loss"], step, "the value loss")
                optimizer_step(self.critic, self.critic_opt, a.clip_grad)
                for k in stats:
                    stats[k].append(metrics[k])
        row = {"step": step + 1, "reward": float(scores.mean()), "kl": float(kl.mean()), "kl_coef": self.kl.value,
               **{k: statistics.mean(v) for k, v in stats.items()},
               "response_length": statistics.mean(r.completion_lengths)}
        self.kl.update(row["kl"], len(rows))
        self.history.append(row)
        return row, r

    # --- checkpoints --------------------------------------------------------------------------------------

    @staticmethod
    def rank_file(step_dir: str) -> str:
        """This rank's file in a step folder: `rank_TT.pt`, `rank_TT_PPP.pt` at PP > 1 (megatron's naming)."""
        from megatron.core import parallel_state

        from megatron_patch.models.parallel import current_rank

        rank = current_rank()
        pp = parallel_state.get_pipeline_model_parallel_world_size()
        return os.path.join(step_dir, f"rank_{rank.tp:02d}" + (f"_{rank.pp:03d}" if pp > 1 else "") + ".pt")

    def save(self, folder: str, step: int) -> None:
        """`folder/step_N/rank_TT[_PPP].pt` (actor, critic, both optimizers, RNG) per TP x PP rank, then
        `state.json` (step, layout, KL coefficient, history) and the tracker `latest`, which is written last: a
        step folder the tracker names is complete."""
        import shutil

        import torch.distributed as dist

        from megatron_patch.cli import is_first_rank
        from megatron_patch.conversion.atomic import atomic_output_file

        if self.replace_saved:
            if is_first_rank():  # the tracker first: a folder without it holds no checkpoint
                os.remove(os.path.join(folder, TRACKER))
                for name in os.listdir(folder):
                    if name.startswith("step_"):
                        shutil.rmtree(os.path.join(folder, name))
            if dist.is_initialized():
                dist.barrier()
            self.replace_saved = False
        step_dir = os.path.join(folder, f"step_{step:06d}")
        os.makedirs(step_dir, exist_ok=True)
        path = self.rank_file(step_dir)
        try:
            torch.save({"actor": self.policy.state_dict(), "critic": self.critic.state_dict(),
                        "actor_optimizer": self.policy_opt.state_dict(),
                        "critic_optimizer": self.critic_opt.state_dict(), "rng": torch.get_rng_state()},
                       path + ".partial")
            os.replace(path + ".partial", path)
        finally:
            if os.path.exists(path + ".partial"):
                os.remove(path + ".partial")
        if dist.is_initialized():
            dist.barrier()
        if is_first_rank():
            with atomic_output_file(os.path.join(step_dir, STATE)) as f:
                json.dump({"step": step, "tp": self.args.tp, "pp": self.args.pp, "kl_coef": self.kl.value,
                           "history": self.history}, f)
            with atomic_output_file(os.path.join(folder, TRACKER)) as f:
                f.write(f"{step}\n")
        if dist.is_initialized():
            dist.barrier()

    def load(self, folder: str) -> int:
        """Resume from `folder`'s latest complete step; returns the number of steps done (0: nothing there)."""
        from megatron_patch.cli import is_first_rank

        step = saved_step(folder)
        if step is None:
            if is_first_rank():
                print(f"warning: no PPO checkpoint in {folder} ({TRACKER} missing): starting from step 1",
                      file=sys.stderr)
            return 0
        step_dir = os.path.join(folder, f"step_{step:06d}")
        state = json.load(open(os.path.join(step_dir, STATE)))
        saved_at = (state["tp"], state.get("pp", 1))
        if saved_at != (self.args.tp, self.args.pp):
            raise ValueError(f"--load {folder} was saved at TP={saved_at[0]} x PP={saved_at[1]}: resume it with "
                             f"--tp {saved_at[0]} --pp {saved_at[1]}")
        saved = torch.load(self.rank_file(step_dir), map_location=self.device, weights_only=True)
        self.policy.load_state_dict(saved["actor"])
        self.critic.load_state_dict(saved["critic"])
        self.policy_opt.load_state_dict(saved["actor_optimizer"])
        self.critic_opt.load_state_dict(saved["critic_optimizer"])
        torch.set_rng_state(saved["rng"])
        self.kl.value, self.history = state["kl_coef"], state["history"]
        return step


def saved_step(folder: str) -> int | None:
    """The step of a checkpoint folder's latest complete checkpoint (its tracker); None when it holds none."""
    tracker = os.path.join(folder, TRACKER)
    return int(open(tracker).read().strip()) if os.path.isfile(tracker) else None


def replaces_saved_run(args) -> bool:
    """Whether this run starts again in a --save folder holding another run's checkpoints (--overwrite). Without
    --overwrite, such a rerun (the same command after an interruption, without --load) would start at step 1 and
    replace them: refused, naming the two ways on. Resuming is --load naming the folder (as megatron.training
    resumes when --load is --save)."""
    if not args.save or (args.load and os.path.realpath(args.load) == os.path.realpath(args.save)):
        return False
    step = saved_step(args.save)
    if step is not None and not args.overwrite:
        raise ValueError(f"--save {args.save} already holds a PPO checkpoint (step {step}): pass --load {args.save} "
                         "to resume it, or --overwrite to start again and replace it")
    return step is not None


def check_args(args) -> None:
    from megatron_patch.rlhf.rollout import check_layout

    if bool(args.reward_model) == bool(args.reward):
        raise ValueError("pass one of --reward-model DIR (a reward model) or --reward module:function (a rule)")
    if not (args.mcore_dir or args.hf_dir):
        raise ValueError("pass --mcore-dir CKPT or --hf-dir DIR (the policy to start from)")
    check_layout(args, "PPO")
    if args.mini_batches > args.prompts_per_step:
        raise ValueError(f"--mini-batches {args.mini_batches} is more than --prompts-per-step "
                         f"{args.prompts_per_step} (rollouts per step)")
    if args.kl_coef < 0 or not 0 <= args.gamma <= 1 or not 0 <= args.lam <= 1:
        raise ValueError("--kl-coef must be >= 0, --gamma and --lam in [0, 1]")


def setup(args) -> tuple[Trainer, str]:
    """(the run's Trainer, the tokenizer folder) after every check of the arguments, outputs, models and
    prompts: nothing is loaded before they pass."""
    from megatron_patch.cli import is_first_rank
    from megatron_patch.conversion.atomic import check_output
    from megatron_patch.inference import model_folder, read_prompts
    from megatron_patch.models import load_hf_config
    from megatron_patch.tokenizer import build_tokenizer

    check_args(args)
    sources = [args.hf_dir, args.mcore_dir, args.reward_model, args.critic]
    for out in (args.out, args.critic_out):
        if out:
            check_output(out, args.overwrite, sources)
    if args.out and args.out == args.critic_out:
        raise ValueError("--out and --critic-out name the same folder")
    replace_saved = replaces_saved_run(args)
    if not args.out and is_first_rank():
        print("warning: no --out: the trained policy will not be exported", file=sys.stderr)
    policy_dir = model_folder(args.mcore_dir, args.hf_dir)
    tok_dir = args.tokenizer or policy_dir
    tokenizer = build_tokenizer(tok_dir)
    texts, prompt_ids = read_prompts(args.prompts, tokenizer, args.chat)
    check_inputs(args, load_hf_config(policy_dir), tokenizer, prompt_ids)
    torch.manual_seed(args.seed)
    trainer = Trainer(args, tokenizer, texts, prompt_ids)
    trainer.replace_saved = replace_saved
    return trainer, tok_dir


def train(args) -> dict:
    from megatron_patch.cli import is_first_rank
    from megatron_patch.rlhf.rollout import reward_summary, save_hf

    trainer, tok_dir = setup(args)
    first = trainer.load(args.load) if args.load else 0
    start = time.time()
    for step in range(first, args.steps):
        row, _ = trainer.step(step)
        if is_first_rank():
            print(json.dumps({k: round(v, 5) if isinstance(v, float) else v for k, v in row.items()}),
                  file=sys.stderr, flush=True)
        if args.save and ((step + 1) % args.save_interval == 0 or step + 1 == args.steps):
            trainer.save(args.save, step + 1)
    if args.out:
        save_hf(trainer.policy, trainer.cfg, tok_dir, args.out, args.tp, args.pp, args.overwrite)
    if args.critic_out:
        save_hf(trainer.critic, trainer.critic_cfg, tok_dir, args.critic_out, args.tp, args.pp, args.overwrite)
    history = trainer.history
    return {"steps": len(history), "resumed_at": first, **reward_summary(history),
            "kl_max": round(max(r["kl"] for r in history), 4) if history else None,
            "seconds": round(time.time() - start, 1), "out": args.out, "critic_out": args.critic_out,
            "history": history}


def parser() -> argparse.ArgumentParser:
    from megatron_patch.cli import HelpFormatter, positive_float, positive_int
    from megatron_patch.rlhf.rollout import add_rollout_args

    p = argparse.ArgumentParser(prog="python -m megatron_patch.rlhf.ppo", description=__doc__,
                                formatter_class=HelpFormatter)
    add_rollout_args(p, prompts_per_step=16, out_help="write the final actor here as an HF causal LM",
                     seed_help="sampling seed (and a fresh value head's)",
                     clip_grad_help="gradient norm clip (actor and critic, each)")
    p.add_argument("--reward-model", help="a reward model (HF ...ForSequenceClassification folder or Megatron "
                                          "checkpoint) sharing the policy's tokenizer")
    p.add_argument("--reward", help="or a rule: module:function, called as fn(prompt, completion) -> float")
    p.add_argument("--critic", help="start the critic from this model (HF folder or Megatron checkpoint; default: the "
                                    "reward model, else the policy)")
    p.add_argument("--steps", type=positive_int, default=100, help="PPO steps (rollout + update)")
    p.add_argument("--lr", type=positive_float, default=1e-6, help="actor AdamW learning rate")
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
    p.add_argument("--save", help="checkpoint folder (every --save-interval steps and at the end); one holding a "
                                  "checkpoint needs --load naming it (resume) or --overwrite (start again)")
    p.add_argument("--save-interval", type=positive_int, default=50, help="steps between checkpoints")
    p.add_argument("--load", help="resume from this checkpoint folder's latest step (usually the --save folder)")
    return p


def main(argv: list[str] | None = None) -> int:
    from megatron_patch.cli import run as run_tool

    args = parser().parse_args(argv)
    return run_tool(lambda: train(args))[0]


if __name__ == "__main__":
    sys.exit(main())
