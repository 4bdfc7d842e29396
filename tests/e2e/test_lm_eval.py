"""lm-evaluation-harness through the `megatron_patch` model equals lm-eval's own `hf` model on the same
weights and the same local tasks (no downloads): a multiple-choice task (twice: the usual " " between
question and choice, and a context ending in a space with no delimiter, which lm-eval moves into the
continuation), a rolling-window perplexity task (documents longer than max_length=64, so several windows)
and a greedy generate_until task. Checked on a converted TP2xPP2 checkpoint loaded at TP=1, at TP2xPP2
and at TP=2 with two data-parallel replicas (4 gloo processes); plus the `python -m` CLI and bad model
args.

Equal means: acc / acc_norm / exact_match identical; each request's log-likelihood within 1e-5 per token
of its continuation and its is_greedy flag identical; each document's rolling log-likelihood within 1e-5
per scored token (~180 tokens); generated text identical. Per token, because a log-likelihood is a sum of
per-token log-probabilities in fp32: at |ll| ~ 70 one fp32 step is 7.6e-6, so two correct sums of five
tokens can differ by 1.5e-5 (seen: HF -73.73231506, ours -73.73233032)."""

import contextlib
import gzip
import json

import pytest

from megatron_patch.convert import main as convert
from megatron_patch.tokenizer import CORPUS, TINY_TOKENIZER
from tests.models import hf_model, llama_config, save_hf

TASKS = ["mp_mc", "mp_mc_space", "mp_ppl", "mp_gen"]
MAX_LENGTH = 64  # both models: the rolling documents need several windows

_COMMON = """dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
"""
_TASKS = {
    "mp_mc": """output_type: multiple_choice
doc_to_text: "Question: {{question}}\\nAnswer:"
doc_to_choice: "{{choices}}"
doc_to_target: "{{answer}}"
metric_list: [{metric: acc}, {metric: acc_norm}]
""",
    "mp_mc_space": """output_type: multiple_choice
doc_to_text: "{{question}} "
target_delimiter: ""
doc_to_choice: "{{choices}}"
doc_to_target: "{{answer}}"
metric_list: [{metric: acc}, {metric: acc_norm}]
""",
    "mp_ppl": """output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{text}}"
metric_list: [{metric: word_perplexity}, {metric: byte_perplexity}, {metric: bits_per_byte}]
""",
    "mp_gen": """output_type: generate_until
doc_to_text: "{{prompt}}"
doc_to_target: "{{target}}"
generation_kwargs: {until: ["\\n\\n", "."], max_gen_toks: 12, do_sample: false}
metric_list: [{metric: exact_match}]
""",
}


def _write_tasks(root, texts) -> str:
    mc = []
    for i, t in enumerate(texts[:6]):
        w = t.split()
        mc.append({"question": " ".join(w[:10]), "choices": [" ".join(w[10 + 3 * k: 13 + 3 * k]) for k in range(4)],
                   "answer": i % 4})
    data = {"mp_mc": mc, "mp_mc_space": mc, "mp_ppl": [{"text": t[:700]} for t in texts[:3]],
            "mp_gen": [{"prompt": " ".join(t.split()[:8]), "target": " ".join(t.split()[8:10])} for t in texts[:4]]}
    tasks = root / "tasks"
    tasks.mkdir()
    for name, rows in data.items():
        (root / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (tasks / f"{name}.yaml").write_text(f"task: {name}\n" + _COMMON.format(data=root / f"{name}.jsonl")
                                            + _TASKS[name])
    return str(tasks)


def _evaluate(model: str, model_args: dict, tasks_dir: str, tasks: list[str] = TASKS) -> dict:
    """lm-eval's Python API on the local tasks; per task: metrics and the samples in document order."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    import megatron_patch.lm_eval_model  # noqa: F401  (registers the model name)

    r = lm_eval.simple_evaluate(model=model, model_args={**model_args, "max_length": MAX_LENGTH}, tasks=tasks,
                                task_manager=TaskManager(include_path=tasks_dir, include_defaults=False),
                                log_samples=True, batch_size=2)
    if r is None:  # not the process that reports
        return {}
    out = {}
    for task in tasks:
        samples = sorted(r["samples"][task], key=lambda s: s["doc_id"])
        out[task] = {"metrics": {k: v for k, v in r["results"][task].items() if isinstance(v, float)},
                     "resps": [s["resps"] for s in samples], "filtered": [s["filtered_resps"] for s in samples],
                     "docs": [s["doc"] for s in samples], "args": [s["arguments"] for s in samples]}
    return out


@pytest.fixture(scope="module")
def setup(tmp_path_factory, cpu_megatron):
    """An HF folder and its TP2xPP2 Megatron conversion, the local tasks, and lm-eval's `hf` scores on them.
    Nothing may reach the network: the hub and datasets are offline for the whole module."""
    root = tmp_path_factory.mktemp("lm_eval")
    # eos 0 = the tiny tokenizer's end-of-text, where megatron's generation stops (HF stops at the config's)
    hf = hf_model(llama_config("gqa", eos_token_id=0, bos_token_id=0))
    hf_dir = save_hf(hf, str(root / "hf"))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (root / "hf" / name).write_bytes(open(f"{TINY_TOKENIZER}/{name}", "rb").read())
    mc = str(root / "mc")
    assert convert(["hf-to-mcore", "--hf-dir", hf_dir, "--out", mc, "--tp", "2", "--pp", "2"]) == 0
    with gzip.open(CORPUS, "rt") as f:
        texts = [json.loads(next(f))["text"] for _ in range(6)]
    tasks_dir = _write_tasks(root, texts)
    with offline(root):
        ref = _evaluate("hf", {"pretrained": hf_dir, "dtype": "float32", "device": "cpu"}, tasks_dir)
        yield root, mc, tasks_dir, ref


@contextlib.contextmanager
def offline(root):
    """The hub and datasets offline (also for spawned processes), the datasets cache under `root`."""
    import datasets
    import huggingface_hub

    with pytest.MonkeyPatch.context() as mp:
        for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
            mp.setenv(var, "1")  # also for the spawned gloo processes
        mp.setenv("HF_DATASETS_CACHE", str(root / "datasets_cache"))
        mp.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # already imported: read at import
        mp.setattr(datasets.config, "HF_HUB_OFFLINE", True)
        mp.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)
        mp.setattr(datasets.config, "HF_DATASETS_CACHE", root / "datasets_cache")
        yield


def _assert_same_scores(ours: dict, ref: dict, tasks: list[str] = TASKS, per_token: float = 1e-5) -> dict:
    """The module docstring's equalities (log-likelihoods within `per_token` per token); returns the largest
    differences seen."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(TINY_TOKENIZER)
    worst = {"loglikelihood": 0.0, "loglikelihood_per_token": 0.0, "rolling": 0.0, "rolling_per_token": 0.0}
    for task in tasks:
        a, b = ours[task], ref[task]
        assert a["docs"] == b["docs"], task
        for metric in ("acc,none", "acc_norm,none", "exact_match,none"):
            if metric in b["metrics"]:
                assert a["metrics"][metric] == b["metrics"][metric], (task, metric)
        for doc, args, mine, theirs in zip(a["docs"], a["args"], a["resps"], b["resps"]):
            for arg, (x, *_), (y,) in zip(args, mine, theirs, strict=True):
                # (lm-eval pads a data-parallel replica's share by repeating its last request: extra responses)
                if task == "mp_gen":
                    assert x == y
                elif task == "mp_ppl":
                    n = len(tok.encode(doc["text"]))
                    assert abs(x - y) <= per_token * n, (x, y, n)
                    worst["rolling"] = max(worst["rolling"], abs(x - y))
                    worst["rolling_per_token"] = max(worst["rolling_per_token"], abs(x - y) / n)
                else:
                    n = len(tok.encode(arg[1].strip()))  # the continuation's tokens, about
                    assert abs(x[0] - y[0]) <= per_token * n and x[1] == y[1], (task, x, y, n)
                    worst["loglikelihood"] = max(worst["loglikelihood"], abs(x[0] - y[0]))
                    worst["loglikelihood_per_token"] = max(worst["loglikelihood_per_token"], abs(x[0] - y[0]) / n)
        if task == "mp_ppl":
            for metric, value in b["metrics"].items():
                assert abs(a["metrics"][metric] - value) <= per_token * abs(value), (metric, a["metrics"][metric],
                                                                                      value)
    assert any(f[0] for f in ref["mp_gen"]["filtered"])  # text was generated: the comparison compares something
    return worst


def test_scores_equal_lm_eval_hf_at_tp1(setup):
    root, mc, tasks_dir, ref = setup
    worst = _assert_same_scores(_evaluate("megatron_patch", {"mcore_dir": mc}, tasks_dir), ref)
    print("max |our - hf| at TP1:", worst)


def test_sampling_follows_the_seed(setup):
    """do_sample=True (here from lm-eval's --gen_kwargs) samples with megatron's sampler: the model arg
    `seed` makes it reproducible."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    root, mc, tasks_dir, ref = setup
    runs = []
    for seed in (1, 1, 2):
        r = lm_eval.simple_evaluate(model="megatron_patch", model_args={"mcore_dir": mc, "seed": seed},
                                    tasks=["mp_gen"], gen_kwargs="do_sample=True,temperature=0.8,top_k=20",
                                    task_manager=TaskManager(include_path=tasks_dir, include_defaults=False),
                                    log_samples=True, batch_size=2)
        runs.append([s["filtered_resps"][0] for s in sorted(r["samples"]["mp_gen"], key=lambda s: s["doc_id"])])
    assert runs[0] == runs[1] != runs[2]
    assert runs[0] != [f[0] for f in ref["mp_gen"]["filtered"]]  # not the greedy text


def _local_tasks_only():
    """lm-eval's CLI indexes its ~10k built-in task files first (9 s here): these tests need only theirs."""
    import lm_eval.tasks

    class LocalTasksOnly(lm_eval.tasks.TaskManager):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **{**kwargs, "include_defaults": False})

    return LocalTasksOnly


def _cli(mc: str, tasks_dir: str, *extra: str) -> tuple[int, str]:
    """`python -m megatron_patch.lm_eval_model ...` in this process: (exit code, what it printed)."""
    import contextlib
    import io

    from megatron_patch.lm_eval_model import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["--model", "megatron_patch", "--model_args", f"mcore_dir={mc},max_length={MAX_LENGTH}",
                     *extra, "--tasks", "mp_mc", "--include_path", tasks_dir, "--batch_size", "2"])
    return code, out.getvalue()


def _table_has_acc(table: str, acc: float) -> bool:
    flat = table.replace(" ", "")
    return "|mp_mc|" in flat and f"|acc|↑|{acc:.4f}|" in flat


def _in_world(rank: int, mc: str, tasks_dir: str) -> dict:
    import lm_eval.tasks

    from tests import _cpu

    _cpu.init_model_parallel(2, 2)
    out = {"tp2pp2": _evaluate("megatron_patch", {"mcore_dir": mc, "tp": 2, "pp": 2}, tasks_dir)}
    _cpu.init_model_parallel(2, 1)  # TP=2 with two data-parallel replicas
    out["tp2dp2"] = _evaluate("megatron_patch", {"mcore_dir": mc, "tp": 2}, tasks_dir)
    lm_eval.tasks.TaskManager = _local_tasks_only()  # a process of its own: no need to restore
    out["cli"] = _cli(mc, tasks_dir, "--model_args", "tp=2")
    return out


def test_scores_equal_lm_eval_hf_at_tp2_pp2_and_data_parallel(setup):
    """4 gloo processes: TP2xPP2, then TP=2 x two data-parallel replicas that split the documents (all
    tasks, generation included: megatron-core's dynamic engine runs pipeline-parallel models). Every
    process of a replica runs the same passes; only the first process reports results."""
    from tests import _cpu

    root, mc, tasks_dir, ref = setup
    per_rank = _cpu.run_world(4, _in_world, mc, tasks_dir)
    assert all(rank["tp2pp2"] == rank["tp2dp2"] == {} for rank in per_rank[1:])
    assert per_rank[0]["cli"][0] == 0 and _table_has_acc(per_rank[0]["cli"][1], ref["mp_mc"]["metrics"]["acc,none"])
    assert all(rank["cli"] == (0, "") for rank in per_rank[1:])  # the CLI prints on the first process only
    print("max |our - hf| at TP2xPP2:", _assert_same_scores(per_rank[0]["tp2pp2"], ref))
    print("max |our - hf| at TP2, DP2:", _assert_same_scores(per_rank[0]["tp2dp2"], ref))


def test_command_line(setup, capsys, monkeypatch):
    """`python -m megatron_patch.lm_eval_model` is lm-eval's CLI with the model registered."""
    import lm_eval.tasks

    from megatron_patch.lm_eval_model import main

    monkeypatch.setattr(lm_eval.tasks, "TaskManager", _local_tasks_only())
    root, mc, tasks_dir, ref = setup
    code, table = _cli(mc, tasks_dir)
    assert code == 0 and _table_has_acc(table, ref["mp_mc"]["metrics"]["acc,none"]), table
    assert main(["--model", "megatron_patch", "--model_args", f"mcore_dir={root / 'none'}",
                 "--tasks", "mp_mc", "--include_path", tasks_dir]) == 1
    assert f"error: {root / 'none'} does not exist" in capsys.readouterr().err


def test_bad_model_args(setup):
    from megatron_patch.lm_eval_model import MegatronLM

    root, mc, *_ = setup
    for kwargs, match in [({}, "pass mcore_dir=CKPT"),
                          ({"mcore_dir": mc, "pretrained": "x"}, "unknown argument.* pretrained"),
                          ({"mcore_dir": mc, "hf_dir": str(root / "hf")}, "either mcore_dir or hf_dir"),
                          ({"mcore_dir": mc, "tp": "two"}, "tp='two'"),
                          ({"mcore_dir": mc, "batch_size": "auto"}, "batch_size=auto"),
                          ({"mcore_dir": mc, "dtype": "int8"}, "dtype='int8'"),
                          ({"mcore_dir": str(root / "none")}, "does not exist")]:
        with pytest.raises(ValueError, match=match):
            MegatronLM(**kwargs)
    with pytest.raises(ValueError, match="unknown argument.* foo"):  # as lm-eval passes a model_args string
        MegatronLM.create_from_arg_string(f"mcore_dir={mc},foo=1", {"batch_size": 1, "device": "cpu"})
