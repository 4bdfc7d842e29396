"""The CPU test harness's gloo worlds (`tests._cpu.run_world`) on a busy machine: a port probed free can be taken
by any process (another test suite, a second session) before rank 0 listens on it (seen: EADDRINUSE under
load; a retry on that error was itself racy, since another rank could fail first with another message). The
worlds meet through a file instead, so a taken port changes nothing."""

import socket

from tests import _cpu


def _rank(rank: int) -> int:
    return rank


def test_a_port_taken_after_the_probe_does_not_matter(monkeypatch):
    probe = _cpu.free_port
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        ports = iter([taken.getsockname()[1]])  # the first probe's port is taken before rank 0 binds it
        monkeypatch.setattr(_cpu, "free_port", lambda: next(ports, None) or probe())
        assert _cpu.run_world(2, _rank) == [0, 1]
