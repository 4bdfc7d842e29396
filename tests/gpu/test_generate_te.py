"""Greedy generation with the Transformer Engine implementation on the GPU equals transformers'
`generate`: a small LLaMA is first trained for a few hundred steps on the bundled corpus (random weights
give near-ties everywhere, which any rounding difference flips), then 5 prompts of different lengths
continue for 32 tokens with `megatron_patch.inference.generate` (megatron.core.inference, TE spec, weights
from the HF folder) and with HF `generate`, in fp32 and bf16. Where a token differs, the margin between
HF's two best logits at that step is recorded: a divergence is explained only by a near-tie.

TE runs fp32 GEMMs in TF32 on Hopper (tests/gpu/RESULTS.md: max logit difference to HF ~3e-2), so in fp32
the tokens must be identical unless HF's top-2 margin at the first differing step is below 0.05; in bf16
below 0.5 (bf16's logit noise on this model, same table)."""

import gzip
import json

import pytest
import torch

from tests.gpu.test_te import GPU_CFG, HAVE_TE, _record

pytestmark = pytest.mark.skipif(not HAVE_TE, reason="needs a CUDA GPU and Transformer Engine")

STEPS = 32
MARGIN = {torch.float32: 0.05, torch.bfloat16: 0.5}


def trained_hf_folder(path: str, steps: int = 400, device: str = "cuda") -> tuple[str, list[list[int]], float]:
    """A small LLaMA trained briefly on the corpus, saved with the tiny tokenizer; 5 prompts; the last loss."""
    from megatron_patch.conversion.hf_io import copy_side_files
    from megatron_patch.tokenizer import CORPUS, TINY_TOKENIZER, build_tokenizer
    from tests.models import hf_model, llama_config

    tok = build_tokenizer(TINY_TOKENIZER)
    with gzip.open(CORPUS, "rt") as f:
        rows = [json.loads(line)["text"] for _, line in zip(range(400), f)]
    ids = torch.tensor([t for r in rows for t in tok.tokenize(r) + [tok.eod]], device=device)
    torch.manual_seed(0)
    model = hf_model(llama_config("gqa", **GPU_CFG, max_position_embeddings=512)).to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    seq, batch = 128, 32
    for _ in range(steps):
        starts = torch.randint(0, len(ids) - seq - 1, (batch,), device=device)
        x = torch.stack([ids[s: s + seq] for s in starts.tolist()])
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    model.eval().save_pretrained(path)
    copy_side_files(TINY_TOKENIZER, path, ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"])
    prompts = [tok.tokenize(r)[:n] for r, n in zip(rows[10:], (3, 9, 17, 40, 64))]
    return path, prompts, float(loss)


def hf_greedy(model, prompt: list[int], device: str) -> tuple[list[int], list[float]]:
    """HF's greedy tokens and, per step, the margin between its two best logits."""
    out = model.generate(torch.tensor([prompt], device=device), max_new_tokens=STEPS, min_new_tokens=STEPS,
                         do_sample=False, output_scores=True, return_dict_in_generate=True, pad_token_id=0)
    top2 = [s[0].float().topk(2).values for s in out.scores]
    return out.sequences[0, len(prompt):].tolist(), [float(v[0] - v[1]) for v in top2]


def compare_greedy(hf_dir: str, prompts: list[list[int]], dtype: torch.dtype, impl: str, device: str) -> dict:
    from transformers import AutoModelForCausalLM

    from megatron_patch.inference import generate, load_model
    from megatron_patch.tokenizer import build_tokenizer

    torch.backends.cuda.matmul.allow_tf32 = False  # HF in true fp32 (TE picks its own GEMM precision)
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype).to(device).eval()
    model, _ = load_model(None, hf_dir, impl=impl, dtype=dtype)
    ours = generate(model, build_tokenizer(hf_dir), prompts, STEPS, top_k=1, max_batch_size=len(prompts), stop_id=None)
    rows = []
    for prompt, mine in zip(prompts, ours):
        ref, margins = hf_greedy(hf, prompt, device)
        first = next((i for i, (a, b) in enumerate(zip(mine, ref)) if a != b), None)
        rows.append({"prompt_len": len(prompt), "identical": mine == ref, "first_diff": first,
                     "hf_margin_at_diff": None if first is None else round(margins[first], 4),
                     "min_margin": round(min(margins), 4)})
    return {"dtype": str(dtype).replace("torch.", ""), "impl": impl, "prompts": rows,
            "identical": sum(r["identical"] for r in rows)}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    from megatron_patch.models.parallel import ensure_model_parallel

    ensure_model_parallel(1, 1)
    return trained_hf_folder(str(tmp_path_factory.mktemp("gen") / "hf"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_te_greedy_equals_hf_generate(trained, dtype):
    hf_dir, prompts, loss = trained
    result = compare_greedy(hf_dir, prompts, dtype, "transformer_engine", "cuda")
    _record(test="generate_te_greedy", train_loss=round(loss, 3), steps=STEPS, **result)
    assert len(result["prompts"]) == 5
    for r in result["prompts"]:
        assert r["identical"] or r["hf_margin_at_diff"] < MARGIN[dtype], r
