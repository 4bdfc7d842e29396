"""lm-evaluation-harness (`lm-eval` 0.4) on a Megatron checkpoint: the model `megatron_patch`.

    python -m megatron_patch.lm_eval_model --model megatron_patch \\
        --model_args mcore_dir=CKPT --tasks hellaswag,wikitext --batch_size 8          # lm-eval's own CLI
    torchrun --nproc-per-node 4 -m megatron_patch.lm_eval_model --model megatron_patch \\
        --model_args mcore_dir=CKPT,tp=2,pp=2 --tasks hellaswag --batch_size 8

    import lm_eval, megatron_patch.lm_eval_model                  # the import registers the model name
    lm_eval.simple_evaluate(model="megatron_patch", model_args={"mcore_dir": "CKPT"}, tasks=[...])

lm-eval 0.4 finds models only in its own registry (it has no plugin entry points), so plain `lm_eval
--model megatron_patch` does not know the name: the `python -m` entry above registers it and then runs
lm-eval's CLI with the same arguments.

The model is this package's inference path: a Megatron checkpoint as stored (`mcore_dir=`, any stored
layout, loaded at `tp`/`pp`/`ep`) or an HF folder converted in memory (`hf_dir=`); `loglikelihood` and
`loglikelihood_rolling` score with `megatron_patch.runtime.logits.megatron_logits` (full-vocab logits at
any TP x PP), `generate_until` runs `megatron_patch.inference.generate` (megatron-core's dynamic inference
engine, any TP x PP).
Text is encoded exactly as lm-eval's `hf` model encodes it (the checkpoint's HF tokenizer, the same
context / continuation split, BOS rule, left truncation, rolling windows and stop-string cutting), so on
the same weights the two report the same scores. Under torchrun every process of a model replica runs the
same forward passes; processes beyond TP x PP x EP are data-parallel replicas that split the requests
(EP = 1 only).
"""

from __future__ import annotations

import os
import re
import sys
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F

try:
    from lm_eval.api.model import TemplateLM
except ImportError as e:  # an optional dependency: only this module needs it
    raise ImportError("megatron_patch.lm_eval_model needs lm-evaluation-harness: "
                      "pip install 'megatron_patch[lm_eval]' (or 'lm-eval[hf]>=0.4.13,<0.5')") from e

MODEL_NAME = "megatron_patch"
# lm-eval's dtype spellings (and torch's) for the ones `megatron_patch.names.DTYPE_NAMES` knows
_DTYPE_ALIASES = {"fp32": "fp32", "float32": "fp32", "bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16",
                  "float16": "fp16"}
# generation kwargs of lm-eval tasks that map onto `megatron_patch.inference.generate`
_GEN_KWARGS = ("do_sample", "temperature", "top_k", "top_p", "until", "max_gen_toks", "max_length")


def register() -> None:
    """Make `megatron_patch` a model name of lm-eval (idempotent). Registered by import path, so lm-eval
    uses this module's class as imported, also when this file runs as `__main__`."""
    import lm_eval.models  # noqa: F401  (lm-eval registers its own models only while its registry is empty)
    from lm_eval.api.registry import model_registry

    if MODEL_NAME not in model_registry:
        model_registry.register(MODEL_NAME, target="megatron_patch.lm_eval_model:MegatronLM")


def _int_arg(name: str, value: Any, minimum: int = 1) -> int:
    """A model arg as an integer >= minimum (lm-eval passes numbers parsed from text, or as given)."""
    if isinstance(value, bool) or not re.fullmatch(r"\d+", str(value).strip()) or int(value) < minimum:
        raise ValueError(f"model_args {name}={value!r}: expected an integer >= {minimum}")
    return int(value)


class MegatronLM(TemplateLM):
    """lm-eval's `LM` interface over a megatron-core GPTModel (this rank's part of it)."""

    def __init__(self, mcore_dir: str | None = None, hf_dir: str | None = None, tokenizer: str | None = None,
                 tp: int = 1, pp: int = 1, ep: int = 1, impl: str | None = None, dtype: str = "fp32",
                 batch_size: int | str = 1, max_length: int | None = None, max_gen_toks: int = 256,
                 add_bos_token: bool | None = None, prefix_token_id: int | None = None, seed: int = 1234,
                 trust_remote_code: bool = False, device: str | None = None, max_batch_size: int | None = None,
                 **unknown: Any) -> None:
        """`device` and `max_batch_size` are accepted because lm-eval always passes them: the device is
        megatron's (this process's GPU, else the CPU) and `batch_size` is fixed (no `auto`)."""
        super().__init__()
        from megatron_patch.inference import model_and_tokenizer

        if unknown:
            raise ValueError(f"model_args: unknown argument(s) {', '.join(sorted(unknown))} for the megatron_patch "
                             "model (known: mcore_dir, hf_dir, tokenizer, tp, pp, ep, impl, dtype, batch_size, "
                             "max_length, max_gen_toks, add_bos_token, prefix_token_id, seed, trust_remote_code)")
        if not (mcore_dir or hf_dir):
            raise ValueError("model_args: pass mcore_dir=CKPT (a Megatron checkpoint) or hf_dir=DIR (an HF folder)")
        if mcore_dir and hf_dir:
            raise ValueError("model_args: pass either mcore_dir or hf_dir, not both")
        if str(dtype) not in _DTYPE_ALIASES:
            raise ValueError(f"model_args dtype={dtype!r}: expected one of {', '.join(sorted(_DTYPE_ALIASES))}")
        if str(batch_size).startswith("auto"):
            raise ValueError(f"model_args batch_size={batch_size}: automatic batch sizes are not supported; "
                             "pass a number")
        if impl not in (None, "local", "transformer_engine"):
            raise ValueError(f"model_args impl={impl!r}: expected local or transformer_engine")
        tp, pp, ep = _int_arg("tp", tp), _int_arg("pp", pp), _int_arg("ep", ep)
        self.batch_size_per_gpu = _int_arg("batch_size", batch_size)
        self._max_gen_toks = _int_arg("max_gen_toks", max_gen_toks)
        self.seed = _int_arg("seed", seed, minimum=0)
        self.add_bos_token = add_bos_token
        self.custom_prefix_token_id = None if prefix_token_id is None else _int_arg("prefix_token_id",
                                                                                    prefix_token_id, 0)
        args = SimpleNamespace(mcore_dir=mcore_dir and str(mcore_dir), hf_dir=hf_dir and str(hf_dir),
                               tokenizer=tokenizer and str(tokenizer), tp=tp, pp=pp, ep=ep, impl=impl,
                               dtype=_DTYPE_ALIASES[str(dtype)])

        def hf_tokenizer(tok) -> None:
            # lm-eval's `hf` model encodes with the HF tokenizer (`encode`, with its special tokens): so does
            # this one, loaded from the package tokenizer's folder before the weights are read
            self.tokenizer = self._hf_tokenizer(tok, add_bos_token, trust_remote_code)

        # mtokenizer: the package's tokenizer, which megatron.core.inference's controller takes
        self.model, self.vocab_size, self.mtokenizer = model_and_tokenizer(args, hf_tokenizer)
        self._max_length = (_int_arg("max_length", max_length) if max_length is not None
                            else int(self.model.max_sequence_length))
        self._rank, self._world_size, self._dp_group = self._data_parallel(tp * pp * ep, ep)

    # --- what lm-eval asks of a model ---------------------------------------------------------------

    @staticmethod
    def _hf_tokenizer(tok, add_bos_token: bool | None, trust_remote_code: bool):
        from transformers import AutoTokenizer

        if tok.library != "huggingface":
            raise ValueError(f"tokenizer {tok.path}: lm-eval needs a Hugging Face tokenizer folder "
                             "(pass tokenizer=DIR)")
        extra = {} if add_bos_token is None else {"add_bos_token": bool(add_bos_token)}
        return AutoTokenizer.from_pretrained(tok.path, local_files_only=True, use_fast=True,
                                             trust_remote_code=bool(trust_remote_code), **extra)

    @staticmethod
    def _data_parallel(model_parallel: int, ep: int) -> tuple[int, int, Any]:
        """(rank, world size, group) of the data-parallel replicas: lm-eval gives each replica its share of
        the requests. All processes of one replica must report the same rank (they run the same passes)."""
        import torch.distributed as dist

        if not dist.is_initialized() or dist.get_world_size() == model_parallel:
            return 0, 1, None
        if ep > 1:
            raise ValueError(f"expert parallelism with data-parallel replicas is not supported: run "
                             f"{model_parallel} processes (TP x PP x EP), not {dist.get_world_size()}")
        from megatron.core import parallel_state as ps

        return ps.get_data_parallel_rank(), ps.get_data_parallel_world_size(), ps.get_data_parallel_group()

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        """The token an empty context (and each rolling window's start) conditions on: as lm-eval's hf."""
        if self.custom_prefix_token_id is not None:
            return self.custom_prefix_token_id
        if self.tokenizer.bos_token_id is not None:
            return self.tokenizer.bos_token_id
        return self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def batch_size(self) -> int:
        return self.batch_size_per_gpu

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.name_or_path.replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, left_truncate_len: int | None = None,
                   **kwargs) -> list[int]:
        """lm-eval hf's rule: the tokenizer's own special tokens unless `add_special_tokens`/`add_bos_token`
        say otherwise, and none when the text already starts with the prefix (BOS) token."""
        from lm_eval.models.utils import has_bos_prefix

        special = ({"add_special_tokens": add_special_tokens} if add_special_tokens is not None
                   else {"add_special_tokens": bool(self.add_bos_token)} if self.add_bos_token is not None else {})
        if add_special_tokens is None and has_bos_prefix(string, self.tokenizer.decode(self.prefix_token_id)):
            special["add_special_tokens"] = False
        ids = self.tokenizer.encode(string, **special)
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def tok_decode(self, tokens: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(chat_history, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt,
                                                  continue_final_message=not add_generation_prompt)

    def get_model_info(self) -> dict:
        return {"model_num_parameters": sum(p.numel() for p in self.model.parameters()),
                "model_dtype": str(next(self.model.parameters()).dtype)}

    # data-parallel replicas: what lm-eval's evaluator calls to pad and gather their shares
    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        if self._world_size == 1:
            return tensor
        parts = [torch.zeros_like(tensor) for _ in range(self._world_size)]
        dist.all_gather(parts, tensor, group=self._dp_group)
        return torch.stack(parts) if tensor.dim() == 0 else torch.cat(parts)

    def gather_object(self, obj: Any, dst: int = 0) -> list | None:
        import torch.distributed as dist

        if self._world_size == 1:
            return [obj]
        out = [None] * self._world_size if self._rank == dst else None
        dist.gather_object(obj, out, dst=dist.get_global_rank(self._dp_group, dst), group=self._dp_group)
        return out

    def barrier(self) -> None:
        import torch.distributed as dist

        if self._world_size > 1:
            dist.barrier(group=self._dp_group)

    # --- scoring ----------------------------------------------------------------------------------------

    def _last_logprobs(self, inputs: list[list[int]], counts: list[int]) -> list[torch.Tensor]:
        """Per input, the log-softmax over the vocab at its last `count` positions [count, vocab] (fp32). The
        batch is right-padded: a causal model's scores at a position never see the tokens after it."""
        from megatron_patch.runtime.logits import megatron_logits

        longest = max(len(x) for x in inputs)
        ids = torch.tensor([x + [self.eot_token_id] * (longest - len(x)) for x in inputs], device=self.device)
        logits = megatron_logits(self.model, ids, self.vocab_size)  # on every rank of the replica
        return [F.log_softmax(row[len(x) - n: len(x)].float(), dim=-1) for row, x, n in zip(logits, inputs, counts)]

    def _loglikelihood_tokens(self, requests: list[tuple[Any, list[int], list[int]]], disable_tqdm: bool = False,
                              **kwargs) -> list[tuple[float, bool]]:
        """(log p(continuation | context), continuation is the greedy one) per request, batched and ordered
        as lm-eval's hf model does (longest first; one pass for requests that share all but a last token)."""
        from lm_eval.models.utils import Collator
        from tqdm import tqdm

        from megatron_patch.cli import is_first_rank

        res: list[tuple[float, bool]] = []
        order = Collator(requests, sort_fn=lambda r: (-len(r[1] + r[2]), tuple(r[1] + r[2])),
                         group_by="contexts", group_fn=lambda r: r[-2] + r[-1][:-1])
        bar = tqdm(total=len(requests), disable=disable_tqdm or not is_first_rank(),
                   desc="Running loglikelihood requests")
        for chunk in order.get_batched(n=self.batch_size):
            inputs = []
            for _, context, continuation in chunk:
                if not context or not continuation:
                    raise ValueError("a loglikelihood request needs a context and a continuation token")
                if len(continuation) > self.max_length:
                    raise ValueError(f"a continuation of {len(continuation)} tokens is longer than max_length "
                                     f"{self.max_length}")
                # too long: the context is cut from the left; the last token is only predicted
                inputs.append((context + continuation)[-(self.max_length + 1):][:-1])
            scored_all = self._last_logprobs(inputs, [len(c) for _, _, c in chunk])
            for (request, context, continuation), scored in zip(chunk, scored_all):
                scored = scored.unsqueeze(0)  # [1, continuation, vocab]
                greedy = scored.argmax(dim=-1)
                # the requests that share this pass (all but their last continuation token)
                for shared, cont, logits in order.get_cache(req_str=request, cxt_toks=context,
                                                            cont_toks=continuation, logits=scored):
                    cont = torch.tensor(cont, dtype=torch.long, device=logits.device).unsqueeze(0)
                    is_greedy = bool((greedy[:, -cont.shape[1]:] == cont).all())
                    answer = (float(logits.gather(2, cont.unsqueeze(-1)).sum()), is_greedy)
                    res.append(answer)
                    if shared is not None:  # rolling windows are cached per document instead
                        self.cache_hook.add_partial("loglikelihood", shared, answer)
                    bar.update(1)
        bar.close()
        return order.get_original(res)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each document's total log-likelihood over disjoint windows of `max_length` predictions, the first
        conditioned on the prefix token (lm-eval's `get_rolling_token_windows`, context length 1)."""
        from lm_eval import utils

        windows, counts = [], []
        for (text,) in [req.args for req in requests]:
            doc = [(None, *utils.make_disjoint_window(w)) for w in utils.get_rolling_token_windows(
                token_list=self.tok_encode(text), prefix_token=self.prefix_token_id, max_seq_len=self.max_length,
                context_len=1)]
            windows.extend(doc)
            counts.append(len(doc))
        scores = self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm)
        out, start = [], 0
        for req, n in zip(requests, counts):
            total = sum(s for s, _ in scores[start: start + n])
            start += n
            out.append(total)
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return out

    # --- generation -------------------------------------------------------------------------------------

    def _context_ids(self, contexts: list[str], max_ctx_len: int) -> list[list[int]]:
        """lm-eval hf's batch encoding: no special tokens if the first context already starts with BOS,
        else `add_bos_token` if set, else the tokenizer's default; left-truncated to `max_ctx_len`."""
        from lm_eval.models.utils import has_bos_prefix

        special = {}
        if has_bos_prefix(contexts[0], getattr(self.tokenizer, "bos_token", None)):
            special = {"add_special_tokens": False}
        elif self.add_bos_token is not None:
            special = {"add_special_tokens": bool(self.add_bos_token)}
        return [self.tokenizer.encode(c, **special)[-max_ctx_len:] for c in contexts]

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy (do_sample false / temperature 0) or sampled continuations from megatron-core's dynamic
        inference engine (one call per lm-eval batch; the engine is built once and reused), up to
        `max_gen_toks` tokens or the end-of-text token, cut at the first `until` string."""
        from lm_eval.models.utils import (
            Collator,
            handle_stop_sequences,
            normalize_gen_kwargs,
            postprocess_generated_text,
        )
        from tqdm import tqdm

        from megatron_patch.cli import is_first_rank
        from megatron_patch.inference import Sampling, generate

        res: list[str] = []
        order = Collator([req.args for req in requests], sort_fn=lambda r: (-len(self.tok_encode(r[0])), r[0]),
                         group_by="gen_kwargs", group_fn=lambda r: r[1])
        bar = tqdm(total=len(requests), disable=disable_tqdm or not is_first_rank(),
                   desc="Running generate_until requests")
        eos = self.tok_decode([self.eot_token_id], skip_special_tokens=False)
        for chunk in order.get_batched(n=self.batch_size):
            contexts, all_kwargs = zip(*chunk)
            kwargs = normalize_gen_kwargs(all_kwargs[0], self.max_gen_toks)
            unsupported = sorted(set(kwargs) - set(_GEN_KWARGS))
            if unsupported:
                raise ValueError(f"generation_kwargs {', '.join(unsupported)} are not supported by the "
                                 f"megatron_patch model (supported: {', '.join(_GEN_KWARGS)})")
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            max_new = kwargs.pop("max_gen_toks")
            max_ctx_len = self.max_length - max_new
            if max_ctx_len <= 0:
                raise ValueError(f"max_gen_toks {max_new} must be less than max_length {self.max_length}")
            prompts = self._context_ids(list(contexts), max_ctx_len)
            if "max_length" in kwargs:  # HF's meaning: the longest prompt plus the new tokens
                max_new = int(kwargs.pop("max_length")) - max(len(p) for p in prompts)
            temperature = float(kwargs.get("temperature", 0.0))
            if kwargs.get("do_sample") and temperature > 0:
                top_k, top_p = int(kwargs.get("top_k", 0)), float(kwargs.get("top_p", 0.0))
            else:
                temperature, top_k, top_p = 1.0, 1, 0.0  # greedy: megatron's top_k=1
            # `until` ends each generation early (megatron stops on it); lm-eval's cut then trims the text
            sampling = Sampling(max_new, temperature, top_k, top_p, self.seed, stop_id=self.eot_token_id,
                                stop=[s for s in until if s])
            outs = generate(self.model, self.mtokenizer, prompts, sampling, max_batch_size=len(prompts))
            for context, tokens in zip(contexts, outs):
                text = postprocess_generated_text(self.tok_decode(tokens), stop=until, think_end_token=None)
                res.append(text)
                self.cache_hook.add_partial("generate_until", (context, all_kwargs[0]), text)
                bar.update(1)
        bar.close()
        return order.get_original(res)


def main(argv: list[str] | None = None) -> int:
    """lm-eval's command line with the `megatron_patch` model registered: exit 0, or 1 with one `error:` line.
    Under torchrun only the first process prints (each node's first process would otherwise print too)."""
    from megatron_patch.cli import quiet_third_party, run

    quiet_third_party()
    register()
    from lm_eval.__main__ import cli_evaluate

    def evaluate() -> None:
        saved, stdout = sys.argv, sys.stdout
        sys.argv = ["lm-eval", *(saved[1:] if argv is None else argv)]  # lm-eval's CLI reads sys.argv
        try:
            with open(os.devnull, "w") as devnull:
                if int(os.environ.get("RANK", "0")) != 0:
                    sys.stdout = devnull
                cli_evaluate()
        finally:
            sys.argv, sys.stdout = saved, stdout

    return run(evaluate, summary=None)[0]


register()

if __name__ == "__main__":
    sys.exit(main())
