"""Issue 29's checks at real widths (one H200; `bash tests/gpu/run_suite.sh widths`, ~6 min, not in quick):

- **LoRA vs full SFT at Llama-3-8B widths** (8 of 32 layers, vocabulary 128,256, seq 4096, micro-batch 1, 8 per
  step; bf16 base from a random HF checkpoint) on the SFT proof task (the training proof's synthetic chats,
  packed): both losses fall; trainable parameters = PEFT's count; tokens/s and peak memory of each are
  recorded. The LoRA run's PEFT export (`--save-peft`) loads in `peft` and gives our logits:
  - fp32 (local spec, TF32 off on both sides): the adapted logits differ from HF + PEFT no more than the base
    model's logits already do (plain fp32 reassociation: K * 2^-24 relative with K = 14,336 -> ~1e-3 of a
    logit sum of |x||w| terms; measured base difference recorded), and the adapters moved the logits by far
    more than that;
  - bf16 (Transformer Engine, the training dtype): each side's distance from the fp32 HF + PEFT logits,
    ours at most twice PEFT's own bf16 distance (bf16's noise, measured on the peer, is the tolerance).
- **fp8 LoRA** at the same widths: trains (finite, falling loss).
- **lm-eval at Llama-3.2-1B widths** (random weights, bf16, `max_length` 1024): the `megatron_patch` model vs
  lm-eval's `hf` model on local multiple-choice and rolling-perplexity tasks. Per-token log-likelihoods: each
  bf16 side's distance from HF in fp32, ours at most twice HF-bf16's + 1e-3; acc / acc_norm equal, a choice
  allowed to differ only where HF-fp32's margin between the two choices is within that tolerance (a tie in
  bf16). Wall time of each whole evaluation (model load included) side by side.
Figures go to $GPU_REPORT (tests/gpu/last_results.jsonl rows)."""

import gzip
import json
import math
import os
import time

import pytest
import torch

from tests.gpu.test_te import HAVE_TE, _record

pytestmark = [pytest.mark.skipif(not HAVE_TE, reason="needs a CUDA GPU and Transformer Engine"),
              pytest.mark.widths]

VOCAB = 128_256
W8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=8, num_attention_heads=32,
           num_key_value_heads=8, seq=8192)
W1B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
           num_key_value_heads=8, seq=4096)
SEQ, ITERS, RANK, ALPHA = 4096, 20, 16, 32


def _hf_config(widths: dict, tie: bool = False) -> dict:
    from benchmarks.train_bench import config

    return {**config({**widths, "vocab": VOCAB}), "tie_word_embeddings": tie, "eos_token_id": 0,
            "bos_token_id": 0}


def _random_hf(widths: dict, folder: str, tie: bool = False) -> str:
    """A random HF checkpoint (bf16, seed 0) of those widths with the tiny tokenizer beside it."""
    from benchmarks.train_bench import random_hf
    from megatron_patch.conversion.hf_io import copy_side_files
    from megatron_patch.tokenizer import TINY_TOKENIZER

    random_hf(_hf_config(widths, tie), folder)
    copy_side_files(TINY_TOKENIZER, folder, ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"])
    return folder


@pytest.fixture(scope="module")
def base8b(tmp_path_factory):
    root = tmp_path_factory.mktemp("w8b")
    from tests.helpers import conversations

    chats = root / "chats.jsonl"
    chats.write_text("".join(json.dumps(c) + "\n" for c in conversations(4000)))
    return _random_hf(W8B, str(root / "hf")), str(chats), root


def _sft(root, name: str, hf: str, chats: str, *extra: str) -> dict:
    """`megatron_patch.sft` from the HF start at seq 4096 (the training proof's runner); losses, ms per
    iteration (median of the second half), tokens/s, peak MB, the log."""
    from megatron_patch.training.log import parse_log
    from tests.gpu.train_proof import train

    run = train(str(root), name, 1, chats, ["--load-hf", hf], ITERS, "--seq-length", str(SEQ),
                "--micro-batch-size", "1", "--global-batch-size", "8", "--lr-warmup-iters", "2", *extra,
                entry="sft")
    text = open(os.path.join(root, f"{name}.log")).read()
    log = parse_log(text)
    ms = log.median("elapsed time per iteration (ms)", 0.5)
    run.update(log=text, ms=ms, tokens_per_s=round(8 * SEQ / (ms / 1000)) if ms else None,
               peak_gb=round(max(log.max_allocated_mb) / 1024, 1) if log.max_allocated_mb else None)
    assert run["rc"] == 0, run["tail"]
    return run


def _falls(losses: dict) -> bool:
    first, last = sorted(losses)[:3], sorted(losses)[-3:]
    return (all(math.isfinite(v) for v in losses.values())
            and sum(losses[i] for i in last) / 3 < sum(losses[i] for i in first) / 3 - 0.5)


def test_lora_vs_full_sft_at_8b_widths_and_the_peft_export(base8b):
    import re

    from megatron_patch.conversion.mcore_io import checkpoint_step_dir
    from megatron_patch.lora.peft import read_checkpoint_adapter
    from megatron_patch.models import load_hf_config
    from tests.e2e.test_lora import _expected_trainable

    hf, chats, root = base8b
    full = _sft(root, "full", hf, chats, "--lr", "1e-4", "--min-lr", "1e-5")
    lora = _sft(root, "lora", hf, chats, "--lr", "2e-3", "--min-lr", "2e-4", "--lora-rank", str(RANK),
                "--lora-alpha", str(ALPHA), "--save", str(root / "ckpt"), "--save-peft", str(root / "peft"))
    trainable = [int(c.replace(",", "")) for c in re.findall(r"LoRA: ([\d,]+) trainable", lora["log"])]
    cfg = load_hf_config(hf)
    cfg_for_count = {**cfg, "head_dim": cfg["hidden_size"] // cfg["num_attention_heads"]}
    _record(test="lora_vs_full_sft_8b_widths", seq=SEQ, global_batch=8, iters=ITERS,
            **{f"{k}_{f}": r[f] for k, r in (("full", full), ("lora", lora))
               for f in ("losses", "tokens_per_s", "peak_gb", "ms")}, lora_trainable=trainable)
    assert trainable == [_expected_trainable(cfg_for_count, RANK)]
    assert _falls(full["losses"]), full["losses"]
    assert _falls(lora["losses"]), lora["losses"]
    assert lora["peak_gb"] < full["peak_gb"]

    adapter = read_checkpoint_adapter(checkpoint_step_dir(str(root / "ckpt")))
    ids = _prompts(chats)
    fp32 = _peft_vs_ours(hf, str(root / "peft"), adapter, ids, torch.float32)
    bf16 = _peft_vs_ours(hf, str(root / "peft"), adapter, ids, torch.bfloat16, truth=fp32["peft_logits"])
    _record(test="lora_peft_export_8b_widths", **{k: v for k, v in fp32.items() if not k.endswith("logits")},
            **{f"bf16_{k}": v for k, v in bf16.items() if not k.endswith("logits")})
    # fp32: the adapters add no disagreement beyond the base model's own, and they did move the logits
    assert fp32["base_diff"] <= 2e-3, fp32
    assert fp32["adapted_diff"] <= max(2 * fp32["base_diff"], 2e-4), fp32
    assert fp32["adapter_effect"] >= 20 * max(fp32["adapted_diff"], 1e-4), fp32
    # bf16: ours is no further from fp32 HF + PEFT than twice PEFT's own bf16 rounding
    assert bf16["ours_vs_truth"] <= 2 * bf16["peft_vs_truth"] + 1e-2, bf16


def test_lora_in_fp8_at_8b_widths(base8b):
    hf, chats, root = base8b
    run = _sft(root, "lora_fp8", hf, chats, "--lr", "2e-3", "--min-lr", "2e-4", "--lora-rank", str(RANK),
               "--lora-alpha", str(ALPHA), "--precision", "fp8", "--fp8-recipe", "delayed")
    _record(test="lora_fp8_8b_widths", losses=run["losses"], tokens_per_s=run["tokens_per_s"],
            peak_gb=run["peak_gb"], ms=run["ms"])
    assert _falls(run["losses"]), run["losses"]


def _prompts(chats: str) -> torch.Tensor:
    """Four chats of the task (their first 48 tokens, tiny tokenizer) as a [4, 48] batch."""
    from megatron_patch.tokenizer import TINY_TOKENIZER, build_tokenizer

    tok = build_tokenizer(TINY_TOKENIZER)
    rows = [json.loads(line) for line in open(chats)][:40]
    texts = [" ".join(m["content"] for m in r["messages"]) for r in rows if "messages" in r]
    ids = [tok.tokenize(t * 4)[:48] for t in texts[:4]]
    return torch.tensor(ids)


def _peft_vs_ours(hf_dir: str, peft_dir: str, adapter: dict, ids: torch.Tensor, dtype: torch.dtype,
                  truth: torch.Tensor | None = None) -> dict:
    """HF (+ PEFT) and ours (base, then with the trained adapter) on `ids`, in `dtype`: fp32 on the local spec
    with TF32 off, bf16 under Transformer Engine. Largest absolute logit differences."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from megatron_patch import Bridge
    from megatron_patch.lora.adapters import load_adapter

    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        ids = ids.cuda()
        hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype).cuda().eval()
        with torch.no_grad():
            hf_base = hf(ids).logits.float()
            peft = PeftModel.from_pretrained(hf, peft_dir).eval()
            peft_logits = peft(ids).logits.float()
        del hf, peft
        torch.cuda.empty_cache()
        bridge = Bridge.from_hf(hf_dir)
        impl = "local" if dtype == torch.float32 else "transformer_engine"
        model = bridge.build(impl=impl, dtype=dtype)
        bridge.load_hf_weights(model, hf_dir)
        model.eval()
        ours_base = bridge.logits(model, ids)
        bridge.add_lora(model, rank=RANK, alpha=ALPHA)
        load_adapter(model, {k: v.cuda() for k, v in adapter.items()})
        model.eval()
        ours = bridge.logits(model, ids)
        del model
        torch.cuda.empty_cache()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before
    out = {"base_diff": (ours_base - hf_base).abs().max().item(),
           "adapted_diff": (ours - peft_logits).abs().max().item(),
           "adapter_effect": (peft_logits - hf_base).abs().max().item(),
           "logit_scale": peft_logits.abs().max().item(), "peft_logits": peft_logits}
    if truth is not None:
        out["ours_vs_truth"] = (ours - truth).abs().max().item()
        out["peft_vs_truth"] = (peft_logits - truth).abs().max().item()
    return out


# --- lm-eval at 1B widths ------------------------------------------------------------------------------------------

MC_DOCS, PPL_DOCS, MAX_LENGTH = 100, 20, 1024


def _tasks(root) -> str:
    from megatron_patch.tokenizer import CORPUS
    from tests.e2e.test_lm_eval import _COMMON, _TASKS

    with gzip.open(CORPUS, "rt") as f:
        texts = [json.loads(next(f))["text"] for _ in range(MC_DOCS + 50)]
    texts = [t for t in texts if len(t.split()) >= 22][:MC_DOCS]
    mc = [{"question": " ".join(w[:10]), "choices": [" ".join(w[10 + 3 * k: 13 + 3 * k]) for k in range(4)],
           "answer": i % 4} for i, w in enumerate(t.split() for t in texts)]
    data = {"mp_mc": mc, "mp_ppl": [{"text": t[:4000]} for t in texts[:PPL_DOCS]]}
    tasks = root / "tasks"
    tasks.mkdir()
    for name, rows in data.items():
        (root / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (tasks / f"{name}.yaml").write_text(f"task: {name}\n" + _COMMON.format(data=root / f"{name}.jsonl")
                                            + _TASKS[name])
    return str(tasks)


def _lm_eval(model: str, model_args: dict, tasks_dir: str) -> tuple[dict, float]:
    import lm_eval
    from lm_eval.tasks import TaskManager

    import megatron_patch.lm_eval_model  # noqa: F401  (registers the model name)

    began = time.perf_counter()
    r = lm_eval.simple_evaluate(model=model, model_args={**model_args, "max_length": MAX_LENGTH},
                                tasks=["mp_mc", "mp_ppl"], log_samples=True, batch_size=8,
                                task_manager=TaskManager(include_path=tasks_dir, include_defaults=False))
    seconds = time.perf_counter() - began
    out = {}
    for task in ("mp_mc", "mp_ppl"):
        samples = sorted(r["samples"][task], key=lambda s: s["doc_id"])
        out[task] = {"metrics": {k: v for k, v in r["results"][task].items() if isinstance(v, float)},
                     "resps": [[x[0] for x in s["resps"]] for s in samples], "docs": [s["doc"] for s in samples]}
    torch.cuda.empty_cache()
    return out, seconds


def _lls(run: dict) -> list[tuple[float, int, str]]:
    """(log-likelihood, tokens, which) of every request, in order: each choice of each mc document, each
    rolling document."""
    from transformers import AutoTokenizer

    from megatron_patch.tokenizer import TINY_TOKENIZER

    tok = AutoTokenizer.from_pretrained(TINY_TOKENIZER)
    out = []
    for doc, resps in zip(run["mp_mc"]["docs"], run["mp_mc"]["resps"]):
        out += [(r[0], len(tok.encode(" " + c)), "mc") for r, c in zip(resps, doc["choices"])]
    for doc, resps in zip(run["mp_ppl"]["docs"], run["mp_ppl"]["resps"]):
        out.append((resps[0], len(tok.encode(doc["text"])), "ppl"))
    return out


def _choices(run: dict) -> list[tuple[int, int]]:
    """(acc choice, acc_norm choice) per mc document, as lm-eval picks them."""
    out = []
    for doc, resps in zip(run["mp_mc"]["docs"], run["mp_mc"]["resps"]):
        ll = [r[0] for r in resps]
        norm = [x / len(c) for x, c in zip(ll, doc["choices"])]
        out.append((max(range(4), key=ll.__getitem__), max(range(4), key=norm.__getitem__)))
    return out


def test_lm_eval_at_1b_widths_equals_hf(tmp_path):
    pytest.importorskip("lm_eval")
    from tests.e2e.test_lm_eval import offline

    hf = _random_hf(W1B, str(tmp_path / "hf"), tie=True)
    tasks = _tasks(tmp_path)
    with offline(tmp_path):
        truth, _ = _lm_eval("hf", {"pretrained": hf, "dtype": "float32", "device": "cuda"}, tasks)
        ref, hf_seconds = _lm_eval("hf", {"pretrained": hf, "dtype": "bfloat16", "device": "cuda"}, tasks)
        ours, ours_seconds = _lm_eval("megatron_patch", {"hf_dir": hf, "dtype": "bf16", "impl": "transformer_engine"},
                                      tasks)
    t, r, o = _lls(truth), _lls(ref), _lls(ours)
    assert [x[1:] for x in t] == [x[1:] for x in r] == [x[1:] for x in o]
    hf_noise = max(abs(a[0] - b[0]) / b[1] for a, b in zip(r, t))
    ours_noise = max(abs(a[0] - b[0]) / b[1] for a, b in zip(o, t))
    ours_vs_hf = max(abs(a[0] - b[0]) / b[1] for a, b in zip(o, r))
    tol = 2 * hf_noise + 1e-3  # per token
    # a choice may differ only where fp32 HF's own margin between the two choices is within the tolerance
    ties, flips = 0, []
    tdocs = truth["mp_mc"]
    for d, (c_ours, c_ref) in enumerate(zip(_choices(ours), _choices(ref))):
        for kind, (a, b) in enumerate(zip(c_ours, c_ref)):
            if a == b:
                continue
            ll = [x[0] for x in tdocs["resps"][d]]
            choices = tdocs["docs"][d]["choices"]
            scale = [len(c) for c in choices] if kind else [1] * 4
            margin = abs(ll[a] / scale[a] - ll[b] / scale[b])
            n = max(x[1] for x in t[4 * d: 4 * d + 4])
            if margin > 2 * tol * n / min(scale):
                flips.append((d, kind, margin))
            ties += 1
    _record(test="lm_eval_1b_widths", dtype="bf16", mc_docs=MC_DOCS, ppl_docs=PPL_DOCS, max_length=MAX_LENGTH,
            hf_seconds=round(hf_seconds, 2), ours_seconds=round(ours_seconds, 2),
            per_token={"hf_bf16_vs_fp32": hf_noise, "ours_bf16_vs_fp32": ours_noise, "ours_vs_hf_bf16": ours_vs_hf},
            metrics={"ours": ours["mp_mc"]["metrics"] | ours["mp_ppl"]["metrics"],
                     "hf": ref["mp_mc"]["metrics"] | ref["mp_ppl"]["metrics"],
                     "hf_fp32": truth["mp_mc"]["metrics"]}, choices_differing_at_ties=ties)
    assert ours_noise <= tol, (ours_noise, hf_noise)
    assert not flips, flips
    if not ties:
        for metric in ("acc,none", "acc_norm,none"):
            assert ours["mp_mc"]["metrics"][metric] == ref["mp_mc"]["metrics"][metric]
