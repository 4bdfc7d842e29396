"""Mixture-of-experts families (Mixtral, Qwen2-MoE, Qwen3-MoE): the router picks the same experts as
transformers, conversion at TP x PP x EP is bitwise both ways (local and TE grouped-GEMM naming), each EP
rank holds its experts numbered from 0, the legacy format's per-EP-rank folders round-trip through the
CLI, and bad layouts are refused. (EP=2 logits = EP=1 = HF: tests/distributed/test_layouts.py.)"""

import os

import pytest
import torch

from megatron_patch.conversion.engine import hf_to_megatron, load_rank_state_dict, make_plan, megatron_to_hf
from megatron_patch.conversion.hf_io import read_all
from megatron_patch.convert import main
from megatron_patch.models import Layout, build_model
from tests.models import case, save_case

MOE = ["mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3"]


@pytest.mark.parametrize("variant", MOE[:3])
def test_router_picks_the_same_experts_as_transformers(cpu_megatron, variant):
    from megatron_patch.conversion.verify import fixed_prompts
    from megatron_patch.runtime.logits import megatron_logits

    c = case(variant)
    model = build_model(c.cfg).eval()
    load_rank_state_dict(model, hf_to_megatron(make_plan(c.cfg), c.sd.__getitem__, c.sd.keys())[(0, 0, 0)])
    ours = {}

    def keep(layer):
        def hook(module, args, out):
            ours[layer] = out[1].float()  # routing map [tokens, experts]: True where an expert is chosen
        return hook

    for i, layer in enumerate(model.decoder.layers):
        if hasattr(layer.mlp, "router"):
            layer.mlp.router.register_forward_hook(keep(i))
    ids = fixed_prompts(c.vocab_size, batch=2, seq=24)
    megatron_logits(model, ids, c.vocab_size)
    with torch.no_grad():
        ref = c.ref(ids, output_router_logits=True)
    theirs = {}
    sparse = sorted(ours)
    assert sparse and len(ref.router_logits) >= len(sparse)
    for i, logits in zip(sparse, [r for r in ref.router_logits if r is not None][-len(sparse):]):
        k = c.cfg["num_experts_per_tok"]
        top = logits.float().view(-1, logits.shape[-1]).topk(k, dim=-1).indices
        theirs[i] = torch.zeros_like(ours[i]).scatter_(1, top, 1.0)
    # megatron routes [s, b] tokens, HF [b, s]
    for i in sparse:
        b, s = ids.shape
        mine = ours[i].view(s, b, -1).transpose(0, 1).reshape(b * s, -1)
        assert torch.equal(mine, theirs[i]), f"{variant} layer {i}: different experts chosen"


@pytest.mark.parametrize("variant", ["mixtral", "deepseek_v3"])
def test_exact_routing_is_fp64_in_every_router_and_keeps_parity(cpu_megatron, variant):
    """`verify` routes MoE models in fp64 (megatron-core's fp32 router GEMM goes through TE's TF32 on a
    GPU); every router sees it, and the logits still equal transformers'."""
    from megatron_patch.conversion.verify import compare, exact_routing, fixed_prompts
    from megatron_patch.runtime.logits import megatron_logits

    c = case(variant)
    model = build_model(c.cfg).eval()
    load_rank_state_dict(model, hf_to_megatron(make_plan(c.cfg), c.sd.__getitem__, c.sd.keys())[(0, 0, 0)])
    exact_routing(model)
    routers = [layer.mlp.router for layer in model.decoder.layers if hasattr(layer.mlp, "router")]
    assert routers and all(r.config.moe_router_dtype == "fp64" for r in routers)
    probs = []
    routers[0].register_forward_hook(lambda m, a, out: probs.append(out[0].dtype) and None)
    ids = fixed_prompts(c.vocab_size, batch=2, seq=24)
    ours = megatron_logits(model, ids, c.vocab_size)
    assert probs == [torch.float64]
    with torch.no_grad():
        ref = c.ref(ids).logits
    assert compare(ref, ours)["max_abs_logit_diff"] <= 1e-5


@pytest.mark.parametrize("variant", MOE)
def test_torch_dist_keys_are_transformer_engines(cpu_megatron, variant):
    """A torch_dist checkpoint holds the same keys whichever implementation wrote it: the local
    model's sharded keys equal Transformer Engine's (its state-dict names, checked against real TE
    models on the GPU, with the grouped experts' weight{j} stacked as megatron-core stores them)."""
    import re

    c = case(variant)
    ours = {sh.key for name, sh in build_model(c.cfg).sharded_state_dict().items() if not name.endswith("_extra_state")}
    te = {re.sub(r"mlp\.experts\.linear_fc(\d)\.weight\d+$", r"mlp.experts.experts.linear_fc\1.weight", n)
          for n in make_plan(c.cfg, Layout(), "transformer_engine").megatron_names(0)}
    assert ours == te, (sorted(ours - te)[:6], sorted(te - ours)[:6])


@pytest.mark.parametrize("variant", ["mixtral", "deepseek_v3", "qwen3"])
def test_torch_dist_for_transformer_engine_holds_its_extra_states(cpu_megatron, tmp_path, variant):
    """megatron-core loads every `_extra_state` object a TE model asks for (found on the GPU: a TE
    checkpoint without the final norm's failed to load), so a checkpoint converted for TE holds one for
    each TE module, per layer (MoE) or stacked over layers (dense, e.g. Qwen3's q/k norms)."""
    import re

    from torch.distributed.checkpoint import FileSystemReader

    from megatron_patch.conversion.engine import extra_state_names
    from megatron_patch.conversion.mcore_io import checkpoint_step_dir

    c = case(variant)
    hf, out = save_case(c, str(tmp_path / "hf")), str(tmp_path / "mc")
    assert main(["hf-to-mcore", "--hf-dir", hf, "--out", out, "--impl", "transformer_engine"]) == 0
    metadata = FileSystemReader(checkpoint_step_dir(out)).read_metadata()
    stored = {k.split("/shard_")[0] for k in metadata.state_dict_metadata}
    names = extra_state_names(make_plan(c.cfg, Layout(), "transformer_engine"), 0)
    keys = names if variant in MOE else {re.sub(r"^decoder\.layers\.\d+\.", "decoder.layers.", n) for n in names}
    assert keys <= stored, sorted(keys - stored)[:6]
    assert "decoder.final_layernorm._extra_state" in stored


@pytest.mark.parametrize("variant", ["mixtral", "deepseek_v3"])
def test_converter_cli_converts_and_verifies_in_a_plain_process(tmp_path, variant):
    """The CLI as a user runs it on a CPU machine: fresh processes, none of the test harness's CUDA
    redirects (multi-latent attention asks for a CUDA device at construction; MoE checkpoints store
    per-layer keys): torch_dist conversion, `verify` against transformers, and back to HF bitwise."""
    import json
    import subprocess
    import sys

    hf, out = save_case(case(variant), str(tmp_path / "hf")), str(tmp_path / "mc")

    def cli(*args):
        p = subprocess.run([sys.executable, "-m", "megatron_patch.convert", *args], capture_output=True,
                           text=True, timeout=300)
        assert p.returncode == 0, p.stderr[-3000:]
        return p.stdout

    cli("hf-to-mcore", "--hf-dir", hf, "--out", out)
    result = json.loads(cli("verify", "--hf-dir", hf, "--mcore-dir", out).strip().splitlines()[-1])
    assert result["ok"] and result["max_abs_logit_diff"] <= 1e-5 and result["top1_agreement"] == 1.0
    cli("mcore-to-hf", "--mcore-dir", out, "--out", str(tmp_path / "back"))
    theirs, back = read_all(hf), read_all(str(tmp_path / "back"))
    assert back.keys() == theirs.keys() and all(torch.equal(back[k], theirs[k]) for k in theirs)


@pytest.mark.parametrize("impl", ["local", "transformer_engine"])
@pytest.mark.parametrize("tp,pp,ep", [(1, 1, 2), (2, 1, 2), (1, 2, 2), (2, 2, 2), (1, 1, 4)])
@pytest.mark.parametrize("variant", MOE)
def test_round_trip_with_expert_parallel_bitwise(variant, tp, pp, ep, impl):
    c = case(variant)
    plan = make_plan(c.cfg, Layout(tp, pp, ep=ep), impl)
    ranks = hf_to_megatron(plan, c.sd.__getitem__, c.sd.keys())
    assert set(ranks) == {(t, p, e) for t in range(tp) for p in range(pp) for e in range(ep)}
    back = megatron_to_hf(plan, ranks)
    tied = {k for k in c.sd if plan.is_dropped(k)}
    assert set(back) == set(c.sd) - tied
    assert all(torch.equal(back[k], c.sd[k]) for k in back)


def test_expert_parallel_ranks_hold_their_experts_numbered_from_zero():
    c = case("mixtral")  # 4 experts: EP rank 1 of 2 holds experts 2 and 3 as local 0 and 1
    for impl, name in (("local", "decoder.layers.0.mlp.experts.local_experts.{j}.linear_fc2.weight"),
                       ("transformer_engine", "decoder.layers.0.mlp.experts.linear_fc2.weight{j}")):
        ranks = hf_to_megatron(make_plan(c.cfg, Layout(ep=2), impl), c.sd.__getitem__, c.sd.keys())
        for ep, (first, second) in enumerate(((0, 1), (2, 3))):
            sd = ranks[(0, 0, ep)]
            assert {k for k in sd if "experts" in k and "fc2" in k and k.startswith("decoder.layers.0.")} == {
                name.format(j=0), name.format(j=1)}
            for local, glob in ((0, first), (1, second)):
                hf = c.sd[f"model.layers.0.block_sparse_moe.experts.{glob}.w2.weight"]
                assert torch.equal(sd[name.format(j=local)], hf)
            # everything that is not an expert is the same on every EP rank
            router = "decoder.layers.0.mlp.router.weight"
            assert torch.equal(sd[router], ranks[(0, 0, 0)][router])


@pytest.mark.parametrize("variant,tp,pp,ep", [("mixtral", 1, 1, 2), ("qwen2_moe", 2, 2, 2), ("qwen3_moe", 1, 2, 2)])
def test_legacy_checkpoint_per_expert_rank_round_trip(cpu_megatron, tmp_path, variant, tp, pp, ep):
    c = case(variant)
    hf_dir = save_case(c, str(tmp_path / "hf"))
    mc = str(tmp_path / "mc")
    assert main(["hf-to-mcore", "--hf-dir", hf_dir, "--out", mc, "--format", "legacy", "--tp", str(tp), "--pp", str(pp),
                 "--ep", str(ep)]) == 0
    folders = sorted(d for d in os.listdir(os.path.join(mc, "release")) if d.startswith("mp_rank_"))
    assert len(folders) == tp * pp * ep and folders[-1].endswith(f"_{ep - 1:03d}")
    # to another layout (EP=1, TE naming) and back to HF: bitwise
    mc2 = str(tmp_path / "mc2")
    assert main(["mcore-to-mcore", "--mcore-dir", mc, "--out", mc2, "--ep", "1", "--tp", "1", "--pp", "1",
                 "--impl", "transformer_engine"]) == 0
    back = str(tmp_path / "back")
    assert main(["mcore-to-hf", "--mcore-dir", mc2, "--out", back]) == 0
    a, b = read_all(hf_dir), read_all(back)
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_bad_expert_layouts():
    c = case("mixtral")
    with pytest.raises(ValueError, match="EP=3 does not divide the 4 experts"):
        make_plan(c.cfg, Layout(ep=3))
    with pytest.raises(ValueError, match="no experts to split"):
        make_plan(case("gqa").cfg, Layout(ep=2))


def test_deepseek_router_choices_and_mtp_layers(cpu_megatron):
    """DeepSeek's routers (V3: sigmoid + bias + groups; V2: softmax, greedy) pick HF's experts, and a
    checkpoint's multi-token-prediction layer is dropped by name, not silently ignored."""
    from megatron_patch.conversion.verify import fixed_prompts
    from megatron_patch.runtime.logits import megatron_logits

    for variant in ("deepseek_v3", "deepseek_v2"):
        c = case(variant)
        model = build_model(c.cfg).eval()
        load_rank_state_dict(model, hf_to_megatron(make_plan(c.cfg), c.sd.__getitem__, c.sd.keys())[(0, 0, 0)])
        ours, theirs = {}, {}
        for i, layer in enumerate(model.decoder.layers):
            if hasattr(layer.mlp, "router"):
                layer.mlp.router.register_forward_hook(lambda m, a, out, i=i, d=ours: d.__setitem__(i, out[1]))
        for i, layer in enumerate(c.ref.model.layers):
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.register_forward_hook(lambda m, a, out, i=i, d=theirs: d.__setitem__(i, out[-1]))
        ids = fixed_prompts(c.vocab_size, batch=2, seq=24)
        megatron_logits(model, ids, c.vocab_size)
        with torch.no_grad():
            c.ref(ids)
        assert sorted(ours) == sorted(theirs) == [1, 2, 3]
        b, s = ids.shape
        for i in ours:
            mine = ours[i].view(s, b, -1).transpose(0, 1).reshape(b * s, -1)
            ref = torch.zeros_like(mine).scatter_(1, theirs[i].view(b * s, -1), True)
            assert torch.equal(mine, ref), (variant, i)
    c = case("deepseek_v3")
    plan = make_plan(c.cfg)
    mtp = {"model.layers.4.eh_proj.weight": torch.zeros(64, 128), "model.layers.4.enorm.weight": torch.ones(64)}
    sd = {**c.sd, **mtp}
    assert all(plan.is_dropped(k) for k in mtp)
    hf_to_megatron(plan, sd.__getitem__, sd.keys())  # accepted: the MTP tensors are dropped explicitly


@pytest.mark.parametrize("fmt", ["torch_dist", "legacy"])
def test_conversion_streams_expert_tensors(cpu_megatron, tmp_path, monkeypatch, fmt):
    """HF -> Megatron holds a few HF tensors at a time (torch_dist), or one rank file's worth (legacy: each
    rank file is assembled in memory), never a whole model's experts."""
    import weakref

    from megatron_patch.conversion import hf_io

    c = case("deepseek_v3")
    hf_dir = save_case(c, str(tmp_path / "hf"))
    live: list[weakref.ref] = []
    peak = [0]
    get = hf_io.HFCheckpoint.get

    def tracked(self, name):
        t = get(self, name)  # (freed tensors die at once: no reference cycles to collect)
        live[:] = [r for r in live if r() is not None]
        live.append(weakref.ref(t))
        peak[0] = max(peak[0], len(live))
        return t

    monkeypatch.setattr(hf_io.HFCheckpoint, "get", tracked)
    assert main(["hf-to-mcore", "--hf-dir", hf_dir, "--out", str(tmp_path / "mc"), "--format", fmt, "--ep", "2"]) == 0
    assert sum("experts." in k for k in c.sd) >= 60
    assert peak[0] <= (8 if fmt == "torch_dist" else len(c.sd) // 2), (len(c.sd), peak[0])


def test_expert_tensor_parallel_other_than_tp():
    """ETP=1 at TP=2: a process keeps its experts whole (its attention still split); whole-checkpoint
    conversion at ETP != TP is refused with the way out (torch_dist), and ETP must divide the FFN."""
    from megatron_patch.conversion.engine import ConversionError

    c = case("mixtral")
    plan = make_plan(c.cfg, Layout(2, 1, ep=2, etp=1))
    with pytest.raises(ConversionError, match="ETP=1 differs from TP=2"):
        hf_to_megatron(plan, c.sd.__getitem__, c.sd.keys())
    sd = hf_to_megatron(plan, c.sd.__getitem__, c.sd.keys(), tp_ranks=[1], ep_ranks=[1], etp_rank=0)[(1, 0, 1)]
    fc2 = sd["decoder.layers.0.mlp.experts.local_experts.0.linear_fc2.weight"]
    assert torch.equal(fc2, c.sd["model.layers.0.block_sparse_moe.experts.2.w2.weight"])  # whole, global expert 2
    qkv = sd["decoder.layers.0.self_attention.linear_qkv.weight"]
    assert qkv.shape[0] * 2 == make_plan(c.cfg).shapes.num_heads * 8 + 2 * 2 * 8  # TP-split
    with pytest.raises(ConversionError, match="ETP != TP"):
        megatron_to_hf(plan, {(t, 0, e): sd for t in range(2) for e in range(2)})
    with pytest.raises(ValueError, match="ETP=3 does not divide"):
        make_plan(c.cfg, Layout(ep=2, etp=3))


def _generate(rank: int, hf_dir: str, ep: int) -> list[list[int]]:
    from megatron_patch.inference import Sampling, generate, load_model
    from megatron_patch.tokenizer import build_tokenizer

    tok = build_tokenizer(hf_dir)
    model, _ = load_model(None, hf_dir, layout=Layout(ep=ep))
    return generate(model, tok, [tok.tokenize("The module returns"), tok.tokenize("def f(x):")],
                    Sampling(6, top_k=1, stop_id=None))


def test_greedy_generation_at_expert_parallel_2_equals_transformers(tmp_path):
    """megatron.core.inference on a Mixtral split over two EP ranks (gloo) continues like HF `generate`."""
    from megatron_patch.conversion.hf_io import copy_side_files
    from megatron_patch.tokenizer import TINY_TOKENIZER, build_tokenizer
    from tests import _cpu

    c = case("mixtral")
    hf_dir = save_case(c, str(tmp_path / "hf"))
    copy_side_files(TINY_TOKENIZER, hf_dir, ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"])
    ours = _cpu.run_world(2, _generate, hf_dir, 2)
    tok = build_tokenizer(TINY_TOKENIZER)
    for prompt, mine in zip(["The module returns", "def f(x):"], ours[0]):
        ids = tok.tokenize(prompt)
        ref = c.ref.generate(torch.tensor([ids]), max_new_tokens=6, min_new_tokens=6, do_sample=False,
                             pad_token_id=0)[0, len(ids):].tolist()
        assert mine == ref, (prompt, mine, ref)
    assert ours[0] == ours[1]
