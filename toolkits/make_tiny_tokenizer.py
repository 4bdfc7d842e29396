"""Regenerate the bundled text corpus and the tiny tokenizer trained on it.

    python -m toolkits.make_tiny_tokenizer corpus --doc-dir DIR   # DIR: .../html/_sources of python3.11-doc
    python -m toolkits.make_tiny_tokenizer tokenizer              # retrain assets/tiny_tokenizer/ from the corpus

`corpus` turns the reStructuredText sources of the Python 3.11 documentation (Debian's `python3.11-doc`,
PSF licence; see assets/corpus/README.md) into JSONL documents, one per section, with the markup that is
not prose (index entries, link targets, role syntax) removed. `tokenizer` trains a byte-level BPE with
exactly 1000 entries, four of them special, and writes it as a Hugging Face tokenizer folder with a
ChatML chat template. Both outputs are byte-for-byte reproducible: files are read in sorted order, the
gzip header carries no time, and BPE training is deterministic for a fixed input.
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import os
import re
import sys
from collections.abc import Iterator

ASSETS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "megatron_patch", "assets")
CORPUS = os.path.join(ASSETS, "corpus", "corpus.jsonl.gz")
TOKENIZER_DIR = os.path.join(ASSETS, "tiny_tokenizer")

# The prose-heavy parts of the documentation; the library reference is mostly signatures.
DOC_PARTS = ("tutorial", "howto", "faq", "reference", "glossary.rst.txt", "using", "extending", "whatsnew")

VOCAB_SIZE = 1000
EOD, PAD, IM_START, IM_END = "<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [EOD, PAD, IM_START, IM_END]

# ChatML. The assistant's content and its <|im_end|> sit inside {% generation %} so that
# transformers' apply_chat_template(..., return_assistant_tokens_mask=True) marks exactly them.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['role'] == 'assistant' %}"
    "{%- generation %}{{- message['content'] + '<|im_end|>' }}{%- endgeneration %}"
    "{{- '\\n' }}"
    "{%- else %}"
    "{{- message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# --- corpus -------------------------------------------------------------------------------------

# Directives whose marker line and indented body are not prose.
_DROP_DIRECTIVES = {"index", "currentmodule", "module", "sectionauthor", "moduleauthor", "highlight", "toctree",
                    "testsetup", "testcleanup", "include", "literalinclude", "image", "figure", "only", "raw",
                    "tabularcolumns", "miscnews", "audit-event", "productionlist"}
# Directives whose argument is a language or a group name, not text; their body is kept.
_CODE_DIRECTIVES = {"code-block", "sourcecode", "code", "doctest", "testcode", "testoutput"}
_EXPLICIT = re.compile(r"^\.\.(\s+([\w:-]+)::\s*(.*))?")
_ROLE = re.compile(r":([\w:.+-]+):`([^`]*)`")
_ANGLE_TARGET = re.compile(r"\s*<[^<>]*>$")
_UNDERLINE = re.compile(r"^([=\-~^*#\"'+])\1{2,}\s*$")


def _role_text(m: re.Match) -> str:
    """`:func:`~os.path.join`` -> `os.path.join`; `:ref:`text <label>`` -> `text`; `:issue:`123`` -> `bpo-123`."""
    role, text = m.group(1), _ANGLE_TARGET.sub("", m.group(2)) or m.group(2)
    prefix = {"issue": "bpo-", "gh": "gh-"}.get(role, "")
    return prefix + text.lstrip("~!")


def _inline(text: str) -> str:
    """Inline markup to plain text; run on whole sections, since a role may wrap onto the next line."""
    text = _ROLE.sub(_role_text, text).replace("``", "")
    return re.sub(r"`([^`<]+?)(\s*<[^>]*>)?`_{1,2}", r"\1", text)  # hyperlink references


def clean_rst(text: str) -> list[tuple[str, str]]:
    """Split one reStructuredText file into (title, body) sections of plain-ish text."""
    lines = text.splitlines()
    sections: list[tuple[str, list[str]]] = [("", [])]
    i, dropping_indent = 0, None
    while i < len(lines):
        line = lines[i]
        stripped = line.strip()
        if dropping_indent is not None:  # inside the body of a dropped explicit-markup block
            if not stripped or (len(line) - len(line.lstrip())) > dropping_indent:
                i += 1
                continue
            dropping_indent = None
        m = _EXPLICIT.match(stripped)
        if m and (stripped == ".." or stripped.startswith(".. ")):  # not "..." (doctest, ellipsis)
            indent = len(line) - len(line.lstrip())
            name, arg = m.group(2), m.group(3)
            if name is None or name in _DROP_DIRECTIVES:  # a comment, a link target or a dropped directive
                dropping_indent = indent
            elif arg and name not in _CODE_DIRECTIVES:
                sections[-1][1].append(" " * indent + arg)  # e.g. the signature of ".. function::"
            i += 1
            continue
        if stripped == "::" or _UNDERLINE.match(line):
            i += 1
            continue
        nxt = lines[i + 1] if i + 1 < len(lines) else ""
        if stripped and not line[0].isspace() and _UNDERLINE.match(nxt) and len(nxt.strip()) >= len(stripped):
            sections.append((stripped, []))
            i += 2
            continue
        if line.rstrip().endswith("::"):
            line = line.rstrip()[:-1]  # "For example::" introduces a literal block; keep one colon
        sections[-1][1].append(line.rstrip())
        i += 1
    out = []
    for title, body in sections:
        body_text = re.sub(r"\n{3,}", "\n\n", "\n".join(body)).strip("\n")
        out.append((_inline(title), _inline(body_text)))
    return out


def _chunks(text: str, max_chars: int = 6000) -> Iterator[str]:
    """Split a long section at paragraph boundaries into pieces of at most about `max_chars`."""
    piece: list[str] = []
    size = 0
    for para in text.split("\n\n"):
        if piece and size + len(para) > max_chars:
            yield "\n\n".join(piece)
            piece, size = [], 0
        piece.append(para)
        size += len(para) + 2
    if piece:
        yield "\n\n".join(piece)


def corpus_documents(doc_dir: str, min_chars: int = 200) -> Iterator[dict]:
    """Yield {"text", "source"} documents from the documentation sources under `doc_dir`."""
    paths = []
    for part in DOC_PARTS:
        full = os.path.join(doc_dir, part)
        if os.path.isfile(full):
            paths.append(full)
        for root, _, files in os.walk(full):
            paths += [os.path.join(root, f) for f in files if f.endswith(".rst.txt")]
    if not paths:
        raise ValueError(f"no .rst.txt documentation sources under {doc_dir}")
    for path in sorted(paths):
        with open(path, encoding="utf-8") as f:
            sections = clean_rst(f.read())
        rel = os.path.relpath(path, doc_dir)
        for title, body in sections:
            for chunk in _chunks(body):
                text = f"{title}\n\n{chunk}" if title else chunk
                if len(text) >= min_chars:
                    yield {"text": text, "source": rel}


def write_corpus(doc_dir: str, out: str = CORPUS) -> dict:
    """Write the corpus as gzipped JSONL with a fixed (zero) gzip time, so reruns are byte-identical."""
    buf = io.BytesIO()
    docs = chars = 0
    with gzip.GzipFile(filename="", mode="wb", fileobj=buf, compresslevel=9, mtime=0) as gz:
        for doc in corpus_documents(doc_dir):
            gz.write((json.dumps(doc, ensure_ascii=False) + "\n").encode("utf-8"))
            docs += 1
            chars += len(doc["text"])
    with open(out, "wb") as f:
        f.write(buf.getvalue())
    return {"documents": docs, "characters": chars, "bytes": len(buf.getvalue()), "path": out}


def read_corpus(path: str = CORPUS) -> Iterator[str]:
    """The texts of the bundled corpus, in order."""
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            yield json.loads(line)["text"]


# --- tokenizer ----------------------------------------------------------------------------------

def train_tokenizer(texts: list[str], vocab_size: int = VOCAB_SIZE):
    """A GPT-2 style byte-level BPE: the 256 byte symbols, the special tokens, and merges up to `vocab_size`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(f"trained {tok.get_vocab_size()} tokens, wanted {vocab_size}")
    return tok


def write_tokenizer(out: str = TOKENIZER_DIR, corpus: str = CORPUS) -> dict:
    """Train on the corpus and write tokenizer.json, tokenizer_config.json and special_tokens_map.json."""
    tok = train_tokenizer(list(read_corpus(corpus)))
    os.makedirs(out, exist_ok=True)
    tok.save(os.path.join(out, "tokenizer.json"))
    added = {str(tok.token_to_id(t)): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                       "single_word": False, "special": True} for t in SPECIAL_TOKENS}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": None,
        "eos_token": EOD,
        "pad_token": PAD,
        "unk_token": None,
        "additional_special_tokens": [IM_START, IM_END],
        "clean_up_tokenization_spaces": False,  # decode must give back the exact text
        "model_max_length": 4096,
        "chat_template": CHAT_TEMPLATE,
    }
    specials = {"eos_token": EOD, "pad_token": PAD, "additional_special_tokens": [IM_START, IM_END]}
    for name, obj in (("tokenizer_config.json", config), ("special_tokens_map.json", specials)):
        with open(os.path.join(out, name), "w", encoding="utf-8") as f:
            json.dump(obj, f, indent=2, ensure_ascii=False)
            f.write("\n")
    return {"vocab_size": tok.get_vocab_size(), "path": out}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m toolkits.make_tiny_tokenizer", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("corpus", help="rebuild assets/corpus/corpus.jsonl.gz from the Python documentation")
    c.add_argument("--doc-dir", required=True, help="the html/_sources folder of Debian's python3.11-doc")
    c.add_argument("--out", default=CORPUS)
    t = sub.add_parser("tokenizer", help="retrain assets/tiny_tokenizer/ from the corpus")
    t.add_argument("--corpus", default=CORPUS)
    t.add_argument("--out", default=TOKENIZER_DIR)
    args = p.parse_args(argv)
    try:
        result = write_corpus(args.doc_dir, args.out) if args.command == "corpus" else \
            write_tokenizer(args.out, args.corpus)
    except (OSError, ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
