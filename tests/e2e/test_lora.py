"""LoRA (megatron_patch.lora) on CPU, fp32, checked numerically:

- in memory (tiny LLaMA, TP=PP=1): the adapted model's logits equal the base's exactly at initialisation;
  with non-zero adapters, the merged HF weights (transformers) and PEFT's model built from our adapter
  folder give the adapted model's logits (<= 1e-5); a PEFT adapter made by `peft` itself on q_proj / v_proj
  only is imported and gives PEFT's logits; trainable parameters = PEFT's count;
- `python -m megatron_patch.sft --lora-rank ...` end to end: only adapters train (the loss falls), TP=2 and
  PP=2 give the TP=1 losses, a resume from the adapter-only checkpoint is exact, the checkpoint exports
  (at the end of training and from a TP=2 checkpoint) to a PEFT folder and a merged HF folder whose logits
  equal the adapted model's, and `--lora-import` continues from a PEFT folder;
- bad input: unknown target, a target that matches no module, rank <= 0, an adapter of another base.
"""

import contextlib
import io
import json
import os
import re

import pytest
import torch

from megatron_patch.tokenizer import TINY_TOKENIZER
from tests import _cpu
from tests.helpers import conversations

RANK, ALPHA = 4, 8.0


def _adapted_model(cfg, sd, targets=("all-linear",), rank=RANK, alpha=ALPHA, modules=None):
    from megatron_patch.conversion.engine import hf_to_megatron, load_rank_state_dict, make_plan
    from megatron_patch.lora.adapters import LoRAConfig, apply_lora
    from megatron_patch.models import Layout, build_model

    plan = make_plan(cfg, Layout())
    model = build_model(cfg).eval()
    load_rank_state_dict(model, hf_to_megatron(plan, sd.__getitem__, sd.keys())[(0, 0, 0)])
    apply_lora(model, cfg, LoRAConfig(rank, alpha, targets=targets, modules=modules), plan)
    return model, plan


def _logits(model, ids, vocab=1000):
    from megatron_patch.runtime.logits import megatron_logits

    with torch.no_grad():
        return megatron_logits(model, ids, vocab)


def _peft_logits(hf, folder, ids, trainable=False):
    from peft import PeftModel

    model = PeftModel.from_pretrained(hf, folder, is_trainable=trainable).eval()
    with torch.no_grad():
        return model(ids).logits, model.get_nb_trainable_parameters()[0]


def _peft_version() -> tuple[int, int]:
    import peft

    return tuple(int(x) for x in peft.__version__.split(".")[:2])


def _hf_logits(cfg, state, ids):
    from tests.models import hf_model

    hf = hf_model(cfg)
    hf.load_state_dict(state)
    with torch.no_grad():
        return hf(ids).logits


def _expected_trainable(cfg, rank=RANK):
    h, f = cfg["hidden_size"], cfg["intermediate_size"]
    q, kv = cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"]
    per_layer = sum(rank * (i + o) for i, o in ((h, q), (h, kv), (h, kv), (q, h), (h, f), (h, f), (f, h)))
    return per_layer * cfg["num_hidden_layers"]


def test_adapted_model_equals_base_merged_and_peft(cpu_megatron, tmp_path):
    from megatron_patch.conversion.verify import fixed_prompts
    from megatron_patch.lora import peft as P
    from megatron_patch.lora.adapters import adapter_tensors, count_parameters, load_adapter
    from tests.models import hf_model, llama_config

    cfg = llama_config("gqa")
    sd = hf_model(cfg).state_dict()
    ids = fixed_prompts(1000, 2, 24)
    base = _hf_logits(cfg, sd, ids)
    model, plan = _adapted_model(cfg, sd)
    assert torch.equal(_logits(model, ids), _logits(_adapted_model(cfg, sd, targets=("linear_proj",))[0], ids))
    assert (_logits(model, ids) - base).abs().max().item() <= 1e-5  # B = 0: the base function, exactly
    trainable, total = count_parameters(model)
    assert trainable == _expected_trainable(cfg) and total > 10 * trainable
    assert all(p.requires_grad == (".lora_" in n) for n, p in model.named_parameters())

    g = torch.Generator().manual_seed(7)  # stand-in for training: every adapter factor non-zero
    with torch.no_grad():
        for p in (p for p in model.parameters() if p.requires_grad):
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    ours = _logits(model, ids)
    assert (ours - base).abs().max().item() > 0.5
    adapter = P.to_peft(adapter_tensors(model), plan, RANK, ALPHA)
    P.write_peft(str(tmp_path / "peft"), adapter, plan)
    config = json.load(open(tmp_path / "peft" / "adapter_config.json"))
    assert config["target_modules"] == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    peft_logits, peft_trainable = _peft_logits(hf_model(cfg), str(tmp_path / "peft"), ids, trainable=True)
    assert peft_trainable == trainable
    assert (peft_logits - ours).abs().max().item() <= 1e-5
    merged = _hf_logits(cfg, P.merge_into(sd.__getitem__, list(sd), adapter), ids)
    assert (merged - ours).abs().max().item() <= 1e-5

    # back in: the PEFT folder gives the same adapter tensors, bitwise
    again, _ = _adapted_model(cfg, sd)
    load_adapter(again, P.from_peft(P.read_peft(str(tmp_path / "peft")), plan))
    assert all(torch.equal(a, b) for a, b in zip(adapter_tensors(again).values(), adapter_tensors(model).values()))


@pytest.mark.parametrize("variant", ["qwen2", "qwen2_moe", "falcon_40b", "bloom", "glm", "deepseek_v3", "qwen3_moe"])
def test_families_match_peft(cpu_megatron, tmp_path, variant):
    """Other layouts of the fused linears (qkv biases and tied embeddings, shared experts beside routed ones,
    per-group packed query_key_value, Bloom's per-head layout, GLM's one gate_up_proj, MLA's linear_proj and
    dense-then-MoE layers): our adapted model with random adapters = PEFT's model from our folder, with as many
    trainable parameters (PEFT adds none on the routed experts: target_modules names the MLP linears by their
    path inside a layer, `mlp.down_proj`, never by a last name the experts' fused parameters share)."""
    from megatron_patch.conversion.engine import hf_to_megatron, load_rank_state_dict, make_plan
    from megatron_patch.conversion.verify import fixed_prompts, hf_logits
    from megatron_patch.lora import peft as P
    from megatron_patch.lora.adapters import LoRAConfig, adapter_tensors, apply_lora, count_parameters
    from megatron_patch.models import Layout, build_model
    from tests.models import Case, case, hf_model, save_case

    c = case(variant)
    plan = make_plan(c.cfg, Layout())
    model = build_model(c.cfg).eval()
    load_rank_state_dict(model, hf_to_megatron(plan, c.sd.__getitem__, c.sd.keys())[(0, 0, 0)])
    apply_lora(model, c.cfg, LoRAConfig(RANK, ALPHA), plan)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in (p for p in model.parameters() if p.requires_grad):
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    ids = fixed_prompts(c.vocab_size, 2, 16)
    ours = _logits(model, ids, c.vocab_size)
    adapter = P.to_peft(adapter_tensors(model), plan, RANK, ALPHA)
    merged = P.merge_into(c.sd.__getitem__, list(c.sd), adapter)
    folder = save_case(Case(c.cfg, merged, c.ref), str(tmp_path / "merged"))
    assert (hf_logits(folder, ids) - ours).abs().max().item() <= 1e-5
    P.write_peft(str(tmp_path / "peft"), adapter, plan)
    if variant in ("deepseek_v3", "qwen3_moe") and _peft_version() < (0, 22):
        # transformers 5 fuses their experts in memory, and peft 0.21 (utils/transformers_weight_conversion.py)
        # then turns every target ending in gate_proj / up_proj / down_proj into the experts' fused parameters
        return
    theirs, trainable = _peft_logits(hf_model(c.cfg), str(tmp_path / "peft"), ids, trainable=True)
    assert trainable == count_parameters(model)[0]
    assert (theirs - ours).abs().max().item() <= 1e-5


def test_import_peft_adapter_on_some_of_the_fused_modules(cpu_megatron, tmp_path):
    """An adapter made by `peft` itself on q_proj and v_proj only (k_proj's rows of the fused linear_qkv
    stay without adapter): imported, our model gives PEFT's logits."""
    from peft import LoraConfig, get_peft_model

    from megatron_patch.conversion.verify import fixed_prompts
    from megatron_patch.lora import peft as P
    from megatron_patch.lora.adapters import load_adapter
    from tests.models import hf_model, llama_config

    cfg = llama_config("gqa")
    sd = hf_model(cfg).state_dict()
    pm = get_peft_model(hf_model(cfg), LoraConfig(r=2, lora_alpha=5, target_modules=["q_proj", "v_proj"]))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    pm.save_pretrained(str(tmp_path / "theirs"))
    ids = fixed_prompts(1000, 2, 24)
    with torch.no_grad():
        theirs = pm.eval()(ids).logits
    adapter = P.read_peft(str(tmp_path / "theirs"))
    _, plan = _adapted_model(cfg, sd, rank=2)
    targets, modules = P.megatron_targets(adapter, plan)
    assert targets == ("linear_qkv",) and modules == {"q_proj", "v_proj"}
    model, _ = _adapted_model(cfg, sd, targets, adapter.rank, adapter.alpha, modules)
    load_adapter(model, P.from_peft(adapter, plan))
    assert (_logits(model, ids) - theirs).abs().max().item() <= 1e-5


def test_bad_input_is_a_clear_error(cpu_megatron, tmp_path):
    from megatron_patch.conversion.engine import make_plan
    from megatron_patch.lora import peft as P
    from megatron_patch.lora.adapters import LoRAConfig, LoRAError, find_sites, load_adapter
    from megatron_patch.models import Layout
    from tests.models import family_config, hf_model, llama_config

    with pytest.raises(LoRAError, match="unknown LoRA target 'q_proj'"):
        LoRAConfig(4, targets=("q_proj",))
    for rank in (0, -2):
        with pytest.raises(LoRAError, match="rank must be a positive integer"):
            LoRAConfig(rank)
    mixtral = family_config("mixtral")  # every MLP is routed experts: linear_fc1 names no adaptable module
    with pytest.raises(LoRAError, match="linear_fc1 matches no module"):
        find_sites(None, mixtral, LoRAConfig(4, targets=("linear_fc1",)), make_plan(mixtral, Layout()))
    # an adapter trained on another base (wider MLP): a shape error naming the module, on import and on merge
    cfg, other = llama_config("gqa"), {**llama_config("gqa"), "intermediate_size": 192}
    other_model, other_plan = _adapted_model(other, hf_model(other).state_dict())
    from megatron_patch.lora.adapters import adapter_tensors

    adapter = P.to_peft(adapter_tensors(other_model), other_plan, RANK, ALPHA)
    sd = hf_model(cfg).state_dict()
    model, plan = _adapted_model(cfg, sd)
    with pytest.raises(LoRAError, match=r"mlp\.gate_proj: adapter shapes .* do not fit this model"):
        load_adapter(model, P.from_peft(adapter, plan))
    with pytest.raises(LoRAError, match="gate_proj: adapter B @ A is 192x64, the base weight"):
        P.merge_into(sd.__getitem__, list(sd), adapter)
    foreign = P.Adapter({"model.layers.9.self_attn.q_proj": adapter.modules["model.layers.0.self_attn.q_proj"]}, 4, 8.0)
    with pytest.raises(LoRAError, match="layers.9.self_attn.q_proj is not a linear LoRA can adapt"):
        P.from_peft(foreign, plan)
    # a non-finite adapter is refused like every tensor the project writes (manifest.TensorLog): no folder left
    from megatron_patch.conversion.manifest import NonFiniteError

    name = "model.layers.0.self_attn.q_proj"
    a_nan = adapter.modules[name][0].clone()
    a_nan[0, 0] = float("nan")
    with pytest.raises(NonFiniteError, match=r"q_proj\.lora_A\.weight has 1 non-finite values"):
        P.write_peft(str(tmp_path / "nan_peft"), P.Adapter({name: (a_nan, adapter.modules[name][1])}, RANK, ALPHA),
                     plan)
    assert not os.path.exists(tmp_path / "nan_peft")


def _adapt(cfg, **lora):
    """The training entry points' LoRA step (`lora.training.adapt`) on a freshly built model of `cfg`, at TP=PP=1;
    `lora` overrides the settled --lora-* arguments."""
    import argparse

    from megatron_patch.lora.training import adapt
    from megatron_patch.models import build_model, get_family

    args = argparse.Namespace(model_class="gpt", tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                              make_vocab_size_divisible_by=128, expert_model_parallel_size=1,
                              expert_tensor_parallel_size=None, transformer_impl="local", padded_vocab_size=None,
                              lora_rank=RANK, lora_alpha=ALPHA, lora_dropout=0.0, lora_target=["all-linear"],
                              lora_import=None, seed=0, resuming=False)
    for k, v in lora.items():
        setattr(args, k, v)
    model = build_model(cfg)
    adapt(model, args, cfg, get_family(cfg))
    return model


def test_startup_line_names_what_is_adapted(cpu_megatron, capsys):
    """Issue 35 item 8: on Mixtral every MLP is routed experts, which LoRA leaves alone: the start-up line lists
    the linears really adapted (attention only) and says the routed experts are not; on Qwen2-MoE linear_fc1 /
    linear_fc2 are adapted (the shared experts, the dense first layer) and listed."""
    from tests.models import family_config, llama_config

    _adapt(family_config("mixtral"))
    line = [x for x in capsys.readouterr().out.splitlines() if x.startswith("LoRA: ")]
    assert len(line) == 1, line
    adapted = re.search(r"adapted linears \(([^)]*)\)", line[0]).group(1)
    assert "linear_qkv" in adapted and "linear_proj" in adapted, line[0]
    assert "linear_fc1" not in adapted and "linear_fc2" not in adapted, line[0]
    assert "routed experts are not adapted" in line[0], line[0]
    _adapt(family_config("qwen2_moe"))
    line = [x for x in capsys.readouterr().out.splitlines() if x.startswith("LoRA: ")][0]
    adapted = re.search(r"adapted linears \(([^)]*)\)", line).group(1)
    assert all(t in adapted for t in ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")), line
    assert "routed experts are not adapted" in line, line
    _adapt(llama_config("gqa"))
    line = [x for x in capsys.readouterr().out.splitlines() if x.startswith("LoRA: ")][0]
    assert "routed" not in line, line  # no experts: nothing to say about them


def _peft_folder(cfg, folder, **config):
    """A PEFT LoRA folder made by `peft` itself on a random model of `cfg` (non-zero adapters)."""
    from peft import LoraConfig, get_peft_model

    from tests.models import hf_model

    pm = get_peft_model(hf_model(cfg), LoraConfig(r=2, lora_alpha=4, **config))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    pm.save_pretrained(str(folder))
    return str(folder)


def test_valid_peft_adapters_we_cannot_take_are_clear_errors(cpu_megatron, tmp_path):
    """Issue 35 item 7: a PEFT adapter on some layers only (a regex target_modules) and one with lora_bias=True
    are refused on import with PEFT's terms (the module, the option), never an internal Megatron name or
    "unexpected tensor"; written back as a PEFT folder, the some-layers adapter keeps naming those layers only."""
    from megatron_patch.lora import peft as P
    from megatron_patch.lora.adapters import LoRAError
    from tests.models import llama_config

    cfg = llama_config("gqa")
    some = _peft_folder(cfg, tmp_path / "some_layers", target_modules=r".*\.layers\.0\.self_attn\.(q_proj|v_proj)")
    with pytest.raises(LoRAError) as e:
        _adapt(cfg, lora_import=some, lora_rank=2, lora_alpha=4.0)
    message = str(e.value)
    assert "decoder." not in message and "linear_qkv" not in message, message
    assert "model.layers.1.self_attn.q_proj" in message and "every layer" in message, message
    # copied as a PEFT folder (export --adapter ... --save-peft), its target_modules still name layer 0 only
    from megatron_patch.conversion.engine import make_plan

    plan = make_plan(cfg)
    P.write_peft(str(tmp_path / "copy"), P.read_peft(some), plan)
    targets = json.load(open(tmp_path / "copy" / "adapter_config.json"))["target_modules"]
    assert isinstance(targets, list), targets  # PEFT's suffix match (peft 0.22 widens a regex to its last names)
    selected = {m for m in (h[: -len(".weight")] for h in plan.hf_names())
                if any(m == t or m.endswith(f".{t}") for t in targets)}
    assert selected == {"model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.v_proj"}, targets
    biased = _peft_folder(cfg, tmp_path / "biased", target_modules=["q_proj", "v_proj"], lora_bias=True)
    with pytest.raises(LoRAError, match=r"lora_bias=True .*is not supported") as e:
        P.read_peft(biased)
    assert "unexpected tensor" not in str(e.value) and biased in str(e.value)


def _export(*argv) -> tuple[int, str]:
    from megatron_patch.lora import export

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = export.main([str(a) for a in argv])
    return code, err.getvalue()


def _tree(folder) -> dict[str, int]:
    """Every file under `folder` with its size and mtime (what a write over it would change)."""
    out = {}
    for root, _, files in os.walk(folder):
        for f in files:
            st = os.stat(os.path.join(root, f))
            out[os.path.relpath(os.path.join(root, f), folder)] = (st.st_size, st.st_mtime_ns)
    return out


def test_adapter_for_another_base_is_refused_or_warned(cpu_megatron, tmp_path):
    """Issue 35 item 7: an adapter whose recorded base (`base_model_name_or_path`) is a folder with another
    architecture is refused, naming the config key, though every adapted shape fits (only vocab_size differs);
    one recorded under another name (a hub id) gets a warning; the same name, none."""
    from tests.models import hf_model, llama_config, save_hf

    cfg = llama_config("gqa")
    base = save_hf(hf_model(cfg), str(tmp_path / "tiny-llama"))
    other = save_hf(hf_model({**cfg, "vocab_size": 1100}), str(tmp_path / "other"))
    adapter = _peft_folder(cfg, tmp_path / "adapter", target_modules=["q_proj", "v_proj"])
    config_path = os.path.join(adapter, "adapter_config.json")

    def made_for(name):
        config = json.load(open(config_path))
        config["base_model_name_or_path"] = name
        json.dump(config, open(config_path, "w"))

    made_for(other)
    code, err = _export("--adapter", adapter, "--base", base, "--save-merged", tmp_path / "m1")
    assert code == 1 and err.strip().splitlines()[-1].startswith("error: "), err
    assert "vocab_size" in err and other in err and base in err, err
    assert not os.path.exists(tmp_path / "m1")
    made_for("some-org/Another-Model-7B")
    code, err = _export("--adapter", adapter, "--base", base, "--save-merged", tmp_path / "m2")
    assert code == 0, err
    assert "warning: " in err and "some-org/Another-Model-7B" in err, err
    made_for("some-org/tiny-llama")
    code, err = _export("--adapter", adapter, "--base", base, "--save-merged", tmp_path / "m3")
    assert code == 0 and "warning" not in err, err


def test_export_never_writes_over_its_input(cpu_megatron, tp1, tmp_path):
    """Issue 35 item 1: with --overwrite, an output that is, or holds, an input (--base, --adapter, --load) or the
    other output is refused with one error line naming the flag, before anything is written: the inputs stay
    byte for byte as they were."""
    import shutil

    from tests.models import hf_model, llama_config, save_hf

    cfg = llama_config("gqa")
    base = save_hf(hf_model(cfg), str(tmp_path / "base"))
    adapter = _peft_folder(cfg, tmp_path / "adapter", target_modules=["q_proj", "v_proj"])
    ckpt = str(tmp_path / "ckpt")
    shutil.copytree(tp1[1] / "ckpt", ckpt)
    before = {p: _tree(p) for p in (base, adapter, ckpt)}
    cases = [
        (("--adapter", adapter, "--base", base, "--save-peft", base), "--save-peft", "destroy the input"),
        (("--adapter", adapter, "--base", base, "--save-merged", base), "--save-merged", "destroy the input"),
        (("--adapter", adapter, "--base", base, "--save-merged", tmp_path), "--save-merged", "destroy the input"),
        (("--adapter", adapter, "--base", base, "--save-peft", adapter), "--save-peft", "destroy the input"),
        (("--load", ckpt, "--save-peft", ckpt), "--save-peft", "destroy the input"),
        (("--load", ckpt, "--base", base, "--save-merged", os.path.join(ckpt, "hf")), "--save-merged",
         "part of the input"),
        (("--adapter", adapter, "--base", base, "--save-peft", tmp_path / "x", "--save-merged", tmp_path / "x"),
         "--save-peft", "the --save-merged folder"),
    ]
    for argv, flag, match in cases:
        code, err = _export(*argv, "--overwrite")
        last = err.strip().splitlines()[-1] if err.strip() else ""
        assert code == 1 and last.startswith("error: ") and flag in last and match in last, (argv, err)
        assert {p: _tree(p) for p in before} == before, argv
    assert not os.path.exists(tmp_path / "x")


# --- end to end: python -m megatron_patch.sft --lora-rank ... (spawned gloo worlds) ---------------------------

def _run(rank: int, argv: list[str]) -> dict:
    _cpu.install_training()
    from megatron_patch import sft
    from megatron_patch.training import gpt

    sums, loss_func = [], gpt.loss_func

    def record(mask, output):
        out = loss_func(mask, output)
        sums.append(out[0].item() / out[1].item())
        return out

    gpt.loss_func = record
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        try:
            code = sft.main(argv)
        except SystemExit as e:  # --exit-interval
            code = e.code or 0
    assert code == 0, text.getvalue()[-3000:]
    counts = re.findall(r"LoRA: ([\d,]+) trainable parameters", text.getvalue())
    return {"losses": sums, "trainable": [int(c.replace(",", "")) for c in counts]}


LORA = ("--lora-rank", str(RANK), "--lora-alpha", str(ALPHA))


def _argv(data, hf, save, *extra, lora=LORA):
    return ["--load-hf", hf, "--sft-data", data, "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
            TINY_TOKENIZER, "--seq-length", "128", "--micro-batch-size", "2", "--global-batch-size", "4",
            "--train-iters", "8", "--lr", "1e-2", "--lr-decay-style", "constant", "--transformer-impl", "local",
            "--use-cpu-initialization", "--no-masked-softmax-fusion", "--no-persist-layer-norm", "--no-rope-fusion",
            "--no-bias-swiglu-fusion", "--distributed-backend", "gloo", "--num-workers", "0", "--log-interval", "1",
            "--eval-iters", "0", "--eval-interval", "1000", "--seed", "1234", "--make-vocab-size-divisible-by", "4",
            "--save", save, *lora, *extra]


def _train(world: int, argv: list[str]) -> dict:
    return _cpu.run_world(world, _run, argv)[-1]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    from tests.models import hf_model, llama_config, save_hf

    root = tmp_path_factory.mktemp("lora_inputs")
    data = root / "chats.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in conversations(200)))
    return str(data), save_hf(hf_model(llama_config("gqa")), str(root / "hf"))


@pytest.fixture(scope="module")
def tp1(inputs, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_tp1")
    run = _train(1, _argv(*inputs, str(root / "ckpt"), "--save-hf", str(root / "merged"),
                          "--save-peft", str(root / "peft")))
    return run, root


def test_sft_lora_trains_adapters_and_exports_exactly(cpu_megatron, tp1, inputs):
    """Only the adapters train (the loss falls from the base's); the exported PEFT folder and merged HF
    model give the adapted model's logits (the base from --load-hf + the checkpoint's adapters)."""
    from megatron_patch.conversion.hf_io import read_all
    from megatron_patch.conversion.mcore_io import checkpoint_step_dir
    from megatron_patch.conversion.verify import fixed_prompts
    from megatron_patch.lora.adapters import load_adapter
    from megatron_patch.lora.peft import read_checkpoint_adapter
    from megatron_patch.models import load_hf_config
    from tests.models import hf_model

    run, root = tp1
    losses = run["losses"]
    assert len(losses) == 16 and sum(losses[-4:]) / 4 < sum(losses[:4]) / 4 - 0.5, losses
    cfg = load_hf_config(inputs[1])
    assert run["trainable"] == [_expected_trainable(cfg)]
    trained = read_checkpoint_adapter(checkpoint_step_dir(str(root / "ckpt")))
    assert all(t.abs().max() > 0 for k, t in trained.items() if ".lora_B." in k)
    base = read_all(inputs[1])
    model, _ = _adapted_model(cfg, base)
    load_adapter(model, trained)
    ids = fixed_prompts(1000, 2, 24)
    ours = _logits(model, ids)
    merged = read_all(str(root / "merged"))
    assert set(merged) == set(base) and not torch.equal(merged["model.layers.0.mlp.up_proj.weight"],
                                                        base["model.layers.0.mlp.up_proj.weight"])
    assert torch.equal(merged["model.norm.weight"], base["model.norm.weight"])  # only adapted weights change
    assert (_hf_logits(cfg, merged, ids) - ours).abs().max().item() <= 1e-5
    hf = hf_model(cfg)
    hf.load_state_dict(base)
    assert (_peft_logits(hf, str(root / "peft"), ids)[0] - ours).abs().max().item() <= 1e-5


# The layout comparison trains with plain SGD: Adam divides by sqrt(v-hat), so an element whose gradient is at rounding
# level moves by up to lr per step in a direction the rounding picks, and no element-wise bound across layouts
# holds after a few steps (seen: 1.7e-4 apart on one machine, under 1e-4 on another). SGD's step is linear in the
# gradient, so the layouts' weights differ by what their gradients do.
SGD = ("--optimizer", "sgd", "--sgd-momentum", "0")
SGD_BOUND = 1e-5


@pytest.fixture(scope="module")
def tp1_sgd(inputs, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_tp1_sgd")
    return _train(1, _argv(*inputs, str(root / "ckpt"), *SGD)), root


@pytest.mark.parametrize("layout", [["--tensor-model-parallel-size", "2"], ["--pipeline-model-parallel-size", "2"]])
def test_tp2_and_pp2_train_as_tp1(tp1_sgd, inputs, tmp_path, layout):
    """Same adapters at start (seeded per layer and module, in HF layout), same losses; the checkpoint stores the
    adapters whole, so its export equals TP=1's adapters up to the training's rounding. The bound, for 8 SGD steps
    (w <- w - lr g, lr 1e-2): PP moves activations without arithmetic and TP splits sums of at most K = 256 terms
    (hidden 64 x 4 heads' worth, the MLP's 256), so the layouts' gradients differ by fp32 reassociation, at most
    K u |g|_1-scale ~ 256 * 6e-8 = 1.5e-5 relative, on adapter gradients of size <= ~0.1: <= 1.5e-6 absolute per
    step; 8 steps of lr 1e-2 give <= 1.2e-7, and carrying a difference through later steps multiplies it by
    (1 + lr L)^8 (L: the loss's curvature in the adapters); SGD_BOUND = 1e-5 holds for L up to ~50."""
    from megatron_patch.conversion.mcore_io import checkpoint_step_dir
    from megatron_patch.lora.peft import read_checkpoint_adapter

    run = _train(2, _argv(*inputs, str(tmp_path / "ckpt"), *layout, *SGD))
    ref = tp1_sgd[0]["losses"]
    assert len(run["losses"]) == len(ref) == 16
    assert max(abs(a - b) for a, b in zip(run["losses"], ref)) <= 1e-5, (run["losses"], ref)
    ours = read_checkpoint_adapter(checkpoint_step_dir(str(tmp_path / "ckpt")))
    theirs = read_checkpoint_adapter(checkpoint_step_dir(str(tp1_sgd[1] / "ckpt")))
    assert set(ours) == set(theirs)
    assert any(t.abs().max() > 0 for k, t in theirs.items() if ".lora_B." in k)  # the adapters trained
    assert max((ours[k] - theirs[k]).abs().max().item() for k in ours) <= SGD_BOUND


def test_resume_from_adapter_checkpoint_is_exact(tp1, inputs, tmp_path):
    """Stop at iteration 4 (adapters + their optimizer state saved, no base), resume to 8: every
    micro-batch loss equals the uninterrupted run's."""
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint import FileSystemReader

    from megatron_patch.conversion.mcore_io import checkpoint_step_dir

    ckpt = str(tmp_path / "ckpt")
    first = _train(1, _argv(*inputs, ckpt, "--exit-interval", "4", "--save-interval", "4"))["losses"]
    step = checkpoint_step_dir(ckpt)
    keys = [k for k in FileSystemReader(step).read_metadata().state_dict_metadata if not k.startswith("rng")]
    model_keys = [k for k in keys if k.startswith(("decoder.", "embedding.", "output_layer."))]
    assert model_keys and all(".lora_" in k for k in model_keys), model_keys  # adapters only, no base
    assert any(".lora_" in k and "exp_avg" in k for k in keys)  # their optimizer state
    assert dist_checkpointing.load_common_state_dict(step)["args"].lora_rank == RANK
    resumed = _train(1, _argv(*inputs, ckpt, "--load", ckpt))["losses"]
    full = tp1[0]["losses"]
    assert len(first) == 8 and len(resumed) == 8
    assert max(abs(a - b) for a, b in zip(first + resumed, full)) <= 1e-6


def test_lora_import_continues_from_a_peft_folder(tp1, inputs, tmp_path):
    """--lora-import: the run starts from the PEFT folder's adapters (at lr 0 they are saved unchanged)."""
    from megatron_patch.conversion.engine import make_plan
    from megatron_patch.conversion.mcore_io import checkpoint_step_dir
    from megatron_patch.lora import peft as P
    from megatron_patch.models import Layout, load_hf_config

    peft_dir = str(tp1[1] / "peft")
    _train(1, _argv(*inputs, str(tmp_path / "ckpt"), "--train-iters", "1", "--lr", "0.0", "--lora-import", peft_dir,
                    lora=()))
    saved = P.read_checkpoint_adapter(checkpoint_step_dir(str(tmp_path / "ckpt")))
    read = P.from_peft(P.read_peft(peft_dir), make_plan(load_hf_config(inputs[1]), Layout()))
    assert set(saved) == set(read) and all(torch.equal(saved[k], read[k]) for k in read)


def _parse(rank: int, argvs: list[list[str]]) -> list[str]:
    _cpu.install_training()
    from megatron.training.global_vars import unset_global_variables

    from megatron_patch.sft import _sft_settings, add_sft_args
    from megatron_patch.training.arguments import parse_args

    out = []
    for argv in argvs:
        try:
            parse_args(argv, add_sft_args, indexed_data=False, adjust=_sft_settings)
            out.append("")
            unset_global_variables()  # accepted: the next case parses afresh
        except (ValueError, OSError) as e:
            out.append(str(e))
    return out


def test_bad_lora_options_are_refused_before_training(inputs, tmp_path):
    data, hf = inputs
    base = _argv(data, hf, str(tmp_path / "c"))
    cases = {
        "rank 0": ([*base, "--lora-rank", "0"], "--lora-rank must be a positive integer, got 0"),
        "unknown target": ([*base, "--lora-target", "q_proj"], "unknown LoRA target 'q_proj'"),
        "no base": ([a if a != "--load-hf" else "--hf-config" for a in base], "pass --load-hf DIR"),
        "peft without lora": (_argv(data, hf, str(tmp_path / "d"), "--save-peft", str(tmp_path / "p"), lora=()),
                              "--save-peft exports LoRA adapters"),
        "not a peft folder": ([*base, "--lora-import", hf], "is not a PEFT adapter folder"),
    }
    messages = _cpu.run_world(1, _parse, [argv for argv, _ in cases.values()])[0]
    for (name, (_, match)), message in zip(cases.items(), messages):
        assert match in message, (name, message)


def test_lora_options_without_rank_are_refused(inputs, tmp_path):
    """Issue 35 item 4: --lora-alpha, --lora-target or --lora-dropout without --lora-rank (or --lora-import)
    would run a full fine-tune: refused, naming the flag, even when given its default value."""
    data, hf = inputs
    plain = _argv(data, hf, str(tmp_path / "c"), lora=())
    cases = {
        "alpha": ([*plain, "--lora-alpha", "16"], "--lora-alpha"),
        "target": ([*plain, "--lora-target", "linear_qkv"], "--lora-target"),
        "dropout": ([*plain, "--lora-dropout", "0.1"], "--lora-dropout"),
        "dropout 0": ([*plain, "--lora-dropout", "0"], "--lora-dropout"),
    }
    messages = _cpu.run_world(1, _parse, [argv for argv, _ in cases.values()])[0]
    for (name, (_, flag)), message in zip(cases.items(), messages):
        assert message.startswith(flag) and "needs --lora-rank" in message, (name, message)


def test_sft_outputs_are_checked_before_training(inputs, tmp_path):
    """Issue 35 item 6: --save-hf / --save-peft that are or hold --save, an input or each other, that are --save's
    own hf/ folder, or that exist already, are refused when the arguments are read (before any model is built),
    naming the flag, and never suggest an --overwrite that sft does not have. Another folder inside --save is
    fine (the launchers write OUT/peft beside the checkpoints in OUT)."""
    data, hf = inputs
    save = str(tmp_path / "ckpt")
    (tmp_path / "exists").mkdir()
    cases = {
        "save-hf is save": (_argv(data, hf, save, "--save-hf", save, lora=()), "--save-hf", "the --save folder"),
        "save-peft is save": (_argv(data, hf, save, "--save-peft", save), "--save-peft", "the --save folder"),
        "save-hf in save": (_argv(data, hf, save, "--save-hf", os.path.join(save, "hf"), lora=()), "--save-hf",
                            "the --save folder"),
        "save-hf holds save": (_argv(data, hf, str(tmp_path / "out" / "ckpt"), "--save-hf", str(tmp_path / "out"),
                                     lora=()), "--save-hf", "the --save folder"),
        "save-hf is load-hf": (_argv(data, hf, save, "--save-hf", hf, lora=()), "--save-hf", "destroy the input"),
        "save-peft is load-hf": (_argv(data, hf, save, "--save-peft", hf), "--save-peft", "destroy the input"),
        "same folder": (_argv(data, hf, save, "--save-hf", str(tmp_path / "o"), "--save-peft", str(tmp_path / "o")),
                        "--save-hf", "the --save-peft folder"),
        "save-hf exists": (_argv(data, hf, save, "--save-hf", str(tmp_path / "exists"), lora=()), "--save-hf",
                           "already exists"),
        "save-peft exists": (_argv(data, hf, save, "--save-peft", str(tmp_path / "exists")), "--save-peft",
                             "already exists"),
        "no parent": (_argv(data, hf, save, "--save-hf", str(tmp_path / "nowhere" / "hf"), lora=()),
                      "cannot create --save-hf", "its parent folder"),
    }
    fine = [  # beside the checkpoints in --save; beside --save in a folder that the run's first save creates
        _argv(data, hf, save, "--save-hf", os.path.join(save, "merged"), "--save-peft", os.path.join(save, "peft")),
        _argv(data, hf, str(tmp_path / "run" / "ckpt"), "--save-hf", str(tmp_path / "run" / "hf"), lora=()),
    ]
    messages = _cpu.run_world(1, _parse, [*(argv for argv, *_ in cases.values()), *fine])[0]
    for (name, (_, flag, match)), message in zip(cases.items(), messages):
        assert message.startswith(flag) and match in message, (name, message)
        assert "--overwrite" not in message, (name, message)
    assert messages[len(cases):] == [""] * len(fine)
    assert not os.path.exists(save) and os.listdir(tmp_path / "exists") == []


def test_model_tools_refuse_a_lora_checkpoint_naming_the_export(cpu_megatron, tp1, inputs, tmp_path, capsys):
    """Issue 35 item 5: a LoRA run's checkpoint holds the adapters only; generate, evaluate, verify, mcore-to-hf
    and mcore-to-mcore say so in one error line naming `python -m megatron_patch.lora.export` (nothing written)."""
    from megatron_patch import evaluate, generate
    from megatron_patch.convert import main as convert

    ckpt = str(tp1[1] / "ckpt")
    (tmp_path / "prompts.jsonl").write_text(json.dumps({"prompt": "The module"}) + "\n")
    (tmp_path / "docs.jsonl").write_text(json.dumps({"text": "The module returns a list of values."}) + "\n")
    model = ["--mcore-dir", ckpt, "--tokenizer", TINY_TOKENIZER]
    runs = {
        "generate": lambda: generate.main([*model, "--prompts", str(tmp_path / "prompts.jsonl"),
                                           "--out", str(tmp_path / "gen.jsonl")]),
        "evaluate": lambda: evaluate.main([*model, "--text", str(tmp_path / "docs.jsonl"), "--seq-length", "32"]),
        "verify": lambda: convert(["verify", "--hf-dir", inputs[1], "--mcore-dir", ckpt]),
        "mcore-to-hf": lambda: convert(["mcore-to-hf", "--mcore-dir", ckpt, "--out", str(tmp_path / "hf")]),
        "mcore-to-mcore": lambda: convert(["mcore-to-mcore", "--mcore-dir", ckpt, "--out", str(tmp_path / "mc")]),
    }
    for name, run in runs.items():
        assert run() == 1, name
        err = capsys.readouterr().err.strip().splitlines()
        assert err and err[-1].startswith("error: ") and "python -m megatron_patch.lora.export" in err[-1] \
            and ckpt in err[-1], (name, err)
    assert sorted(os.listdir(tmp_path)) == ["docs.jsonl", "prompts.jsonl"]


def _dpo(rank: int, argv: list[str]) -> list[dict]:
    _cpu.install_training()
    from megatron_patch.rlhf import dpo

    logged = _cpu.record_train_steps()
    with contextlib.redirect_stdout(io.StringIO()):
        assert dpo.main(argv) == 0
    return logged


def test_dpo_with_lora(tiny_lm, tmp_path):
    """rlhf.dpo --lora-rank: the policy starts as the reference (B = 0: loss log 2, margin 0) and the
    adapters alone raise the reward margin; the checkpoint holds adapters only."""
    import math

    from megatron_patch.conversion.mcore_io import checkpoint_step_dir
    from megatron_patch.lora.peft import read_checkpoint_adapter
    from tests.helpers import preferences

    train = tmp_path / "prefs.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in preferences(200, 0)))
    argv = ["--load-hf", tiny_lm, "--pref-data", str(train), "--seq-length", "32", "--micro-batch-size", "4",
            "--global-batch-size", "8", "--train-iters", "20", "--lr", "1e-2", "--beta", "0.1",
            "--save", str(tmp_path / "ckpt"), *LORA, "--tokenizer-type", "HuggingFaceTokenizer",
            "--tokenizer-model", TINY_TOKENIZER, "--transformer-impl", "local", "--use-cpu-initialization",
            "--no-masked-softmax-fusion", "--no-persist-layer-norm", "--no-rope-fusion", "--no-bias-swiglu-fusion",
            "--distributed-backend", "gloo", "--num-workers", "0", "--log-interval", "1", "--eval-iters", "0",
            "--eval-interval", "1000", "--seed", "1234", "--lr-decay-style", "constant",
            "--make-vocab-size-divisible-by", "4"]
    logged = _cpu.run_world(1, _dpo, argv)[0]
    assert len(logged) == 20
    # as without LoRA: policy and reference forwards differ only in fp32 rounding (the policy's fused loss)
    assert abs(logged[0]["reward margin"]) < 1e-3 and abs(logged[0]["dpo loss"] - math.log(2)) < 1e-3
    assert sum(r["reward margin"] for r in logged[-5:]) / 5 > 0.2, logged[-1]
    assert read_checkpoint_adapter(checkpoint_step_dir(str(tmp_path / "ckpt")))


def test_export_tool_in_a_plain_process(tp1, tmp_path):
    """python -m megatron_patch.lora.export: the checkpoint's adapters as a PEFT folder, the same tensors as
    the export at the end of training; bad input is one error line."""
    import subprocess
    import sys

    from safetensors.torch import load_file

    def tool(*args):
        return subprocess.run([sys.executable, "-m", "megatron_patch.lora.export", *args], capture_output=True,
                              text=True, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})

    root = tp1[1]
    done = tool("--load", str(root / "ckpt"), "--save-peft", str(tmp_path / "peft"))
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1])["modules"] == 28
    ours, theirs = load_file(str(tmp_path / "peft" / "adapter_model.safetensors")), \
        load_file(str(root / "peft" / "adapter_model.safetensors"))
    assert set(ours) == set(theirs) and all(torch.equal(ours[k], theirs[k]) for k in ours)
    for args, match in [(("--adapter", str(root / "peft"), "--save-merged", str(tmp_path / "m")), "needs --base"),
                        (("--load", str(tmp_path / "nope"), "--save-peft", str(tmp_path / "p")), "does not exist")]:
        bad = tool(*args)
        assert bad.returncode == 1 and bad.stderr.strip().splitlines()[-1].startswith("error: ") and \
            match in bad.stderr, bad.stderr
