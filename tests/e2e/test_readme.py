"""Every command of the READMEs runs as written, at tiny sizes, on this CPU machine: the test reads their
```bash blocks (so a command can't drift from what is tested) and runs them in order in one folder that
holds what they read, with the model folders they name (Llama-3.1-8B, ...) holding a tiny LLaMA and the
tiny tokenizer. "At tiny sizes" means: the size flags in `TINY` get tiny values, training runs on one
process (parallel sizes 1) with `--cpu` added, and the launchers get `--cpu` and tiny sizes. Commands that
cannot run here are in `SKIP`, each with the test that covers it.

The launcher commands of rlhf/README.md (one per RLHF stage, at their real sizes) run as written as far as their
torchrun line: with `--dry-run` added last, each prints the command it would start, sized to its own --tp x --pp,
and the entry point's parser accepts what it would be given."""

from __future__ import annotations

import gzip
import json
import os
import re
import shlex
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODELS = ("Llama-3.1-8B", "Qwen2.5-7B-Instruct")  # the model folders the README names
# flag -> tiny value, in every command
TINY = {"--workers": "1", "--seq-length": "64", "--micro-batch-size": "2", "--global-batch-size": "4",
        "--train-iters": "3", "--lr-warmup-iters": "1", "--max-new-tokens": "8", "--steps": "1",
        "--group-size": "2", "--prompts-per-step": "2", "--nproc_per_node": "1", "--nproc-per-node": "1"}
# and in training commands (one process) and launchers
TRAINING = {"--tensor-model-parallel-size": "1", "--pipeline-model-parallel-size": "1", "--tp": "1", "--pp": "1"}
TRAINERS = ("megatron_patch.pretrain", "megatron_patch.sft", "megatron_patch.rlhf.reward_model",
            "megatron_patch.rlhf.dpo")
LAUNCHER_TINY = ["--cpu", "--seq-length", "64", "--mbs", "2", "--gbs", "4", "--iters", "3"]
SKIP = {
    "make ": "the quick start itself: CI runs `make test`; tests/e2e/test_cli.py runs the demo `make demo` runs",
    "pip install": "installs packages",
    "megatron_patch.lm_eval_model": "needs lm-eval's hub datasets; tests/e2e/test_lm_eval.py runs the same CLI on "
                                    "local tasks",
}


READMES = ("README.md", "megatron_patch/rlhf/README.md")


def readme_commands() -> list[str]:
    """The shell commands of the READMEs' ```bash blocks (continuation lines joined, comments dropped), in
    order, each once."""
    out = []
    for readme in READMES:
        text = open(os.path.join(ROOT, readme), encoding="utf-8").read()
        for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
            for command in block.replace("\\\n", " ").splitlines():
                words = shlex.split(command, comments=True)
                if words and shlex.join(words) not in out:
                    out.append(shlex.join(words))
    return out


COMMANDS = readme_commands()


def _tiny(words: list[str], table: dict) -> list[str]:
    return [words[0]] + [table.get(flag, value) for flag, value in zip(words, words[1:])]


def argv_of(command: str) -> tuple[list[str], str | None]:
    """(argv, stdin text) of a README command at tiny sizes."""
    words = shlex.split(command)
    stdin = None
    if "|" in words:  # echo TEXT | command
        i = words.index("|")
        assert words[0] == "echo", command
        stdin, words = " ".join(words[1:i]) + "\n", words[i + 1:]
    words = _tiny(words, TINY)
    if words[0].startswith("examples/"):
        return ["bash", os.path.join(ROOT, words[0]), *_tiny(words, TRAINING)[1:], *LAUNCHER_TINY], stdin
    module = words[words.index("-m") + 1] if "-m" in words else None
    if module in TRAINERS:
        words = _tiny(words, TRAINING) + ["--cpu"] + (["--eval-iters", "2"] if module.endswith("pretrain") else [])
    if words[0] == "torchrun":
        from tests._cpu import free_port

        return [sys.executable, "-m", "torch.distributed.run", "--master_port", str(free_port()), *words[1:]], stdin
    if words[0] == "megatron-patch":  # the console script pip installed beside this interpreter
        return [os.path.join(os.path.dirname(sys.executable), "megatron-patch"), *words[1:]], stdin
    assert words[0] == "python", f"a README command this test cannot run: {command}"
    return [sys.executable, *words[1:]], stdin


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """A folder with what the README's commands read: the model folders, a corpus, chats, preference
    pairs, prompts, documents, multiple-choice rows and a reward function (not the folders they write into, such
    as data/: the commands make them)."""
    from megatron_patch.conversion.hf_io import copy_side_files
    from megatron_patch.tokenizer import CORPUS, TINY_TOKENIZER
    from tests.helpers import conversations, preferences
    from tests.models import hf_model, llama_config, save_hf

    root = tmp_path_factory.mktemp("readme")
    model = hf_model(llama_config("gqa"))
    for name in MODELS:
        save_hf(model, str(root / name))
        copy_side_files(TINY_TOKENIZER, str(root / name), ["tokenizer.json", "tokenizer_config.json",
                                                           "special_tokens_map.json"])
    with gzip.open(CORPUS, "rt") as f:
        docs = [json.loads(line)["text"] for _, line in zip(range(400), f)]
    (root / "corpus.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    (root / "held_out.jsonl").write_text("".join(json.dumps({"text": d[:300]}) + "\n" for d in docs[:3]))
    (root / "chats.jsonl").write_text("".join(json.dumps(c) + "\n" for c in conversations(40)))
    (root / "prefs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in preferences(40, 0)))
    (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n"
                                                for p in ("The module", "A list of", "def f(x):")))
    (root / "mc.jsonl").write_text("".join(json.dumps(r) + "\n" for r in (
        {"question": "The interpreter reads", "choices": ["the file", "a cat"], "answer": 0},
        {"question": "A list holds", "choices": ["values", "nothing at all", "a tree"], "answer": 0})))
    (root / "my_rules.py").write_text("def score(prompt, completion):\n    return float(len(completion) % 3)\n")
    return root


@pytest.mark.parametrize("command", COMMANDS, ids=[c[:60] for c in COMMANDS])
def test_readme_command_runs(work, command):
    reason = next((why for key, why in SKIP.items() if key in command), None)
    if reason:
        pytest.skip(reason)
    argv, stdin = argv_of(command)
    env = {**os.environ, "TORCHDYNAMO_DISABLE": "1", "PYTHON": sys.executable}
    env.pop("NPROC_PER_NODE", None)
    p = subprocess.run(argv, cwd=work, env=env, input=stdin, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, f"{shlex.join(argv)}\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}"
    assert not [line for line in p.stderr.splitlines() if line.startswith("error:")], p.stderr[-3000:]
    words = shlex.split(command)
    if "--save-hf" in words and "--precision" in words:  # an HF export states the dtype trained in
        dtype = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[words[words.index("--precision") + 1]]
        config = json.load(open(work / words[words.index("--save-hf") + 1] / "config.json"))
        assert config["dtype"] == config["torch_dtype"] == dtype, config


def test_every_readme_command_is_run_or_skipped_for_a_reason():
    assert len(COMMANDS) >= 15
    for command in COMMANDS:
        if not any(key in command for key in SKIP):
            argv_of(command)  # raises for a command of a kind the test does not know how to run


LAUNCHER_README = "rlhf/README.md"
LAUNCHER_SKIP = {"rlhf/example_cpu.sh": "runs every stage for real: "
                                        "tests/e2e/test_ppo.py::test_workflow_sft_rm_ppo_export"}


def launcher_commands() -> list[list[str]]:
    """The words of each command of rlhf/README.md's ```bash blocks (continuation lines joined)."""
    text = open(os.path.join(ROOT, LAUNCHER_README), encoding="utf-8").read()
    return [words for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S)
            for line in block.replace("\\\n", " ").splitlines() if (words := shlex.split(line, comments=True))]


LAUNCHERS = launcher_commands()


@pytest.mark.parametrize("words", LAUNCHERS, ids=[shlex.join(w)[:60] for w in LAUNCHERS])
def test_rlhf_readme_launcher_commands_run_as_written(words, tmp_path):
    if words[0] in LAUNCHER_SKIP:
        pytest.skip(LAUNCHER_SKIP[words[0]])
    words = _tiny(words, TINY)
    # --dry-run last, where a user adds an option to the README's line (before `--`: what follows is Megatron's)
    cut = words.index("--") if "--" in words else len(words)
    argv = ["bash", os.path.join(ROOT, words[0]), *words[1:cut], "--dry-run", *words[cut:]]
    # --dry-run starts nothing; the launchers' Python reads the recipes and defaults (megatron_patch/recipes.py)
    env = {**os.environ, "PYTHON": sys.executable, "NPROC_PER_NODE": "8"}
    p = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, (shlex.join(argv), p.stderr)
    cmd = [w for w in shlex.split(p.stdout) if not re.match(r"^[A-Z_]+=", w)]  # less the environment it sets
    assert cmd[0] == sys.executable and "megatron_patch.torchrun" in cmd, p.stdout
    entry = cmd[cmd.index("-m", cmd.index("megatron_patch.torchrun")) + 1]
    given = cmd[cmd.index(entry) + 1:]
    if entry in ("megatron_patch.rlhf.ppo", "megatron_patch.rlhf.grpo"):  # sized by the command's own layout
        layout = {flag: int(words[words.index(flag) + 1]) if flag in words else 1 for flag in ("--tp", "--pp")}
        assert int(cmd[cmd.index("--nproc_per_node") + 1]) == layout["--tp"] * layout["--pp"], p.stdout
        assert [given[i + 1] for i, w in enumerate(given) if w == "--tp"] == [str(layout["--tp"])], given
        import importlib

        importlib.import_module(entry).parser().parse_args(given)  # the options the README gives exist
