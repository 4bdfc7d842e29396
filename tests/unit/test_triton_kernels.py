"""Our decode kernels (issue 27) on a CPU through Triton's interpreter: the GEMV (`megatron_patch.inference.gemv`),
the split-KV paged decode attention (`megatron_patch.inference.decode_attention`) and the in-place RoPE
(`megatron_patch.inference.decode_rope`, also through the dynamic engine), the same source the GPU runs, against
float64 references of the same inputs."""

import pytest
import torch

from megatron_patch.inference import decode_attention, decode_rope, dynamic
from megatron_patch.inference import gemv as gemv_mod
from megatron_patch.inference.paged_attention import attend
from tests.helpers import INTERPRETED, rope_reference, rope_table, run_interpreted


def test_the_kernel_tests_under_triton_interpreter():
    run_interpreted(__file__, "gemv_ or attention_ or rope_")


@pytest.fixture
def interpreted():
    if not INTERPRETED:
        pytest.skip("run by test_the_kernel_tests_under_triton_interpreter (TRITON_INTERPRET=1)")
    return gemv_mod.gemv


def _bound(h: torch.Tensor, w: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Per output: one bf16 step of the result (Triton's interpreter converts fp32 to bf16 by truncation, the GPU
    rounds to nearest: half a step there) plus fp32 summation error, K * 2^-24 * sum|h w|."""
    k = w.shape[1]
    return ref.abs() * 2.0 ** -7 + k * 2.0 ** -24 * (h.abs() @ w.abs().T) + 1e-30


@pytest.mark.parametrize("m, n, k, block_k",
                         [(1, 40, 96, 32), (3, 17, 130, 64), (2, 64, 2048, 1024), (1, 5, 1000, 256)])
def test_gemv_equals_float64_with_bias(interpreted, m, n, k, block_k):
    g = torch.Generator().manual_seed(m * n + k)
    x = torch.randn(m, 1, k, generator=g).to(torch.bfloat16)
    w = (torch.randn(n, k, generator=g) * 0.05).to(torch.bfloat16)
    b = torch.randn(n, generator=g).to(torch.bfloat16)
    cfg = dict(BLOCK_N=4, BLOCK_K=block_k, num_warps=4, num_stages=2)
    y = interpreted(x, w, b, config=cfg)
    assert y.shape == (m, 1, n) and y.dtype == torch.bfloat16
    ref = x.double().reshape(m, k) @ w.double().T + b.double()
    assert ((y.double().reshape(m, n) - ref).abs() <= _bound(x.double().reshape(m, k), w.double(), ref)).all()


@pytest.mark.parametrize("kind, zero_centered", [("RMSNorm", False), ("RMSNorm", True), ("LayerNorm", False)])
def test_gemv_folds_the_norm_in(interpreted, kind, zero_centered):
    """The norm's statistics in fp32 in the same pass, applied to the sums at the end (the normalised input is
    never rounded to bf16): equal to float64 arithmetic of norm(x) @ W^T within one rounding of the result and
    fp32 sums over K of |w| times each term the kernel adds (|g| |x|, |g| |mean| and |beta|, scaled by rstd)."""
    m, n, k = 2, 24, 768
    g = torch.Generator().manual_seed(7)
    x = (torch.randn(m, k, generator=g) * 3 + 0.5).to(torch.bfloat16)
    w = (torch.randn(n, k, generator=g) * 0.05).to(torch.bfloat16)
    gamma = (torch.randn(k, generator=g) * 0.1 + (0 if zero_centered else 1)).to(torch.bfloat16)
    beta = torch.randn(k, generator=g).to(torch.bfloat16) if kind == "LayerNorm" else None
    eps = 1e-5
    norm = gemv_mod.Norm(kind, gamma, beta, eps, zero_centered)
    y = interpreted(x, w, None, norm)
    xf, scale = x.double(), gamma.double() + (1 if zero_centered else 0)
    mean = xf.mean(-1, keepdim=True) if kind == "LayerNorm" else torch.zeros(m, 1, dtype=torch.float64)
    rstd = torch.rsqrt((xf - mean).pow(2).mean(-1, keepdim=True) + eps)
    h = (xf - mean) * rstd * scale + (beta.double() if beta is not None else 0)
    ref = h @ w.double().T
    terms = rstd * scale.abs() * (xf.abs() + mean.abs()) + (beta.double().abs() if beta is not None else 0)
    assert ((y.double() - ref).abs() <= 2 * _bound(terms, w.double(), ref)).all()


def test_gemv_refuses_what_it_does_not_serve(interpreted):
    w = torch.zeros(8, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="features"):
        interpreted(torch.zeros(1, 15, dtype=torch.bfloat16), w)
    with pytest.raises(ValueError, match="rows"):
        interpreted(torch.zeros(gemv_mod.MAX_ROWS + 1, 16, dtype=torch.bfloat16), w)


def test_decode_gemv_needs_a_gpu(monkeypatch):
    """On a CPU the patch does not apply and engines are planned without it; the plan tells engines apart by it
    (their CUDA graphs hold its kernels)."""
    from megatron_patch import patches

    assert not patches.apply("decode_gemv") and not patches.apply("split_kv_decode_attention")
    assert not patches.apply("fused_decode_rope")
    assert dynamic.wanted(True) is False and dynamic.wanted(None) is False
    plan = dynamic.EnginePlan(1, False, 64, 64, 0.1, True, True, False, False, False)
    assert plan.covers(plan)
    assert not plan.covers(dynamic.EnginePlan(1, False, 64, 64, 0.1, True, True, False, True, False))
    assert not plan.covers(dynamic.EnginePlan(1, False, 64, 64, 0.1, True, True, False, False, True))
    assert not plan.covers(dynamic.EnginePlan(1, False, 64, 64, 0.1, True, True, False, False, False, True))


def test_decode_kernels_are_on_by_default_on_a_gpu(monkeypatch):
    """The GEMV, the split-KV attention and the RoPE kernel are the defaults where there is a GPU (one H100,
    2026-12-06, 8B at one request: 7.37 -> 6.42 ms a step with the GEMV and the attention, 8 and 32 requests within
    0.9%; docs/benchmarks.md), and off without one."""
    assert dynamic.DECODE_GEMV is None and dynamic.DECODE_ATTENTION is None and dynamic.DECODE_ROPE is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert dynamic.wanted(dynamic.DECODE_GEMV) and dynamic.wanted(dynamic.DECODE_ATTENTION)
    assert dynamic.wanted(dynamic.DECODE_ROPE) and not dynamic.wanted(False)


def test_gemv_serves_only_decode_sized_plain_calls_outside_fp8():
    """The GEMV's eligibility check: the FP8 state is looked up once (a call handed in), and a call outside what
    the kernel serves (autograd, too many tokens, FP8 autocast, TP > 1) keeps the original forward."""
    from megatron_patch import patches

    assert patches._fp8_autocast_probe()() is False  # no Transformer Engine here: never FP8
    w = torch.zeros(8, 16, dtype=torch.bfloat16)
    x = torch.zeros(1, 1, 16, dtype=torch.bfloat16)
    off, on = (lambda: False), (lambda: True)
    def on_gpu(t):  # what _gemv_serves reads of a CUDA tensor
        return type("Cuda", (), {"is_cuda": True, "dtype": t.dtype, "shape": t.shape, "numel": t.numel})()

    cuda = on_gpu(x)
    with torch.no_grad():
        assert patches._gemv_serves(cuda, w, 1, off)
        assert not patches._gemv_serves(cuda, w, 1, on) and not patches._gemv_serves(cuda, w, 2, off)
        assert not patches._gemv_serves(x, w, 1, off)  # a CPU tensor
        assert not patches._gemv_serves(on_gpu(torch.zeros(gemv_mod.SERVED_ROWS + 1, 16, dtype=x.dtype)), w, 1, off)
    assert not patches._gemv_serves(cuda, w, 1, off)  # autograd on


@pytest.mark.parametrize("requests, heads, kv_heads, dim, page, lengths, alibi", [
    (3, 8, 2, 32, 64, [1, 200, 0], False),  # a single key, several pages, a padding row
    (1, 4, 4, 64, 128, [500], False),  # one request: many splits of one tile each
    (2, 32, 8, 128, 256, [257, 1024], False),  # Llama-3-8B's heads, megatron's 256-token pages, a full table
    (3, 8, 2, 32, 64, [1, 200, 0], True),  # ALiBi (Bloom, Baichuan-13B): 8 heads' slopes
    (2, 12, 12, 64, 64, [77, 250], True),  # ALiBi with a head count that is not a power of two
])
def test_split_kv_decode_attention_equals_float64(interpreted, requests, heads, kv_heads, dim, page, lengths,
                                                  alibi):
    """Every split and the combine: equal to softmax(q k^T / sqrt(d) [+ ALiBi]) v in float64 over each request's
    pages in its block-table order, within the bf16 rounding of the probabilities before P V (as flash-attn
    rounds them: 2^-8 of max |v|) and of the output (one bf16 step under the interpreter, which truncates); a
    padding row (length 0) gives 0."""
    from megatron_patch.models.modules.alibi import alibi_slopes

    g = torch.Generator().manual_seed(sum(lengths) + heads)
    blocks = 4
    pool = requests * blocks + 3
    k = torch.randn(pool, page, kv_heads, dim, generator=g).to(torch.bfloat16)
    v = torch.randn(pool, page, kv_heads, dim, generator=g).to(torch.bfloat16)
    table = torch.stack([torch.randperm(pool, generator=g)[:blocks] for _ in range(requests)]).int()
    lens = torch.tensor(lengths, dtype=torch.int32)
    q = torch.randn(requests, heads, dim, generator=g).to(torch.bfloat16)
    scale = dim ** -0.5
    slopes = alibi_slopes(heads) if alibi else None
    y = decode_attention.decode_attention(q, k, v, table, lens, scale, slopes)
    keys, values = k[table.long()].flatten(1, 2).double(), v[table.long()].flatten(1, 2).double()
    ref = attend(q.double()[:, None], keys, values, (lens.long() - 1)[:, None], lens.long(), scale, None, None,
                 slopes)[:, 0]
    bound = 2.0 ** -8 * values.abs().amax() + 2.0 ** -7 * ref.abs() + 1e-6
    assert y.shape == q.shape and y.dtype == q.dtype
    assert ((y.double() - ref).abs() <= bound).all()
    assert torch.equal(y[lens == 0], torch.zeros_like(y[lens == 0]))


@pytest.mark.parametrize("requests, heads, rank, rope, lengths", [
    (3, 16, 64, 16, [1, 200, 0]),  # a single key, several pages, a padding row
    (1, 20, 32, 16, [130]),  # a head count that is not a multiple of the heads a program takes
    (2, 16, 512, 64, [70, 190]),  # DeepSeek's latent (512) and rotated part (64), V2-Lite's 16 heads
])
def test_mla_decode_attention_equals_float64(interpreted, requests, heads, rank, rope, lengths):
    """Multi-latent attention's absorbed decode over the paged latent cache (one shared key row a token, its first
    `rank` dims the value; pages of 64 as megatron-core's cached-latent path keeps them): equal to the torch
    attention of the engine's CPU path (`attend` over the gathered latents) in float64, within the bf16
    rounding bounds of the test above; a padding row gives 0."""
    g = torch.Generator().manual_seed(sum(lengths) + heads + rank)
    blocks, page = 4, 64
    pool = requests * blocks + 3
    latents = torch.randn(pool, page, rank + rope, generator=g).to(torch.bfloat16)
    table = torch.stack([torch.randperm(pool, generator=g)[:blocks] for _ in range(requests)]).int()
    lens = torch.tensor(lengths, dtype=torch.int32)
    q = torch.randn(requests, heads, rank + rope, generator=g).to(torch.bfloat16)
    scale = (rank + rope) ** -0.5
    assert decode_attention.mla_supports(q, latents, rank)
    y = decode_attention.mla_decode_attention(q, latents, table, lens, scale, rank)
    keys = latents[table.long()].flatten(1, 2).double()[:, :, None]
    ref = attend(q.double()[:, None], keys, keys[..., :rank], (lens.long() - 1)[:, None], lens.long(), scale, None,
                 None)[:, 0]
    bound = 2.0 ** -8 * keys[..., :rank].abs().amax() + 2.0 ** -7 * ref.abs() + 1e-6
    assert y.shape == (requests, heads, rank) and y.dtype == q.dtype
    assert ((y.double() - ref).abs() <= bound).all()
    assert torch.equal(y[lens == 0], torch.zeros_like(y[lens == 0]))


def test_mla_decode_attention_takes_deepseeks_shapes_only():
    q, latents = torch.zeros(2, 16, 576, dtype=torch.bfloat16), torch.zeros(9, 64, 576, dtype=torch.bfloat16)
    assert decode_attention.mla_supports(q, latents, 512)
    assert not decode_attention.mla_supports(q.float(), latents.float(), 512)  # fp32: the torch path
    assert not decode_attention.mla_supports(q[..., :24], latents[..., :24], 16)  # a rotated part of 8 dims
    assert not decode_attention.mla_supports(q, torch.zeros(9, 32, 576, dtype=torch.bfloat16), 512)  # pages of 32
    # a model's widths, as the engine's CUDA-graph plan asks before any tensor exists (`dynamic.graphs_refused`)
    assert decode_attention.mla_kernel_takes(torch.bfloat16, 512, 64)
    assert decode_attention.mla_kernel_takes(torch.float16, 16, 16)
    assert not decode_attention.mla_kernel_takes(torch.float32, 512, 64)
    assert not decode_attention.mla_kernel_takes(torch.bfloat16, 16, 8)
    assert not decode_attention.mla_kernel_takes(torch.bfloat16, 1024, 64)
    assert not decode_attention.mla_kernel_takes(torch.bfloat16, 384, 64)


def test_split_kv_decode_attention_splits_to_fill_the_gpu():
    """Requests x KV heads x splits reaches ~2 programs per SM, each split whole tiles, never past the table."""
    assert decode_attention.part_for(1, 8, 1280) == 64  # 20 splits of 64 (the target asks for 33)
    assert decode_attention.part_for(1, 8, 8192) == 256  # 32 splits
    assert decode_attention.part_for(64, 8, 1280) == 1280  # one split: 512 programs already
    for n, hk, length in [(1, 8, 1280), (3, 2, 256), (256, 8, 4096)]:
        part = decode_attention.part_for(n, hk, length)
        assert part % decode_attention.BLOCK_T == 0 and -(-length // part) * part < length + part


def _rope_case(n: int, heads: int, dim: int, rot: int, dtype: torch.dtype):
    """(angle table of `rot` dims for 4,096 positions, n positions, the last one 4,095, a buffer [n, heads + 3,
    dim] of `dtype` whose heads 2..2 + heads the tests rotate)."""
    g = torch.Generator().manual_seed(n * heads + dim)
    positions = torch.randint(0, 4096, (n,), generator=g)
    positions[0] = 4095
    return rope_table(rot, 4096), positions, torch.randn(n, heads + 3, dim, generator=g).to(dtype)


@pytest.mark.parametrize("n, heads, dim, rot, dtype", [
    (1, 32, 128, 128, torch.bfloat16),  # Llama-3-8B's query heads, one decode token
    (3, 5, 64, 32, torch.bfloat16),  # partial rotary: dimensions past 32 pass through
    (4, 8, 80, 80, torch.float32),  # half = 40: padded lanes masked
])
def test_rope_in_place_equals_float64(interpreted, n, heads, dim, rot, dtype):
    """`rope_` rotates a strided view in place (the heads of a larger buffer, as the query and key are views of
    the QKV output), at each token's own position of megatron-core's angle table (positions past 1,000 radians:
    precise sine and cosine), within fp32 arithmetic plus the rounding to the tensor's dtype (one step under the
    interpreter, which truncates); the buffer around the view is untouched; megatron-core's own unfused RoPE at
    those positions agrees to the same bound."""
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    freqs, positions, buf = _rope_case(n, heads, dim, rot, dtype)
    before = buf.clone()
    t = buf[:, 2:2 + heads]
    ref = rope_reference(before[:, 2:2 + heads], freqs, positions)
    assert decode_rope.rope_(t, freqs, positions) is t
    step = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -22
    bound = ref.abs() * step + before.double()[:, 2:2 + heads].abs().amax(-1, keepdim=True) * 2.0 ** -19
    assert ((buf[:, 2:2 + heads].double() - ref).abs() <= bound).all()
    assert torch.equal(buf[:, :2], before[:, :2]) and torch.equal(buf[:, 2 + heads:], before[:, 2 + heads:])
    theirs = _apply_rotary_pos_emb_bshd(before[:, 2:2 + heads, None].float(), freqs[positions], False)[:, :, 0]
    assert ((theirs.double() - ref).abs() <= bound + ref.abs() * 2.0 ** -22).all()
    four = before[:, 2:2 + heads, None].transpose(1, 2)  # [n, 1, heads, dim]: the layout the engine hands over
    assert decode_rope.serves(four, freqs) and not decode_rope.serves(four, freqs.double())
    assert not decode_rope.serves(before.transpose(1, 2), freqs)  # last dimension not contiguous


class _Ids:  # generate reads no tokenizer for token-id prompts without stop strings; the engine its size
    vocab_size, eod, pad = 512, 0, 0

    def detokenize(self, ids):
        return ""


def _generate_under_the_rope_patch(monkeypatch, model, prompts, sampling, rtol: float):
    """(tokens, calls per method): greedy generation on the dynamic engine under the `fused_decode_rope` patch,
    every call of its `apply_rotary_emb_query` / `_key` checked against the original's on a copy of the same
    inputs (within `rtol`)."""
    from megatron.core.inference.contexts.dynamic_context import DynamicInferenceContext

    from megatron_patch import patches
    from megatron_patch.inference import generate

    names = {"query": "apply_rotary_emb_query", "key": "apply_rotary_emb_key"}
    originals = {k: getattr(DynamicInferenceContext, v) for k, v in names.items()}
    calls = {"query": 0, "key": 0}
    with patches.applied("fused_decode_rope"):
        ours = {k: getattr(DynamicInferenceContext, v) for k, v in names.items()}
        assert ours["query"] is not originals["query"] and ours["key"] is not originals["key"]

        def checked(which):
            def call(self, x, *args, **kwargs):
                expected = originals[which](self, x.clone(), *args, **kwargs)
                got = ours[which](self, x, *args, **kwargs)
                assert got.shape == expected.shape
                assert torch.allclose(got, expected, rtol=rtol, atol=1e-6), (which, (got - expected).abs().max())
                calls[which] += 1
                return got
            return call

        with monkeypatch.context() as m:
            for which, name in names.items():
                m.setattr(DynamicInferenceContext, name, checked(which))
            tokens = generate(model, _Ids(), prompts, sampling, max_batch_size=3, engine="dynamic")
    assert not patches.is_active("fused_decode_rope")
    return tokens, calls


def _deinterleaved(x: torch.Tensor) -> torch.Tensor:
    """MLA's layout for RoPE: the even dimensions, then the odd ones."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], -1)


@pytest.mark.parametrize("n, heads, dim, mscale, dtype", [
    (1, 16, 64, 0.707, torch.bfloat16),  # DeepSeek-V2-Lite's 16 query heads, rope part 64, YaRN's mscale
    (3, 1, 64, 1.0, torch.bfloat16),  # keys: one shared head
    (2, 5, 16, 1.2, torch.float32),  # 5 heads: padded lanes masked
])
def test_mla_rope_equals_megatron_cores_unfused_rope(interpreted, n, heads, dim, mscale, dtype):
    """`mla_rope` gives megatron-core's unfused MLA RoPE (`_apply_rotary_pos_emb_bshd` with
    `mla_rotary_interleaved`: de-interleave, cos / sin x mscale, rotate-half) at each token's own position, within
    the roundings of its arithmetic (each of its four rounding steps one unit apart at most: the interpreter
    rounds by truncation), and float64's within the same; in place on a strided view (the buffer around it
    untouched) and out of place into `out` (t untouched)."""
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    freqs, positions, buf = _rope_case(n, heads, dim, dim, dtype)
    before = buf.clone()
    x = before[:, 2:2 + heads]
    theirs = _apply_rotary_pos_emb_bshd(x[:, None], freqs[positions], False, True,  # (MLA interleaving)
                                        mscale=mscale)[:, 0]
    ref = rope_reference(_deinterleaved(x), freqs, positions) * mscale
    unit = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -23
    bound = 8 * unit * x.double().abs().amax(-1, keepdim=True) * mscale + 1e-6
    out = torch.empty_like(x)
    assert decode_rope.mla_rope(x, freqs, positions, mscale, out=out) is out
    assert torch.equal(buf, before)  # out of place: t untouched
    t = buf[:, 2:2 + heads]
    assert decode_rope.mla_rope(t, freqs, positions, mscale) is t
    assert torch.equal(t, out)
    assert torch.equal(buf[:, :2], before[:, :2]) and torch.equal(buf[:, 2 + heads:], before[:, 2 + heads:])
    assert ((out.double() - theirs.double()).abs() <= bound).all(), (out.double() - theirs.double()).abs().max()
    assert ((out.double() - ref).abs() <= bound).all()
    assert decode_rope.mla_serves(x[:, None], freqs) and not decode_rope.mla_serves(x[..., :dim // 2], freqs)
    with pytest.raises(ValueError, match="mla_rope"):
        decode_rope.mla_rope(x, freqs, positions, mscale, out=torch.empty_like(x, dtype=torch.float64))


def test_mla_rope_through_the_dynamic_engine_equals_megatron_core(interpreted, cpu_megatron, monkeypatch):
    """The `fused_decode_rope` patch with `decode_rope.MLA_ROPE` on, in megatron-core's dynamic engine, for a tiny
    DeepSeek-V3 with YaRN (fp32, eager, prompts of different lengths, prefill and decode steps): every call the
    patch serves gives what the original gives on the same inputs (both on copies, within fp32 rounding), the
    queries' and the keys' calls all take `mla_rope`, and the greedy tokens equal the unpatched engine's; with
    `MLA_ROPE` off, no call takes it."""
    from megatron_patch import patches
    from megatron_patch.conversion.engine import hf_to_megatron, load_rank_state_dict, make_plan
    from megatron_patch.inference import Sampling, generate
    from megatron_patch.models import build_model
    from tests.models import DEEPSEEK_YARN, any_config, case_of

    c = case_of({**any_config("deepseek_v3"), "rope_scaling": DEEPSEEK_YARN})
    model = build_model(c.cfg).eval()
    load_rank_state_dict(model, hf_to_megatron(make_plan(c.cfg), c.sd.__getitem__, c.sd.keys())[(0, 0, 0)])
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 500, (length,), generator=g).tolist() for length in (3, 11, 6)]
    sampling = Sampling(5, top_k=1, stop_id=None)
    plain = generate(model, _Ids(), prompts, sampling, max_batch_size=3, engine="dynamic")
    monkeypatch.setattr(patches, "_gpu_with_triton", lambda: True)
    launches, kernel = [], decode_rope.mla_rope
    monkeypatch.setattr(decode_rope, "mla_rope",
                        lambda t, f, p, m, out=None: launches.append(t.shape) or kernel(t, f, p, m, out=out))
    for on in (True, False):
        monkeypatch.setattr(decode_rope, "MLA_ROPE", on)
        launches.clear()
        patched, calls = _generate_under_the_rope_patch(monkeypatch, model, prompts, sampling, 2.0 ** -19)
        assert patched == plain and all(len(t) == 5 for t in plain)
        assert calls["query"] == calls["key"] >= c.cfg["num_hidden_layers"] * 5, calls
        assert len(launches) == (calls["query"] + calls["key"] if on else 0), (len(launches), calls)


def test_rope_through_the_dynamic_engine_equals_megatron_core(interpreted, cpu_megatron, monkeypatch):
    """The `fused_decode_rope` patch in megatron-core's dynamic engine (a tiny fp32 GPTModel, eager, prompts of
    different lengths, prefill and decode steps): every call the patch serves gives what the original gives on
    the same inputs (both run on copies, within fp32 rounding), queries and keys are both served, and the greedy
    tokens equal the unpatched engine's."""
    from megatron_patch import patches
    from megatron_patch.inference import Sampling, generate
    from megatron_patch.models import build_model
    from tests.models import llama_config

    torch.manual_seed(0)
    model = build_model(llama_config("gqa"), impl="local", dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 500, (length,), generator=g).tolist() for length in (3, 11, 6)]
    sampling = Sampling(6, top_k=1, stop_id=None)
    plain = generate(model, _Ids(), prompts, sampling, max_batch_size=3, engine="dynamic")
    monkeypatch.setattr(patches, "_gpu_with_triton", lambda: True)
    launches = []
    kernel = decode_rope.rope_
    monkeypatch.setattr(decode_rope, "rope_", lambda t, f, p: launches.append(t.shape) or kernel(t, f, p))
    patched, calls = _generate_under_the_rope_patch(monkeypatch, model, prompts, sampling, 2.0 ** -20)
    assert patched == plain and all(len(t) == 6 for t in plain)
    layers = llama_config("gqa")["num_hidden_layers"]
    assert calls["query"] == calls["key"] >= layers * 6, calls  # every layer, prefill and 5 decode steps
    assert len(launches) == calls["query"] + calls["key"], (len(launches), calls)  # every call took the kernel
