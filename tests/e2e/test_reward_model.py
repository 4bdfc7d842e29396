"""Reward models (`<Family>ForSequenceClassification`, num_labels=1): our model's value at the last real
token equals transformers' score (fp32, ≤ 1e-5), conversion HF -> Megatron (TP2xPP2) -> HF is bitwise, and
a converted checkpoint's values equal HF's."""

import json

import pytest
import torch

from megatron_patch.conversion.engine import hf_to_megatron, load_rank_state_dict, make_plan
from megatron_patch.conversion.hf_io import read_all
from megatron_patch.convert import main as convert
from megatron_patch.models import Layout, build_model, get_family
from megatron_patch.models.reward import as_reward_config, scored_values
from megatron_patch.runtime.logits import megatron_logits
from tests.models import any_config


def hf_reward_model(cfg: dict):
    from transformers import AutoConfig, AutoModelForSequenceClassification

    torch.manual_seed(0)
    config = AutoConfig.for_model(**{k: v for k, v in cfg.items() if k != "architectures"})
    config.architectures = cfg["architectures"]
    return AutoModelForSequenceClassification.from_config(config, dtype=torch.float32).eval()


def batch(vocab: int, pad: int):
    torch.manual_seed(1)
    ids = torch.randint(3, vocab, (3, 12))
    lengths = torch.tensor([12, 7, 3])
    for i, n in enumerate(lengths):
        ids[i, n:] = pad  # right padding, as HF expects for sequence classification
    return ids, lengths


@pytest.mark.parametrize("variant", ["gqa", "qwen2", "mistral"])
def test_values_equal_hf_sequence_classification(cpu_megatron, variant):
    cfg = as_reward_config(any_config(variant))
    assert get_family(cfg).name.endswith("_reward")
    hf = hf_reward_model(cfg)
    sd = hf.state_dict()
    model = build_model(cfg)
    load_rank_state_dict(model, hf_to_megatron(make_plan(cfg, Layout()), sd.__getitem__, sd.keys())[(0, 0, 0)])
    ids, lengths = batch(cfg["vocab_size"], cfg["pad_token_id"])
    values = scored_values(megatron_logits(model, ids, 1), ids, lengths, cfg["pad_token_id"])
    with torch.no_grad():
        ref = hf(input_ids=ids).logits[:, 0]
    torch.testing.assert_close(values, ref, atol=1e-5, rtol=0)


def test_round_trip_tp2_pp2_bitwise(cpu_megatron, tmp_path):
    cfg = as_reward_config(any_config("gqa"))
    hf = hf_reward_model(cfg)
    hf.save_pretrained(str(tmp_path / "hf"))
    assert json.load(open(tmp_path / "hf" / "config.json"))["architectures"] == ["LlamaForSequenceClassification"]
    assert convert(["hf-to-mcore", "--hf-dir", str(tmp_path / "hf"), "--out", str(tmp_path / "mc"), "--tp", "2",
                    "--pp", "2"]) == 0
    assert convert(["mcore-to-hf", "--mcore-dir", str(tmp_path / "mc"), "--out", str(tmp_path / "back")]) == 0
    a, b = read_all(str(tmp_path / "hf")), read_all(str(tmp_path / "back"))
    assert a.keys() == b.keys() and "score.weight" in a
    assert all(torch.equal(a[k], b[k]) for k in a)
    from transformers import AutoConfig

    back = AutoConfig.from_pretrained(str(tmp_path / "back"))
    assert back.architectures == ["LlamaForSequenceClassification"] and back.num_labels == 1
    # the TP=1 Megatron checkpoint computes HF's scores
    assert convert(["hf-to-mcore", "--hf-dir", str(tmp_path / "hf"), "--out", str(tmp_path / "mc1")]) == 0
    from megatron_patch.inference import load_model

    model, _ = load_model(str(tmp_path / "mc1"), None)
    ids, lengths = batch(cfg["vocab_size"], cfg["pad_token_id"])
    with torch.no_grad():
        ref = hf(input_ids=ids).logits[:, 0]
    torch.testing.assert_close(scored_values(megatron_logits(model, ids, 1), ids, lengths, cfg["pad_token_id"]), ref,
                               atol=1e-5, rtol=0)


@pytest.mark.parametrize("eos_is_eod", [True, False])
def test_training_scores_the_token_an_exported_model_scores(cpu_megatron, tmp_path, eos_is_eod):
    """Preference data ends each answer with the tokenizer's end-of-document token. When the config's
    eos (the reward model's pad_token_id) is that token, as for Llama-3 and Qwen2.5, HF's
    ForSequenceClassification scores the token before it: training must score the same token, so an
    exported model gives the values it was trained on (fp32, <= 1e-5)."""
    from megatron_patch.rlhf.data import PreferenceDataset, flatten_pairs, read_preferences
    from megatron_patch.rlhf.reward_model import reward_config
    from megatron_patch.tokenizer import TINY_TOKENIZER, build_tokenizer

    tok = build_tokenizer(TINY_TOKENIZER)
    base = any_config("gqa")
    cfg = reward_config({**base, "eos_token_id": tok.eod} if eos_is_eod else base)
    assert (cfg["pad_token_id"] == tok.eod) is eos_is_eod
    path = tmp_path / "prefs.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"Is {w} right?", "chosen": "yes " * n, "rejected": "no"}) + "\n"
                            for n, w in enumerate(["this", "the module", "a list of values"], 1)))
    ds = PreferenceDataset(read_preferences([str(path)], tok), 24, tok.pad)
    batch = flatten_pairs(torch.utils.data.default_collate([ds[i] for i in range(len(ds))]))
    assert all(batch["tokens"][i, n - 1] == tok.eod for i, n in enumerate(batch["lengths"]))
    hf = hf_reward_model(cfg)
    sd = hf.state_dict()
    model = build_model(cfg)
    load_rank_state_dict(model, hf_to_megatron(make_plan(cfg, Layout()), sd.__getitem__, sd.keys())[(0, 0, 0)])
    from megatron_patch.rlhf import reward_model

    # the loss function training calls, on our model's per-position values, with the pad id its forward step
    # reads from the model's head
    pad = reward_model.scalar_head(model).pad_token_id
    assert pad == cfg["pad_token_id"]
    _, _, report = reward_model.pairwise_loss(batch["tokens"], batch["lengths"], pad,
                                              megatron_logits(model, batch["tokens"], 1))
    ours = scored_values(megatron_logits(model, batch["tokens"], 1), batch["tokens"], batch["lengths"],
                         cfg["pad_token_id"])
    with torch.no_grad():  # each sequence as a user passes it to the exported model: unpadded
        theirs = torch.stack([hf(input_ids=batch["tokens"][i: i + 1, :n]).logits[0, 0]
                              for i, n in enumerate(batch["lengths"])])
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)
    margin = (theirs.view(-1, 2)[:, 0] - theirs.view(-1, 2)[:, 1]).sum()
    torch.testing.assert_close(report["margin"][0], margin, atol=1e-5, rtol=0)
