"""examples/<family>/pretrain.sh: one per registered family; --dry-run prints the full torchrun command
(named options, defaults, environment-sized torchrun run by $PYTHON, Megatron arguments passed through);
--help prints the launcher's usage; --split and --cpu."""

import os
import shlex
import subprocess

import pytest

from megatron_patch.models import families

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _dry_run(family: str, *args: str, entry: str = "pretrain", **env: str) -> tuple[int, list[str], str]:
    script = os.path.join(ROOT, "examples", family, f"{entry}.sh")
    environ = {k: v for k, v in os.environ.items() if k not in ("NPROC_PER_NODE", "NNODES", "MODEL", "DATA")}
    p = subprocess.run(["bash", script, "--dry-run", *args], capture_output=True, text=True,
                       env={**environ, "PATH": "/usr/bin:/bin", **env})
    return p.returncode, shlex.split(p.stdout), p.stderr


def _entry(cmd: list[str]) -> str:
    """The module torch.distributed.run starts."""
    return cmd[cmd.index("-m", cmd.index("torch.distributed.run")) + 1]


@pytest.mark.parametrize("entry,data_flag", [("pretrain", "--data-path"), ("sft", "--sft-data")])
@pytest.mark.parametrize("family", sorted(families()))
def test_every_family_has_launchers(family, entry, data_flag):
    code, cmd, err = _dry_run(family, "--data", "corpus", entry=entry)
    assert code == 0, err
    assert cmd[:5] == ["CUDA_DEVICE_MAX_CONNECTIONS=1", "python", "-m", "torch.distributed.run", "--nproc_per_node"]
    assert _entry(cmd) == f"megatron_patch.{entry}"
    assert cmd[cmd.index(data_flag) + 1] == "corpus"
    assert cmd[cmd.index("--hf-config") + 1] == cmd[cmd.index("--tokenizer-model") + 1]


def test_named_options_environment_and_passthrough():
    code, cmd, _ = _dry_run("qwen2", "--model", "/m/Qwen2.5-0.5B", "--data", "/d/x_text_document", "--tp", "2",
                            "--pp", "4", "--precision", "fp8", "--mbs", "2", "--gbs", "64", "--lr", "1e-3",
                            "--iters", "500", "--out", "/ckpt", "--from-hf", "--profile", "benchmark", "--",
                            "--recompute-activations",
                            "--seed", "7", NPROC_PER_NODE="8", NNODES="4", NODE_RANK="3", MASTER_ADDR="node0")
    assert code == 0

    def opt(name):
        return cmd[cmd.index(name) + 1]

    assert (opt("--nproc_per_node"), opt("--nnodes"), opt("--node_rank"), opt("--master_addr")) == \
        ("8", "4", "3", "node0")
    assert opt("--load-hf") == "/m/Qwen2.5-0.5B" and "--hf-config" not in cmd
    assert (opt("--tensor-model-parallel-size"), opt("--pipeline-model-parallel-size")) == ("2", "4")
    assert (opt("--precision"), opt("--micro-batch-size"), opt("--global-batch-size")) == ("fp8", "2", "64")
    assert (opt("--lr"), opt("--min-lr"), opt("--train-iters"), opt("--save")) == ("1e-3", "0.0001", "500", "/ckpt")
    assert opt("--throughput-profile") == "benchmark"
    assert cmd[-3:] == ["--recompute-activations", "--seed", "7"]  # passed through last: they win


def test_missing_required_options():
    code, _, err = _dry_run("llama", "--model", "m")
    assert code == 1 and "--data PREFIX is required" in err


@pytest.mark.parametrize("family", sorted(families()))
def test_generate_and_evaluate_launchers(family):
    for tool in ("generate", "evaluate"):
        script = os.path.join(ROOT, "examples", family, f"{tool}.sh")
        text = open(script).read()
        assert f"-m megatron_patch.{tool} --mcore-dir" in text
        p = subprocess.run(["bash", script], capture_output=True, text=True)
        assert p.returncode != 0 and "checkpoint folder" in p.stderr


@pytest.mark.parametrize("family", sorted(families()))
def test_rlhf_launchers(family):
    for script, entry in (("rlhf_rm", "rlhf.reward_model"), ("rlhf_dpo", "rlhf.dpo")):
        code, cmd, err = _dry_run(family, "--data", "prefs.jsonl", entry=script)
        assert code == 0, err
        assert _entry(cmd) == f"megatron_patch.{entry}"
        assert cmd[cmd.index("--pref-data") + 1] == "prefs.jsonl"
        assert cmd[cmd.index("--load-hf") + 1] == cmd[cmd.index("--tokenizer-model") + 1]
    text = open(os.path.join(ROOT, "examples", family, "rlhf_grpo.sh")).read()
    assert "-m megatron_patch.rlhf.grpo --hf-dir" in text
    p = subprocess.run(["bash", os.path.join(ROOT, "examples", family, "rlhf_grpo.sh")], capture_output=True, text=True)
    assert p.returncode != 0 and "HF model folder" in p.stderr


def test_expert_parallel_option():
    code, cmd, err = _dry_run("mixtral", "--data", "corpus", "--ep", "4", "--tp", "2")
    assert code == 0, err
    assert cmd[cmd.index("--expert-model-parallel-size") + 1] == "4"
    assert _entry(cmd) == "megatron_patch.pretrain"


@pytest.mark.parametrize("script", ["pretrain", "sft", "rlhf_rm", "rlhf_dpo"])
def test_help_prints_the_launchers_usage(script):
    """--help (and -h) print the named options and the environment, then exit 0 without launching."""
    for flag in ("--help", "-h"):
        p = subprocess.run(["bash", os.path.join(ROOT, "examples", "llama", f"{script}.sh"), flag],
                           capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"})
        assert p.returncode == 0, p.stderr
        for text in ("[--model DIR]", "[--split TRAIN,VALID,TEST]", "--cpu", "NPROC_PER_NODE", "PYTHON",
                     "default --model: Llama-3.1-8B", "python -m megatron_patch.<entry> --help"):
            assert text in p.stdout, (text, p.stdout)
    p = subprocess.run(["bash", os.path.join(ROOT, "examples", "launch.sh"), "--help"], capture_output=True, text=True)
    assert p.returncode == 0 and "[--model DIR]" in p.stdout


def test_python_variable_runs_torch_distributed():
    code, cmd, _ = _dry_run("llama", "--data", "corpus", PYTHON="/opt/venv/bin/python")
    assert code == 0 and cmd[1:4] == ["/opt/venv/bin/python", "-m", "torch.distributed.run"]


def test_split_is_an_option_not_hard_coded():
    """No --split unless asked (the entry point's default applies); evaluation only with a validation share."""
    code, cmd, _ = _dry_run("llama", "--data", "corpus")
    assert code == 0 and "--split" not in cmd and cmd[cmd.index("--eval-iters") + 1] == "10"
    code, cmd, _ = _dry_run("llama", "--data", "corpus", "--split", "90,10,0")
    assert code == 0 and cmd[cmd.index("--split") + 1] == "90,10,0" and "--eval-iters" in cmd
    code, cmd, _ = _dry_run("llama", "--data", "corpus", "--split", "100,0,0")
    assert code == 0 and cmd[cmd.index("--split") + 1] == "100,0,0" and "--eval-iters" not in cmd
    for entry in ("sft", "rlhf_rm", "rlhf_dpo"):  # these trainers have no validation set
        code, cmd, _ = _dry_run("llama", "--data", "x.jsonl", entry=entry)
        assert code == 0 and "--eval-iters" not in cmd and "--split" not in cmd


def test_cpu_option():
    code, cmd, _ = _dry_run("llama", "--data", "corpus", "--cpu")
    assert code == 0 and "--cpu" in cmd and "--use-distributed-optimizer" not in cmd
    assert cmd[cmd.index("--precision") + 1] == "fp32" and cmd[cmd.index("--nproc_per_node") + 1] == "1"
    code, cmd, _ = _dry_run("llama", "--data", "corpus")
    assert "--cpu" not in cmd and "--use-distributed-optimizer" in cmd and cmd[cmd.index("--precision") + 1] == "bf16"
