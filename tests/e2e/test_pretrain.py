"""`python -m megatron_patch.pretrain` end to end on CPU (megatron.training over gloo; test-only CPU
redirects in tests/_cpu.py), on the bundled corpus tokenized by `megatron-patch preprocess-data`:

- a tiny LLaMA from an HF config trains (loss falls), saves at iteration 10 and resumes to 15 with
  every micro-batch loss of 11-15 equal to an uninterrupted 15-iteration run (1e-6), at TP=1 and TP=2,
  and TP=2 matches TP=1;
- `--load-hf` starts from an HF checkpoint (first-batch loss = transformers' loss on that batch) and
  `--save-hf` exports the trained model.
"""

import contextlib
import io
import json

import pytest
import torch

from megatron_patch.testing import TINY_LLAMA
from megatron_patch.tokenizer import TINY_TOKENIZER
from tests import _cpu
from tests.helpers import pretrain_argv as _argv


def _run(rank: int, argv: list[str]) -> dict:
    """One training run in this process; returns every micro-batch's loss (in order) and the first batch."""
    _cpu.install_training()
    from megatron_patch.pretrain import main
    from megatron_patch.training import gpt

    losses, tokens, batches, loss_func, get_batch = [], [], [], gpt.loss_func, gpt.get_batch

    def record_loss(mask, output):
        out = loss_func(mask, output)
        losses.append(out[0].item() / out[1].item())
        tokens.append(out[1].item())
        return out

    def record_batch(it):
        batch = get_batch(it)
        if not batches:
            batches.append({k: batch[k].clone() for k in ("tokens", "labels", "loss_mask")})
        return batch

    gpt.loss_func, gpt.get_batch = record_loss, record_batch
    from megatron_patch.training import wgrad

    fused, accumulate, scatter = [], wgrad.WgradAccumulation.wgrad_gemm_accum_fp32, wgrad.scatter_into_main_grad

    def record_fused(total_input, grad_output, main_grad):
        fused.append(tuple(main_grad.shape))
        accumulate(total_input, grad_output, main_grad)

    def record_scatter(main_grad, ids, grad):
        fused.append(("embedding", *main_grad.shape))
        scatter(main_grad, ids, grad)

    wgrad.WgradAccumulation.wgrad_gemm_accum_fp32 = staticmethod(record_fused)
    wgrad.scatter_into_main_grad = record_scatter
    with contextlib.redirect_stdout(io.StringIO()) as out:
        try:
            assert main(argv) == 0
        except SystemExit as e:  # --exit-interval ends the run with sys.exit(0)
            if e.code not in (0, None):
                raise
    from megatron.training import get_args

    from megatron_patch import patches

    settings = {k: getattr(get_args(), k) for k in PROFILE_SETTINGS}
    return {"losses": losses, "tokens": tokens, "log": out.getvalue(), "first_batch": batches[0] if batches else None,
            "settings": settings, "lean_cross_entropy": patches.is_active("lean_cross_entropy"),
            "wgrad_fused": fused}


# the arguments --throughput-profile sets
PROFILE_SETTINGS = ("manual_gc", "manual_gc_interval", "cross_entropy_loss_fusion", "cross_entropy_fusion_impl",
                    "check_for_nan_in_loss_and_grad", "rerun_mode", "create_attention_mask_in_dataloader",
                    "lean_cross_entropy", "wgrad_fusion_without_apex")


def _train(world: int, argv: list[str]) -> dict:
    return _cpu.run_world(world, _run, argv)[-1]  # the last rank holds the loss


@pytest.fixture(scope="module")
def tp1_full(corpus, tmp_path_factory):
    save = str(tmp_path_factory.mktemp("tp1") / "ckpt")
    return {**_train(1, _argv(corpus, save)), "save": save}


def _logged_losses_are_each_iterations_own(run: dict, first_iteration: int) -> None:
    """Each iteration's logged `lm loss` (--log-interval 1) is its own micro-batches' loss (their token-weighted
    mean, printed to 7 significant digits), the second iteration of a process included: megatron-core (0.18.2 to
    0.19.x, issue NVIDIA/Megatron-LM#6237) logs there the mean of the first two iterations without the patch
    `first_log_interval_reset`."""
    from megatron_patch.training.log import parse_log

    logged = {it: row["lm loss"] for it, row in parse_log(run["log"]).iterations.items()}
    per_iteration = len(run["losses"]) // len(logged)
    assert sorted(logged) == list(range(first_iteration, first_iteration + len(logged))), logged
    for k, it in enumerate(sorted(logged)):
        part = slice(k * per_iteration, (k + 1) * per_iteration)
        own = sum(loss * n for loss, n in zip(run["losses"][part], run["tokens"][part])) / sum(run["tokens"][part])
        assert abs(logged[it] - own) <= 1e-6 * own, (it, logged[it], own, logged)


@pytest.mark.parametrize("tp", [1, 2])
def test_resume_matches_uninterrupted(corpus, tmp_path, tp1_full, tp):
    """Every micro-batch loss of the resumed iterations equals the uninterrupted run's (1e-6), and each run logs
    every iteration's own loss (the second iteration after a start or a resume included)."""
    layout = ["--tensor-model-parallel-size", str(tp)]
    full_run = tp1_full if tp == 1 else _train(tp, _argv(corpus, str(tmp_path / "full"), *layout))
    first_run = _train(tp, _argv(corpus, str(tmp_path / "ckpt"), *layout, "--exit-interval", "10"))
    resumed_run = _train(tp, _argv(corpus, str(tmp_path / "ckpt"), *layout, "--load", str(tmp_path / "ckpt")))
    full, first, resumed = full_run["losses"], first_run["losses"], resumed_run["losses"]
    assert len(full) == 30 and len(first) == 20 and len(resumed) == 10  # 2 micro-batches per iteration
    for run, first_iteration in ((full_run, 1), (first_run, 1), (resumed_run, 11)):
        _logged_losses_are_each_iterations_own(run, first_iteration)
    assert max(abs(a - b) for a, b in zip(first + resumed, full)) <= 1e-6
    # it learns: from ~log(1000) = 6.9 at the start, the last iterations are clearly lower (~6.4)
    assert sum(full[-4:]) / 4 < sum(full[:4]) / 4 - 0.3, full


def _run_recording_held_out(rank: int, argv: list[str], stop_at: int | None) -> list[list[int]]:
    """One training run in this process; returns the first tokens of every held-out batch it evaluated (evaluation
    runs without gradients). With `stop_at` n, SIGTERM reaches the process as it reads its n-th held-out batch, as
    `benchmarks/convergence.py train --minutes` sends it to a rank."""
    import os
    import signal

    _cpu.install_training()
    from megatron_patch.pretrain import main
    from megatron_patch.training import gpt

    held_out, get_batch = [], gpt.get_batch

    def record_batch(it):
        batch = get_batch(it)
        if not torch.is_grad_enabled():
            held_out.append(batch["tokens"][0, :8].tolist())
            if len(held_out) == stop_at:
                os.kill(os.getpid(), signal.SIGTERM)
        return batch

    gpt.get_batch = record_batch
    with contextlib.redirect_stdout(io.StringIO()):
        try:
            assert main(argv) == 0
        except SystemExit as e:  # a stop ends the run with sys.exit(0)
            if e.code not in (0, None):
                raise
    return held_out


def test_a_stop_by_signal_keeps_the_held_out_batches_of_a_continued_run_paired(corpus, tmp_path):
    """`convergence.py train --minutes` stops a run by SIGTERM under Megatron's --exit-signal-handler: Megatron
    finishes the iteration and its evaluation, saves and exits, and the continued run evaluates on the same
    held-out batches at the same iterations as an uninterrupted run (here the signal arrives in the middle of the
    second evaluation, at iteration 8). Megatron's --exit-duration-in-mins, which that replaced, also stops inside
    an evaluation, counting its batches as read: the continuation then read every later evaluation's batches early
    (2026-12-04, the fp8-delayed run after iteration 480)."""
    held = ["--split", "80,20,0", "--eval-iters", "2", "--eval-interval", "4", "--train-iters", "12",
            "--save-interval", "100", "--exit-signal-handler"]
    full = _cpu.run_world(1, _run_recording_held_out, _argv(corpus, str(tmp_path / "full"), *held), None)[0]
    ckpt = str(tmp_path / "ckpt")
    first = _cpu.run_world(1, _run_recording_held_out, _argv(corpus, ckpt, *held), 6)[0]
    rest = _cpu.run_world(1, _run_recording_held_out, _argv(corpus, ckpt, *held, "--load", ckpt), None)[0]
    # an evaluation reads 2 iterations of 2 micro-batches: at iterations 4, 8 and 12, and Megatron's final one
    assert len(full) == 16 and len(first) == 8 and len(rest) == 8  # stopped at 8, continued from its save
    assert first + rest == full and full[4] != full[8]  # (consecutive evaluations read different batches)


@pytest.fixture(scope="module")
def hf_start(tmp_path_factory):
    from tests.models import hf_model, llama_config, save_hf

    return save_hf(hf_model(llama_config("gqa")), str(tmp_path_factory.mktemp("hf") / "hf"))


@pytest.fixture(scope="module")
def from_hf_tp1(corpus, hf_start, tmp_path_factory):
    root = tmp_path_factory.mktemp("from_hf")
    # no vocab padding at TP=1 or 2 (1000 = 125 x 4 x 2): padded rows would add zero logits to the softmax
    return _train(1, _argv(corpus, str(root / "ckpt"), "--train-iters", "4", "--make-vocab-size-divisible-by", "4",
                           "--save-hf", str(root / "exported"), model=("--load-hf", hf_start))), root


def test_load_hf_reproduces_hf_loss_and_save_hf_exports(from_hf_tp1, hf_start):
    """--load-hf: the first micro-batch's loss is transformers' loss on it; --save-hf: the trained model
    is exported with the source's names and config."""
    from transformers import AutoModelForCausalLM

    from megatron_patch.conversion.hf_io import read_all

    run, root = from_hf_tp1
    b = run["first_batch"]
    hf = AutoModelForCausalLM.from_pretrained(hf_start, attn_implementation="eager").eval()
    with torch.no_grad():
        logits = hf(b["tokens"]).logits.float()
    token_loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), b["labels"].flatten(), reduction="none")
    mask = b["loss_mask"].flatten().float()
    assert abs((token_loss * mask).sum().item() / mask.sum().item() - run["losses"][0]) <= 1e-5
    exported, original = read_all(str(root / "exported")), read_all(hf_start)
    assert set(exported) == set(original)
    assert all(exported[k].shape == original[k].shape for k in original)
    assert not torch.equal(exported["model.layers.0.mlp.up_proj.weight"], original["model.layers.0.mlp.up_proj.weight"])
    config = json.load(open(root / "exported" / "config.json"))
    assert config["architectures"] == ["LlamaForCausalLM"] and config["vocab_size"] == 1000


def test_tp2_from_hf_matches_tp1(from_hf_tp1, corpus, hf_start, tmp_path):
    """From the same HF weights, TP=2 trains with the same losses as TP=1 (fp32; reduction order only)."""
    run = _train(2, _argv(corpus, str(tmp_path / "ckpt"), "--train-iters", "4", "--make-vocab-size-divisible-by", "4",
                          "--tensor-model-parallel-size", "2", model=("--load-hf", hf_start)))
    tp1 = from_hf_tp1[0]["losses"]
    assert len(run["losses"]) == len(tp1) == 8
    assert max(abs(a - b) for a, b in zip(run["losses"], tp1)) <= 1e-5


def test_virtual_pipeline_from_hf_matches_tp1(from_hf_tp1, corpus, hf_start, tmp_path):
    """--load-hf into a virtual pipeline (PP2 x VPP2: megatron.training's interleaved schedule, each rank two
    model chunks, one layer each, chunk v of rank p holding layer 2v + p): the same losses as TP=1 (fp32;
    reduction order only)."""
    run = _train(2, _argv(corpus, str(tmp_path / "ckpt"), "--train-iters", "4", "--make-vocab-size-divisible-by", "4",
                          "--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "2",
                          model=("--load-hf", hf_start)))
    tp1 = from_hf_tp1[0]["losses"]
    assert len(run["losses"]) == len(tp1) == 8
    assert max(abs(a - b) for a, b in zip(run["losses"], tp1)) <= 1e-5


def _parse_errors(rank: int, argvs: list[list[str]]) -> list[str]:
    _cpu.install_training()
    from megatron_patch.training.arguments import parse_args

    messages = []
    for argv in argvs:
        try:
            parse_args(argv)
            messages.append("")
        except ValueError as e:
            messages.append(str(e))
    return messages


def test_bad_input_is_refused_before_training(corpus, tmp_path, tp1_full):
    """Each a clear error from argument checking, before a model or a GPU is touched (a resume whose optimizer
    state the command line's optimizer cannot load: read from the saved arguments of a real training checkpoint,
    tp1_full's)."""
    cases = {  # the vocab check runs after megatron set its global state: keep it last
        "another optimizer state": (_argv(corpus, str(tmp_path / "c"), "--load", tp1_full["save"],
                                          "--use-precision-aware-optimizer"),
                                    "iter_0000015 was saved without --use-precision-aware-optimizer (its optimizer "
                                    "state holds fp32 master weights), which --use-precision-aware-optimizer cannot "
                                    "load; resume with --no-use-precision-aware-optimizer, or pass --no-load-optim"),
        "no --data-path": ([a for a in _argv(corpus, str(tmp_path / "c")) if a not in ("--data-path", corpus)],
                           "no training data"),
        "missing prefix": (_argv(str(tmp_path / "nope"), str(tmp_path / "c")), "nope.bin"),
        "fp8 on the CPU": (_argv(corpus, str(tmp_path / "c"), "--precision", "fp8"),
                           "--precision fp8 cannot run on the CPU"),
        "architecture conflict": (_argv(corpus, str(tmp_path / "c"), "--num-layers", "7"), "--num-layers 7 conflicts"),
        "TE's fused MLP on the CPU": (_argv(corpus, str(tmp_path / "c"), "--use-transformer-engine-op-fuser"),
                                      "--use-transformer-engine-op-fuser cannot run on the CPU"),
        "TE's activation on the CPU": (_argv(corpus, str(tmp_path / "c"), "--use-te-activation-func"),
                                       "--use-te-activation-func cannot run on the CPU"),
        "fp8 output layer without fp8": (_argv(corpus, str(tmp_path / "c"), "--fp8-output-layer"),
                                         "--fp8-output-layer needs --precision fp8"),
        "no architecture": (_argv(corpus, str(tmp_path / "c"), model=()), "no model architecture"),
        "vocab mismatch": (_argv(corpus, str(tmp_path / "c"), "--tokenizer-model", TINY_TOKENIZER,
                                 model=("--hf-config", str(tmp_path / "small.json"))),
                           "tokenizer has 1000 tokens but the model's vocab_size is 500"),
    }
    small = json.load(open(TINY_LLAMA))
    json.dump({**small, "vocab_size": 500}, open(tmp_path / "small.json", "w"))
    messages = _cpu.run_world(1, _parse_errors, [argv for argv, _ in cases.values()])[0]
    for (name, (_, match)), message in zip(cases.items(), messages):
        assert match in message, (name, message)


def test_fp8_needs_transformer_engine():
    """Without Transformer Engine, --precision fp8 is refused (on any machine)."""
    import importlib.util
    from argparse import Namespace

    from megatron_patch.training.device import apply_precision

    if importlib.util.find_spec("transformer_engine") is not None:
        pytest.skip("Transformer Engine is installed")
    with pytest.raises(ValueError, match="fp8 needs Transformer Engine"):
        apply_precision(Namespace(precision="fp8", bf16=False, fp16=False, fp8=None))


def test_blend_weights_and_prefixes_are_checked(corpus, tmp_path):
    """--data-path "w1 prefix1 w2 prefix2": weights pass, every prefix needs its .bin and .idx."""
    from argparse import Namespace

    from megatron_patch.training.checks import check_data_paths

    base = dict(mock_data=False, train_data_path=None, valid_data_path=None, test_data_path=None,
                data_args_path=None, per_split_data_args_path=None)
    check_data_paths(Namespace(**base, data_path=["0.7", corpus, "0.3", corpus]))
    with pytest.raises(ValueError, match="missing_text_document.bin"):
        check_data_paths(Namespace(**base, data_path=["0.7", corpus, "0.3", str(tmp_path / "missing_text_document")]))


def test_throughput_profiles_reach_megatron_and_train_the_same(corpus, tmp_path):
    """--throughput-profile none / default / benchmark: the settings reach Megatron's arguments (a flag
    given on the command line wins), and the losses stay those of Megatron's defaults. fp32 on CPU: the
    profiles' cross-entropy (`--lean-cross-entropy`) sums in another order."""
    runs = {}
    for profile in ("none", "default", "benchmark"):
        argv = _argv(corpus, str(tmp_path / profile / "ckpt"), "--train-iters", "5", "--throughput-profile", profile)
        runs[profile] = _train(1, argv)
    none, default, bench = (runs[p]["settings"] for p in ("none", "default", "benchmark"))
    assert (none["manual_gc"], none["cross_entropy_loss_fusion"], none["check_for_nan_in_loss_and_grad"],
            none["lean_cross_entropy"]) == (False, False, True, False)
    assert (default["manual_gc"], default["manual_gc_interval"], default["cross_entropy_loss_fusion"],
            default["cross_entropy_fusion_impl"], default["check_for_nan_in_loss_and_grad"],
            default["rerun_mode"], default["lean_cross_entropy"]) == (True, 100, True, "native", True,
                                                                      "validate_results", True)
    assert runs["default"]["lean_cross_entropy"] and not runs["none"]["lean_cross_entropy"]  # the patch, in place
    # the weight-gradient fusion: set, but without --gradient-accumulation-fusion (--cpu turns it off) not applied
    assert default["wgrad_fusion_without_apex"] and not none["wgrad_fusion_without_apex"]
    assert runs["default"]["wgrad_fused"] == []
    assert (bench["check_for_nan_in_loss_and_grad"], bench["rerun_mode"]) == (False, "disabled")
    # the local implementation reads the loader's attention mask: kept (only Transformer Engine drops it)
    assert default["create_attention_mask_in_dataloader"] is True
    for profile in ("default", "benchmark"):
        diffs = [abs(a - b) for a, b in zip(runs["none"]["losses"], runs[profile]["losses"])]
        assert len(diffs) == 10 and max(diffs) <= 5e-4, (profile, diffs)
    # a flag on the command line wins over the profile
    argv = _argv(corpus, str(tmp_path / "own" / "ckpt"), "--train-iters", "3", "--manual-gc", "--rerun-mode",
                 "validate_results", "--throughput-profile", "benchmark")
    own = _train(1, argv)["settings"]
    assert (own["manual_gc"], own["manual_gc_interval"], own["rerun_mode"]) == (True, 0, "validate_results")
    assert own["check_for_nan_in_loss_and_grad"] is False  # the rest of the profile still applies
    # a cross-entropy flag of the user's keeps megatron-core's (the profile's lean one stays out)
    from argparse import Namespace

    from megatron_patch.training.profiles import apply_throughput_profile

    for flag in (["--no-lean-cross-entropy"], ["--cross-entropy-fusion-impl", "native"]):
        args = Namespace(throughput_profile="default", transformer_impl="local", reset_attention_mask=False,
                         lean_cross_entropy=False)
        apply_throughput_profile(args, {flag[0]})
        assert args.lean_cross_entropy is False and args.cross_entropy_loss_fusion is True, flag



def _plain_and_flagged(corpus, tmp_path, flag: str):
    """For TP=1 then TP=2: (tp, (plain, flagged)), two 5-iteration runs on Megatron's defaults
    (`--throughput-profile none`), the second with `flag` on."""
    for tp in (1, 2):
        yield tp, tuple(_train(tp, _argv(corpus, str(tmp_path / f"{name}{tp}" / "ckpt"), "--train-iters", "5",
                                         "--throughput-profile", "none", "--tensor-model-parallel-size", str(tp),
                                         *extra))
                        for name, extra in (("plain", []), ("flagged", [flag])))


def test_lean_cross_entropy_trains_like_megatrons(corpus, tmp_path):
    """--lean-cross-entropy: the patch is in place and the fusion on; 5 iterations at TP=1 and at TP=2 (the
    vocabulary split over the ranks) give megatron-core's unfused fp32 losses of the same layout
    (`--throughput-profile none`) within fp32 rounding grown by training (lr 3e-3; measured: ≤ 5e-7 at TP=2 over
    3 iterations). A fused cross-entropy of another implementation is refused."""
    for tp, (none, lean) in _plain_and_flagged(corpus, tmp_path, "--lean-cross-entropy"):
        assert none["lean_cross_entropy"] is False and lean["lean_cross_entropy"] is True
        assert lean["settings"]["cross_entropy_loss_fusion"] is True
        diffs = [abs(a - b) for a, b in zip(none["losses"], lean["losses"])]
        assert len(diffs) == 10 and max(diffs) <= 1e-4, (tp, diffs)
    from argparse import Namespace

    from megatron_patch.training.arguments import apply_lean_cross_entropy

    te = Namespace(lean_cross_entropy=True, cross_entropy_loss_fusion=True, cross_entropy_fusion_impl="te")
    with pytest.raises(ValueError, match="--lean-cross-entropy takes the place of --cross-entropy-fusion-impl native"):
        apply_lean_cross_entropy(te, {"--lean-cross-entropy", "--cross-entropy-fusion-impl"})


def test_wgrad_fusion_without_apex_trains_like_megatrons(corpus, tmp_path):
    """--wgrad-fusion-without-apex: megatron-core's own linear layers (here, `--transformer-impl local`, all of them
    and the output layer) accumulate their weight gradients into main_grad through `training.wgrad` in place of
    Apex's extension, the word embedding scatters its rows into main_grad, and 5 iterations at TP=1 and TP=2 give
    the losses of the unfused run of the same layout within fp32 rounding (the same products summed in another
    order). Off, nothing goes through it."""
    for tp, (plain, fused) in _plain_and_flagged(corpus, tmp_path, "--wgrad-fusion-without-apex"):
        assert plain["wgrad_fused"] == []
        # in each of 10 micro-batches: every linear layer (4 layers x 4 + the output layer) and the word embedding
        gemms = [shape for shape in fused["wgrad_fused"] if shape[0] != "embedding"]
        assert len(gemms) == 10 * (4 * 4 + 1), (tp, len(gemms))
        assert any(rows * tp >= 1000 and cols == 64 for rows, cols in gemms)  # the output layer's
        assert len(fused["wgrad_fused"]) - len(gemms) == 10, fused["wgrad_fused"]
        diffs = [abs(a - b) for a, b in zip(plain["losses"], fused["losses"])]
        assert len(diffs) == 10 and max(diffs) <= 1e-5, (tp, diffs)


def test_wgrad_fusion_with_tied_embeddings_trains_like_megatrons(corpus, tmp_path):
    """The default profile's weight-gradient fusion where the output layer shares the word embedding's weight
    (Llama-3.2-1B, train_bench's 1b shape): megatron-core marks the shared weight `zero_out_wgrad`, so its output
    layer hands autograd zeros and the DDP hook adds the weight's gradient into main_grad after all; the output
    layer's GEMM accumulates into main_grad through `training.wgrad`, while the embedding keeps `F.embedding` (its
    dense gradient is what that add takes; a scatter would be lost to nothing but also save nothing). 5 iterations
    give the unfused run's losses within fp32 rounding."""
    config = json.load(open(TINY_LLAMA))
    path = tmp_path / "tied.json"
    path.write_text(json.dumps({**config, "tie_word_embeddings": True}))
    plain, fused = (_train(1, _argv(corpus, str(tmp_path / name / "ckpt"), "--train-iters", "5", "--throughput-profile",
                                    "none", *extra, model=("--hf-config", str(path))))
                    for name, extra in (("plain", []), ("fused", ["--wgrad-fusion-without-apex"])))
    assert plain["wgrad_fused"] == []
    # in each of 10 micro-batches: every linear layer (4 layers x 4) and the (shared) output layer; no scatter
    assert len(fused["wgrad_fused"]) == 10 * (4 * 4 + 1), fused["wgrad_fused"]
    assert all(shape[0] != "embedding" for shape in fused["wgrad_fused"])
    assert any(rows >= 1000 and cols == 64 for rows, cols in fused["wgrad_fused"])  # the output layer's (padded vocab)
    diffs = [abs(a - b) for a, b in zip(plain["losses"], fused["losses"])]
    assert len(diffs) == 10 and max(diffs) <= 1e-5, diffs
