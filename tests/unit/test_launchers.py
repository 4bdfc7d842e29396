"""The launchers: one generic script per task (examples/{pretrain,sft,generate,evaluate,convert}.sh, the training
ones over examples/launch.sh, all sharing examples/common.sh) and the recipes of released model sizes
(examples/<family>/<Model>.env).

--dry-run prints the full torchrun command (named options, recipe values, defaults, environment-sized torchrun
run by $PYTHON through megatron_patch.torchrun, Megatron arguments passed through); --help prints the usage; a
launcher's own options count wherever they stand (before `--`). The recipe rules are megatron_patch.recipes'
(the launchers ask `python -m megatron_patch.recipes` for their values; these tests import it): every recipe
parses, its layout is valid for the released model's facts at its GPU count (`Layout.check`, experts, virtual
pipeline, data-parallel batch), each task's command (bash) carries the values `task_values` gives, and the family
README's table is the one the recipes give.

The launchers run with PATH=/usr/bin:/bin plus a folder whose `python` (launcher_python) runs this test's interpreter
for `python -m megatron_patch.recipes` only, which they need even with --dry-run: anything else, torchrun
included, fails at once, so a launcher that would start a command instead of printing it fails fast (as
/nonexistent/python, NO_PYTHON, did when the launchers needed no Python before starting one; --help and the
online launchers still do not)."""

from __future__ import annotations

import glob
import os
import re
import shlex
import subprocess
import sys

import pytest

from megatron_patch.models import Layout, families
from megatron_patch.recipes import DEFAULTS, RecipeError, cpu_note, read_recipe, task_values

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = os.path.join(ROOT, "examples")
RECIPES = sorted(glob.glob(os.path.join(EXAMPLES, "*", "*.env")))
RECIPE_IDS = [os.path.relpath(p, EXAMPLES)[:-4] for p in RECIPES]  # FAMILY/MODEL, as --recipe takes it
TASKS = {"PRETRAIN": ("pretrain.sh", "megatron_patch.pretrain"), "SFT": ("sft.sh", "megatron_patch.sft"),
         "RM": ("../rlhf/rm.sh", "megatron_patch.rlhf.reward_model"),
         "DPO": ("../rlhf/dpo.sh", "megatron_patch.rlhf.dpo")}
TORCHRUN = "megatron_patch.torchrun"  # torch.distributed.run, ending as the package's tools end
NO_PYTHON = "/nonexistent/python"  # what needs no Python (--help, the online launchers' --dry-run) runs without
_BIN: dict[str, str] = {}  # "dir": the folder of the launchers' `python` (launcher_python)


@pytest.fixture(autouse=True, scope="module")
def launcher_python(tmp_path_factory) -> str:
    """The launchers' `python` (first on their PATH, the path returned): `python -m megatron_patch.recipes` runs
    this test's interpreter; anything else (torchrun) fails at once, saying what it would have started."""
    folder = tmp_path_factory.mktemp("bin")
    python = folder / "python"
    python.write_text(f'#!/bin/sh\nif [ "$1" = -m ] && [ "$2" = megatron_patch.recipes ]; then\n'
                      f'  exec {shlex.quote(sys.executable)} "$@"\nfi\n'
                      f'echo "the test\'s python starts nothing: $*" >&2\nexit 127\n')
    python.chmod(0o755)
    _BIN["dir"] = str(folder)
    return str(python)


def _lines(script: str, *args: str, dry_run: bool = True, **env: str) -> tuple[int, list[list[str]], str]:
    """(exit status, the words of each line printed on stdout, stderr) of a launcher (`python`: launcher_python)."""
    environ = {k: v for k, v in os.environ.items()
               if k not in ("NPROC_PER_NODE", "NNODES", "MODEL", "DATA", "PYTHON")}
    p = subprocess.run(["bash", os.path.join(EXAMPLES, script), *(["--dry-run"] if dry_run else []), *args],
                       capture_output=True, text=True,
                       env={**environ, "PATH": f"{_BIN['dir']}:/usr/bin:/bin", **env})
    return p.returncode, [shlex.split(line) for line in p.stdout.splitlines()] if p.returncode == 0 else [], p.stderr


def _run(script: str, *args: str, dry_run: bool = True, **env: str) -> tuple[int, list[str], str]:
    code, lines, err = _lines(script, *args, dry_run=dry_run, **env)
    return code, [w for line in lines for w in line], err


def _entry(cmd: list[str]) -> str:
    """The module the torchrun launcher starts."""
    return cmd[cmd.index("-m", cmd.index(TORCHRUN)) + 1]


def _entry_args(cmd: list[str]) -> list[str]:
    """What the entry point is given."""
    return cmd[cmd.index("-m", cmd.index(TORCHRUN)) + 2:]


def _opt(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


# ---- the generic launchers ---------------------------------------------------------------------------------

def test_no_per_family_launchers():
    """A family folder holds recipes and a README, never a script: every task has one generic launcher."""
    scripts = [os.path.relpath(p, EXAMPLES) for p in glob.glob(os.path.join(EXAMPLES, "*", "*"))
               if not p.endswith((".env", "README.md"))]
    assert scripts == []
    assert sorted(os.path.basename(p) for p in glob.glob(os.path.join(EXAMPLES, "*.sh"))) == \
        ["common.sh", "convert.sh", "evaluate.sh", "generate.sh", "launch.sh", "pretrain.sh", "sft.sh"]


@pytest.mark.parametrize("family", sorted(families()))
def test_every_registered_family_launches_with_model(family):
    """A family with no recipe (a new one included) trains through the same launchers with --model."""
    for task, data_flag in (("PRETRAIN", "--data-path"), ("SFT", "--sft-data"), ("RM", "--pref-data"),
                            ("DPO", "--pref-data")):
        script, entry = TASKS[task]
        code, cmd, err = _run(script, "--model", f"/models/{family}", "--data", "corpus", "--lr", "1e-5")
        assert code == 0, err
        assert cmd[:5] == ["CUDA_DEVICE_MAX_CONNECTIONS=1", "python", "-m", TORCHRUN, "--nproc_per_node"]
        assert _entry(cmd) == entry and _opt(cmd, data_flag) == "corpus"
        assert _opt(cmd, "--load-hf" if task in ("RM", "DPO") else "--hf-config") == f"/models/{family}"
        assert _opt(cmd, "--tokenizer-model") == f"/models/{family}"


def test_named_options_environment_and_passthrough():
    code, cmd, err = _run("pretrain.sh", "--model", "/m/Qwen2.5-0.5B", "--data", "/d/x_text_document", "--tp", "2",
                          "--pp", "4", "--vpp", "3", "--cp", "2", "--precision", "fp8", "--mbs", "2", "--gbs", "64",
                          "--lr", "1e-3", "--iters", "500", "--out", "/ckpt", "--from-hf", "--profile", "benchmark",
                          "--", "--recompute-activations", "--seed", "7",
                          NPROC_PER_NODE="8", NNODES="4", NODE_RANK="3", MASTER_ADDR="node0")
    assert code == 0, err
    assert (_opt(cmd, "--nproc_per_node"), _opt(cmd, "--nnodes"), _opt(cmd, "--node_rank"),
            _opt(cmd, "--master_addr")) == ("8", "4", "3", "node0")
    assert _opt(cmd, "--load-hf") == "/m/Qwen2.5-0.5B" and "--hf-config" not in cmd
    assert (_opt(cmd, "--tensor-model-parallel-size"), _opt(cmd, "--pipeline-model-parallel-size"),
            _opt(cmd, "--context-parallel-size"), _opt(cmd, "--num-virtual-stages-per-pipeline-rank")) == \
        ("2", "4", "2", "3")
    assert (_opt(cmd, "--precision"), _opt(cmd, "--micro-batch-size"), _opt(cmd, "--global-batch-size")) == \
        ("fp8", "2", "64")
    assert (_opt(cmd, "--lr"), _opt(cmd, "--min-lr"), _opt(cmd, "--train-iters"), _opt(cmd, "--save")) == \
        ("1e-3", "0.0001", "500", "/ckpt")
    assert _opt(cmd, "--throughput-profile") == "benchmark"
    assert "--expert-tensor-parallel-size" not in cmd  # not set: Megatron's default (TP)
    assert cmd[-3:] == ["--recompute-activations", "--seed", "7"]  # passed through last: they win


def test_one_node_takes_a_free_port_unless_told():
    """Two jobs on one machine (or two test suites) must not both take port 6000: on one node with neither
    MASTER_ADDR nor MASTER_PORT set, torchrun runs --standalone (a free port); either variable, or several nodes,
    gives the rendezvous they name (seen failing: two `make test` runs at once, EADDRINUSE on 6000)."""
    base = ("--model", "/m/Qwen2.5-0.5B", "--data", "/d/x_text_document")
    code, cmd, err = _run("pretrain.sh", *base, MASTER_ADDR="", MASTER_PORT="")  # unset, whatever this process has
    assert code == 0, err
    assert "--standalone" in cmd and "--master_port" not in cmd and "--nnodes" not in cmd
    code, cmd, err = _run("pretrain.sh", *base, MASTER_ADDR="", MASTER_PORT="6123")
    assert code == 0 and "--standalone" not in cmd, err
    assert (_opt(cmd, "--master_addr"), _opt(cmd, "--master_port"), _opt(cmd, "--nnodes")) == ("localhost", "6123", "1")


def test_missing_required_options_and_a_layout_the_world_cannot_hold():
    code, _, err = _run("pretrain.sh", "--model", "m")
    assert code == 1 and "--data PREFIX is required" in err
    code, _, err = _run("pretrain.sh", "--data", "d")
    assert code == 1 and "--model HF_DIR is required" in err
    code, _, err = _run("pretrain.sh", "--model", "m", "--data", "d", "--tp", "4", "--pp", "2", NPROC_PER_NODE="4")
    assert code == 1 and "error: TP x PP x CP = 8 does not divide the 4 processes" in err


def test_own_options_count_wherever_they_stand(launcher_python):
    """A launcher option after Megatron's (a late --dry-run, --tp, --cpu) is the launcher's: it prints the command
    instead of starting it (launcher_python would refuse to start it), and sizes the layout; after `--` every word
    is Megatron's."""
    code, cmd, err = _run("pretrain.sh", "--model", "m", "--data", "d", "--recompute-activations", "--tp", "2",
                          "--cpu", "--dry-run", "--", "--seed", "7", "--tp", dry_run=False, NPROC_PER_NODE="2",
                          PYTHON=launcher_python)
    assert code == 0, err
    assert _opt(cmd, "--tensor-model-parallel-size") == "2" and "--cpu" in cmd and _opt(cmd, "--precision") == "fp32"
    assert cmd[-4:] == ["--recompute-activations", "--seed", "7", "--tp"]


@pytest.mark.parametrize("tool", ["generate", "evaluate"])
def test_generate_and_evaluate_launchers(tool, tmp_path, launcher_python):
    """examples/generate.sh / evaluate.sh: CKPT and the entry point's options, --tp/--pp/--ep sizing torchrun
    (TP x PP x EP processes on this node), --recipe (its layout; without CKPT its HF folder) and --dry-run,
    wherever they stand; usage errors are one `error:` line before torchrun starts (launcher_python would refuse
    to start it)."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    for args, match in (((), "CKPT"), ((str(tmp_path / "none"),), f"{tmp_path / 'none'}: no such folder"),
                        ((str(ckpt), "--tp", "0"), "--tp takes a positive integer, got '0'"),
                        (("--recipe", "llama/Llama-9B"), "--recipe llama/Llama-9B: no such recipe")):
        code, _, err = _run(f"{tool}.sh", *args, dry_run=False, PYTHON=launcher_python)
        assert code == 1 and err.startswith("error: ") and len(err.splitlines()) == 1 and match in err, (args, err)
    code, cmd, err = _run(f"{tool}.sh", str(ckpt), "--prompts", "p.jsonl", "--tp", "2", "--pp", "2", "--dry-run",
                          dry_run=False, PYTHON=launcher_python)
    assert code == 0, err
    assert cmd[:3] == [launcher_python, "-m", TORCHRUN] and _opt(cmd, "--nproc_per_node") == "4"
    assert _entry(cmd) == f"megatron_patch.{tool}"
    assert _entry_args(cmd) == ["--mcore-dir", str(ckpt), "--tp", "2", "--pp", "2", "--ep", "1", "--prompts",
                                "p.jsonl"]
    code, cmd, err = _run(f"{tool}.sh", "--recipe", "llama/Llama-3.1-70B", "--max-new-tokens", "8")
    assert code == 0, err
    assert _opt(cmd, "--nproc_per_node") == "16"  # the recipe's TP 4 x PP 4
    assert _entry_args(cmd) == ["--hf-dir", "Llama-3.1-70B", "--tp", "4", "--pp", "4", "--ep", "1",
                                "--max-new-tokens", "8"]
    code, cmd, err = _run(f"{tool}.sh", "--recipe", "mixtral/Mixtral-8x7B-v0.1", str(ckpt), "--tp", "1", "--pp", "1")
    assert code == 0, err
    assert _opt(cmd, "--nproc_per_node") == "8" and _entry_args(cmd)[:8] == [
        "--mcore-dir", str(ckpt), "--tp", "1", "--pp", "1", "--ep", "8"]  # the options win, the recipe's EP stays


def test_entry_point_usage_errors_come_before_the_workers(tmp_path):
    """An option the entry point does not take: one `error:` line (argparse's message) and exit 2, from the
    launcher itself, before any worker starts (no usage block per rank, no torchrun report)."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    code, _, err = _run("generate.sh", str(ckpt), "--prompts", "p.jsonl", "--no-such-option", dry_run=False,
                        PYTHON=sys.executable)
    assert code == 2 and err.strip().splitlines() == ["error: unrecognized arguments: --no-such-option (python -m "
                                                      "megatron_patch.generate --help lists the options)"], err


def test_convert_launcher(launcher_python):
    """examples/convert.sh HF_DIR OUT: hf-to-mcore at the layout asked (or the recipe's), then verify; --recipe alone
    names the HF folder; --dry-run prints both commands (launcher_python would refuse to start them)."""
    for args, match in (((), "HF folder"), (("only_one",), "HF folder")):
        code, _, err = _run("convert.sh", *args, dry_run=False, PYTHON=launcher_python)
        assert code == 1 and err.startswith("error: ") and len(err.splitlines()) == 1 and match in err, err
    code, lines, err = _lines("convert.sh", "hf", "out", "--tp", "2", "--dtype", "bf16", "--dry-run", dry_run=False,
                              PYTHON=launcher_python)
    assert code == 0, err
    converter = [launcher_python, "-m", "megatron_patch.convert"]
    assert lines == [converter + ["hf-to-mcore", "--hf-dir", "hf", "--out", "out", "--tp", "2", "--pp", "1", "--ep",
                                  "1", "--dtype", "bf16"],
                     converter + ["verify", "--hf-dir", "hf", "--mcore-dir", "out"]]
    code, lines, err = _lines("convert.sh", "--recipe", "llama/Llama-3.1-70B", "out", PYTHON=launcher_python)
    assert code == 0, err
    assert lines[0][3:] == ["hf-to-mcore", "--hf-dir", "Llama-3.1-70B", "--out", "out", "--tp", "4", "--pp", "4",
                            "--ep", "1"]


@pytest.mark.parametrize("stage", ["ppo", "grpo"])
def test_online_launcher_reads_its_options_anywhere(stage):
    """rlhf/ppo.sh and grpo.sh (rlhf/online.sh): --model, --tp, --pp and --dry-run are the launcher's wherever they
    stand (the README puts --tp after the entry point's options): torchrun gets TP x PP processes and a late --dry-run
    prints the command instead of starting it; every other word goes to the entry point, in order (after `--`, all)."""
    script = os.path.join(ROOT, "rlhf", f"{stage}.sh")
    p = subprocess.run(["bash", script, "--prompts", "p.jsonl", "--model", "m", "--steps", "3", "--tp", "2",
                        "--pp", "2", "--dry-run", "--", "--seed", "5"], capture_output=True, text=True,
                       env={"PATH": "/usr/bin:/bin", "PYTHON": NO_PYTHON})
    assert p.returncode == 0, p.stderr
    cmd = shlex.split(p.stdout)
    assert cmd[:3] == [NO_PYTHON, "-m", TORCHRUN] and _opt(cmd, "--nproc_per_node") == "4"
    assert _entry(cmd) == f"megatron_patch.rlhf.{stage}"
    assert _entry_args(cmd) == ["--hf-dir", "m", "--tp", "2", "--pp", "2", "--prompts", "p.jsonl", "--steps", "3",
                                "--seed", "5"]
    for args, match in ((["--prompts", "p.jsonl"], "--model HF_DIR is required"),
                        (["--model", "m", "--steps", "2", "--pp", "x"], "--pp takes a positive integer, got 'x'")):
        p = subprocess.run(["bash", script, *args], capture_output=True, text=True,
                           env={"PATH": "/usr/bin:/bin", "PYTHON": NO_PYTHON})
        assert p.returncode == 1 and p.stderr.startswith("error: ") and match in p.stderr, p.stderr


def test_expert_parallel_options():
    code, cmd, err = _run("pretrain.sh", "--model", "m", "--data", "corpus", "--ep", "4", "--etp", "1", "--tp", "2",
                          NPROC_PER_NODE="8")
    assert code == 0, err
    assert (_opt(cmd, "--expert-model-parallel-size"), _opt(cmd, "--expert-tensor-parallel-size")) == ("4", "1")


@pytest.mark.parametrize("script", ["pretrain.sh", "sft.sh", "../rlhf/rm.sh", "../rlhf/dpo.sh"])
def test_help_prints_the_launchers_usage(script):
    """--help (and -h) print the named options and the environment, then exit 0 without launching."""
    for flag in ("--help", "-h"):
        p = subprocess.run(["bash", os.path.join(EXAMPLES, script), flag], capture_output=True, text=True,
                           env={"PATH": "/usr/bin:/bin"})
        assert p.returncode == 0, p.stderr
        for text in ("[--recipe FAMILY/MODEL|FILE]", "[--model DIR]", "[--split TRAIN,VALID,TEST]", "--cpu",
                     "NPROC_PER_NODE", "PYTHON", "SFT_KEY", "python -m megatron_patch.<entry> --help"):
            assert text in p.stdout, (text, p.stdout)
    p = subprocess.run(["bash", os.path.join(EXAMPLES, "launch.sh"), "--help"], capture_output=True, text=True)
    assert p.returncode == 0 and "[--model DIR]" in p.stdout
    for tool in ("generate.sh", "evaluate.sh", "convert.sh"):
        p = subprocess.run(["bash", os.path.join(EXAMPLES, tool), "--help"], capture_output=True, text=True,
                           env={"PATH": "/usr/bin:/bin", "PYTHON": NO_PYTHON})
        assert p.returncode == 0 and "--recipe" in p.stdout and "--dry-run" in p.stdout, (tool, p.stdout, p.stderr)


def test_python_variable_runs_torch_distributed(launcher_python):
    """$PYTHON (an interpreter of one's own, here launcher_python by its path) works out the values and runs
    torchrun; the launchers' own `python` is not asked."""
    code, cmd, err = _run("pretrain.sh", "--model", "m", "--data", "corpus", PYTHON=launcher_python,
                          PATH="/usr/bin:/bin")
    assert code == 0 and cmd[1:4] == [launcher_python, "-m", TORCHRUN], err


def test_split_is_an_option_not_hard_coded():
    """No --split unless asked (the entry point's default applies); evaluation only with a validation share."""
    code, cmd, _ = _run("pretrain.sh", "--model", "m", "--data", "corpus")
    assert code == 0 and "--split" not in cmd and _opt(cmd, "--eval-iters") == "10"
    code, cmd, _ = _run("pretrain.sh", "--model", "m", "--data", "corpus", "--split", "90,10,0")
    assert code == 0 and _opt(cmd, "--split") == "90,10,0" and "--eval-iters" in cmd
    code, cmd, _ = _run("pretrain.sh", "--model", "m", "--data", "corpus", "--split", "100,0,0")
    assert code == 0 and _opt(cmd, "--split") == "100,0,0" and "--eval-iters" not in cmd
    for task in ("SFT", "RM", "DPO"):  # these trainers have no validation set
        code, cmd, _ = _run(TASKS[task][0], "--model", "m", "--data", "x.jsonl")
        assert code == 0 and "--eval-iters" not in cmd and "--split" not in cmd


def test_cpu_option():
    code, cmd, _ = _run("pretrain.sh", "--model", "m", "--data", "corpus", "--cpu")
    assert code == 0 and "--cpu" in cmd and "--use-distributed-optimizer" not in cmd
    assert _opt(cmd, "--precision") == "fp32" and _opt(cmd, "--nproc_per_node") == "1"
    code, cmd, _ = _run("pretrain.sh", "--model", "m", "--data", "corpus")
    assert "--cpu" not in cmd and "--use-distributed-optimizer" in cmd and _opt(cmd, "--precision") == "bf16"


# ---- recipes -----------------------------------------------------------------------------------------------

def test_there_are_recipes_for_the_released_sizes():
    ids = set(RECIPE_IDS)
    for wanted in ("llama/Llama-2-7b-hf", "llama/Llama-3.1-8B", "llama/Llama-3.1-70B", "mixtral/Mixtral-8x7B-v0.1",
                   "mixtral/Mixtral-8x22B-v0.1", "deepseek_v3/DeepSeek-V3-Base", "qwen2/Qwen2.5-72B",
                   "qwen3_moe/Qwen3-235B-A22B", "falcon/falcon-40b", "bloom/bloom", "starcoder2/starcoder2-15b"):
        assert wanted in ids
    assert {r.split("/")[0] for r in ids} <= set(families())


@pytest.mark.parametrize("path", RECIPES, ids=RECIPE_IDS)
def test_recipe_layout_is_valid_for_the_released_model(path):
    """Each task's layout fits the released model (TP divides heads and kv groups, PP x VPP the layers, EP the
    experts) and the recipe's GPU count (whole data-parallel replicas, a global batch they divide); pretraining
    accumulates at least 8 micro-batches per step (what docs/benchmarks.md measured worthwhile); DPO runs at
    PP 1 and nothing that starts from HF weights uses a virtual pipeline."""
    recipe = read_recipe(path)
    for key in ("HF_ID", "LAYERS", "HEADS", "KV_HEADS", "EXPERTS", "GPUS", "SFT_LR", "RM_LR", "DPO_LR"):
        assert key in recipe, key
    layers, heads, kv, experts, gpus = (int(recipe[k]) for k in ("LAYERS", "HEADS", "KV_HEADS", "EXPERTS", "GPUS"))
    for task in TASKS:
        v = task_values(recipe, task)
        tp, pp, vpp, cp, ep, mbs, gbs = (int(v[k]) for k in ("TP", "PP", "VPP", "CP", "EP", "MBS", "GBS"))
        etp = int(v["ETP"] or tp)
        # the one layout check (PP x VPP dividing the layers, EP the experts, ...), as the converter runs it
        Layout(tp=tp, pp=pp, ep=ep, etp=etp, cp=cp, vpp=vpp if vpp > 1 else None).check(layers, heads, kv, experts)
        assert vpp == 1 or pp > 2, (task, "megatron's interleaved schedule needs PP > 2 (without p2p overlap)")
        assert gpus % (tp * pp * cp) == 0 and (gpus // pp) % (ep * etp) == 0, (task, "whole replicas")
        dp = gpus // (tp * pp * cp)
        assert gbs % (mbs * dp) == 0, (task, f"global batch {gbs} vs micro-batch {mbs} x DP {dp}")
        gpu_args = v["GPU_ARGS"].split()
        assert tp == 1 or "--sequence-parallel" in gpu_args, (task, "TP > 1 wants sequence parallelism")
        assert "--overlap-grad-reduce" in gpu_args
        if task == "PRETRAIN":
            assert gbs // (mbs * dp) >= 8, "fewer than 8 micro-batches per optimizer step"
        else:
            assert vpp == 1, (task, "--load-hf does not take a virtual pipeline")
        if task == "DPO":
            assert pp == 1
        float(v["LR"]), float(v["MIN_LR"])
        assert v["PRECISION"] in ("bf16", "fp8", "fp16")


def test_recipes_are_not_copies():
    """No two recipes that differ only in the model's name (or their comments)."""
    seen = {}
    for path, rid in zip(RECIPES, RECIPE_IDS):
        body = tuple(sorted((k, v) for k, v in read_recipe(path).items() if k != "HF_ID"))
        assert body not in seen, f"{rid} repeats {seen[body]}"
        seen[body] = rid


OURS = ("--hf-config", "--load-hf", "--precision", "--throughput-profile", "--data-path", "--sft-data", "--pref-data")


def megatron_accepts(cmd: list[str], recipe: dict[str, str], monkeypatch) -> None:
    """Megatron-LM's own argument checks (`parse_args` + `validate_args`, at the recipe's world size, on Hopper)
    accept the Megatron arguments of a launcher command, given a model of the recipe's shape; our entry point's
    own options (the model folder, data, precision, profile) are left out."""
    import contextlib
    import io

    import megatron.training.arguments as megatron_args

    argv = _entry_args(cmd)
    argv = [a for i, a in enumerate(argv) if a not in OURS and (i == 0 or argv[i - 1] not in OURS)]
    layers, heads, kv, experts = (recipe[k] for k in ("LAYERS", "HEADS", "KV_HEADS", "EXPERTS"))
    argv += ["--num-layers", layers, "--hidden-size", str(int(heads) * 128), "--num-attention-heads", heads,
             "--max-position-embeddings", "131072", "--bf16", "--mock-data"]
    argv += ["--group-query-attention", "--num-query-groups", kv] if kv != heads else []
    argv += ["--num-experts", experts] if experts != "0" else []
    # the CUDA-capability query validate_args makes; H100 / H200 (the recipes' GPUs) report 9
    monkeypatch.setattr(megatron_args, "get_device_arch_version", lambda: 9)
    monkeypatch.setattr("sys.argv", ["megatron", *argv])
    for key, value in {"WORLD_SIZE": recipe["GPUS"], "RANK": "0", "LOCAL_RANK": "0",
                       "CUDA_DEVICE_MAX_CONNECTIONS": "1"}.items():
        monkeypatch.setenv(key, value)
    with contextlib.redirect_stdout(io.StringIO()):
        megatron_args.validate_args(megatron_args.parse_args(), {})


# the launcher's command-line flag of each value that is always on it
FLAGS = {"--tensor-model-parallel-size": "TP", "--pipeline-model-parallel-size": "PP", "--context-parallel-size": "CP",
         "--expert-model-parallel-size": "EP", "--seq-length": "SEQ", "--micro-batch-size": "MBS",
         "--global-batch-size": "GBS", "--lr": "LR", "--min-lr": "MIN_LR", "--precision": "PRECISION",
         "--throughput-profile": "PROFILE"}


@pytest.mark.parametrize("path", RECIPES, ids=RECIPE_IDS)
def test_recipe_gives_each_tasks_command(path, monkeypatch):
    """The launcher (bash) gets each task's values as task_values gives them and puts them on its command line,
    which Megatron-LM's argument checks accept at the recipe's GPU count; the recipe's model folder is the
    default --model."""
    recipe, rid = read_recipe(path), os.path.relpath(path, EXAMPLES)[:-4]
    gpus = int(recipe["GPUS"])
    env = {"NPROC_PER_NODE": str(min(gpus, 8)), "NNODES": str(max(gpus // 8, 1))}
    for task, (script, entry) in TASKS.items():
        v = task_values(recipe, task)
        code, cmd, err = _run(script, "--recipe", rid, "--data", "d", **env)
        assert code == 0, (task, err)
        assert _entry(cmd) == entry
        assert _opt(cmd, "--tokenizer-model") == recipe["HF_ID"].split("/")[-1]
        assert {flag: _opt(cmd, flag) for flag in FLAGS} == {flag: v[key] for flag, key in FLAGS.items()}, task
        assert ("--num-virtual-stages-per-pipeline-rank" in cmd) == (v["VPP"] != "1")
        if v["VPP"] != "1":
            assert _opt(cmd, "--num-virtual-stages-per-pipeline-rank") == v["VPP"]
        assert ("--expert-tensor-parallel-size" in cmd) == bool(v["ETP"])
        tail = cmd[cmd.index("--use-distributed-optimizer") + 1:]
        assert tail == v["GPU_ARGS"].split(), task
        megatron_accepts(cmd, recipe, monkeypatch)


def test_recipe_on_the_cpu():
    """--cpu keeps a recipe's batch and learning rate, not its GPU settings or precision."""
    code, cmd, err = _run("pretrain.sh", "--recipe", "mixtral/Mixtral-8x7B-v0.1", "--data", "d", "--cpu", "--pp", "1",
                          "--vpp", "1")
    assert code == 0, err
    assert cmd[-1] == "--cpu" and _opt(cmd, "--precision") == "fp32" and "--overlap-grad-reduce" not in cmd
    assert (_opt(cmd, "--global-batch-size"), _opt(cmd, "--lr"), _opt(cmd, "--expert-model-parallel-size")) == \
        ("512", "3e-4", "8")


def test_cpu_leaves_out_the_recipes_virtual_pipeline():
    """--cpu drops what a CPU run cannot use from the recipe (its virtual pipeline: a tiny model on the laptop's
    processes; its context parallelism: Transformer Engine only), saying so in one line; an option given wins."""
    code, cmd, err = _run("pretrain.sh", "--recipe", "llama/Llama-3.1-70B", "--data", "d", "--cpu", "--tp", "1",
                          "--pp", "1")
    assert code == 0, err
    assert "--num-virtual-stages-per-pipeline-rank" not in cmd and _opt(cmd, "--context-parallel-size") == "1"
    assert err.splitlines() == ["note: --cpu leaves out what a CPU run cannot use: recipe llama/Llama-3.1-70B's "
                                "virtual pipeline (VPP 5), context parallelism (CP 2)"], err
    code, cmd, err = _run("pretrain.sh", "--recipe", "llama/Llama-3.1-70B", "--data", "d", "--cpu", "--tp", "1",
                          "--pp", "4", "--vpp", "2", NPROC_PER_NODE="4")
    assert code == 0 and _opt(cmd, "--num-virtual-stages-per-pipeline-rank") == "2", err
    assert "VPP" not in err and "CP 2" in err
    code, cmd, err = _run("pretrain.sh", "--recipe", "llama/Llama-3.1-8B", "--data", "d", "--cpu", "--tp", "1")
    assert code == 0 and err == "", err  # nothing left out: nothing said


def test_recipe_errors(tmp_path):
    bad = tmp_path / "bad.env"
    bad.write_text("TP=2\nTENSOR=4\n")
    code, _, err = _run("pretrain.sh", "--recipe", str(bad), "--model", "m", "--data", "d")
    assert code == 1 and f"error: {bad}:2: unknown key TENSOR" in err
    bad.write_text("TP 2\n")
    code, _, err = _run("pretrain.sh", "--recipe", str(bad), "--model", "m", "--data", "d")
    assert code == 1 and "1: not a KEY=VALUE line" in err
    code, _, err = _run("pretrain.sh", "--recipe", "llama/Llama-9B", "--data", "d")
    assert code == 1 and "error: --recipe llama/Llama-9B: no such recipe" in err
    own = tmp_path / "own.env"  # a recipe of one's own, anywhere; the fine-tuning LR must be said
    own.write_text('# mine\nTP=2\nSFT_GBS=16  # per task\nGPU_ARGS="--sequence-parallel"\nMIN_LR=3e-5\n')
    code, _, err = _run("sft.sh", "--recipe", str(own), "--model", "m", "--data", "d", NPROC_PER_NODE="2")
    assert code == 1 and "sets no SFT_LR (its LR is for pretraining): pass --lr" in err
    code, cmd, err = _run("sft.sh", "--recipe", str(own), "--model", "m", "--data", "d", "--lr", "2e-5",
                          NPROC_PER_NODE="2")
    assert code == 0, err
    assert (_opt(cmd, "--tensor-model-parallel-size"), _opt(cmd, "--global-batch-size"), _opt(cmd, "--lr"),
            _opt(cmd, "--min-lr")) == ("2", "16", "2e-5", "2e-06") and cmd[-1] == "--sequence-parallel"
    code, cmd, err = _run("pretrain.sh", "--recipe", str(own), "--model", "m", "--data", "d", NPROC_PER_NODE="2")
    assert code == 0 and (_opt(cmd, "--lr"), _opt(cmd, "--min-lr"), _opt(cmd, "--global-batch-size")) == \
        ("3e-4", "3e-5", "32"), err


def test_defaults_without_a_recipe():
    """No recipe: the launcher's command carries DEFAULTS, MIN_LR the LR / 10; an empty ETP and GPU_ARGS and a VPP
    of 1 put nothing on it."""
    code, cmd, err = _run("pretrain.sh", "--model", "m", "--data", "d")
    assert code == 0, err
    v = task_values(None, "PRETRAIN")
    assert v == {**DEFAULTS, "MIN_LR": "3e-05"}
    assert {flag: _opt(cmd, flag) for flag in FLAGS} == {flag: v[key] for flag, key in FLAGS.items()}
    assert "--expert-tensor-parallel-size" not in cmd and "--num-virtual-stages-per-pipeline-rank" not in cmd
    assert cmd[cmd.index("--use-distributed-optimizer") + 1:] == []


def test_read_recipe_names_the_line(tmp_path):
    """megatron_patch.recipes.read_recipe: KEY=VALUE lines (bare or double-quoted, a # comment after), # comments
    and blank lines; a line of another form, or a key no task knows, is a RecipeError naming FILE:LINE (the
    launchers' one `error:` line)."""
    path = tmp_path / "r.env"
    path.write_text('# a comment\n\n  \t# indented\nTP=2  # two\nGPU_ARGS="--a --b"  \nSFT_LR=1e-5\nETP=\n'
                    'PP=1\r\nPP=4')
    assert read_recipe(str(path)) == {"TP": "2", "GPU_ARGS": "--a --b", "SFT_LR": "1e-5", "ETP": "", "PP": "4"}
    for body, line, what in (("TP=2\nTP 4\n", 2, "not a KEY=VALUE line: TP 4"),
                             ("TP=2\n\nGPU_ARGS=--a --b\n", 3, "not a KEY=VALUE line: GPU_ARGS=--a --b"),
                             ('SEQ="4096\n', 1, 'not a KEY=VALUE line: SEQ="4096'),
                             ("tp=2\n", 1, "not a KEY=VALUE line: tp=2"),
                             ("# x\nTENSOR=4\n", 2, "unknown key TENSOR (keys: HF_ID "),
                             ("SFT_PRECISION=fp8\n", 1, "unknown key SFT_PRECISION"),
                             ("PPO_LR=1e-6\n", 1, "unknown key PPO_LR")):
        path.write_text(body)
        with pytest.raises(RecipeError) as e:
            read_recipe(str(path))
        assert str(e.value).startswith(f"{path}:{line}: {what}"), str(e.value)


def test_task_values_rules():
    """task_values, the launcher's rules: the option given, else the task's key, else the recipe's, else DEFAULTS
    (an empty value is none); a recipe's LR is pretraining's and its MIN_LR goes with it (not with a task's own LR
    nor a given one); MIN_LR defaults to the LR / 10 as awk's %g prints it; --lora's LR 1e-4; --cpu's fp32, no
    GPU_ARGS, and the recipe's VPP and CP left out (cpu_note says so) unless given."""
    recipe = {"TP": "2", "SFT_TP": "4", "PP": "", "SEQ": "8192", "SFT_SEQ": "", "LR": "2e-4", "MIN_LR": "1e-5",
              "SFT_LR": "1e-5", "PRETRAIN_VPP": "3", "CP": "2", "GPU_ARGS": "--x", "PRECISION": "fp8"}
    v = task_values(recipe, "PRETRAIN")
    assert [v[k] for k in ("TP", "PP", "VPP", "CP", "SEQ", "LR", "MIN_LR", "PRECISION", "GPU_ARGS")] == \
        ["2", "1", "3", "2", "8192", "2e-4", "1e-5", "fp8", "--x"]
    v = task_values(recipe, "SFT", {"MBS": "2", "PP": "", "GBS": ""})
    assert [v[k] for k in ("TP", "PP", "VPP", "SEQ", "MBS", "GBS", "LR", "MIN_LR")] == \
        ["4", "1", "1", "8192", "2", "32", "1e-5", "1e-06"]
    assert task_values(recipe, "PRETRAIN", {"LR": "1e-3"})["MIN_LR"] == "0.0001"  # not the recipe's 1e-5
    assert task_values(recipe, "PRETRAIN", {"LR": "1e-3", "MIN_LR": "0"})["MIN_LR"] == "0"
    assert task_values({**recipe, "PRETRAIN_MIN_LR": "7e-6"}, "PRETRAIN")["MIN_LR"] == "7e-6"
    assert task_values({**recipe, "SFT_MIN_LR": "3e-6"}, "SFT")["MIN_LR"] == "3e-6"
    with pytest.raises(RecipeError, match=r"^recipe r sets no RM_LR \(its LR is for pretraining\): pass --lr$"):
        task_values(recipe, "RM", name="r")
    assert task_values(recipe, "RM", {"LR": "3e-6"})["MIN_LR"] == "3e-07"
    assert [task_values(recipe, t, lora=True)[k] for t in ("RM", "SFT") for k in ("LR", "MIN_LR")] == \
        ["1e-4", "1e-05", "1e-4", "1e-05"]  # LoRA's LR, even over the task's own
    assert task_values(recipe, "SFT", {"LR": "3e-4"}, lora=True)["LR"] == "3e-4"
    assert task_values({}, "PRETRAIN") == task_values(None, "PRETRAIN") == {**DEFAULTS, "MIN_LR": "3e-05"}
    with pytest.raises(RecipeError, match="sets no SFT_LR"):
        task_values({}, "SFT", name="empty")  # a recipe without SFT_LR, even an empty one
    v = task_values(recipe, "PRETRAIN", cpu=True)
    assert [v[k] for k in ("TP", "VPP", "CP", "PRECISION", "GPU_ARGS")] == ["2", "1", "1", "fp32", ""]
    assert cpu_note(recipe, "PRETRAIN", {}, "r") == ("note: --cpu leaves out what a CPU run cannot use: recipe r's "
                                                    "virtual pipeline (VPP 3), context parallelism (CP 2)")
    v = task_values(recipe, "PRETRAIN", {"VPP": "2", "PRECISION": "bf16"}, cpu=True)
    assert [v[k] for k in ("VPP", "CP", "PRECISION")] == ["2", "1", "bf16"]
    assert cpu_note(recipe, "PRETRAIN", {"VPP": "2"}, "r").endswith("recipe r's context parallelism (CP 2)")
    assert cpu_note(recipe, "SFT", {"CP": "2"}, "r") is None and cpu_note(None, "PRETRAIN") is None
    with pytest.raises(RecipeError, match="--lr takes a number, got '1e-3x'"):
        task_values(None, "PRETRAIN", {"LR": "1e-3x"})
    assert task_values(None, "PRETRAIN", {"LR": "1e-3x", "MIN_LR": "1e-4"})["LR"] == "1e-3x"  # Megatron says
    for lr in ("3e-4", "1.5e-4", "1e-3", "5e-07", "0.00025", "1", "2.5E-5", ".3", "7."):
        awk = subprocess.run(["awk", f'BEGIN {{ printf "%g", {lr} / 10 }}'], capture_output=True, text=True).stdout
        assert task_values(None, "PRETRAIN", {"LR": lr})["MIN_LR"] == awk, lr


def test_recipes_command_line(tmp_path):
    """python -m megatron_patch.recipes, which the launchers ask: the values as shell assignments bash can eval
    (quoted), a recipe's error as one `error:` line and exit 1 (no traceback), --cpu's note on stderr; the module
    imports no torch, megatron, toolkits or command-line module."""
    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "megatron_patch.recipes", *args], capture_output=True, text=True)

    p = run("--recipe", "llama/Llama-3.1-70B", "--task", "SFT", "TP=", "PP=2", "GPU_ARGS", "MODEL", "GPUS")
    assert p.returncode == 0 and p.stderr == "", p.stderr
    assert p.stdout.splitlines() == ["TP=4", "PP=2", "GPU_ARGS='--sequence-parallel --overlap-grad-reduce "
                                     "--overlap-param-gather'", "MODEL=Llama-3.1-70B", "GPUS=32"]
    odd = "a b'c $(exit 3) \"d\"\n*"
    p = subprocess.run(["bash", "-c", 'eval "$("$0" -m megatron_patch.recipes MODEL="$1")"; printf %s "$MODEL"',
                        sys.executable, odd], capture_output=True, text=True)
    assert p.returncode == 0 and p.stdout == odd, p.stderr
    own = tmp_path / "own.env"
    own.write_text("TP=2\n")
    for args, message in ((("--recipe", "llama/Llama-9B"), "error: --recipe llama/Llama-9B: no such recipe "
                           "(examples/<family>/README.md lists them: FAMILY/MODEL)"),
                          (("--recipe", str(own), "--task", "DPO", "LR="), f"error: recipe {own} sets no DPO_LR "
                           "(its LR is for pretraining): pass --lr")):
        p = run(*args)
        assert p.returncode == 1 and p.stdout == "" and p.stderr.splitlines() == [message], p.stderr
    p = run("--recipe", "llama/Llama-3.1-70B", "--task", "PRETRAIN", "--cpu", "VPP", "CP=", "PRECISION")
    assert p.returncode == 0 and p.stdout.splitlines() == ["VPP=1", "CP=1", "PRECISION=fp32"]
    assert p.stderr.splitlines() == ["note: --cpu leaves out what a CPU run cannot use: recipe llama/Llama-3.1-70B's "
                                     "virtual pipeline (VPP 5), context parallelism (CP 2)"]
    p = subprocess.run([sys.executable, "-c", "import sys, megatron_patch.recipes; print(sorted(m for m in sys.modules "
                        "if m.split('.')[0] in ('torch', 'megatron', 'toolkits') or m == 'megatron_patch.cli'))"],
                       capture_output=True, text=True)
    assert p.returncode == 0 and p.stdout.strip() == "[]", (p.stdout, p.stderr)


# ---- READMEs -----------------------------------------------------------------------------------------------

def _layout(v: dict[str, str]) -> str:
    shown = [f"{k}{v[k]}" for k in ("TP", "PP", "VPP", "CP", "EP") if v[k] != "1"]
    return " ".join(shown + ([f"ETP{v['ETP']}"] if v["ETP"] else [])) or "TP1"


def recipe_table(family: str) -> str:
    """The markdown table of a family's recipes (examples/<family>/README.md holds it)."""
    rows = ["| recipe (`--recipe`) | GPUs | pretraining layout | seq | micro / global batch | LR | precision | "
            "SFT · RM · DPO |", "|---|---|---|---|---|---|---|---|"]
    for path, rid in zip(RECIPES, RECIPE_IDS):
        if rid.split("/")[0] != family:
            continue
        recipe = read_recipe(path)
        v = task_values(recipe, "PRETRAIN")
        dp = int(recipe["GPUS"]) // (int(v["TP"]) * int(v["PP"]) * int(v["CP"]))
        tuned = [task_values(recipe, t) for t in ("SFT", "RM", "DPO")]
        tune = f"LR {' · '.join(t['LR'] for t in tuned)}; batch {' · '.join(t['GBS'] for t in tuned)}"
        if {t["SEQ"] for t in tuned} != {v["SEQ"]}:
            tune += f"; seq {' · '.join(t['SEQ'] for t in tuned)}"
        if any(_layout(t) != _layout(v) for t in tuned):
            tune += f"; {' · '.join(_layout(t) for t in tuned)}"
        layout = _layout(v)
        rows.append(f"| `{rid}` | {recipe['GPUS']} | {layout}, DP{dp} | {v['SEQ']} | {v['MBS']} / {v['GBS']} "
                    f"| {v['LR']} | {v['PRECISION']} | {tune} |")
    return "\n".join(rows)


FAMILY_DIRS = sorted(d for d in os.listdir(EXAMPLES) if os.path.isdir(os.path.join(EXAMPLES, d)))


@pytest.mark.parametrize("family", FAMILY_DIRS)
def test_family_readme_tables_the_recipes(family):
    assert family in families(), f"examples/{family}/ is not a registered family"
    text = open(os.path.join(EXAMPLES, family, "README.md"), encoding="utf-8").read()
    if any(rid.startswith(f"{family}/") for rid in RECIPE_IDS):
        assert recipe_table(family) in text, f"examples/{family}/README.md: update the table to\n{recipe_table(family)}"


def _readme_commands(path: str) -> list[str]:
    text = open(path, encoding="utf-8").read()
    return [line for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S)
            for line in block.replace("\\\n", " ").splitlines() if line.strip() and not line.startswith("#")]


@pytest.mark.parametrize("readme", ["README.md", *[f"{d}/README.md" for d in FAMILY_DIRS]])
def test_examples_readme_commands_dry_run(readme):
    """Every launcher command of examples/**/README.md runs as far as its torchrun line (--dry-run)."""
    for command in _readme_commands(os.path.join(EXAMPLES, readme)):
        words = shlex.split(command, comments=True)
        env = dict(w.split("=", 1) for w in words if re.match(r"^[A-Z_]+=", w))
        words = [w for w in words if not re.match(r"^[A-Z_]+=", w)]
        script = os.path.relpath(os.path.join(ROOT, words[0]), EXAMPLES)
        code, cmd, err = _run(script, *words[1:], **{"NPROC_PER_NODE": "8", **env})
        assert code == 0, (command, err)


def test_lora_switch():
    """--lora RANK: adapters of that rank on every linear layer (alpha 2 x RANK), the PEFT folder beside the
    checkpoints, LoRA's learning rate unless --lr is given, no sequence parallelism (LoRA refuses it), and the
    frozen base read from --from-hf, which it needs."""
    code, cmd, err = _run("sft.sh", "--recipe", "llama/Llama-3.1-70B", "--from-hf", "--lora", "16", "--data", "x.jsonl",
                          "--out", "/ck", NPROC_PER_NODE="32")
    assert code == 0, err

    def opt(name):
        return cmd[cmd.index(name) + 1]

    assert (opt("--lora-rank"), opt("--lora-alpha"), opt("--lora-target"), opt("--save-peft")) == \
        ("16", "32", "all-linear", "/ck/peft")
    assert opt("--lr") == "1e-4" and "--sequence-parallel" not in cmd
    code, cmd, _ = _run("sft.sh", "--recipe", "llama/Llama-3.1-70B", "--from-hf", "--data", "x.jsonl",
                        NPROC_PER_NODE="32")
    assert code == 0 and "--sequence-parallel" in cmd and "--lora-rank" not in cmd  # the recipe as it is
    code, cmd, _ = _run("sft.sh", "--recipe", "llama/Llama-3.1-8B", "--from-hf", "--lora", "8", "--lr", "3e-4",
                        "--data", "x.jsonl")
    assert code == 0 and cmd[cmd.index("--lr") + 1] == "3e-4"
    for args, match in ((["--lora", "16"], "pass --from-hf"), (["--from-hf", "--lora", "0"], "positive integer")):
        code, _, err = _run("sft.sh", "--recipe", "llama/Llama-3.1-8B", "--data", "x.jsonl", *args)
        assert code == 1 and err.startswith("error: ") and match in err, err
