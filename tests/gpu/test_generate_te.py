"""Greedy generation with the Transformer Engine implementation on the GPU equals transformers'
`generate`, on both inference engines (static and dynamic): a small LLaMA is first trained for a few hundred
steps on the bundled corpus (the `trained` fixture, tests/gpu/conftest.py: random weights give near-ties
everywhere, which any rounding difference flips), then 5 prompts of different lengths continue for 32 tokens
with `megatron_patch.inference.generate` (megatron.core.inference, TE spec, weights from the HF folder) and
with HF `generate`, in fp32 and bf16. Where a token differs, the margin between
HF's two best logits at that step is recorded: a divergence is explained only by a near-tie.

TE runs fp32 GEMMs in TF32 on Hopper (tests/gpu/RESULTS.md: max logit difference to HF ~3e-2), so in fp32
the tokens must be identical unless HF's top-2 margin at the first differing step is below 0.05; in bf16
below 0.5 (bf16's logit noise on this model, same table)."""

import pytest
import torch

from tests.gpu.test_te import HAVE_TE, _record

pytestmark = pytest.mark.skipif(not HAVE_TE, reason="needs a CUDA GPU and Transformer Engine")

STEPS = 32
MARGIN = {torch.float32: 0.05, torch.bfloat16: 0.5}


def hf_greedy(model, prompt: list[int], device: str) -> tuple[list[int], list[float]]:
    """HF's greedy tokens and, per step, the margin between its two best logits."""
    out = model.generate(torch.tensor([prompt], device=device), max_new_tokens=STEPS, min_new_tokens=STEPS,
                         do_sample=False, output_scores=True, return_dict_in_generate=True, pad_token_id=0)
    top2 = [s[0].float().topk(2).values for s in out.scores]
    return out.sequences[0, len(prompt):].tolist(), [float(v[0] - v[1]) for v in top2]


def compare_greedy(hf_dir: str, prompts: list[list[int]], dtype: torch.dtype, impl: str, device: str,
                   engine: str = "auto") -> dict:
    from transformers import AutoModelForCausalLM

    from megatron_patch.inference import Sampling, generate, load_model
    from megatron_patch.tokenizer import build_tokenizer

    torch.backends.cuda.matmul.allow_tf32 = False  # HF in true fp32 (TE picks its own GEMM precision)
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype).to(device).eval()
    model, _ = load_model(None, hf_dir, impl=impl, dtype=dtype)
    ours = generate(model, build_tokenizer(hf_dir), prompts, Sampling(STEPS, top_k=1, stop_id=None),
                    max_batch_size=len(prompts), engine=engine)
    rows = []
    for prompt, mine in zip(prompts, ours):
        ref, margins = hf_greedy(hf, prompt, device)
        first = next((i for i, (a, b) in enumerate(zip(mine, ref)) if a != b), None)
        rows.append({"prompt_len": len(prompt), "identical": mine == ref, "first_diff": first,
                     "hf_margin_at_diff": None if first is None else round(margins[first], 4),
                     "min_margin": round(min(margins), 4)})
    return {"dtype": str(dtype).replace("torch.", ""), "impl": impl, "engine": engine, "prompts": rows,
            "identical": sum(r["identical"] for r in rows)}


@pytest.mark.parametrize("engine", ["static", "dynamic"])
@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, marks=pytest.mark.smoke), torch.bfloat16])
def test_te_greedy_equals_hf_generate(trained, dtype, engine):
    hf_dir, prompts, loss = trained
    result = compare_greedy(hf_dir, prompts, dtype, "transformer_engine", "cuda", engine)
    _record(test="generate_te_greedy", train_loss=round(loss, 3), steps=STEPS, **result)
    assert len(result["prompts"]) == 5
    for r in result["prompts"]:
        assert r["identical"] or r["hf_margin_at_diff"] < MARGIN[dtype], r


def test_dynamic_engine_256_mixed_requests_graphs_on_equals_off(trained):
    """Issue 27's acceptance on the GPU: 256 requests of mixed prompt lengths (4-400 tokens) on the dynamic engine
    (bf16, TE, at most 64 in flight: continuous batching refills freed slots) all finish with their 32 tokens, and
    the greedy tokens with CUDA graphs equal those without (the same kernels, replayed or launched: identical)."""
    import gzip
    import json

    from megatron_patch.inference import Sampling, generate, load_model
    from megatron_patch.tokenizer import CORPUS, build_tokenizer

    hf_dir = trained[0]
    tok = build_tokenizer(hf_dir)
    with gzip.open(CORPUS, "rt") as f:
        rows = [json.loads(line)["text"] for _, line in zip(range(700), f)][400:]  # past the training rows
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(4, 401, (256,), generator=gen).tolist()
    docs = [t for t in (tok.tokenize(r) for r in rows) if len(t) >= 400]
    prompts = [docs[i % len(docs)][:n] for i, n in enumerate(lengths)]
    model, _ = load_model(None, hf_dir, impl="transformer_engine", dtype=torch.bfloat16)
    sampling = Sampling(STEPS, top_k=1, stop_id=None)
    on = generate(model, tok, prompts, sampling, max_batch_size=64, cuda_graphs=True, engine="dynamic")
    off = generate(model, tok, prompts, sampling, max_batch_size=64, cuda_graphs=False, engine="dynamic")
    same = sum(a == b for a, b in zip(on, off))
    _record(test="dynamic_256_graphs_on_off", requests=len(prompts), prompt_lengths=[min(lengths), max(lengths)],
            finished=sum(len(t) == STEPS for t in on), identical=same)
    assert all(len(t) == STEPS for t in on) and all(len(t) == STEPS for t in off)
    assert same == len(prompts)
