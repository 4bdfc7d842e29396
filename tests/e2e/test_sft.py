"""SFT: packed samples (assistant-only loss, per-document attention), checked numerically, and
`python -m megatron_patch.sft` end to end on CPU with per-token loss normalisation."""

import contextlib
import io
import json

import pytest
import torch

from megatron_patch.tokenizer import TINY_TOKENIZER, build_tokenizer
from megatron_patch.training.sft_data import PackedSFTDataset
from tests import _cpu
from tests.helpers import conversations


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(TINY_TOKENIZER)


def test_loss_only_on_assistant_tokens_of_each_document(tok):
    convs = conversations(12)
    ds = PackedSFTDataset(convs, tok, seq_length=128)
    assert len(ds) < len(convs)  # packed several per sample
    for i in range(len(ds)):
        x = ds[i]
        cu = x["cu_seqlens"][x["cu_seqlens"] >= 0].tolist()
        for a, b in zip(cu[:-1], cu[1:]):
            lbl, m = x["labels"][a:b], x["loss_mask"][a:b].bool()
            if not m.any():
                continue  # the padding tail
            # the loss tokens of a document are its assistant answer and the turn's end token
            text = tok.detokenize(lbl[m].tolist())
            assert text.endswith("<|im_end|>") and text.count("<|im_end|>") == 1, text
            assert text[: -len("<|im_end|>")] in {c.get("output") or c.get("messages", [{}])[-1].get("content")
                                                  for c in convs}
            assert not m[-1] or b == 128  # never across into the next document
            assert x["position_ids"][a] == 0


def test_packed_logits_equal_each_document_alone(cpu_megatron, tok):
    from megatron_patch.conversion.engine import hf_to_megatron, load_rank_state_dict, make_plan
    from megatron_patch.models import Layout, build_model
    from tests.models import hf_model, llama_config

    cfg = llama_config("gqa")
    hf = hf_model(cfg)
    sd = hf.state_dict()
    model = build_model(cfg).eval()
    load_rank_state_dict(model, hf_to_megatron(make_plan(cfg, Layout()), sd.__getitem__, sd.keys())[(0, 0, 0)])
    ds = PackedSFTDataset(conversations(8), tok, seq_length=128)
    x = ds[0]
    cu = x["cu_seqlens"][x["cu_seqlens"] >= 0].tolist()
    assert len(cu) >= 3  # at least two documents
    with torch.no_grad():
        packed = model(x["tokens"][None], x["position_ids"][None], x["attention_mask"][None])
        for a, b in zip(cu[:-1], cu[1:]):
            if x["position_ids"][a] != 0 or not x["loss_mask"][a:b].any():
                continue
            alone = hf(x["tokens"][None, a:b]).logits
            assert (packed[0, a:b, :1000] - alone[0]).abs().max().item() <= 1e-5


def _run(rank: int, argv: list[str]) -> dict:
    _cpu.install_training()
    from megatron_patch import sft
    from megatron_patch.training import gpt

    sums, loss_func = [], gpt.loss_func

    def record(mask, output):
        out = loss_func(mask, output)
        sums.append((out[0].item(), out[1].item()))
        return out

    gpt.loss_func = record
    reduced = _cpu.record_train_steps()
    with contextlib.redirect_stdout(io.StringIO()):
        assert sft.main(argv) == 0
    return {"sums": sums, "logged": dict(enumerate((r["lm loss"] for r in reduced), 1))}


def test_sft_end_to_end_with_packing(tmp_path):
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in conversations(200)))
    argv = ["--hf-config", "megatron_patch/assets/tiny_llama.json", "--sft-data", str(data),
            "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", TINY_TOKENIZER, "--seq-length", "128",
            "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "12", "--lr", "3e-3",
            "--lr-decay-style", "constant", "--transformer-impl", "local", "--use-cpu-initialization",
            "--no-masked-softmax-fusion", "--no-persist-layer-norm",
            "--no-rope-fusion", "--no-bias-swiglu-fusion", "--distributed-backend", "gloo", "--num-workers", "0",
            "--log-interval", "1", "--eval-iters", "0", "--eval-interval", "1000", "--seed", "1234"]
    run = _cpu.run_world(1, _run, argv)[0]
    sums, logged = run["sums"], run["logged"]
    assert sorted(logged) == list(range(1, 13)) and len(sums) == 24
    for it in range(1, 13):
        # per-token normalisation over the global batch: sum of token losses / number of loss tokens
        (s1, n1), (s2, n2) = sums[2 * it - 2: 2 * it]
        assert abs(logged[it] - (s1 + s2) / (n1 + n2)) <= 1e-5 * logged[it]
    assert sum(logged[i] for i in (10, 11, 12)) / 3 < sum(logged[i] for i in (1, 2, 3)) / 3 - 1.0, logged
