"""The online-RL loop that GRPO, PPO and RLOO share; each algorithm is an `Algorithm` (its advantages and its
update), the loop is the rest:

    set-up      every check of the arguments, outputs, prompts and models before any weight is read; the
                policy and a frozen reference (two copies of the starting model in this rank's TP x PP slice),
                the policy's AdamW; then the algorithm's own models (PPO: reward model, critic)
    each step   `prompts_per_step` prompts (cycled), each sampled `group_size` times on the policy
                (`megatron_patch.rlhf.rollout`); the log-probabilities of the sampled tokens under the policy
                that sampled them and under the reference (`megatron_patch.rlhf.logprobs`); the completions'
                rewards (a rule, `--reward module:function`, or the algorithm's reward model); the algorithm's
                update, whose metrics make the step's JSON line on stderr (with where the step's seconds went,
                `_PhaseClock`: `rollout_s` the rollouts, `score_s` the log-probabilities and rewards, `update_s`
                the algorithm's `train_step`, PPO's critic values and advantages included; the summary sums
                them as `rollout_seconds`, `score_seconds`, `update_seconds`; timings stay out of the history)
    checkpoints `--save` / `--load` (`megatron_patch.rlhf.checkpoint`): the policy, its optimizer, the RNG and
                the history, plus the algorithm's state; a resumed run equals the uninterrupted one
    export      `--out`: the policy as an HF folder (the converter's writer, from the live model:
                `megatron_patch.conversion.live.save_hf`), plus what the algorithm exports (PPO's critic)

A new algorithm is a small module: a subclass of `Algorithm` (advantages, loss, update) and a parser
(`megatron_patch.rlhf.rloo` is one). The TP x PP ranks are the whole world (one replica); no expert
parallelism."""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

# --- what every algorithm uses ----------------------------------------------------------------------------------


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


def check_finite(loss: torch.Tensor | float, step: int, what: str = "the loss") -> None:
    """A non-finite loss stops the run before the optimizer writes NaN into the weights."""
    value = float(loss)
    if not math.isfinite(value):
        raise ValueError(f"step {step + 1}: {what} is {value} (non-finite); stopping before the model is "
                         "corrupted (lower the learning rate or check the reward)")


def optimizer_step(model, optimizer, max_norm: float) -> float:
    """After a backward pass: the tied embedding's gradient shared by the first and last stages, the gradients
    clipped to norm `max_norm` over all model-parallel ranks, the optimizer's step; returns the norm before
    clipping."""
    from megatron_patch.runtime import pipeline

    pipeline.share_embedding_grads(model)
    norm = pipeline.clip_grad_norm(model, max_norm)
    optimizer.step()
    return norm


def update(model, optimizer, tokens: torch.Tensor, loss_fn, step: int, max_norm: float,
           loss_key: str = "loss", what: str = "the loss") -> dict:
    """One optimizer step of `model` on `tokens` at any TP x PP (`pipeline.forward_backward` with `loss_fn`,
    which returns (loss, metrics)): its metrics, the step refused when `metrics[loss_key]` is not finite."""
    from megatron_patch.runtime import pipeline

    optimizer.zero_grad(set_to_none=True)
    metrics = pipeline.forward_backward(model, tokens, loss_fn)
    check_finite(metrics[loss_key], step, what)
    optimizer_step(model, optimizer, max_norm)
    return metrics


def save_hf(model, cfg: dict, tokenizer_dir: str, out: str, overwrite: bool = False) -> None:
    """A trained model (policy, or a reward-model-shaped critic) as an HF folder, streamed from the live model
    at its TP x PP layout and written by rank 0 with the converter's writer (atomically; NaN / Inf refused;
    config.json = `cfg` stating the dtype); every rank calls it."""
    from megatron_patch.conversion.live import save_hf as save_live

    save_live(model, cfg, out, side_dir=tokenizer_dir, overwrite=overwrite)


def frozen(model):
    for p in model.parameters():
        p.requires_grad_(False)
    return model.eval()


def policy_and_reference(mcore_dir: str | None, hf_dir: str | None, tp: int, pp: int, impl: str | None, dtype):
    """(policy, frozen reference, hf_config): two copies of the starting model in this rank's TP x PP slice."""
    from megatron_patch.inference import load_model
    from megatron_patch.models import Layout

    policy, cfg = load_model(mcore_dir, hf_dir, layout=Layout(tp, pp), impl=impl, dtype=dtype)
    reference, _ = load_model(mcore_dir, hf_dir, layout=Layout(tp, pp), impl=impl, dtype=dtype)
    for p in policy.parameters():
        p.requires_grad_(True)
    return policy, frozen(reference), cfg


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


def add_loop_args(parser, prompts_per_step: int, out_help: str, seed_help: str, clip_grad_help: str,
                  lr: float = 1e-6, lr_help: str = "AdamW learning rate") -> None:
    """The options every online-RL trainer has: the model, the prompts and how rollouts are sampled, the
    steps, the policy's learning rate and gradient clip, the seed, the HF export and the checkpoints (what
    the seed and the clip apply to is each trainer's to say)."""
    from megatron_patch.cli import positive_float, positive_int
    from megatron_patch.inference import ENGINES, add_model_args
    from megatron_patch.rlhf.checkpoint import add_checkpoint_args

    add_model_args(parser)
    parser.add_argument("--engine", choices=ENGINES, default="auto",
                        help="inference engine of the rollouts (auto: the dynamic one; samples are reproducible "
                             "for the same engine)")
    parser.add_argument("--prompts", required=True, help="JSONL prompts (`prompt` text or chat `messages`)")
    parser.add_argument("--chat", action="store_true", help="render plain prompts with the chat template")
    parser.add_argument("--prompts-per-step", type=positive_int, default=prompts_per_step,
                        help="prompts sampled per step")
    parser.add_argument("--max-new-tokens", type=positive_int, default=128, help="longest completion")
    parser.add_argument("--temperature", type=positive_float, default=1.0, help="sampling temperature of the rollouts")
    parser.add_argument("--top-p", type=float, default=0.0, help="nucleus sampling of the rollouts (0: off)")
    parser.add_argument("--lr", type=positive_float, default=lr, help=lr_help)
    parser.add_argument("--clip-grad", type=positive_float, default=1.0, help=clip_grad_help)
    parser.add_argument("--seed", type=int, default=1234, help=seed_help)
    parser.add_argument("--out", help=out_help)
    parser.add_argument("--overwrite", action="store_true", help="replace existing output folders")
    add_checkpoint_args(parser)


PHASES = ("rollout", "score", "update")  # a step's phases, in order


class _PhaseClock:
    """Where a step's seconds went: `start()` at the step's beginning, then `lap(name)` at the end of each phase
    records the seconds since the previous lap (or the start) under `name`, in this step's `laps` and in the
    run's `totals`. Before reading the clock it waits for the GPU (when CUDA is initialised), so the GPU work a
    phase queued counts to that phase."""

    def __init__(self):
        self.laps: dict[str, float] = {}  # this step's
        self.totals: dict[str, float] = dict.fromkeys(PHASES, 0.0)  # this process's steps
        self._last = 0.0

    @staticmethod
    def _now() -> float:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        return time.perf_counter()

    def start(self) -> None:
        self.laps = {}
        self._last = self._now()

    def lap(self, name: str) -> float:
        now = self._now()
        seconds, self._last = now - self._last, now
        self.laps[name] = self.laps.get(name, 0.0) + seconds
        self.totals[name] = self.totals.get(name, 0.0) + seconds
        return seconds


# --- the algorithm interface ------------------------------------------------------------------------------------


@dataclass
class Batch:
    """One step's rollouts as the algorithm sees them (per-token tensors [rows, s], aligned with the
    completion mask `rollouts.mask`)."""

    step: int  # 0-based
    rows: list[int]  # the index of each rollout's prompt
    rollouts: object  # megatron_patch.rlhf.rollout.Rollouts
    old: torch.Tensor  # log p of each label under the policy that sampled it
    ref: torch.Tensor  # ... under the frozen reference
    scores: torch.Tensor  # [rows] each completion's reward, on the policy's device


class Algorithm:
    """What an online-RL algorithm adds to the loop. One instance per run; `self.loop` is the `OnlineRL` (its
    args, policy, reference, policy optimizer, device, vocabulary). The defaults are those of an algorithm that
    trains the policy alone on rule rewards."""

    name = "?"  # in messages: "GRPO"

    def __init__(self, loop: OnlineRL):
        self.loop = loop

    @staticmethod
    def check_args(args) -> None:
        """Refuse what this algorithm cannot run, before anything is read."""

    @staticmethod
    def sources(args) -> dict[str, str | None]:
        """The algorithm's model inputs by flag (no output may be one of them)."""
        return {}

    @staticmethod
    def outputs(args) -> dict[str, str | None]:
        """What the algorithm writes besides --out, by flag."""
        return {}

    @staticmethod
    def group_size(args) -> int:
        """Samples per prompt in a step."""
        return 1

    def check_inputs(self, policy_cfg: dict) -> None:
        """Check the algorithm's own models against the policy (`policy_cfg`, `loop.tokenizer`) and the prompts
        (`loop.check_fits`), before any weight is read."""

    def setup(self) -> None:
        """Load the algorithm's own models and optimizers (after the policy and reference)."""

    def scores(self, rows: list[int], rollouts) -> torch.Tensor:
        """[rows] reward of each completion: the rule's (--reward)."""
        a = self.loop.args
        return rewards_of(self.loop.reward_fn, a.reward, self.loop.texts, rows, rollouts.texts,
                          self.group_size(a))

    def train_step(self, batch: Batch) -> dict:
        """Update on one batch; returns the step's row (its metrics, without the step number)."""
        raise NotImplementedError

    def rank_state(self) -> dict:
        """This rank's part of a checkpoint besides the policy, its optimizer and the RNG."""
        return {}

    def run_state(self) -> dict:
        """The run's part of a checkpoint (JSON) besides the step, layout and history."""
        return {}

    def load_state(self, rank_state: dict, run_state: dict) -> None:
        """Resume what `rank_state` / `run_state` saved."""

    def export(self, tokenizer_dir: str) -> None:
        """Write what the algorithm exports besides the policy (after --out)."""

    def summary(self, history: list[dict]) -> dict:
        """Figures of the run's summary besides steps, rewards and time."""
        return {}


# --- the loop ---------------------------------------------------------------------------------------------------


class OnlineRL:
    """One run of an online-RL algorithm on this rank: set-up (every check first), steps, checkpoints,
    export."""

    def __init__(self, args, algorithm: type[Algorithm]):
        from megatron_patch.cli import is_first_rank
        from megatron_patch.inference import context_length_of, model_folder, read_prompts
        from megatron_patch.models import load_hf_config, vocab_size
        from megatron_patch.names import torch_dtype
        from megatron_patch.outputs import check_output
        from megatron_patch.rlhf.checkpoint import replaces_saved_run
        from megatron_patch.tokenizer import build_tokenizer

        name = algorithm.name
        if not (args.mcore_dir or args.hf_dir):
            raise ValueError("pass --mcore-dir CKPT or --hf-dir DIR (the policy to start from)")
        check_layout(args, name)
        algorithm.check_args(args)
        sources = {"--hf-dir": args.hf_dir, "--mcore-dir": args.mcore_dir, **algorithm.sources(args)}
        outputs = {"--out": args.out, **algorithm.outputs(args)}
        for flag, out in outputs.items():
            if out:
                others = {f: o for f, o in outputs.items() if f != flag}
                check_output(out, args.overwrite, sources, flag=flag, outputs=others)
        self.replace_saved = replaces_saved_run(args, name)
        if not args.out and is_first_rank():
            print("warning: no --out: the trained policy will not be saved", file=sys.stderr)
        self.args, self.name = args, name
        self.reward_fn = load_reward(args.reward) if getattr(args, "reward", None) else None
        policy_dir = model_folder(args.mcore_dir, args.hf_dir)
        self.tokenizer_dir = args.tokenizer or policy_dir
        self.tokenizer = build_tokenizer(self.tokenizer_dir)
        self.texts, self.prompt_ids = read_prompts(args.prompts, self.tokenizer, args.chat)
        self.check_fits(context_length_of(args.mcore_dir, args.hf_dir))
        self.algorithm = algorithm(self)
        self.algorithm.check_inputs(load_hf_config(policy_dir))

        torch.manual_seed(args.seed)
        self.dtype = torch_dtype(args.dtype)
        self.policy, self.reference, self.cfg = policy_and_reference(args.mcore_dir, args.hf_dir, args.tp, args.pp,
                                                                     args.impl, self.dtype)
        self.policy_opt = torch.optim.AdamW(self.policy.parameters(), lr=args.lr, weight_decay=0.0)
        self.device = next(self.policy.parameters()).device
        self.vocab = vocab_size(self.cfg)
        self.history: list[dict] = []
        self.clock = _PhaseClock()  # this process's steps (timings stay out of the history)
        self.algorithm.setup()

    def check_fits(self, context: int | None, model: str = "") -> None:
        """Every prompt plus --max-new-tokens fits a model's context (None: no limit); `model` names the model
        when it is not the policy ("of the critic DIR")."""
        from megatron_patch.inference import check_lengths

        if context is not None:
            try:
                check_lengths(self.prompt_ids, self.args.max_new_tokens, context, "--max-new-tokens")
            except ValueError as e:
                raise ValueError(f"{e}{' ' + model if model else ''}; shorten the prompt or lower --max-new-tokens") \
                    from None

    def step(self, step: int) -> tuple[dict, object]:
        """One step: (its row, the rollouts it trained on)."""
        from megatron_patch.inference.sampling import Sampling
        from megatron_patch.rlhf.logprobs import token_logps
        from megatron_patch.rlhf.rollout import rollout

        a = self.args
        group = self.algorithm.group_size(a)
        # each prompt `group` times in a row: a group's samples sit together
        rows = [(step * a.prompts_per_step + i) % len(self.prompt_ids) for i in range(a.prompts_per_step)
                for _ in range(group)]
        # sampled from the whole distribution (top-k off) or its nucleus (--top-p), the end token ending a sample
        sampling = Sampling(a.max_new_tokens, a.temperature, top_k=0, top_p=a.top_p, seed=a.seed + step,
                            stop_id=self.tokenizer.eod)
        self.clock.start()
        r = rollout(self.policy, self.tokenizer, [self.prompt_ids[i] for i in rows], sampling, self.device, a.engine)
        self.clock.lap("rollout")
        old = token_logps(self.policy, r.tokens, r.labels, self.vocab)
        ref = token_logps(self.reference, r.tokens, r.labels, self.vocab)
        scores = self.algorithm.scores(rows, r).to(self.device)
        self.clock.lap("score")
        self.policy.train()
        row = {"step": step + 1, **self.algorithm.train_step(Batch(step, rows, r, old, ref, scores))}
        self.clock.lap("update")
        self.history.append(row)
        return row, r

    def save(self, folder: str, step: int) -> None:
        from megatron_patch.rlhf import checkpoint

        if self.replace_saved:  # --overwrite into a --save folder of another run: its checkpoints go first
            checkpoint.remove_saved(folder)
            self.replace_saved = False
        rank_state = {"actor": self.policy.state_dict(), "actor_optimizer": self.policy_opt.state_dict(),
                      "rng": torch.get_rng_state(), **self.algorithm.rank_state()}
        run_state = {"tp": self.args.tp, "pp": self.args.pp, "history": self.history, **self.algorithm.run_state()}
        checkpoint.save(folder, step, rank_state, run_state)

    def load(self, folder: str) -> int:
        """Resume from `folder`'s latest complete step; returns the number of steps done (0: nothing there)."""
        from megatron_patch.rlhf import checkpoint

        saved = checkpoint.load(folder, self.args.tp, self.args.pp, self.device, self.name)
        if saved is None:
            return 0
        step, rank_state, run_state = saved
        self.policy.load_state_dict(rank_state["actor"])
        self.policy_opt.load_state_dict(rank_state["actor_optimizer"])
        torch.set_rng_state(rank_state["rng"])
        self.history = run_state["history"]
        self.algorithm.load_state(rank_state, run_state)
        return step

    def train(self) -> dict:
        from megatron_patch.cli import is_first_rank

        a = self.args
        first = self.load(a.load) if a.load else 0
        start = time.time()
        for step in range(first, a.steps):
            row, _ = self.step(step)
            if is_first_rank():
                line = {**row, **{f"{phase}_s": self.clock.laps[phase] for phase in PHASES}}
                print(json.dumps({k: round(v, 5) if isinstance(v, float) else v for k, v in line.items()}),
                      file=sys.stderr, flush=True)
            if a.save and ((step + 1) % a.save_interval == 0 or step + 1 == a.steps):
                self.save(a.save, step + 1)
        if a.out:
            save_hf(self.policy, self.cfg, self.tokenizer_dir, a.out, a.overwrite)
        self.algorithm.export(self.tokenizer_dir)
        history = self.history
        return {"steps": len(history), "resumed_at": first, **reward_summary(history),
                **self.algorithm.summary(history), "seconds": round(time.time() - start, 1),
                **{f"{phase}_seconds": round(self.clock.totals[phase], 2) for phase in PHASES}, "out": a.out,
                "history": history}


def main(argv: list[str] | None, parser: Callable[[], argparse.ArgumentParser], algorithm: type[Algorithm]) -> int:
    """An online-RL trainer's command line: parse, run (errors as one `error:` line), print the summary."""
    from megatron_patch.cli import run as run_tool

    args = parser().parse_args(argv)
    return run_tool(lambda: OnlineRL(args, algorithm).train())[0]
