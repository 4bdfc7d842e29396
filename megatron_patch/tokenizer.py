"""Tokenizers behind megatron-core's tokenizer interface (`megatron.core.tokenizers.MegatronTokenizerBase`,
the type of `GPTDatasetConfig.tokenizer`): a Hugging Face tokenizer folder (`transformers.AutoTokenizer`,
local files only, no remote code) or a sentencepiece `.model` file.

Besides what GPTDataset reads (`vocab_size`, `eod`, `pad`, `unique_identifiers`), the wrapper renders chat
conversations with the tokenizer's Jinja chat template and returns a loss mask that is 1 exactly on the
tokens of the assistant turns (their content and end token, not the role headers). The mask does not rely
on `{% generation %}` markup, which most published templates lack: each assistant turn is located by
rendering the conversation up to it, with and without the turn, and its characters are mapped to tokens
through the tokenizer's offsets.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from functools import cached_property
from typing import Any, NamedTuple

from megatron.core.tokenizers import MegatronTokenizerBase

from megatron_patch.models.family import padded_vocab_size as _padded_vocab_size

ASSETS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets")
TINY_TOKENIZER = os.path.join(ASSETS, "tiny_tokenizer")
"""A byte-level BPE of 1000 tokens with ChatML special tokens, trained on CORPUS (toolkits/make_tiny_tokenizer.py)."""
CORPUS = os.path.join(ASSETS, "corpus", "corpus.jsonl.gz")
"""About 3 MB of English text from the Python documentation, as JSONL {"text", "source"} (see its README)."""

# Files that make a folder an HF tokenizer folder.
_HF_FILES = ("tokenizer.json", "tokenizer_config.json")


class ChatEncoding(NamedTuple):
    """Token ids of a rendered conversation and a same-length 0/1 mask, 1 on assistant tokens."""

    ids: list[int]
    loss_mask: list[int]


def to_messages(example: Sequence[Mapping[str, str]] | Mapping[str, Any]) -> list[dict[str, str]]:
    """A conversation as [{"role", "content"}, ...] from a message list, {"messages": [...]}, or instruction
    form {"instruction", "input"?, "output"?, "system"?} (user = instruction, then input after a blank line)."""
    if isinstance(example, Mapping):
        if "messages" in example:
            example = example["messages"]
        elif "instruction" in example:
            user = example["instruction"] + (f"\n\n{example['input']}" if example.get("input") else "")
            messages = [{"role": "system", "content": example["system"]}] if example.get("system") else []
            messages.append({"role": "user", "content": user})
            if example.get("output") is not None:
                messages.append({"role": "assistant", "content": example["output"]})
            return messages
        else:
            raise ValueError(f"a chat example needs 'messages' or 'instruction', got keys {sorted(example)}")
    messages = []
    for i, m in enumerate(example):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError(f"message {i} is not a {{'role': str, 'content': str}} dict: {m!r}")
        messages.append({"role": m["role"], "content": m["content"]})
    if not messages:
        raise ValueError("the conversation has no messages")
    return messages


class Tokenizer(MegatronTokenizerBase):
    """What both backends share: megatron's identity and padding, inverse vocab, chat template + loss mask.

    Subclasses provide `tokenize`, `detokenize`, `vocab`, `vocab_size`, the special ids, `_offsets` and
    `_template_tokens`."""

    library = ""

    def __init__(self, path: str, chat_template: str | None) -> None:
        super().__init__(os.path.abspath(path), {"library": self.library, "chat_template": chat_template})

    # --- megatron-core's interface -------------------------------------------------------------------

    @cached_property
    def inv_vocab(self) -> dict[int, str]:
        return {i: t for t, i in self.vocab.items()}

    @property
    def unique_identifiers(self) -> OrderedDict:
        """Identifies the tokenizer in megatron's dataset cache keys (GPTDataset hashes these)."""
        return OrderedDict([("class", f"{type(self).__module__}.{type(self).__qualname__}"),
                            ("tokenizer_path", self.path)])

    def padded_vocab_size(self, tp: int = 1, divisible_by: int = 128) -> int:
        """The model's embedding rows for this vocabulary at tensor parallelism `tp` (Megatron's
        `--make-vocab-size-divisible-by` x TP, the rule the checkpoint converter uses)."""
        return _padded_vocab_size(self.vocab_size, tp, divisible_by)

    # --- chat ----------------------------------------------------------------------------------------

    def render_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = False,
                    chat_template: str | None = None) -> str:
        """The conversation as text, rendered with `chat_template` or the tokenizer's own."""
        from transformers.utils.chat_template_utils import render_jinja_template

        template = chat_template or self.chat_template
        if not template:
            raise ValueError(f"tokenizer {self.path} has no chat template; pass chat_template=")
        try:
            rendered, _ = render_jinja_template([messages], chat_template=template,
                                                add_generation_prompt=add_generation_prompt,
                                                **self._template_tokens())
        except Exception as e:  # jinja raises its own types, including the template's raise_exception()
            raise ValueError(f"chat template of {self.path} failed: {e}") from e
        return rendered[0]

    def apply_chat_template(self, conversation: Sequence[Mapping[str, str]] | Mapping[str, Any],
                            chat_template: str | None = None, add_generation_prompt: bool = False) -> ChatEncoding:
        """Token ids of the rendered conversation and a loss mask: 1 on each assistant turn's content and
        end token (e.g. `<|im_end|>`), 0 on system/user turns, role headers and the generation prompt.

        Accepts what `to_messages` accepts (message list, {"messages"}, instruction form)."""
        messages = to_messages(conversation)
        text = self.render_chat(messages, add_generation_prompt, chat_template)
        spans = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            head = self.render_chat(messages[:i], True, chat_template)
            turn = self.render_chat(messages[: i + 1], False, chat_template)
            if not (text.startswith(head) and text.startswith(turn) and turn.startswith(head)):
                raise ValueError(f"the chat template of {self.path} does not render message {i} (assistant) "
                                 "the same way in a prefix of the conversation, so its tokens cannot be located")
            # the template's whitespace after the end token is formatting, not the assistant's output
            spans.append((len(head), len(turn.rstrip())))
        ids, offsets = self._offsets(text)
        mask = [0] * len(ids)
        s = 0
        for t, (begin, end) in enumerate(offsets):  # a token overlapping a span is an assistant token
            while s < len(spans) and begin >= spans[s][1]:
                s += 1
            if s == len(spans):
                break
            if end > spans[s][0] and end > begin:
                mask[t] = 1
        return ChatEncoding(ids, mask)

    def _offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Token ids of `text` (with the special tokens it spells) and each token's [begin, end) characters."""
        raise NotImplementedError

    def _template_tokens(self) -> dict[str, str]:
        """Special-token strings the chat template may refer to (bos_token, eos_token, ...)."""
        raise NotImplementedError


class HFTokenizer(Tokenizer):
    """A Hugging Face tokenizer folder (tokenizer.json / tokenizer_config.json), loaded offline."""

    library = "huggingface"

    def __init__(self, path: str, chat_template: str | None = None) -> None:
        from transformers import AutoTokenizer

        try:
            self._tok = AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)
        except Exception as e:  # transformers raises OSError, ValueError or KeyError depending on what is wrong
            raise ValueError(f"cannot load the Hugging Face tokenizer in {path}: {e}") from e
        if self._tok.eos_token_id is None:
            raise ValueError(f"tokenizer {path} defines no eos token, which megatron needs as end-of-document")
        super().__init__(path, chat_template or getattr(self._tok, "chat_template", None))

    def tokenize(self, text: str) -> list[int]:
        """Ids of `text` without added bos/eos: documents are separated by `eod` instead."""
        return self._tok.encode(text, add_special_tokens=False)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), clean_up_tokenization_spaces=False)

    @cached_property
    def vocab(self) -> dict[str, int]:
        return self._tok.get_vocab()

    @property
    def vocab_size(self) -> int:
        """len(tokenizer): the base vocabulary plus added tokens, so every id it can emit is < vocab_size."""
        return len(self._tok)

    @property
    def eod(self) -> int:
        return self._tok.eos_token_id

    @property
    def eos(self) -> int:
        return self._tok.eos_token_id

    @property
    def bos(self) -> int | None:
        return self._tok.bos_token_id

    @property
    def pad(self) -> int:
        return self._tok.pad_token_id if self._tok.pad_token_id is not None else self.eod

    def _offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        if not self._tok.is_fast:
            raise ValueError(f"the chat loss mask needs a fast tokenizer (tokenizer.json) in {self.path}")
        enc = self._tok(text, add_special_tokens=False, return_offsets_mapping=True)
        return enc["input_ids"], [tuple(o) for o in enc["offset_mapping"]]

    def _template_tokens(self) -> dict[str, str]:
        return dict(self._tok.special_tokens_map)


class SentencePieceTokenizer(Tokenizer):
    """A sentencepiece `.model` file. eod is its eos piece; pad falls back to eod when the model has none."""

    library = "sentencepiece"

    def __init__(self, path: str, chat_template: str | None = None) -> None:
        import sentencepiece

        try:
            self._sp = sentencepiece.SentencePieceProcessor(model_file=path)
        except (OSError, RuntimeError) as e:
            raise ValueError(f"cannot load the sentencepiece model {path}: {e}") from e
        if self._sp.eos_id() < 0:
            raise ValueError(f"sentencepiece model {path} has no eos piece, which megatron needs as end-of-document")
        super().__init__(path, chat_template)

    def tokenize(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._sp.decode(list(ids))

    @cached_property
    def vocab(self) -> dict[str, int]:
        return {self._sp.id_to_piece(i): i for i in range(self._sp.get_piece_size())}

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()

    @property
    def eod(self) -> int:
        return self._sp.eos_id()

    @property
    def eos(self) -> int:
        return self._sp.eos_id()

    @property
    def bos(self) -> int | None:
        return self._sp.bos_id() if self._sp.bos_id() >= 0 else None

    @property
    def pad(self) -> int:
        return self._sp.pad_id() if self._sp.pad_id() >= 0 else self.eod

    def _offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        enc = self._sp.encode(text, return_type="offset_mapping")  # character offsets for str input
        return list(enc["ids"]), [tuple(o) for o in enc["offsets"]]

    def _template_tokens(self) -> dict[str, str]:
        ids = {"bos_token": self.bos, "eos_token": self.eos, "unk_token": self._sp.unk_id()}
        return {k: self._sp.id_to_piece(i) for k, i in ids.items() if i is not None and i >= 0}


def build_tokenizer(path: str, chat_template: str | None = None) -> Tokenizer:
    """The tokenizer at `path`: an HF tokenizer folder, a folder holding only a sentencepiece
    `tokenizer.model`, or a sentencepiece `.model` file. `chat_template` overrides the tokenizer's own."""
    if not os.path.exists(path):
        raise ValueError(f"tokenizer path {path} does not exist")
    if os.path.isdir(path):
        if any(os.path.isfile(os.path.join(path, f)) for f in _HF_FILES):
            return HFTokenizer(path, chat_template)
        if os.path.isfile(os.path.join(path, "tokenizer.model")):
            return SentencePieceTokenizer(os.path.join(path, "tokenizer.model"), chat_template)
        raise ValueError(f"folder {path} has no tokenizer files ({', '.join(_HF_FILES)} or tokenizer.model)")
    if path.endswith(".model"):
        return SentencePieceTokenizer(path, chat_template)
    raise ValueError(f"unsupported tokenizer file {path}: expected an HF tokenizer folder or a sentencepiece .model")
