"""megatron_patch.tokenizer: the bundled tiny tokenizer, the chat loss mask, sentencepiece models, errors."""

from __future__ import annotations

import gzip
import itertools
import json
import os

import pytest

from megatron_patch.models.family import padded_vocab_size
from megatron_patch.tokenizer import (
    CORPUS,
    TINY_TOKENIZER,
    HFTokenizer,
    SentencePieceTokenizer,
    build_tokenizer,
    to_messages,
)

CONVERSATION = [
    {"role": "system", "content": "You answer questions about Python."},
    {"role": "user", "content": "What does a list hold?"},
    {"role": "assistant", "content": "Any objects, in order; it is mutable."},
    {"role": "user", "content": "And a tuple?"},
    {"role": "assistant", "content": " The same, but immutable.\nUse it as a dict key."},
]


def corpus_texts(n: int) -> list[str]:
    with gzip.open(CORPUS, "rt", encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in itertools.islice(f, n)]


def masked_runs(tok, ids: list[int], mask: list[int], decode=None) -> list[str]:
    """The text of each maximal run of mask==1 tokens."""
    runs, run = [], []
    for i, m in zip(ids, mask):
        if m:
            run.append(i)
        elif run:
            runs.append(run)
            run = []
    return [(decode or tok.detokenize)(r) for r in runs + ([run] if run else [])]


@pytest.fixture(scope="module")
def tiny() -> HFTokenizer:
    return build_tokenizer(TINY_TOKENIZER)


def test_tiny_tokenizer_vocab_and_special_ids(tiny):
    from megatron.core.tokenizers import MegatronTokenizerBase

    assert isinstance(tiny, MegatronTokenizerBase)
    assert tiny.vocab_size == 1000 == len(tiny.vocab) == len(tiny.inv_vocab)
    assert tiny.eod == tiny.eos == tiny.vocab["<|endoftext|>"]
    assert tiny.pad == tiny.vocab["<|pad|>"] != tiny.eod
    assert tiny.bos is None
    assert {tiny.inv_vocab[i] for i in (tiny.vocab["<|im_start|>"], tiny.vocab["<|im_end|>"])} == \
        {"<|im_start|>", "<|im_end|>"}
    assert list(tiny.unique_identifiers.items()) == [
        ("class", "megatron_patch.tokenizer.HFTokenizer"), ("tokenizer_path", os.path.abspath(TINY_TOKENIZER))]
    # special tokens in text are single tokens
    assert tiny.tokenize("a<|endoftext|>b") == tiny.tokenize("a") + [tiny.eod] + tiny.tokenize("b")


def test_tiny_tokenizer_loads_with_transformers_offline(monkeypatch):
    from transformers import AutoTokenizer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hf = AutoTokenizer.from_pretrained(TINY_TOKENIZER)
    assert len(hf) == 1000 and hf.eos_token == "<|endoftext|>" and hf.pad_token == "<|pad|>"


def test_round_trip_and_compression_on_corpus(tiny):
    texts = corpus_texts(40)
    chars = tokens = 0
    for text in texts:
        ids = tiny.tokenize(text)
        assert tiny.detokenize(ids) == text
        assert all(0 <= i < tiny.vocab_size for i in ids)
        chars, tokens = chars + len(text), tokens + len(ids)
    odd = "Tabs\tand  double  spaces,\n\n  ünïcödé 景太郎 and emoji \N{SNAKE}\n"
    assert tiny.detokenize(tiny.tokenize(odd)) == odd  # byte-level: nothing is out of vocabulary
    assert chars / tokens > 2.5, "the BPE merges should compress English text well beyond one byte per token"


def test_chat_mask_covers_exactly_the_assistant_turns(tiny):
    ids, mask = tiny.apply_chat_template(CONVERSATION)
    assert len(ids) == len(mask) and set(mask) == {0, 1}
    assert tiny.detokenize(ids) == "".join(
        f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in CONVERSATION)
    assert masked_runs(tiny, ids, mask) == [CONVERSATION[2]["content"] + "<|im_end|>",
                                           CONVERSATION[4]["content"] + "<|im_end|>"]
    im_end = tiny.vocab["<|im_end|>"]
    assert [m for i, m in zip(ids, mask) if i == im_end] == [0, 0, 1, 0, 1]  # system, user, asst, user, asst


def test_chat_mask_matches_transformers_generation_markup(tiny):
    """The template's {% generation %} markup and our prefix-rendering mask agree token for token."""
    out = tiny._tok.apply_chat_template(CONVERSATION, tokenize=True, return_dict=True,
                                        return_assistant_tokens_mask=True)
    ids, mask = tiny.apply_chat_template(CONVERSATION)
    assert out["input_ids"] == ids
    assert out["assistant_masks"] == mask


def test_generation_prompt(tiny):
    ids, mask = tiny.apply_chat_template(CONVERSATION[:2], add_generation_prompt=True)
    assert tiny.detokenize(ids).endswith("What does a list hold?<|im_end|>\n<|im_start|>assistant\n")
    assert sum(mask) == 0


def test_instruction_form(tiny):
    example = {"system": "Be brief.", "instruction": "Sum the numbers.", "input": "1 2 3", "output": "6"}
    assert to_messages(example) == [{"role": "system", "content": "Be brief."},
                                    {"role": "user", "content": "Sum the numbers.\n\n1 2 3"},
                                    {"role": "assistant", "content": "6"}]
    ids, mask = tiny.apply_chat_template(example)
    assert (ids, mask) == tiny.apply_chat_template(to_messages(example))
    assert masked_runs(tiny, ids, mask) == ["6<|im_end|>"]
    ids, mask = tiny.apply_chat_template({"instruction": "Say hi.", "output": "Hi."})
    assert tiny.detokenize(ids) == "<|im_start|>user\nSay hi.<|im_end|>\n<|im_start|>assistant\nHi.<|im_end|>\n"
    assert masked_runs(tiny, ids, mask) == ["Hi.<|im_end|>"]
    assert tiny.apply_chat_template({"messages": CONVERSATION}) == tiny.apply_chat_template(CONVERSATION)


def test_padded_vocab_size(tiny):
    assert tiny.padded_vocab_size(2) == 1024 == padded_vocab_size(1000, 2)
    assert tiny.padded_vocab_size(1) == 1024
    assert tiny.padded_vocab_size(3) == 1152 == padded_vocab_size(1000, 3)  # 3 x 128 = 384 per step
    assert tiny.padded_vocab_size(2, divisible_by=100) == 1000


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory) -> str:
    import sentencepiece

    texts = corpus_texts(30) + [m["content"] for m in CONVERSATION]
    prefix = str(tmp_path_factory.mktemp("sp") / "sp")
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(texts), model_prefix=prefix, vocab_size=200, model_type="bpe",
        character_coverage=1.0, normalization_rule_name="identity", remove_extra_whitespaces=False,
        user_defined_symbols=["<|im_start|>", "<|im_end|>"], num_threads=1, minloglevel=2)
    return prefix + ".model"


def test_sentencepiece_model(sp_model, tmp_path):
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=sp_model)
    tok = build_tokenizer(sp_model)
    assert isinstance(tok, SentencePieceTokenizer)
    assert tok.vocab_size == 200 == len(tok.vocab)
    assert tok.eod == tok.eos == sp.eos_id() and tok.inv_vocab[tok.eod] == "</s>"
    assert tok.bos == sp.bos_id() and tok.pad == tok.eod  # the model has no pad piece
    assert tok.unique_identifiers["tokenizer_path"] == os.path.abspath(sp_model)
    text = corpus_texts(1)[0][:400]
    ids = tok.tokenize(text)
    assert ids == sp.encode(text) and len(ids) < len(text)
    assert tok.detokenize(ids) == text
    assert tok.tokenize(tok.detokenize(ids)) == ids
    # a folder that holds only tokenizer.model is read as sentencepiece too
    os.symlink(sp_model, tmp_path / "tokenizer.model")
    assert build_tokenizer(str(tmp_path)).tokenize(text) == ids


def test_sentencepiece_chat_mask(sp_model, tiny):
    tok = build_tokenizer(sp_model, chat_template=tiny.chat_template)
    ids, mask = tok.apply_chat_template(CONVERSATION)
    # spelled from the pieces: sentencepiece's decode drops the leading space of " The same" on its own
    pieces = lambda run: "".join(tok.inv_vocab[i] for i in run).replace("\u2581", " ")  # noqa: E731
    assert masked_runs(tok, ids, mask, pieces) == [CONVERSATION[2]["content"] + "<|im_end|>",
                                                  CONVERSATION[4]["content"] + "<|im_end|>"]
    with pytest.raises(ValueError, match="no chat template"):
        build_tokenizer(sp_model).apply_chat_template(CONVERSATION)


def test_errors_name_the_path(tmp_path):
    missing = str(tmp_path / "nowhere")
    with pytest.raises(ValueError, match=f"{missing} does not exist"):
        build_tokenizer(missing)
    with pytest.raises(ValueError, match=f"folder {tmp_path} has no tokenizer files"):
        build_tokenizer(str(tmp_path))
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("a\nb\n")
    with pytest.raises(ValueError, match=f"unsupported tokenizer file {vocab}"):
        build_tokenizer(str(vocab))
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match=f"cannot load the Hugging Face tokenizer in {broken}"):
        build_tokenizer(str(broken))
    bad_sp = tmp_path / "bad.model"
    bad_sp.write_bytes(b"\x00garbage")
    with pytest.raises(ValueError, match=f"cannot load the sentencepiece model {bad_sp}"):
        build_tokenizer(str(bad_sp))


def test_bad_conversations(tiny):
    with pytest.raises(ValueError, match="message 1"):
        tiny.apply_chat_template([{"role": "user", "content": "hi"}, {"role": "assistant"}])
    with pytest.raises(ValueError, match="'messages' or 'instruction'"):
        tiny.apply_chat_template({"prompt": "hi"})
    with pytest.raises(ValueError, match="no messages"):
        tiny.apply_chat_template([])
