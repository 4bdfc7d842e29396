"""python -m megatron_patch.generate on CPU (megatron-core's dynamic inference engine, eager, the torch
paged attention of `paged_attention_in_torch`): greedy continuations of prompts with different lengths
equal transformers' `generate` token for token (from a converted TP2xPP2 checkpoint, run at TP=1, TP=2 and
PP=2); continuous batching frees a finished request's slot for a waiting one; sampling with a fixed seed
is reproducible; --stop ends generating (not only the text); bad input (empty prompts or file, a prompt
too long for the context, a KV budget too small, an unwritable --out) is refused with one error line;
--out is written whole; without --out, stdout holds only the rows."""

import dataclasses
import importlib.util
import io
import json
import os

import pytest
import torch

from megatron_patch.compat import async_scheduling_available
from megatron_patch.convert import main as convert
from megatron_patch.tokenizer import TINY_TOKENIZER
from tests.helpers import count_calls
from tests.models import hf_model, llama_config, save_hf

PROMPTS = ["The interpreter", "A module is a file containing Python definitions and statements.", "def f(x):"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory, cpu_megatron):
    root = tmp_path_factory.mktemp("gen")
    hf = hf_model(llama_config("gqa"))
    hf_dir = save_hf(hf, str(root / "hf"))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (root / "hf" / name).write_bytes(open(f"{TINY_TOKENIZER}/{name}", "rb").read())
    mc = str(root / "mc")
    assert convert(["hf-to-mcore", "--hf-dir", hf_dir, "--out", mc, "--tp", "2", "--pp", "2"]) == 0
    (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    return root, hf, mc


def _rows(path):
    return [json.loads(line) for line in open(path)]


@pytest.mark.parametrize("engine", ["static", "dynamic"])
def test_greedy_equals_transformers_generate(setup, capsys, engine):
    from megatron_patch.generate import main
    from megatron_patch.tokenizer import build_tokenizer

    root, hf, mc = setup
    out = root / f"greedy_{engine}.jsonl"
    assert main(["--mcore-dir", mc, "--prompts", str(root / "prompts.jsonl"), "--out", str(out), "--greedy",
                 "--max-new-tokens", "12", "--engine", engine]) == 0
    tok = build_tokenizer(TINY_TOKENIZER)
    for row, prompt in zip(_rows(out), PROMPTS):
        ids = tok.tokenize(prompt)
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, eos_token_id=tok.eod,
                          pad_token_id=tok.pad)[0, len(ids):].tolist()
        assert row["generated_tokens"] == ref, (prompt, row["generated_tokens"], ref)
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["prompts"] == 3


def test_cli_in_a_plain_process_equals_the_in_process_run(setup):
    """As a user runs it on a CPU machine: a fresh process without the test harness's CUDA redirects
    (megatron's inference controller moves its buffers with `.cuda()`; the library's `cpu_cuda_calls`
    patch keeps them on the CPU). Same tokens as the greedy run checked against transformers above."""
    import os
    import subprocess
    import sys

    from megatron_patch.generate import main

    root, _, mc = setup
    argv = ["--mcore-dir", mc, "--prompts", str(root / "prompts.jsonl"), "--greedy", "--max-new-tokens", "12"]
    assert main([*argv, "--out", str(root / "in_process.jsonl")]) == 0
    p = subprocess.run([sys.executable, "-m", "megatron_patch.generate", *argv, "--out", str(root / "plain.jsonl")],
                       capture_output=True, text=True, env={**os.environ, "TORCHDYNAMO_DISABLE": "1"}, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert ([r["generated_tokens"] for r in _rows(root / "plain.jsonl")]
            == [r["generated_tokens"] for r in _rows(root / "in_process.jsonl")])


def test_sampling_is_reproducible(setup):
    from megatron_patch.generate import main

    root, _, mc = setup
    runs = []
    for name, seed in (("a", "7"), ("b", "7"), ("c", "8")):
        assert main(["--hf-dir", str(root / "hf"), "--prompts", str(root / "prompts.jsonl"), "--out",
                     str(root / f"{name}.jsonl"), "--temperature", "1.0", "--top-k", "50", "--seed", seed,
                     "--max-new-tokens", "10"]) == 0
        runs.append([r["generated_tokens"] for r in _rows(root / f"{name}.jsonl")])
    assert runs[0] == runs[1] and runs[0] != runs[2]


def test_bad_input(setup, tmp_path, capsys):
    from megatron_patch.generate import main

    root, _, mc = setup
    notjson = tmp_path / "p.jsonl"
    notjson.write_text("hello\n")
    small = tmp_path / "small"
    small.mkdir()
    cfg = json.load(open(root / "hf" / "config.json"))
    for argv, match in [
        (["--mcore-dir", str(tmp_path / "none"), "--prompts", str(root / "prompts.jsonl")], "does not exist"),
        (["--mcore-dir", mc, "--prompts", str(notjson)], "line 1: not JSON"),
    ] + ([] if importlib.util.find_spec("transformer_engine") else [  # running TE naming needs TE
        (["--mcore-dir", mc, "--prompts", str(root / "prompts.jsonl"), "--impl", "transformer_engine"],
         "needs Transformer Engine, which is not installed"),
    ]):
        assert main(argv) == 1
        assert match in capsys.readouterr().err
    # a tokenizer with more tokens than the model's vocab
    json.dump({**cfg, "vocab_size": 500}, open(small / "config.json", "w"))
    model = hf_model({**llama_config("gqa"), "vocab_size": 500})
    model.save_pretrained(str(small))
    assert main(["--hf-dir", str(small), "--tokenizer", TINY_TOKENIZER, "--prompts", str(root / "prompts.jsonl")]) == 1
    assert "tokenizer has 1000 tokens but the model's vocab_size is 500" in capsys.readouterr().err


def _generate_tp2_and_pp2(rank: int, mc: str) -> dict[str, list[list[int]]]:
    from megatron_patch.inference import Sampling, generate, load_model
    from megatron_patch.models import Layout
    from megatron_patch.tokenizer import build_tokenizer
    from tests import _cpu

    tok = build_tokenizer(TINY_TOKENIZER)
    out = {}
    for tp, pp in ((2, 1), (1, 2)):
        _cpu.init_model_parallel(tp, pp)
        model, _ = load_model(mc, None, layout=Layout(tp, pp))
        out[f"tp{tp}pp{pp}"] = generate(model, tok, [tok.tokenize(p) for p in PROMPTS],
                                        Sampling(12, top_k=1, stop_id=tok.eod), max_batch_size=2)
    return out


def test_greedy_at_tp2_and_pp2_equals_transformers(setup):
    """The same prompts at TP=2 and at PP=2 (two gloo processes, the checkpoint's TP2 x PP2 resharded),
    two in flight: megatron-core's dynamic engine runs pipeline stages (the last broadcasts the logits)."""
    from megatron_patch.tokenizer import build_tokenizer
    from tests import _cpu

    root, hf, mc = setup
    tok = build_tokenizer(TINY_TOKENIZER)
    per_rank = _cpu.run_world(2, _generate_tp2_and_pp2, mc)
    for i, prompt in enumerate(PROMPTS):
        ids = tok.tokenize(prompt)
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, eos_token_id=tok.eod,
                          pad_token_id=tok.pad)[0, len(ids):].tolist()
        for layout in ("tp2pp1", "tp1pp2"):
            assert per_rank[0][layout][i] == per_rank[1][layout][i] == ref, layout


def test_single_prompt_streams_to_terminal(setup, tmp_path, capsys):
    """--stream prints the text step by step to stderr; the streamed text is the final generation, and
    the library's per-step callback sees the tokens grow one at a time."""
    from megatron_patch.generate import main
    from megatron_patch.inference import Sampling, generate, load_model
    from megatron_patch.tokenizer import build_tokenizer

    root, _, mc = setup
    one = tmp_path / "one.jsonl"
    one.write_text(json.dumps({"prompt": PROMPTS[1]}) + "\n")
    assert main(["--mcore-dir", mc, "--prompts", str(one), "--out", str(tmp_path / "o.jsonl"), "--greedy",
                 "--max-new-tokens", "8", "--stream"]) == 0
    row = _rows(tmp_path / "o.jsonl")[0]
    assert row["generated_text"] and capsys.readouterr().err.endswith(row["generated_text"] + "\n")
    tok = build_tokenizer(TINY_TOKENIZER)
    model, _ = load_model(mc, None)
    seen = []
    out = generate(model, tok, [tok.tokenize(PROMPTS[1])], Sampling(8, top_k=1),
                   on_tokens=lambda i, t: seen.append((i, t)))
    assert [len(t) for _, t in seen] == list(range(1, len(out[0]) + 1)) and seen[-1] == (0, out[0])


class _EodIs:
    """The tiny tokenizer with another end-of-document token."""

    def __init__(self, tokenizer, eod):
        self.tokenizer, self.eod = tokenizer, eod

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


def _model_never_loads(*args, **kwargs):
    raise RuntimeError("the model was loaded")


def _cut_at_stop(tok, tokens: list[int], stop: list[str], max_new: int) -> tuple[list[int], str]:
    """Reference: the shortest prefix of an unstopped generation whose text holds a stop string."""
    for j in range(1, len(tokens) + 1):
        if any(s in tok.detokenize(tokens[:j]) for s in stop):
            return tokens[:j], "stop"
    return tokens, "length" if len(tokens) == max_new else "eod"


@pytest.mark.parametrize("engine", ["static", "dynamic"])
def test_stop_string_ends_generation_at_the_completing_token(setup, tmp_path, engine):
    """A stop string that ends inside a token: that sequence's last token is the one completing it,
    generated_text is exactly the decoding of generated_tokens (so it ends with the stop string plus the
    rest of that token), the other sequences of the batch run on unchanged, and the model is run only
    as many steps as tokens were kept (generation stopped, not trimmed afterwards)."""
    from megatron_patch.generate import main
    from megatron_patch.inference import Sampling, generate, load_model
    from megatron_patch.tokenizer import build_tokenizer

    root, _, mc = setup
    tok = build_tokenizer(TINY_TOKENIZER)
    model, _ = load_model(mc, None)
    ids = [tok.tokenize(p) for p in PROMPTS]
    full = generate(model, tok, ids, Sampling(12, top_k=1, stop_id=tok.eod), engine=engine)
    # a stop string for prompt 0: the last character before token k and the first of token k's text
    for k in range(1, len(full[0]) - 1):
        before, text = tok.detokenize(full[0][:k]), tok.detokenize(full[0][:k + 1])
        if text.startswith(before) and len(text) - len(before) >= 2:
            stop = before[-1:] + text[len(before)]
            if stop not in before and text.index(stop) + len(stop) < len(text):  # ends inside token k
                break
    else:
        raise AssertionError(f"no token of {full[0]} suits a mid-token stop string")

    calls = []
    hook = model.register_forward_hook(lambda *a: calls.append(1))
    try:
        one = generate(model, tok, [ids[0]], Sampling(12, top_k=1, stop_id=tok.eod, stop=[stop]), engine=engine)
    finally:
        hook.remove()
    assert one == [full[0][:k + 1]] and len(calls) == k + 1 < 12

    # and one spanning several tokens of prompt 2 (from inside its first token to the end of its fifth)
    several = tok.detokenize(full[2][:5])[1:]
    assert several not in tok.detokenize(full[0]) and several not in tok.detokenize(full[2][:4])
    out = tmp_path / "stop.jsonl"
    assert main(["--mcore-dir", mc, "--prompts", str(root / "prompts.jsonl"), "--out", str(out), "--greedy",
                 "--max-new-tokens", "12", "--stop", stop, several, "--engine", engine]) == 0
    rows = _rows(out)
    assert rows[2]["generated_tokens"] == full[2][:5] and rows[2]["finish_reason"] == "stop"
    for row, tokens in zip(rows, full):
        want, reason = _cut_at_stop(tok, tokens, [stop, several], 12)
        assert row["generated_tokens"] == want and row["finish_reason"] == reason
        assert row["generated_text"] == tok.detokenize(row["generated_tokens"])
    assert rows[0]["generated_tokens"] == full[0][:k + 1] and rows[0]["generated_text"].endswith(text[len(before):])
    assert any(r["finish_reason"] == "length" for r in rows)  # the batch went on for the others


@pytest.mark.skipif(not async_scheduling_available(), reason="megatron-core < 0.19 has no asynchronous scheduling")
def test_async_scheduling_generates_the_same_tokens(setup, monkeypatch):
    """megatron-core's asynchronous scheduling (`dynamic.ASYNC_SCHEDULING`) against the default: the same
    greedy tokens for prompts of different lengths with more prompts than slots (continuous batching), an
    end token and a stop string; the engine is rebuilt when the setting changes (not reused across it)."""
    from megatron_patch.inference import Sampling, dynamic, generate, load_model
    from megatron_patch.tokenizer import build_tokenizer

    _, _, mc = setup
    tok = build_tokenizer(TINY_TOKENIZER)
    model, _ = load_model(mc, None)
    ids = [tok.tokenize(p) for p in PROMPTS * 2]
    runs = {}
    for on in (False, True):
        monkeypatch.setattr(dynamic, "ASYNC_SCHEDULING", on)
        full = generate(model, tok, ids, Sampling(12, top_k=1, stop_id=tok.eod), max_batch_size=2, engine="dynamic")
        assert dynamic._Engines.plan.async_scheduling is on
        end = full[1][4]  # a token the greedy run samples: an end token that cuts requests short
        cut = generate(model, tok, ids, Sampling(12, top_k=1, stop_id=end), max_batch_size=2, engine="dynamic")
        stop = tok.detokenize(full[0][:3])[-2:]
        stopped = generate(model, tok, ids, Sampling(12, top_k=1, stop_id=tok.eod, stop=[stop]), max_batch_size=2,
                           engine="dynamic")
        runs[on] = full, cut, stopped
    dynamic.release_engine()
    assert runs[True] == runs[False]
    full, cut, stopped = runs[False]
    assert all(len(t) == 12 for t in full) and any(len(t) < 12 for t in cut) and any(len(t) < 12 for t in stopped)


def test_empty_prompt_is_refused_with_its_line(setup, tmp_path, capsys, monkeypatch):
    from megatron_patch.generate import main
    from megatron_patch.inference import Sampling, generate
    from megatron_patch.tokenizer import build_tokenizer

    root, _, mc = setup
    monkeypatch.setattr("megatron_patch.inference.load_model", _model_never_loads)
    prompts = tmp_path / "p.jsonl"
    for row in ({"prompt": ""}, {"messages": []}):
        prompts.write_text(json.dumps({"prompt": "def f(x):"}) + "\n\n" + json.dumps(row) + "\n")
        assert main(["--mcore-dir", mc, "--prompts", str(prompts), "--out", str(tmp_path / "o.jsonl")]) == 1
        assert f"error: {prompts}, line 3: empty prompt" in capsys.readouterr().err
    assert not (tmp_path / "o.jsonl").exists()
    with pytest.raises(ValueError, match="prompt 1 is empty"):  # the library refuses it too
        generate(None, build_tokenizer(TINY_TOKENIZER), [[5, 6], []], Sampling(4))


def test_out_is_checked_before_the_model_loads(setup, tmp_path, capsys, monkeypatch):
    from megatron_patch.generate import main

    root, _, mc = setup
    monkeypatch.setattr("megatron_patch.inference.load_model", _model_never_loads)
    (tmp_path / "a_file").write_text("")
    for out, match in [(tmp_path, "is a folder"), (tmp_path / "missing" / "o.jsonl", "does not exist"),
                       (tmp_path / "a_file" / "o.jsonl", "is a file, not a folder")]:
        assert main(["--mcore-dir", mc, "--prompts", str(root / "prompts.jsonl"), "--out", str(out)]) == 1
        err = capsys.readouterr().err
        assert f"error: --out {out}" in err and match in err, err
    assert main(["--mcore-dir", mc, "--prompts", str(root / "prompts.jsonl"), "--stop", ""]) == 1
    assert "error: --stop: an empty string" in capsys.readouterr().err


def test_out_is_written_whole_with_the_umask_mode(setup, tmp_path):
    """A failure while the results are written (here: a file-size limit, as a full disk would do, in a
    plain process) leaves an existing --out as it was and no temporary file; a success replaces it with
    the mode `open()` would give a new file under the user's umask."""
    import resource
    import signal
    import subprocess
    import sys

    from megatron_patch.generate import main

    root, _, mc = setup
    out = tmp_path / "o.jsonl"
    argv = ["--mcore-dir", mc, "--prompts", str(root / "prompts.jsonl"), "--out", str(out), "--greedy",
            "--max-new-tokens", "3"]
    out.write_text("old\n")

    def small_files():  # in the child: writes past 200 bytes fail with EFBIG instead of a signal
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (200, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

    p = subprocess.run([sys.executable, "-m", "megatron_patch.generate", *argv], capture_output=True, text=True,
                       env={**os.environ, "TORCHDYNAMO_DISABLE": "1"}, timeout=300, preexec_fn=small_files)
    assert p.returncode == 1 and "error: [Errno 27] File too large" in p.stderr, p.stderr[-3000:]
    assert out.read_text() == "old\n" and os.listdir(tmp_path) == ["o.jsonl"]
    out.unlink()
    old = os.umask(0o027)
    try:
        assert main(argv) == 0
    finally:
        os.umask(old)
    assert len(_rows(out)) == 3 and os.stat(out).st_mode & 0o777 == 0o640
    assert os.listdir(tmp_path) == ["o.jsonl"]


def test_without_out_stdout_holds_only_the_rows(setup, capsys, monkeypatch):
    """Rows on stdout (pipeable into a JSONL reader), the summary on stderr; stdin prompts, one per
    non-blank line."""
    from megatron_patch.generate import main

    root, _, mc = setup
    monkeypatch.setattr("sys.stdin", io.StringIO("def f(x):\n\nThe interpreter\n"))
    assert main(["--mcore-dir", mc, "--greedy", "--max-new-tokens", "4", "--no-stream"]) == 0
    captured = capsys.readouterr()
    rows = [json.loads(line) for line in captured.out.splitlines()]
    assert [r["prompt"] for r in rows] == ["def f(x):", "The interpreter"]
    assert all(len(r["generated_tokens"]) == 4 and r["finish_reason"] == "length" for r in rows)
    summary = json.loads(captured.err.strip().splitlines()[-1])
    assert summary["prompts"] == 2 and summary["new_tokens"] == 8 and summary["out"] is None


def test_generation_ends_before_eod(setup):
    """megatron stops a sequence at the tokenizer's end-of-document token and leaves it out: the tokens
    are those before it, and finish_reason says "eod". (A tokenizer whose eod is a token this model
    generates greedily for prompt 2, at its 5th step.)"""
    from megatron_patch.generate import finish_reason
    from megatron_patch.inference import Sampling, generate, load_model
    from megatron_patch.tokenizer import build_tokenizer

    *_, mc = setup
    tok = build_tokenizer(TINY_TOKENIZER)
    model, _ = load_model(mc, None)
    full = generate(model, tok, [tok.tokenize(PROMPTS[2])], Sampling(12, top_k=1, stop_id=tok.eod))[0]
    eod = full[4]
    assert eod not in full[:4]

    other = _EodIs(tok, eod)
    out = generate(model, other, [tok.tokenize(PROMPTS[2])], Sampling(12, top_k=1, stop_id=eod))[0]
    assert out == full[:4]
    assert finish_reason(tok.detokenize(out), out, [], 12) == "eod"
    assert finish_reason(tok.detokenize(full), full, [], 12) == "length"


def test_stop_strings_take_the_escapes_a_shell_passes_through():
    """`--stop "\\n\\n"` typed in bash reaches the tool as backslash-n twice: it means two newlines."""
    from megatron_patch.generate import unescape

    assert unescape("\\n\\n") == "\n\n" and unescape("a\\tb\\r") == "a\tb\r"
    assert unescape("\\\\n") == "\\n" and unescape("C:\\x") == "C:\\x" and unescape("plain") == "plain"


MORE = PROMPTS + ["Errors detected during execution are called exceptions", "x = [1, 2", "import os"]


def test_continuous_batching_frees_slots_as_requests_finish(setup):
    """Six prompts of different lengths, at most two in flight, with an end token that ends some early:
    every request's tokens equal transformers' `generate` alone with that end token (and one-at-a-time
    generation), never more than two requests run in a step, and a waiting request starts in the step
    after a slot frees, while the other slot's request is still running (continuous, not fixed batches)."""
    from megatron_patch.inference import Sampling, generate, load_model
    from megatron_patch.tokenizer import build_tokenizer

    root, hf, mc = setup
    tok = build_tokenizer(TINY_TOKENIZER)
    model, _ = load_model(mc, None)
    ids = [tok.tokenize(p) for p in MORE]
    full = generate(model, tok, [ids[0]], Sampling(12, top_k=1), engine="dynamic")[0]
    k = next(k for k in range(2, 12) if full[k] not in full[:k])
    eod = full[k]  # request 0 ends after k tokens
    ends = _EodIs(tok, eod)
    steps, grew = [0], {}
    hook = model.register_forward_pre_hook(lambda *a: steps.__setitem__(0, steps[0] + 1))
    try:
        out = generate(model, ends, ids, Sampling(12, top_k=1, stop_id=eod), max_batch_size=2,
                       on_tokens=lambda i, t: grew.setdefault(steps[0], set()).add(i), engine="dynamic")
    finally:
        hook.remove()
    for prompt, mine in zip(ids, out):
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=eod,
                          pad_token_id=tok.pad)[0, len(prompt):].tolist()
        assert mine == (ref[:-1] if ref[-1] == eod else ref)
    assert out == [generate(model, ends, [p], Sampling(12, top_k=1, stop_id=eod), max_batch_size=1, engine="dynamic")[0]
                   for p in ids]
    assert len(out[0]) == k < len(out[1]) and max(len(g) for g in grew.values()) == 2
    first = {i: min(s for s, g in grew.items() if i in g) for i in range(len(ids))}
    last = {i: max(s for s, g in grew.items() if i in g) for i in range(len(ids))}
    # request 0 grows in steps 1..k and samples its end token in step k + 1; request 2 takes its slot in
    # the next step, while request 1 still runs
    assert first[0] == first[1] == 1 and last[0] == k and first[2] == k + 2 < last[1]


def test_kv_budget_and_context_are_checked(setup, tmp_path, capsys, monkeypatch):
    """Refused with one `error:` line, nothing written: a prompt that leaves less than --max-new-tokens of
    the model's context (before the model loads), an empty prompt file (likewise), a KV cache budget
    that cannot hold the longest request (before any generation). The library refuses the same."""
    from megatron_patch.generate import main
    from megatron_patch.inference import Sampling, generate, load_model
    from megatron_patch.tokenizer import build_tokenizer

    root, _, mc = setup
    tok = build_tokenizer(TINY_TOKENIZER)
    n = len(tok.tokenize(PROMPTS[1]))  # the longest
    out = tmp_path / "o.jsonl"
    argv = ["--mcore-dir", mc, "--prompts", str(root / "prompts.jsonl"), "--out", str(out)]
    assert main([*argv, "--max-new-tokens", "4", "--kv-cache-gb", "1e-6", "--engine", "dynamic"]) == 1
    err = capsys.readouterr().err
    assert (f"error: the KV cache budget of 1e-06 GiB (--kv-cache-gb) holds 0 tokens; the longest request needs "
            f"{n + 4} ({n} prompt + 4 new tokens), in blocks of 256 tokens" in err), err
    with monkeypatch.context() as m:
        m.setattr("megatron_patch.inference.load_model", _model_never_loads)
        assert main([*argv, "--max-new-tokens", "250"]) == 1
        assert (f"error: prompt 2 has {n} tokens: with --max-new-tokens 250 it needs {n + 250}, more than the "
                "model's context of 256 tokens" in capsys.readouterr().err)
        empty = tmp_path / "empty.jsonl"
        empty.write_text("\n")
        assert main(["--mcore-dir", mc, "--prompts", str(empty), "--out", str(out)]) == 1
        assert f"error: no prompts in {empty}" in capsys.readouterr().err
    assert not out.exists()
    model, _ = load_model(mc, None)
    with pytest.raises(ValueError, match="more than the model's context of 256"):
        generate(model, tok, [tok.tokenize(PROMPTS[0])], Sampling(254))
    with pytest.raises(ValueError, match="budget of 1e-06 GiB .* holds 0 tokens"):
        generate(model, tok, [tok.tokenize(PROMPTS[0])], Sampling(4), kv_cache_gb=1e-6, engine="dynamic")
    with pytest.raises(ValueError, match="one of the two filters"):
        generate(model, tok, [tok.tokenize(PROMPTS[0])], Sampling(4, top_k=5, top_p=0.9))


def test_engine_is_kept_between_calls_and_inference_mode_cleared(setup):
    """The engine (KV cache, graphs on a GPU) is built once for calls that fit it and rebuilt for one that
    does not; after a call megatron-core's process-wide InferenceMode is off again, so plain forward
    passes of the same model (scoring, training) still run."""
    from megatron.core.inference.utils import InferenceMode

    from megatron_patch import inference
    from megatron_patch.inference import dynamic
    from megatron_patch.runtime.logits import megatron_logits
    from megatron_patch.tokenizer import build_tokenizer

    *_, mc = setup
    tok = build_tokenizer(TINY_TOKENIZER)
    model, _ = inference.load_model(mc, None)
    ids = [tok.tokenize(p) for p in PROMPTS]
    greedy = inference.Sampling
    first = inference.generate(model, tok, ids, greedy(6), engine="dynamic")
    engine = dynamic._Engines.engine
    assert inference.generate(model, tok, ids[:2], greedy(4), engine="dynamic") == [t[:4] for t in first[:2]]
    assert dynamic._Engines.engine is engine and not InferenceMode.is_active()
    assert inference.generate(model, tok, ids, greedy(12), engine="dynamic")[0][:6] == first[0]  # a new engine
    assert dynamic._Engines.engine is not engine
    megatron_logits(model, torch.tensor([ids[0]]), 1000)
    dynamic.release_engine()
    assert dynamic._Engines.engine is None


def _hf_greedy(c, prompt: list[int], n: int) -> list[int]:
    """The reference's greedy tokens: transformers' generate, or argmax over its logits token by token (the
    ALiBi Baichuan reference is a module, not a transformers model)."""
    with torch.no_grad():
        if hasattr(c.ref, "generate"):
            return c.ref.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                                  pad_token_id=0)[0, len(prompt):].tolist()
        seq = list(prompt)
        for _ in range(n):
            seq.append(int(c.ref(torch.tensor([seq])).logits[0, -1].argmax()))
        return seq[len(prompt):]


def _converted(variant: str, **overrides):
    from megatron_patch.conversion.engine import hf_to_megatron, load_rank_state_dict, make_plan
    from megatron_patch.models import build_model
    from tests.models import any_config, case, case_of

    c = case_of({**any_config(variant), **overrides}) if overrides else case(variant)
    model = build_model(c.cfg).eval()
    load_rank_state_dict(model, hf_to_megatron(make_plan(c.cfg), c.sd.__getitem__, c.sd.keys())[(0, 0, 0)])
    return c, model


@pytest.mark.parametrize("variant", ["deepseek_v3", "deepseek_v2"])
def test_multi_latent_attention_runs_on_the_dynamic_engine(variant, cpu_megatron, monkeypatch):
    """Multi-latent attention (DeepSeek) on the dynamic engine, which `auto` picks on a CPU: the paged cache holds
    each token's latent (kv_lora_rank + rope dims, blocks of 64 tokens as megatron-core's cached-latent path
    asserts), prefill attends over the latents up-projected, decode with the up-projection absorbed into the
    queries (`mla_latent_cache` patch). Greedy tokens = transformers' generate for prompts of mixed lengths,
    one longer than a block, as on the static engine. The latent switch is on for the call only and the layers
    keep their weights: a training forward pass after generating gives the same logits as before it."""
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    from megatron_patch import patches
    from megatron_patch.inference import Sampling, choose_engine, dynamic, generate, paged_attention
    from megatron_patch.tokenizer import build_tokenizer

    c, model = _converted(variant)
    tok = build_tokenizer(TINY_TOKENIZER)
    assert choose_engine(model) == "dynamic"
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    before = model(ids, torch.arange(8)[None], None).detach().clone()
    prompts = [[5, 6, 7], [(7 * i) % 997 + 2 for i in range(70)], [9, 10, 11, 12, 13, 14]]
    want = [_hf_greedy(c, p, 10) for p in prompts]
    calls, up = [], []
    for name in ("mla_prefill", "mla_decode"):
        def spy(self, q, latents, *args, name=name, original=getattr(paged_attention, name)):
            calls.append((name, latents.dim(), q.shape[-1]))
            return original(self, q, latents, *args)

        monkeypatch.setattr(paged_attention, name, spy)
    uncompress = MLASelfAttention.uncompress_kv_from_cache
    monkeypatch.setattr(MLASelfAttention, "uncompress_kv_from_cache",
                        lambda self, rows: up.append(rows.numel() // rows.shape[-1]) or uncompress(self, rows))
    assert generate(model, tok, prompts, Sampling(10, top_k=1), engine="dynamic") == want
    cfg = model.config  # prefill: queries per head over the latents; decode: absorbed queries over the latents
    assert ("mla_prefill", 3, cfg.qk_head_dim + cfg.qk_pos_emb_head_dim) in calls
    assert ("mla_decode", 3, cfg.kv_lora_rank + cfg.qk_pos_emb_head_dim) in calls
    # each prefill up-projects its own request's latents, not the whole cache (pages of 64 for 3 requests)
    assert up and max(up) <= max(map(len, prompts)) + 10
    assert generate(model, tok, prompts, Sampling(10, top_k=1), engine="static") == want
    assert not patches.is_active("mla_latent_cache") and not model.config.cache_mla_latents
    layers = [m for m in model.modules() if hasattr(m, "cache_mla_latents")]
    assert layers and not any(m.cache_mla_latents for m in layers)
    assert torch.equal(model(ids, torch.arange(8)[None], None), before)
    dynamic.release_engine()


@pytest.mark.parametrize("rope", ["rope", "yarn"])
def test_multi_latent_attention_keeps_its_rotary_tables_with_the_engine(cpu_megatron, monkeypatch, rope):
    """Multi-latent attention computes its rotary table inside the decoder block (GQA's comes in from the model, a
    graph input), read from megatron-core's lru_cache on `RotaryEmbedding.forward` (32 entries, process-wide),
    which `generate` clears after every call (`forget_inference_rope`). A CUDA graph reads the table's memory, not
    the object: the engine kept for the next call replayed its graphs over a freed table, so that call's tokens
    parted from eager decoding (the H200, 2026-12-04). The tables the MLA layers read live as long as the kept
    engine: the second call computes none and reads the first call's, alive between the calls, freed with the
    engine; tokens as before, and transformers' (with YaRN too, as DeepSeek's released models rotate: its
    embedding returns the table with its concentration factor)."""
    import gc
    import weakref

    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import YarnRotaryEmbedding

    from megatron_patch.inference import Sampling, dynamic, generate
    from megatron_patch.tokenizer import build_tokenizer
    from tests.models import DEEPSEEK_YARN

    torch.manual_seed(0)
    c, model = _converted("deepseek_v3", **({"rope_scaling": DEEPSEEK_YARN} if rope == "yarn" else {}))
    tok = build_tokenizer(TINY_TOKENIZER)
    made = []  # the tables computed, as weak references
    cls = YarnRotaryEmbedding if rope == "yarn" else RotaryEmbedding
    get_emb = cls.get_emb

    def spy(self, *args, **kwargs):
        emb = get_emb(self, *args, **kwargs)
        made.append(weakref.ref(emb[0] if isinstance(emb, tuple) else emb))
        return emb

    monkeypatch.setattr(cls, "get_emb", spy)
    prompts = [[5, 6, 7], [(7 * i) % 997 + 2 for i in range(70)], [9, 10, 11, 12, 13, 14]]
    dynamic.release_engine()
    first = generate(model, tok, prompts, Sampling(6, top_k=1), engine="dynamic")
    assert first == [_hf_greedy(c, p, 6) for p in prompts]
    gc.collect()
    assert made and all(r() is not None for r in made)  # alive with the kept engine
    count = len(made)
    assert generate(model, tok, prompts, Sampling(6, top_k=1), engine="dynamic") == first
    assert len(made) == count  # the second call read the first call's tables
    assert all("forward" not in m.__dict__ for m in model.modules() if isinstance(m, RotaryEmbedding))
    dynamic.release_engine()
    gc.collect()
    assert all(r() is None for r in made)


def _generate_mla(rank: int, hf_dir: str, prompts: list[list[int]]) -> dict[str, list[list[int]]]:
    from megatron_patch.inference import Sampling, generate, load_model
    from megatron_patch.models import Layout
    from megatron_patch.tokenizer import build_tokenizer
    from tests import _cpu

    tok = build_tokenizer(TINY_TOKENIZER)
    out = {}
    for tp, pp in ((2, 1), (1, 2)):
        _cpu.init_model_parallel(tp, pp)
        model, _ = load_model(None, hf_dir, layout=Layout(tp, pp))
        out[f"tp{tp}pp{pp}"] = generate(model, tok, prompts, Sampling(8, top_k=1), max_batch_size=2,
                                        engine="dynamic")
    return out


def test_multi_latent_attention_at_tp2_and_pp2_on_the_dynamic_engine(cpu_megatron, tmp_path):
    """The latent cache at TP = 2 (each rank caches the whole latent, its heads' absorbed up-projections are views
    of its shard of `linear_kv_up_proj`) and at PP = 2 (each stage caches its own layers' latents): greedy tokens
    = transformers' for prompts of mixed lengths, two in flight, on both ranks."""
    from tests import _cpu
    from tests.models import case, save_case

    c = case("deepseek_v3")
    hf_dir = save_case(c, str(tmp_path / "hf"))
    prompts = [[5, 6, 7], [(7 * i) % 997 + 2 for i in range(70)], [9, 10, 11, 12]]
    want = [_hf_greedy(c, p, 8) for p in prompts]
    per_rank = _cpu.run_world(2, _generate_mla, hf_dir, prompts)
    for layout in ("tp2pp1", "tp1pp2"):
        assert per_rank[0][layout] == per_rank[1][layout] == want, layout


class _FusedNormLinear(torch.nn.Module):
    """Transformer Engine's fused norm + linear as megatron-core's MLA holds it in `linear_kv_up_proj` (the kv
    norm inside, `kv_layernorm` an identity): its attribute names, in torch."""

    def __init__(self, norm, linear):
        super().__init__()
        self.layer_norm_weight, self.weight, self.eps = norm.weight, linear.weight, norm.eps
        self.normalization, self.zero_centered_gamma, self.use_bias = "RMSNorm", False, False

    def forward(self, x):
        normed = torch.nn.functional.rms_norm(x, self.layer_norm_weight.shape, self.layer_norm_weight, self.eps)
        return torch.nn.functional.linear(normed, self.weight), None


def test_multi_latent_attention_with_a_fused_kv_norm_on_the_dynamic_engine(cpu_megatron):
    """With Transformer Engine the kv norm lives inside `linear_kv_up_proj` (a fused norm + linear), which
    megatron-core's own cached-latent path splits into copies and deletes. The patch caches latents normed by
    the fused layer's own norm weight (for the call) and up-projects with its linear part: greedy tokens = HF, and
    afterwards the layer is as before (the identity back in `kv_layernorm`, the same state dict)."""
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.multi_latent_attention import MultiLatentAttention

    from megatron_patch.inference import Sampling, dynamic, generate
    from megatron_patch.tokenizer import build_tokenizer

    c, model = _converted("deepseek_v3")
    tok = build_tokenizer(TINY_TOKENIZER)
    layers = [m for m in model.modules() if isinstance(m, MultiLatentAttention)]
    for m in layers:
        m.linear_kv_up_proj, m.kv_layernorm = _FusedNormLinear(m.kv_layernorm, m.linear_kv_up_proj), IdentityOp()
    keys = sorted(model.state_dict())
    prompts = [[5, 6, 7], [(7 * i) % 997 + 2 for i in range(70)]]
    want = [_hf_greedy(c, p, 10) for p in prompts]
    assert generate(model, tok, prompts, Sampling(10, top_k=1), engine="static") == want
    assert generate(model, tok, prompts, Sampling(10, top_k=1), engine="dynamic") == want
    assert all(isinstance(m.kv_layernorm, IdentityOp) for m in layers) and sorted(model.state_dict()) == keys
    dynamic.release_engine()


def test_multi_latent_attention_takes_the_dynamic_engine_on_a_gpu(cpu_megatron, monkeypatch):
    """On a GPU `auto` puts DeepSeek on the dynamic engine since the H200 smoke of 2026-12-05 (`dynamic.MLA_ON_GPU`:
    HF's tokens there, 12x the static engine's decoding speed at v2-lite); with the switch off, the static engine, and
    `unsupported_attention` gives the reason the dynamic engine refuses with."""
    from megatron_patch.inference import choose_engine, dynamic

    _, model = _converted("deepseek_v3")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert dynamic.unsupported_attention(model) is None
    assert choose_engine(model) == "dynamic"
    monkeypatch.setattr(dynamic, "MLA_ON_GPU", False)
    assert "multi-latent attention" in dynamic.unsupported_attention(model)
    assert choose_engine(model) == "static"


def test_moe_router_fusion_is_planned_and_put_back(cpu_megatron, monkeypatch):
    """`dynamic.MOE_ROUTER_FUSION` (on by default since the H200 of 2026-12-05): on a GPU where megatron-core found
    Transformer Engine's fused top-k, an MoE model's plan routes on it (a dense model's does not, nor without the
    kernel or the switch);
    `router_fusion` sets `moe_router_fusion` in the configs the routers read for the engine's calls and puts the
    old value back after, even when the call fails; a plan without it does not serve one with it."""
    from megatron.core.transformer.moe import moe_utils

    from megatron_patch.inference import dynamic

    _, model = _converted("mixtral")
    _, dense = _converted("gqa")
    plan = lambda m: dynamic.plan_engine(m, [[5, 6, 7]], 4, kv_cache_gb=0.01)  # noqa: E731
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(dynamic, "MOE_GRAPHS", False)
    assert dynamic.MOE_ROUTER_FUSION
    monkeypatch.setattr(moe_utils, "fused_topk_with_score_function", None)
    assert not dynamic.router_fusion_available() and not plan(model).moe_router_fusion
    monkeypatch.setattr(moe_utils, "fused_topk_with_score_function", lambda **kwargs: None)
    fused = plan(model)
    assert fused.moe_router_fusion and not plan(dense).moe_router_fusion
    with monkeypatch.context() as m:
        m.setattr(dynamic, "MOE_ROUTER_FUSION", False)
        assert not plan(model).moe_router_fusion
    assert not dataclasses.replace(fused, moe_router_fusion=False).covers(fused)
    routers = [m.router.config for m in dynamic.moe_layers(model)]
    assert routers and not any(c.moe_router_fusion for c in routers)
    with pytest.raises(RuntimeError, match="inside"):
        with dynamic.router_fusion(model, True):
            assert model.config.moe_router_fusion and all(c.moe_router_fusion for c in routers)
            raise RuntimeError("inside")
    assert not model.config.moe_router_fusion and not any(c.moe_router_fusion for c in routers)
    with dynamic.router_fusion(model, False):
        assert not any(c.moe_router_fusion for c in routers)


@pytest.mark.parametrize("variant", ["mixtral", "deepseek_v3"])
def test_moe_and_latent_attention_plan_their_cuda_graphs(variant, cpu_megatron, monkeypatch):
    """megatron-core's MoE token dispatchers read each expert's token count on the host (`.cpu()`, `.item()`),
    which a CUDA graph cannot capture (on the H200, 2026-12-04: `Cannot copy between CPU and CUDA tensors during
    CUDA graph capture`, all-gather dispatcher): the engine captures MoE layers on the all-to-all dispatcher padded
    to capacity (`moe_graph_dispatch`, tested above), so MoE models get graphs on a GPU as dense ones do; the flex
    dispatcher, which has no such mode here, is refused with the reason. Multi-latent attention's graphs (on since
    the H200 smoke of 2026-12-05, `dynamic.MLA_GRAPHS`) where the Triton kernel decodes (`mla_kernel_takes`: 16-bit,
    DeepSeek's widths); refused with the reason where torch decodes (these tiny fp32 models, a rotated part of 8).
    The plan records the MLA RoPE kernel (`decode_rope.MLA_ROPE`) for MLA models only."""
    from megatron_patch.inference import decode_attention, decode_rope, dynamic
    from megatron_patch.models import build_model
    from tests.models import case

    _, model = _converted(variant)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(dynamic, "MOE_DROPLESS", False)  # the padded path (dropless: the next tests)
    assert model.config.num_moe_experts
    # by default since the H200 smoke of 2026-12-05 (dynamic.MOE_GRAPHS); with the switch off, only when asked for
    monkeypatch.setattr(dynamic, "MOE_GRAPHS", False)
    assert not dynamic.plan_engine(model, [[5, 6, 7]], 4, kv_cache_gb=0.01).cuda_graphs
    if variant == "mixtral":
        assert dynamic.plan_engine(model, [[5, 6, 7]], 4, kv_cache_gb=0.01, cuda_graphs=True).cuda_graphs
    monkeypatch.setattr(dynamic, "MOE_GRAPHS", True)
    plan = dynamic.plan_engine(model, [[5, 6, 7]], 4, kv_cache_gb=0.01)
    assert plan.cuda_graphs == (variant == "mixtral")  # (DeepSeek-V3: multi-latent attention decoded in torch)
    assert not plan.non_decode_graphs  # (a prefill padded to capacity: a row per expert for each of its tokens)
    if variant == "deepseek_v3":  # where the Triton kernel decodes, its MoE layers are captured as Mixtral's
        with monkeypatch.context() as m:
            m.setattr(decode_attention, "mla_kernel_takes", lambda *args: True)
            assert dynamic.plan_engine(model, [[5, 6, 7]], 4, kv_cache_gb=0.01).cuda_graphs
        # the MLA RoPE kernel (decode_rope.MLA_ROPE, on by default) is part of what a kept engine's graphs run
        assert decode_rope.MLA_ROPE and plan.mla_rope
        with monkeypatch.context() as m:
            m.setattr(decode_rope, "MLA_ROPE", False)
            without = dynamic.plan_engine(model, [[5, 6, 7]], 4, kv_cache_gb=0.01)
        assert not without.mla_rope and not plan.covers(without) and not without.covers(plan)
    else:
        assert decode_rope.MLA_ROPE and not plan.mla_rope
    if variant == "mixtral":
        for m in dynamic.moe_layers(model):
            monkeypatch.setattr(m.config, "moe_token_dispatcher_type", "flex")
        assert not dynamic.plan_engine(model, [[5, 6, 7]], 4, kv_cache_gb=0.01).cuda_graphs
        with pytest.raises(ValueError, match="CUDA graphs of MoE layers"):
            dynamic.plan_engine(model, [[5, 6, 7]], 4, kv_cache_gb=0.01, cuda_graphs=True)
    _, dense = _converted("gqa")
    assert dynamic.plan_engine(dense, [[5, 6, 7]], 4, kv_cache_gb=0.01).cuda_graphs
    # DeepSeek with no MoE layer (all dense: first_k_dense_replace = layers): multi-latent attention's graphs where
    # the Triton kernel decodes; where torch does, and with `dynamic.MLA_GRAPHS` off, refused with the reason
    c = case("deepseek_v3")
    dense = build_model({**c.cfg, "first_k_dense_replace": c.cfg["num_hidden_layers"]}).eval()
    assert dense.config.num_moe_experts and not dynamic.plan_engine(dense, [[5, 6, 7]], 4, kv_cache_gb=0.01).cuda_graphs
    with pytest.raises(ValueError, match="multi-latent attention decoded in torch"):
        dynamic.plan_engine(dense, [[5, 6, 7]], 4, kv_cache_gb=0.01, cuda_graphs=True)
    monkeypatch.setattr(decode_attention, "mla_kernel_takes", lambda *args: True)
    assert dynamic.plan_engine(dense, [[5, 6, 7]], 4, kv_cache_gb=0.01).cuda_graphs
    monkeypatch.setattr(dynamic, "MLA_GRAPHS", False)
    assert not dynamic.plan_engine(dense, [[5, 6, 7]], 4, kv_cache_gb=0.01).cuda_graphs
    with pytest.raises(ValueError, match="switched off"):
        dynamic.plan_engine(dense, [[5, 6, 7]], 4, kv_cache_gb=0.01, cuda_graphs=True)


@pytest.mark.parametrize("variant", ["mixtral", "qwen2_moe", "deepseek_v3"])
def test_moe_decode_graphs_pad_each_expert_to_capacity_on_the_all_to_all_dispatcher(variant, cpu_megatron,
                                                                                     monkeypatch):
    """MoE decode under CUDA graphs, megatron-core's way: its all-to-all dispatcher with drop-and-pad
    (`moe_pad_experts_for_cuda_graph_inference`: the controller pads each expert to capacity in graph steps, with a
    capacity of every token, `num_moe_experts / moe_router_topk`, so no token is dropped and the counts per expert
    are constants the host knows). `dynamic.moe_graph_dispatch` swaps the model's all-gather dispatchers for
    all-to-all ones and sets the switch for the engine's calls, then puts both back. Asserted on CPU in fp32: an MoE
    layer gives the same output padded as with the all-gather dispatcher (every token's experts weighted alike; the
    padded rows weigh 0), the same unpadded, and greedy generation inside the swap equals HF's."""
    from megatron.core.inference import utils as inference_utils
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    from megatron_patch.inference import Sampling, dynamic, generate
    from megatron_patch.tokenizer import build_tokenizer

    c, model = _converted(variant)
    cfg = model.config
    layers = dynamic.moe_layers(model)
    before = [m.token_dispatcher for m in layers]
    saved = (cfg.moe_pad_experts_for_cuda_graph_inference, cfg.moe_expert_capacity_factor,
             cfg.moe_pad_expert_input_to_capacity, cfg.moe_token_dispatcher_type)
    assert layers and cfg.moe_token_dispatcher_type == "allgather"
    torch.manual_seed(0)
    x = torch.randn(7, 1, cfg.hidden_size)
    with torch.no_grad():
        want = layers[0](x)[0]
        with dynamic.moe_graph_dispatch(model):
            assert all(isinstance(m.token_dispatcher, MoEAlltoAllTokenDispatcher) for m in layers)
            assert cfg.moe_pad_experts_for_cuda_graph_inference and inference_utils.moe_layer_cache is None
            capacity = cfg.num_moe_experts / cfg.moe_router_topk
            inference_utils.set_decode_expert_padding(model, True, capacity_factor=capacity)  # as in a graph step
            padded = layers[0](x)[0]
            d = layers[0].token_dispatcher
            assert d.drop_and_pad and d.capacity == x.shape[0]  # every expert takes every token's row
            inference_utils.set_decode_expert_padding(model, False)  # as in an eager (prefill) step
            unpadded = layers[0](x)[0]
            out = generate(model, build_tokenizer(TINY_TOKENIZER), [[5, 6, 7], [9, 10, 11, 12]],
                           Sampling(6, top_k=1), engine="dynamic")
        torch.testing.assert_close(padded, want, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(unpadded, want, rtol=1e-5, atol=1e-6)
    assert out == [_hf_greedy(c, p, 6) for p in ([5, 6, 7], [9, 10, 11, 12])]
    assert [m.token_dispatcher for m in layers] == before and inference_utils.moe_layer_cache is None
    assert (cfg.moe_pad_experts_for_cuda_graph_inference, cfg.moe_expert_capacity_factor,
            cfg.moe_pad_expert_input_to_capacity, cfg.moe_token_dispatcher_type) == saved
    dynamic.release_engine()


class _HostReads(torch.overrides.TorchFunctionMode):
    """Records the torch calls that read a tensor's values on the host (a stream synchronisation on a GPU, which a
    CUDA graph cannot capture) or size an output by them."""

    READS = {"tolist", "item", "cpu", "__bool__", "__int__", "__index__", "nonzero", "masked_select", "bincount",
             "unique", "repeat_interleave"}

    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in self.READS:
            self.seen.append(name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("variant", ["mixtral", "qwen2_moe", "deepseek_v3"])
def test_moe_layers_run_dropless_on_grouped_gemms_without_host_reads(variant, cpu_megatron, monkeypatch):
    """`moe_dropless.dispatch`: each MoE layer's tokens to their k experts and each expert's rows through two
    grouped GEMMs at device-side offsets (no drops, no padding, nothing read on the host: megatron-core's
    `SequentialMLP` reads the counts with `.tolist()` and runs its experts one by one). Asserted on CPU: a layer's
    output equals megatron-core's (fp32: the same products and sums, 1e-6; bf16: within two roundings of the
    largest output) for 7 tokens and for 1; megatron-core's layer reads counts on the host and the dropless one
    does not; the experts' weights are stacked in place (the same parameter objects, the same values, now slices of
    one [experts, out, in] buffer) and everything else is put back after the call; with `dynamic.MOE_DROPLESS` the
    engine plans it (graphs of prefill steps too, on a GPU) and greedy generation equals HF's, on the dynamic and the
    static engine."""
    from megatron_patch import patches
    from megatron_patch.inference import Sampling, dynamic, generate, moe_dropless
    from megatron_patch.tokenizer import build_tokenizer

    c, model = _converted(variant)
    layers = dynamic.moe_layers(model)
    assert layers and moe_dropless.refusals(layers) is None
    dispatchers = [m.token_dispatcher for m in layers]
    params = {n: p for n, p in model.named_parameters()}
    values = {n: p.detach().clone() for n, p in params.items()}
    torch.manual_seed(0)
    xs = [torch.randn(7, 1, model.config.hidden_size), torch.randn(1, 1, model.config.hidden_size)]
    with torch.no_grad():
        want = [layers[0](x)[0] for x in xs]
        with _HostReads() as reads:
            layers[0](xs[0])
        assert reads.seen  # (the check sees megatron-core's reads)
        with moe_dropless.dispatch(layers):
            assert all(isinstance(m.token_dispatcher, moe_dropless.DroplessDispatcher) for m in layers)
            with _HostReads() as reads:
                got = [layers[0](x)[0] for x in xs]
            assert reads.seen == []
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)
    assert [m.token_dispatcher for m in layers] == dispatchers
    assert all("forward" not in m.experts.__dict__ for m in layers)
    assert {n: p for n, p in model.named_parameters()} == params  # the same objects
    assert all(torch.equal(p, values[n]) for n, p in params.items())
    for m in layers:  # stacked in place: later calls view the weights without copying
        for ws in moe_dropless.expert_weights(m.experts):
            view, reverse = moe_dropless.stacked(ws)
            assert not reverse and view.data_ptr() == ws[0].data_ptr()
            assert torch.equal(view, torch.stack([w.detach() for w in ws]))
    monkeypatch.setattr(dynamic, "MOE_DROPLESS", True)
    plan = dynamic.plan_engine(model, [[5, 6, 7]], 4, kv_cache_gb=0.01)
    assert plan.moe_dropless
    prompts = [[5, 6, 7], [9, 10, 11, 12]]
    calls = count_calls(monkeypatch, moe_dropless.DroplessDispatcher, "dispatch_postprocess")
    want = [_hf_greedy(c, p, 6) for p in prompts]
    for engine in ("dynamic", "static"):  # (the static engine: where `auto` keeps DeepSeek on a GPU)
        calls.clear()
        assert generate(model, build_tokenizer(TINY_TOKENIZER), prompts, Sampling(6, top_k=1), engine=engine) == want
        assert len(calls) >= 6 * len(layers)  # every step through the dropless layers
        assert [m.token_dispatcher for m in layers] == dispatchers
    dynamic.release_engine()
    if variant == "mixtral":  # graphs of prefill and mixed steps too: no step pads its experts
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        plan = dynamic.plan_engine(model, [[5, 6, 7]], 4, kv_cache_gb=0.01, cuda_graphs=True)
        assert plan.moe_dropless and plan.cuda_graphs
        assert plan.non_decode_graphs == (not patches.attends_in_torch(model.config.params_dtype))
        # under graphs, dropless only where it pays (`dynamic.dropless_pays`: the share of experts chosen in a step
        # of the engine's requests, times DROPLESS_COST, below 1): top-2 of 4 experts pays at 1 and 2 requests, not
        # at 3 or 32 (padded then, decode-only graphs); without graphs, dropless at any count (no host read a layer)
        config = dynamic.moe_layers(model)[0].config
        assert (config.num_moe_experts, config.moe_router_topk) == (4, 2)
        pays = [dynamic.dropless_pays(config, n) for n in (1, 2, 3, 32)]
        assert pays == [True, True, False, False]  # shares 0.5, 0.75, 0.875, 1.0 times 1.3
        many = [[5, 6, 7]] * 32
        plan = dynamic.plan_engine(model, many, 4, kv_cache_gb=0.01, cuda_graphs=True)
        assert plan.cuda_graphs and not plan.moe_dropless and not plan.non_decode_graphs
        assert dynamic.plan_engine(model, many, 4, kv_cache_gb=0.01, cuda_graphs=False).moe_dropless


def test_moe_dropless_views_a_distributed_optimizers_buffer_in_place(cpu_megatron):
    """A model wrapped in megatron-core's DDP with the distributed optimizer (as RLHF trains its actor between
    rollouts) keeps its parameters in DDP's buffer, each expert's fc1 every fc1 + fc2 elements in reverse order: the
    dropless layer views them there (never moves them, so DDP and the optimizer keep working on the same storage)
    and gives megatron-core's output (bf16: within two roundings of the largest value)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from megatron_patch import patches
    from megatron_patch.inference import dynamic, moe_dropless
    from megatron_patch.models import build_model
    from tests.models import any_config

    torch.manual_seed(0)
    model = build_model(any_config("mixtral"), impl="local", dtype=torch.bfloat16)
    with patches.applied("cpu_parallel_state"):
        DistributedDataParallel(model.config, DistributedDataParallelConfig(use_distributed_optimizer=True), model)
    layers = dynamic.moe_layers(model)
    weights = [w for ws in moe_dropless.expert_weights(layers[0].experts) for w in ws]
    where = [(w.untyped_storage().data_ptr(), w.storage_offset()) for w in weights]
    assert len({p for p, _ in where}) == 1 and weights[0].untyped_storage().nbytes() > 2 * weights[0].nbytes
    assert moe_dropless.refusals(layers) is None and moe_dropless.stacked(weights[:len(weights) // 2])[1]
    model.eval()
    x = torch.randn(9, 1, model.config.hidden_size, dtype=torch.bfloat16)
    with torch.no_grad():
        want = layers[0](x)[0].float()
        with moe_dropless.dispatch(layers):
            got = layers[0](x)[0].float()
    assert (got - want).abs().max() <= 2 * 2 ** -8 * want.abs().max()
    assert [(w.untyped_storage().data_ptr(), w.storage_offset()) for w in weights] == where


def test_moe_dropless_in_bf16_in_a_bucket_layout_and_its_refusals(cpu_megatron):
    """The dropless MoE layer in bf16 (the GPU's dtype for the grouped GEMM) gives megatron-core's output within two
    bf16 roundings of the largest value, also with its expert weights where a distributed optimizer's parameter
    buffer puts them (one buffer, in reverse order, fc1 and fc2 interleaved: viewed in place, never moved); what it
    does not serve is refused with the reason, and megatron-core's dispatchers stay: capacity (token drops),
    biases, experts over several ranks, weights at irregular places in a larger buffer, fc1 and fc2 in opposite
    orders."""
    from megatron_patch.inference import dynamic, moe_dropless
    from megatron_patch.models import build_model
    from tests.models import any_config

    torch.manual_seed(0)
    model = build_model(any_config("mixtral"), impl="local", dtype=torch.bfloat16).eval()
    layers = dynamic.moe_layers(model)
    layer = layers[0]
    x = torch.randn(33, 1, model.config.hidden_size, dtype=torch.bfloat16)

    def dropless_matches() -> bool:
        with torch.no_grad():
            want = layer(x)[0].float()
            with moe_dropless.dispatch(layers):
                got = layer(x)[0].float()
        return bool((got - want).abs().max() <= 2 * 2 ** -8 * want.abs().max())

    assert dropless_matches()
    fc1, fc2 = moe_dropless.expert_weights(layer.experts)
    size = fc1[0].numel() + fc2[0].numel() + 64  # (a gap of 64 elements after each parameter's pair)
    bucket = torch.zeros(len(fc1) * size, dtype=torch.bfloat16)

    def place(order: list[int]) -> None:  # expert i's fc2 then fc1 at slot order[i] of the bucket
        for i, slot in enumerate(order):
            for w, start in ((fc2[i], slot * size), (fc1[i], slot * size + fc2[i].numel())):
                view = bucket[start: start + w.numel()].view(w.shape)
                view.copy_(w.detach())
                w.data = view

    n = len(fc1)
    place(list(range(n))[::-1])  # in reverse, as megatron-core's DDP fills its buckets
    assert moe_dropless.stacked(fc1)[1] and moe_dropless.stacked(fc2)[1]
    assert moe_dropless.refusal(layer) is None and dropless_matches()
    assert all(w.untyped_storage().data_ptr() == bucket.untyped_storage().data_ptr() for w in fc1 + fc2)
    place([1, 0, *range(2, n)])  # irregular
    assert "irregular places" in moe_dropless.refusal(layer)
    assert "MoE layer 0" in moe_dropless.refusals(layers)
    place(list(range(n))[::-1])
    for w in fc2:  # fc2 back in storages of their own (stacked in order), fc1 reversed in the bucket
        w.data = w.detach().clone()
    assert "opposite orders" in moe_dropless.refusal(layer)
    for w in fc1:
        w.data = w.detach().clone()
    cfg = layer.config
    cfg.moe_expert_capacity_factor = 1.0
    assert "moe_expert_capacity_factor" in moe_dropless.refusal(layer)
    cfg.moe_expert_capacity_factor, cfg.add_bias_linear = None, True
    assert "add_bias_linear" in moe_dropless.refusal(layer)
    cfg.add_bias_linear, cfg.expert_model_parallel_size = False, 2
    assert "EP or expert TP" in moe_dropless.refusal(layer)
    cfg.expert_model_parallel_size = 1
    assert moe_dropless.refusal(layer) is None and dropless_matches()


# (Bloom's tiny random model greedily picks the same tokens without the bias: the check that the bias matters runs
# on Baichuan2-13B's)
@pytest.mark.parametrize("variant, bias_decides", [("bloom", False), ("baichuan2_13b", True)])
def test_alibi_runs_on_the_dynamic_engine(variant, bias_decides, cpu_megatron, monkeypatch):
    """ALiBi (Bloom; Baichuan2-13B) on the dynamic engine, which `auto` now picks: the `alibi_paged_attention`
    patch adds the bias in the engine's paged attention (the core attention, where training adds it, is
    bypassed there). Greedy tokens = transformers' generate for prompts of mixed lengths (fp32 on CPU), through
    prefill and decode steps; without the patch the engine's attention has no position bias and the tokens
    part from HF's (here: the slopes hidden from the engine's paged attention)."""
    from megatron_patch import patches
    from megatron_patch.inference import Sampling, choose_engine, dynamic, generate
    from megatron_patch.models.modules import alibi
    from megatron_patch.tokenizer import build_tokenizer

    c, model = _converted(variant)
    tok = build_tokenizer(TINY_TOKENIZER)
    assert alibi.has_alibi(model) and choose_engine(model) == "dynamic"
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19], [30]]
    want = [_hf_greedy(c, p, 10) for p in prompts]
    assert generate(model, tok, prompts, Sampling(10, top_k=1)) == want
    assert not patches.is_active("alibi_paged_attention")  # applied for the call only
    dynamic.release_engine()
    if bias_decides:  # the engine's attention without the bias: other tokens
        monkeypatch.setattr(alibi, "layer_slopes", lambda core_attention: None)
        wrong = generate(model, tok, prompts, Sampling(10, top_k=1), engine="dynamic")
        dynamic.release_engine()
        assert wrong != want


def test_stdin_prompts_under_torchrun_at_tp2(setup):
    """`echo PROMPT | torchrun --nproc-per-node 2 -m megatron_patch.generate --tp 2`: every process inherits the
    one stdin and the first to read it took all (rank 1 failed with "no prompts in <stdin>"); the first rank
    reads, the others receive its lines. Rows = the one-process run's (checked against transformers above)."""
    import os
    import subprocess
    import sys

    from tests._cpu import free_port

    root, _, mc = setup
    argv = ["--mcore-dir", mc, "--greedy", "--max-new-tokens", "6", "--no-stream"]
    env = {**os.environ, "TORCHDYNAMO_DISABLE": "1", "OMP_NUM_THREADS": "1"}
    stdin = "\n".join(PROMPTS) + "\n"
    one = subprocess.run([sys.executable, "-m", "megatron_patch.generate", *argv], input=stdin, capture_output=True,
                         text=True, env=env, timeout=300)
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master_port",
                          str(free_port()), "-m", "megatron_patch.generate", *argv, "--tp", "2"], input=stdin,
                         capture_output=True, text=True, env=env, timeout=600)
    assert one.returncode == 0, one.stderr[-3000:]
    assert two.returncode == 0, two.stderr[-3000:]
    rows = [json.loads(line) for line in two.stdout.splitlines() if line.startswith("{\"prompt\"")]
    assert [r["prompt"] for r in rows] == PROMPTS
    assert rows == [json.loads(line) for line in one.stdout.splitlines() if line.startswith("{\"prompt\"")]


@pytest.mark.parametrize("engine", ["static", "dynamic"])
def test_training_after_generating_with_fused_rope(setup, monkeypatch, engine):
    """RLHF and custom trainers generate, then train the same model. megatron-core caches the rotary
    embedding's tensor per sequence length (an lru_cache on `RotaryEmbedding.forward`); made while generating,
    under `torch.inference_mode`, it is an inference tensor, and the fused RoPE (Transformer Engine's kernel,
    on wherever there is a GPU) saves it for backward: `Inference tensors cannot be saved for backward` on the
    first training step (found by the GPU smoke). Here TE's kernel is stood in for by an autograd function that
    saves the frequencies as TE's does; a backward pass after `generate` must work."""
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from megatron_patch.inference import Sampling, dynamic, generate, load_model
    from megatron_patch.tokenizer import build_tokenizer

    class SavesFreqs(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t, freqs):
            ctx.save_for_backward(freqs)
            return rope_utils._apply_rotary_pos_emb_bshd(t, freqs, rotary_interleaved=False)

        @staticmethod
        def backward(ctx, grad):
            (freqs,) = ctx.saved_tensors
            return rope_utils._apply_rotary_pos_emb_bshd(grad, -freqs, rotary_interleaved=False), None

    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb",
                        lambda t, freqs, interleaved=False: SavesFreqs.apply(t, freqs))
    lengths = set()  # the sequence lengths generation asked the rotary embedding for (the cache's keys)
    get_emb = RotaryEmbedding.get_emb
    monkeypatch.setattr(RotaryEmbedding, "get_emb",
                        lambda self, n, *a, **k: lengths.add(n) or get_emb(self, n, *a, **k))
    _, _, mc = setup
    tok = build_tokenizer(TINY_TOKENIZER)
    model, _ = load_model(mc, None)
    monkeypatch.setattr(model.config, "apply_rope_fusion", True)
    ids = [tok.tokenize(p) for p in PROMPTS]
    generate(model, tok, ids, Sampling(4, top_k=1), engine=engine)
    dynamic.release_engine()
    assert lengths
    for n in sorted(lengths):  # a training step at each of those lengths
        tokens = torch.randint(0, 100, (1, n))
        model(tokens, torch.arange(n)[None], None).float().sum().backward()
        assert all(p.grad is not None for p in model.parameters() if p.requires_grad), n
        model.zero_grad(set_to_none=True)
