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
from tests.helpers import rope_reference, rope_table

pytestmark = pytest.mark.skipif(not HAVE_TE, reason="needs a CUDA GPU and Transformer Engine")

STEPS = 32
MARGIN = {torch.float32: 0.05, torch.bfloat16: 0.5}


def hf_greedy(model, prompt: list[int], device: str) -> tuple[list[int], list[float]]:
    """HF's greedy tokens and, per step, the margin between its two best logits."""
    out = model.generate(torch.tensor([prompt], device=device), max_new_tokens=STEPS, min_new_tokens=STEPS,
                         do_sample=False, output_scores=True, return_dict_in_generate=True, pad_token_id=0)
    top2 = [s[0].float().topk(2).values for s in out.scores]
    return out.sequences[0, len(prompt):].tolist(), [float(v[0] - v[1]) for v in top2]


def greedy_rows(hf, prompts: list[list[int]], ours: list[list[int]], device: str) -> list[dict]:
    """Per prompt: whether our tokens are HF's greedy ones, and where not, the first differing step and HF's
    top-2 margin there (a divergence is explained only by a near-tie)."""
    rows = []
    for prompt, mine in zip(prompts, ours, strict=True):
        ref, margins = hf_greedy(hf, prompt, device)
        first = next((i for i, (a, b) in enumerate(zip(mine, ref)) if a != b), None)
        rows.append({"prompt_len": len(prompt), "identical": mine == ref, "first_diff": first,
                     "hf_margin_at_diff": None if first is None else round(margins[first], 4),
                     "min_margin": round(min(margins), 4)})
    return rows


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
    rows = greedy_rows(hf, prompts, ours, device)
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
    # the engine and its graphs are kept for the next call (RLHF rollouts call it every step): the same tokens again
    again = generate(model, tok, prompts, sampling, max_batch_size=64, cuda_graphs=True, engine="dynamic")
    off = generate(model, tok, prompts, sampling, max_batch_size=64, cuda_graphs=False, engine="dynamic")
    same = sum(a == b for a, b in zip(on, off))
    _record(test="dynamic_256_graphs_on_off", requests=len(prompts), prompt_lengths=[min(lengths), max(lengths)],
            finished=sum(len(t) == STEPS for t in on), identical=same,
            reused_engine_identical=sum(a == b for a, b in zip(on, again)))
    assert all(len(t) == STEPS for t in on) and all(len(t) == STEPS for t in off)
    assert same == len(prompts) and again == on


def _cuda_kernels(fn, *args, **kwargs) -> list[str]:
    """The names of the CUDA kernels fn(*args, **kwargs) launches (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn(*args, **kwargs)
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


@pytest.mark.smoke
def test_decode_kernels_layers_and_greedy_tokens(trained, monkeypatch):
    """Issue 27: batch-1 decode's linear layers on our Triton GEMV kernel (the `decode_gemv` patch) compute what
    cuBLAS + TE's norm compute, and our split-KV decode attention (`split_kv_decode_attention`) what float64
    does. Per layer kind (the fused-norm QKV and FC1, the projection and FC2, the output
    layer), one token in bf16: the kernel's distance to an fp64 reference of the same bf16 inputs is at most
    cuBLAS's own distance plus half a bf16 step of the output (each rounds fp32 sums once). With the norm folded
    in, ours is held to the fp64 norm and cuBLAS to the fp64 GEMM of TE's norm output rounded to bf16 (what each
    computes: TE rounds the normalised input before its GEMM, ours does not). Then greedy generation one request
    at a time (decode steps of one token: the kernels' shape) with the kernels on and off equals HF bf16's
    tokens (near-ties allowed, as above).
    That the kernels ran is checked, not assumed (the GEMV and cuBLAS can round alike): per layer the profiler
    sees `gemv_kernel` with the patch and not without; the engine calls both kernels' launchers with them on and
    neither with them off.
    The attention at Llama-3-8B's heads over megatron's 256-token pages: within the bf16 rounding of the
    probabilities (2^-8 of max |v|) and of the output of a float64 reference. The in-place RoPE kernel
    (`fused_decode_rope`, also switched on with the others) at Llama-3's 32 heads of 128 and positions to 8k: within
    half a bf16 step plus fp32 arithmetic of float64, as close as TE's fused RoPE is, and its launcher called."""
    from megatron_patch import patches
    from megatron_patch.inference import Sampling, decode_attention, decode_rope, dynamic, generate, load_model
    from megatron_patch.inference.paged_attention import attend
    from megatron_patch.tokenizer import build_tokenizer

    hf_dir, prompts, _ = trained
    model, _ = load_model(None, hf_dir, impl="transformer_engine", dtype=torch.bfloat16)
    layer = model.decoder.layers[0]
    mods = {"qkv (norm fused)": layer.self_attention.linear_qkv, "proj": layer.self_attention.linear_proj,
            "fc1 (norm fused)": layer.mlp.linear_fc1, "fc2": layer.mlp.linear_fc2, "output": model.output_layer}
    gen = torch.Generator(device="cuda").manual_seed(0)
    report = {}
    with torch.no_grad():
        tied = model.shared_embedding_or_output_weight() if model.share_embeddings_and_output_weights else None
        for name, mod in mods.items():
            weight = tied if name == "output" and tied is not None else mod.weight
            kw = {"weight": tied} if name == "output" and tied is not None else {}
            width = weight.shape[1]
            x = torch.randn(1, 1, width, device="cuda", dtype=torch.bfloat16, generator=gen)
            base = mod(x, **kw)[0].double()
            assert not any("gemv_kernel" in k for k in _cuda_kernels(mod, x, **kw)), name
            with patches.applied("decode_gemv") as active:
                assert active
                ours = mod(x, **kw)[0].double()
                assert any("gemv_kernel" in k for k in _cuda_kernels(mod, x, **kw)), name
            h = h_te = x.double()
            if hasattr(mod, "layer_norm_weight"):  # RMSNorm: TE's kernel hands the GEMM bf16, ours keeps fp32
                h = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + mod.eps)
                h = h * mod.layer_norm_weight.double()
                h_te = h.to(torch.bfloat16).double()
            ref, ref_te = h @ weight.double().T, h_te @ weight.double().T
            half_step = (ref.abs().max() * 2.0 ** -8).item()
            err_base, err_ours = (base - ref_te).abs().max().item(), (ours - ref).abs().max().item()
            report[name] = {"cublas": err_base, "gemv": err_ours, "half_bf16_step": half_step}
            assert err_ours <= err_base + half_step, (name, report[name])
    pool, page, lengths = 40, 256, [1, 300, 1100, 0]
    k = torch.randn(pool, page, 8, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn(pool, page, 8, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    table = torch.randperm(pool, device="cuda", generator=gen)[:5 * len(lengths)].view(len(lengths), 5).int()
    lens = torch.tensor(lengths, device="cuda", dtype=torch.int32)
    q = torch.randn(len(lengths), 32, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    y = decode_attention.decode_attention(q, k, v, table, lens, 128 ** -0.5).double()
    keys, values = k[table.long()].flatten(1, 2).double(), v[table.long()].flatten(1, 2).double()
    ref = attend(q.double()[:, None], keys, values, (lens.long() - 1)[:, None], lens.long(), 128 ** -0.5, None,
                 None)[:, 0]
    report["attention"] = {"max_abs_diff": (y - ref).abs().max().item()}
    assert ((y - ref).abs() <= 2.0 ** -8 * values.abs().amax() + 2.0 ** -8 * ref.abs() + 1e-6).all()
    assert not y[3].any()
    # with ALiBi slopes (the `alibi_paged_attention` patch's decode path: Bloom, Baichuan-13B)
    from megatron_patch.models.modules.alibi import alibi_slopes

    slopes = alibi_slopes(32).cuda()
    y = decode_attention.decode_attention(q, k, v, table, lens, 128 ** -0.5, slopes).double()
    ref = attend(q.double()[:, None], keys, values, (lens.long() - 1)[:, None], lens.long(), 128 ** -0.5, None,
                 None, slopes)[:, 0]
    report["attention_alibi"] = {"max_abs_diff": (y - ref).abs().max().item()}
    assert ((y - ref).abs() <= 2.0 ** -8 * values.abs().amax() + 2.0 ** -8 * ref.abs() + 1e-6).all()
    freqs = rope_table(128, 8192, "cuda")
    positions = torch.tensor([0, 7, 1000, 8191], device="cuda")
    x = torch.randn(4, 1, 32, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    ref = rope_reference(x, freqs, positions)
    bound = ref.abs() * 2.0 ** -8 + x.double().abs().amax(-1, keepdim=True) * 2.0 ** -19
    ours = decode_rope.rope_(x.clone(), freqs, positions).double()
    report["rope"] = {"max_abs_diff": (ours - ref).abs().max().item()}
    assert ((ours - ref).abs() <= bound).all(), report["rope"]
    if HAVE_TE and model.config.apply_rope_fusion:
        from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb

        te = apply_rotary_pos_emb(x, freqs[positions], model.config).double()  # TE's fused kernel on a GPU
        report["rope"]["te_max_abs_diff"] = (te - ref).abs().max().item()
        assert ((te - ref).abs() <= bound).all(), report["rope"]
    tok = build_tokenizer(hf_dir)
    sampling = Sampling(STEPS, top_k=1, stop_id=None)
    from megatron_patch.inference import gemv as gemv_module

    launches = {"gemv": 0, "attention": 0, "rope": 0}

    def counted(name, fn):
        def call(*args, **kwargs):
            launches[name] += 1
            return fn(*args, **kwargs)
        return call

    monkeypatch.setattr(gemv_module, "gemv", counted("gemv", gemv_module.gemv))
    monkeypatch.setattr(decode_attention, "decode_attention", counted("attention", decode_attention.decode_attention))
    monkeypatch.setattr(decode_rope, "rope_", counted("rope", decode_rope.rope_))
    seen, defaults, calls = {}, (dynamic.DECODE_GEMV, dynamic.DECODE_ATTENTION, dynamic.DECODE_ROPE), {}
    for on in (False, True):
        dynamic.DECODE_GEMV = dynamic.DECODE_ATTENTION = dynamic.DECODE_ROPE = on
        launches.update(gemv=0, attention=0, rope=0)
        try:
            seen[on] = [generate(model, tok, [p], sampling, max_batch_size=1, engine="dynamic")[0] for p in prompts]
        finally:
            dynamic.DECODE_GEMV, dynamic.DECODE_ATTENTION, dynamic.DECODE_ROPE = defaults
        calls[on] = dict(launches)
    assert calls[False] == {"gemv": 0, "attention": 0, "rope": 0} and all(calls[True].values()), calls
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.bfloat16).to("cuda").eval()
    diffs = []
    for i, prompt in enumerate(prompts):
        ref, margins = hf_greedy(hf, prompt, "cuda")
        for on in (False, True):
            first = next((j for j, (a, b) in enumerate(zip(seen[on][i], ref)) if a != b), None)
            diffs.append({"prompt": i, "kernels": on, "first_diff": first,
                          "hf_margin_at_diff": None if first is None else round(margins[first], 4)})
    same = sum(a == b for a, b in zip(seen[True], seen[False]))
    _record(test="decode_kernels", layers=report, identical_on_off=same, prompts=len(prompts), vs_hf=diffs,
            launcher_calls=calls)
    for d in diffs:
        assert d["first_diff"] is None or d["hf_margin_at_diff"] < MARGIN[torch.bfloat16], d


# mixed prompt lengths for the tiny random models below: short, one longer than a 64-token page, the shortest, middle
MIXED_PROMPTS = [[5, 6, 7], list(range(20, 120)), [30, 31], list(range(200, 230))]


def _tiny_te_model(cfg: dict, folder: str):
    """A tiny random HF model of `cfg` saved to `folder` and loaded as ours on Transformer Engine in bf16, at
    TP = PP = 1: (our model, the HF model in bf16 on the GPU)."""
    from megatron_patch.inference import load_model
    from megatron_patch.runtime.parallel import ensure_model_parallel
    from tests.models import case_of, save_case

    ensure_model_parallel(1, 1)
    torch.manual_seed(0)
    c = case_of(cfg)
    model, _ = load_model(None, save_case(c, folder), impl="transformer_engine", dtype=torch.bfloat16)
    return model, c.ref.to("cuda", torch.bfloat16).eval()


@pytest.mark.smoke
def test_alibi_on_the_dynamic_engine_equals_hf(tmp_path):
    """ALiBi on the dynamic engine on the GPU (the `alibi_paged_attention` patch: prompts in torch, decode steps on
    the split-KV Triton kernel with the slopes, CUDA graphs of decode-only steps): a small Bloom (random weights,
    8 heads of 32, Transformer Engine, bf16) generates HF bf16's greedy tokens (near-ties allowed, as above), with
    CUDA graphs the same tokens as without (also in a second call on the kept engine, whose graphs are replayed
    as captured in the first), and `auto` picks the dynamic engine for it."""
    from megatron_patch.inference import Sampling, choose_engine, generate
    from megatron_patch.tokenizer import TINY_TOKENIZER, build_tokenizer
    from tests.models import any_config

    cfg = {**any_config("bloom"), "hidden_size": 256}  # 8 heads of 32: a head dim the split-KV kernel takes
    model, hf = _tiny_te_model(cfg, str(tmp_path / "bloom"))
    assert choose_engine(model) == "dynamic"
    prompts = MIXED_PROMPTS
    sampling, tok = Sampling(STEPS, top_k=1, stop_id=None), build_tokenizer(TINY_TOKENIZER)
    on = generate(model, tok, prompts, sampling, cuda_graphs=True, engine="dynamic")
    again = generate(model, tok, prompts, sampling, cuda_graphs=True, engine="dynamic")  # the kept engine's graphs
    off = generate(model, tok, prompts, sampling, cuda_graphs=False, engine="dynamic")
    rows = greedy_rows(hf, prompts, on, "cuda")
    _record(test="alibi_dynamic_engine", prompts=rows, graphs_on_equals_off=on == off,
            reused_engine_equal=again == on)
    assert on == off and again == on
    for r in rows:
        assert r["identical"] or r["hf_margin_at_diff"] < MARGIN[torch.bfloat16], r


def _dense_mla(tmp_path, monkeypatch):
    """A small dense DeepSeek-V3 (random weights, Transformer Engine, bf16; a latent of 64 and a rotated part of 16,
    shapes the Triton decode kernel takes, DeepSeek's are 512 and 64; no MoE layer, which would keep the graphs off)
    on the dynamic engine (`auto`'s choice on a GPU since 2026-12-05, `dynamic.MLA_ON_GPU`): (model, HF bf16
    reference, prompts, a list that counts the calls of the Triton decode kernel)."""
    from megatron_patch.inference import choose_engine, decode_attention
    from tests.models import any_config

    cfg = {**any_config("deepseek_v3"), "kv_lora_rank": 64, "qk_rope_head_dim": 16}
    cfg["first_k_dense_replace"] = cfg["num_hidden_layers"]
    kernel_calls, kernel = [], decode_attention.mla_decode_attention
    monkeypatch.setattr(decode_attention, "mla_decode_attention",
                        lambda *args, **kwargs: kernel_calls.append(1) or kernel(*args, **kwargs))
    model, hf = _tiny_te_model(cfg, str(tmp_path / "deepseek"))
    assert choose_engine(model) == "dynamic"
    return model, hf, MIXED_PROMPTS, kernel_calls


def _generate_timed(model, prompts, **kwargs) -> tuple[float, list[list[int]]]:
    """(seconds, tokens) of greedy generation after a warm-up call (graph capture, compilation)."""
    import time

    from megatron_patch.inference import Sampling, generate
    from megatron_patch.tokenizer import TINY_TOKENIZER, build_tokenizer

    sampling, tok = Sampling(STEPS, top_k=1, stop_id=None), build_tokenizer(TINY_TOKENIZER)
    generate(model, tok, prompts, sampling, **kwargs)
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = generate(model, tok, prompts, sampling, **kwargs)
    torch.cuda.synchronize()
    return round(time.perf_counter() - start, 3), out


@pytest.mark.smoke
def test_mla_on_the_dynamic_engine_equals_hf(tmp_path, monkeypatch):
    """Multi-latent attention on the dynamic engine on the GPU (the `mla_latent_cache` patch with Transformer Engine's
    fused kv norm + linear: latents in pages of 64 tokens, prefill over them up-projected in torch, decode absorbed
    on the Triton kernel `mla_decode_attention`; eagerly here, its CUDA graphs (planned by default,
    `dynamic.MLA_GRAPHS`) in the next test): a small dense DeepSeek-V3 generates HF bf16's greedy tokens (near-ties
    allowed, as above). Recorded, not asserted: whether the torch decode (`paged_attention.mla_decode`) and the
    static engine give the same tokens (other kernels: near-ties may go the other way), and the seconds of each."""
    from megatron_patch.inference import decode_attention, dynamic

    model, hf, prompts, kernel_calls = _dense_mla(tmp_path, monkeypatch)
    assert dynamic.plan_engine(model, prompts, STEPS).cuda_graphs
    seconds, kernel_out = _generate_timed(model, prompts, engine="dynamic", cuda_graphs=False)
    assert kernel_calls
    with monkeypatch.context() as m:
        m.setattr(decode_attention, "mla_supports", lambda *args: False)
        torch_seconds, torch_out = _generate_timed(model, prompts, engine="dynamic", cuda_graphs=False)
    static_seconds, static_out = _generate_timed(model, prompts, engine="static")
    rows = greedy_rows(hf, prompts, kernel_out, "cuda")
    _record(test="mla_dynamic_engine", prompts=rows, torch_decode_rows=greedy_rows(hf, prompts, torch_out, "cuda"),
            kernel_equals_torch_decode=kernel_out == torch_out, equals_static=kernel_out == static_out,
            seconds={"dynamic": seconds, "dynamic_torch_decode": torch_seconds, "static": static_seconds})
    for r in rows:
        assert r["identical"] or r["hf_margin_at_diff"] < MARGIN[torch.bfloat16], r
    dynamic.release_engine()


@pytest.mark.smoke
def test_mla_rope_kernel_equals_megatron_core(tmp_path, monkeypatch):
    """`decode_rope.mla_rope` (the `fused_decode_rope` patch's MLA branch, `decode_rope.MLA_ROPE`, on since this
    passed on the H200 on 2026-12-05) against megatron-core's unfused MLA RoPE on the GPU at DeepSeek-V2-Lite's
    widths (16 query heads and the shared key head, rope part 64, YaRN's mscale 0.707, positions to 8k, bf16): the
    same arithmetic, so every element within the four bf16 roundings of megatron-core's steps (2^-6 of the row's
    largest magnitude; recorded: the share bitwise equal); then the dense DeepSeek-V3 above under CUDA graphs with
    it generates HF bf16's greedy tokens (near-ties allowed), recorded against the tokens without it and timed."""
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    from megatron_patch.inference import decode_rope, dynamic

    g = torch.Generator(device="cuda").manual_seed(0)
    freqs = rope_table(64, 8192, "cuda")
    rows = {}
    for heads in (16, 1):
        x = torch.randn(256, 1, heads, 64, device="cuda", generator=g).to(torch.bfloat16)
        positions = torch.randint(0, 8192, (256,), device="cuda", generator=g)
        theirs = _apply_rotary_pos_emb_bshd(x, freqs[positions], False, True, mscale=0.707)  # (MLA interleaving)
        ours = decode_rope.mla_rope(x.clone(), freqs, positions, 0.707)
        diff = (ours.float() - theirs.float()).abs()
        rows[heads] = {"bitwise_equal_share": (ours == theirs).float().mean().item(), "max_diff": diff.max().item()}
        # megatron-core rounds to bf16 after each of its steps (x*cos, rotate(x)*sin, their sum, the mscale product),
        # each within half a unit (2^-9 relative) of an intermediate no larger than sqrt(2) x the row's largest
        # magnitude; our kernel rounds once: 4 x 2^-9 x sqrt(2) < 2^-6 (H200, 2026-12-05: 25% of elements one unit
        # apart, 0.0156 at magnitudes in [2, 4), over the 2^-7 x 0.707 bound this test first had)
        assert (diff <= 2.0 ** -6 * x.float().abs().amax(-1, keepdim=True)).all(), rows
    model, hf, prompts, _ = _dense_mla(tmp_path, monkeypatch)
    assert decode_rope.MLA_ROPE  # (on by default)
    seconds_on, on = _generate_timed(model, prompts, engine="dynamic")
    dynamic.release_engine()
    monkeypatch.setattr(decode_rope, "MLA_ROPE", False)
    seconds_off, off = _generate_timed(model, prompts, engine="dynamic")
    dynamic.release_engine()
    greedy = greedy_rows(hf, prompts, on, "cuda")
    _record(test="mla_rope_kernel", kernel=rows, prompts=greedy, equals_without=on == off,
            seconds={"with": seconds_on, "without": seconds_off})
    for r in greedy:
        assert r["identical"] or r["hf_margin_at_diff"] < MARGIN[torch.bfloat16], r


@pytest.mark.smoke
def test_mla_cuda_graphs_equal_eager(tmp_path, monkeypatch):
    """The dense DeepSeek-V3 above with CUDA graphs of decode-only steps (`dynamic.MLA_GRAPHS`, on by default since
    this test passed on the H200 on 2026-12-05) generates the same tokens as without them, in the kept engine's
    second call as in a fresh engine's first. On the H200 (2026-12-04) the second call's did not, from its first
    decode step on: MLA layers read their rotary table inside the graphed block from megatron-core's lru_cache,
    which `generate` clears after each call, so the graphs read freed memory; the tables now live with the engine
    (`dynamic._kept_rotary_table`). Also with megatron-core's local layers instead of TE's (its own kv norm; TE's
    fused norm + linear is split by `mla_latent_cache`), and with the torch decode instead of the Triton kernel,
    each against its own eager tokens (on 2026-12-05 the torch decode's graphs were compared with the Triton
    kernel's eager tokens, other kernels whose near-ties, HF margins of 0.0 here, may go the other way; the engine
    refuses graphs of the torch decode until this case passes: `dynamic.graphs_refused`). Recorded: megatron-core's
    rotary cache after the calls, the rows against HF."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from megatron_patch.inference import Sampling, decode_attention, dynamic, generate, load_model
    from megatron_patch.tokenizer import TINY_TOKENIZER, build_tokenizer

    model, hf, prompts, _ = _dense_mla(tmp_path, monkeypatch)
    assert dynamic.MLA_GRAPHS
    _, eager = _generate_timed(model, prompts, engine="dynamic", cuda_graphs=False)
    dynamic.release_engine()
    first = generate(model, build_tokenizer(TINY_TOKENIZER), prompts, Sampling(STEPS, top_k=1, stop_id=None),
                     engine="dynamic", cuda_graphs=True)
    _, graphs = _generate_timed(model, prompts, engine="dynamic", cuda_graphs=True)  # the kept engine's graphs
    equal = {"graphs_first_call_equal_eager": first == eager, "graphs_equal_eager": graphs == eager,
             "rope_cache": RotaryEmbedding.forward.cache_info()._asdict()}
    dynamic.release_engine()
    with monkeypatch.context() as m:
        m.setattr(decode_attention, "mla_supports", lambda *args: False)
        torch_eager = _generate_timed(model, prompts, engine="dynamic", cuda_graphs=False)[1]
        dynamic.release_engine()
        equal["graphs_torch_decode_equal_eager"] = _generate_timed(model, prompts, engine="dynamic",
                                                                   cuda_graphs=True)[1] == torch_eager
    dynamic.release_engine()
    local, _ = load_model(None, str(tmp_path / "deepseek"), impl="local", dtype=torch.bfloat16)
    local_eager = _generate_timed(local.eval(), prompts, engine="dynamic", cuda_graphs=False)[1]
    dynamic.release_engine()
    equal["local_graphs_equal_eager"] = _generate_timed(local, prompts, engine="dynamic",
                                                        cuda_graphs=True)[1] == local_eager
    dynamic.release_engine()
    _record(test="mla_cuda_graphs", prompts=greedy_rows(hf, prompts, graphs, "cuda"),
            eager_rows=greedy_rows(hf, prompts, eager, "cuda"), local_eager_equal_te_eager=local_eager == eager,
            **equal)
    assert all(v for k, v in equal.items() if k != "rope_cache"), equal


@pytest.mark.smoke
@pytest.mark.parametrize("dispatch", ["padded", "dropless"])
def test_mla_and_moe_cuda_graphs_equal_eager(tmp_path, monkeypatch, dispatch):
    """DeepSeek-V3 as DeepSeek's models are (multi-latent attention and MoE layers) with CUDA graphs of decode steps
    (`dynamic.MLA_GRAPHS`; the MoE layers padded to capacity or dropless, as Mixtral's): the kept
    engine's second call generates the tokens of eager decoding, and HF bf16's (near-ties allowed, as above);
    the seconds of both recorded."""
    from megatron_patch.inference import dynamic
    from tests.models import any_config

    monkeypatch.setattr(dynamic, "MOE_DROPLESS", dispatch == "dropless")
    monkeypatch.setattr(dynamic, "DROPLESS_COST", 0.0)
    cfg = {**any_config("deepseek_v3"), "kv_lora_rank": 64, "qk_rope_head_dim": 16}
    model, hf = _tiny_te_model(cfg, str(tmp_path / "deepseek"))
    prompts = MIXED_PROMPTS
    plan = dynamic.plan_engine(model, prompts, STEPS)
    assert plan.cuda_graphs and plan.moe_dropless == (dispatch == "dropless")
    eager_s, eager = _generate_timed(model, prompts, engine="dynamic", cuda_graphs=False)
    dynamic.release_engine()
    seconds, graphs = _generate_timed(model, prompts, engine="dynamic", cuda_graphs=True)
    rows = greedy_rows(hf, prompts, graphs, "cuda")
    _record(test="mla_moe_cuda_graphs", variant=dispatch, prompts=rows, graphs_equal_eager=graphs == eager,
            seconds=seconds, seconds_eager=eager_s)
    dynamic.release_engine()
    assert graphs == eager
    for r in rows:
        assert r["identical"] or r["hf_margin_at_diff"] < MARGIN[torch.bfloat16], r


@pytest.mark.smoke
@pytest.mark.parametrize("variant", ["mixtral", "deepseek_v3"])
def test_moe_router_fusion_equals_the_unfused_router(tmp_path, monkeypatch, variant):
    """MoE routers on Transformer Engine's fused top-k (`dynamic.MOE_ROUTER_FUSION`, on since this passed on the H200
    on 2026-12-05; Mixtral's softmax top-2, DeepSeek-V3's sigmoid with group limits and expert bias) under the
    default plan (CUDA graphs, dropless or padded as the engine picks): HF bf16's greedy tokens (near-ties allowed);
    recorded against the tokens of the unfused router, and the seconds of both."""
    from megatron_patch.inference import dynamic
    from tests.models import any_config

    cfg = any_config(variant)
    cfg = ({**cfg, "hidden_size": 512, "head_dim": 64} if variant == "mixtral"
           else {**cfg, "kv_lora_rank": 64, "qk_rope_head_dim": 16})
    model, hf = _tiny_te_model(cfg, str(tmp_path / variant))
    prompts = MIXED_PROMPTS
    assert dynamic.router_fusion_available()
    assert dynamic.MOE_ROUTER_FUSION  # (on by default)
    plan = dynamic.plan_engine(model, prompts, STEPS)
    assert plan.moe_router_fusion and plan.cuda_graphs
    seconds_on, on = _generate_timed(model, prompts, engine="dynamic")
    dynamic.release_engine()
    assert not model.config.moe_router_fusion
    monkeypatch.setattr(dynamic, "MOE_ROUTER_FUSION", False)
    seconds_off, off = _generate_timed(model, prompts, engine="dynamic")
    dynamic.release_engine()
    rows = greedy_rows(hf, prompts, on, "cuda")
    _record(test="moe_router_fusion", variant=variant, prompts=rows, equals_unfused=on == off,
            seconds={"fused": seconds_on, "unfused": seconds_off})
    for r in rows:
        assert r["identical"] or r["hf_margin_at_diff"] < MARGIN[torch.bfloat16], r


@pytest.mark.smoke
@pytest.mark.parametrize("variant, dispatch", [("mixtral", "padded"), ("mixtral", "dropless"),
                                               ("deepseek_v3", "own"), ("deepseek_v3", "dropless")])
def test_moe_on_the_dynamic_engine_equals_hf(tmp_path, monkeypatch, variant, dispatch):
    """MoE models on the dynamic engine on the GPU. megatron-core's all-gather token dispatcher reads the tokens per
    expert on the host, which broke CUDA graph capture (2026-12-04, `Cannot copy between CPU and CUDA tensors during
    CUDA graph capture`). A small Mixtral with CUDA graphs (`dynamic.MOE_GRAPHS` on for the test): its MoE layers
    captured on the all-to-all dispatcher padded to capacity (`padded`, `dynamic.moe_graph_dispatch`) or dropless
    (`dropless`, `dynamic.MOE_DROPLESS`: grouped GEMMs at device-side offsets, `inference/moe_dropless.py`; graphs
    of prefill steps too), its tokens also compared with eager decoding's and timed against them; a DeepSeek-V3
    with MoE layers (multi-latent attention, with its graphs since 2026-12-05: `dynamic.MLA_GRAPHS`) on
    megatron-core's own dispatcher (padded under graphs) or dropless likewise (TE, bf16, random weights): each
    generates HF bf16's greedy tokens on the dynamic engine (near-ties allowed, as above)."""
    from megatron_patch.inference import dynamic
    from tests.models import any_config

    monkeypatch.setattr(dynamic, "MOE_GRAPHS", True)
    monkeypatch.setattr(dynamic, "MOE_DROPLESS", dispatch == "dropless")
    monkeypatch.setattr(dynamic, "DROPLESS_COST", 0.0)  # dropless at this test's request count (dropless_pays)
    cfg = any_config(variant)
    if variant == "mixtral":  # heads of 64: FA4's paged prefill refuses head dims it has no tiles for (the tiny 8)
        cfg = {**cfg, "hidden_size": 512, "head_dim": 64}
    if variant == "deepseek_v3":
        cfg = {**cfg, "kv_lora_rank": 64, "qk_rope_head_dim": 16}
    model, hf = _tiny_te_model(cfg, str(tmp_path / variant))
    prompts = MIXED_PROMPTS
    plan = dynamic.plan_engine(model, prompts, STEPS)
    assert plan.cuda_graphs and plan.moe_dropless == (dispatch == "dropless")
    seconds, out = _generate_timed(model, prompts, engine="dynamic")
    rows = greedy_rows(hf, prompts, out, "cuda")
    extra = {"seconds": round(seconds, 3)}
    if plan.cuda_graphs:
        eager_s, eager = _generate_timed(model, prompts, engine="dynamic", cuda_graphs=False)
        extra.update(graphs_equal_eager=eager == out, non_decode_graphs=plan.non_decode_graphs,
                     seconds_eager=round(eager_s, 3))
    _record(test="moe_dynamic_engine", variant=f"{variant}-{dispatch}", cuda_graphs=plan.cuda_graphs, prompts=rows,
            **extra)
    for r in rows:
        assert r["identical"] or r["hf_margin_at_diff"] < MARGIN[torch.bfloat16], r
    dynamic.release_engine()
