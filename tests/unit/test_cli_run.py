"""megatron_patch.cli.run: an interruption (Ctrl-C, SIGTERM) is reported as one, with its exit status, even
when the work's cleanup fails on the way out and raises an error of its own (torch.save's zip writer does,
when a signal lands inside it); the handlers are restored afterwards. A summary's `wall_seconds` counts from
the process's start."""

import json
import signal
import types

import pytest

from megatron_patch.cli import run


@pytest.mark.parametrize("sig,code,text", [(signal.SIGTERM, 143, "terminated (SIGTERM)"),
                                           (signal.SIGINT, 130, "interrupted")])
def test_interruption_survives_a_failing_cleanup(sig, code, text, capsys):
    def work():
        try:
            signal.raise_signal(sig)
        finally:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")

    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    assert run(work) == (code, None)
    assert f"error: {text}; no output was left behind" in capsys.readouterr().err
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before


def test_an_error_is_one_line_and_a_bug_keeps_its_traceback(capsys):
    def bad_input():
        raise ValueError("config.json: hidden_size must be a positive integer,\n got 0")

    assert run(bad_input) == (1, None)
    assert capsys.readouterr().err.strip() == "error: config.json: hidden_size must be a positive integer, got 0"
    with pytest.raises(ZeroDivisionError):
        run(lambda: 1 / 0)


def test_only_the_known_megatron_notices_are_silenced():
    """The tools hide megatron-core's notices about optional kernels missing on a CPU (and a deprecated config
    default); any other warning megatron-core gives stays visible."""
    import warnings

    from megatron_patch.cli import quiet_third_party

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_third_party()
        for message, module in (("Apex is not installed. Falling back to Torch Norm", "megatron.core.models.backends"),
                                ("Transformer Engine and Apex are not installed. Falling back to Torch optimizers.",
                                 "megatron.core.optimizer"),
                                ("checkpoint has unexpected keys", "megatron.core.dist_checkpointing")):
            warnings.warn_explicit(message, UserWarning, module.replace(".", "/") + ".py", 1, module=module)
    assert [str(w.message) for w in caught] == ["checkpoint has unexpected keys"]


def test_wall_seconds_count_from_the_process_start(monkeypatch, capsys):
    """`wall_seconds` = now - the process's start (imports included, as a user timing the command sees it),
    on given clock readings: a measured time has no value a test can rely on."""
    import psutil

    from megatron_patch import cli

    monkeypatch.setattr(psutil, "Process", lambda: types.SimpleNamespace(create_time=lambda: 1000.0))
    monkeypatch.setattr(cli, "time", types.SimpleNamespace(time=lambda: 1012.3456))
    assert cli.process_seconds() == pytest.approx(12.3456)
    assert run(lambda: {"seconds": 2.5}) == (0, {"seconds": 2.5, "wall_seconds": 12.35})
    assert json.loads(capsys.readouterr().out) == {"seconds": 2.5, "wall_seconds": 12.35}
