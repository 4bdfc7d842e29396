"""The CPU test harness's gloo worlds (`tests._cpu.run_world`) on a busy machine: the port `free_port()` probes
is free when probed, but any process (another test suite, a second session) can take it before rank 0 listens
on it; the world then starts again on another port instead of failing the test that asked for it."""

import socket

from tests import _cpu


def _rank(rank: int) -> int:
    return rank


def test_a_port_taken_after_the_probe_gets_a_new_world(monkeypatch):
    probe = _cpu.free_port
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        ports = iter([taken.getsockname()[1]])  # the first probe's port is taken before rank 0 binds it
        monkeypatch.setattr(_cpu, "free_port", lambda: next(ports, None) or probe())
        assert _cpu.run_world(2, _rank) == [0, 1]
