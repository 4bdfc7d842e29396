"""Megatron-LM's printed training log as numbers: one parser for everything that reads a run's output (the
benchmarks, the GPU proofs, a user's own scripts). Megatron prints one line per logged iteration,

    [time] iteration  12/ 100 | consumed samples: 384 | elapsed time per iteration (ms): 512.3 | lm loss: 7.1E+00 |

a line per evaluation (`validation loss at iteration N | lm loss value: ...`) and memory reports
(`... memory (MB) | allocated: 123.4 | max allocated: 1234.56 | ...`, after an iteration)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

ITERATION = re.compile(r"iteration\s+(\d+)/\s*\d+ \|(.*)")
VALIDATION = re.compile(r"validation loss at iteration (\d+).*?\| lm loss value: ([0-9.E+-]+)")
MAX_ALLOCATED = re.compile(r"max allocated: ([0-9.]+)")
ALLOCATED = re.compile(r"memory \(MB\) \| allocated: ([0-9.]+)")


@dataclass
class TrainingLog:
    """`iterations`: {iteration: {Megatron's name of the field: value}} for every numeric field of its line
    ("lm loss", "elapsed time per iteration (ms)", "grad norm", "global batch size", an entry point's own
    metrics such as "reward accuracy"); a run continued across calls logs some iterations twice (those after
    its last save): the later line wins. `held_out`: {iteration: validation lm loss}. `max_allocated_mb`:
    the memory reports' peaks, in order; `allocated_mb`: what each report found allocated at its time (after an
    iteration: the weights, gradient buffers and optimizer state the run holds between steps)."""

    iterations: dict[int, dict[str, float]] = field(default_factory=dict)
    held_out: dict[int, float] = field(default_factory=dict)
    max_allocated_mb: list[float] = field(default_factory=list)
    allocated_mb: list[float] = field(default_factory=list)

    def series(self, name: str) -> dict[int, float]:
        """{iteration: value} of one field, over the iterations that logged it."""
        return {i: row[name] for i, row in sorted(self.iterations.items()) if name in row}

    def median(self, name: str, from_fraction: float = 0.0) -> float | None:
        """The median of a field over the iterations after the first `from_fraction` of those that logged it
        (e.g. 0.5: the second half, past warm-up)."""
        values = list(self.series(name).values())
        values = sorted(values[int(len(values) * from_fraction):])
        return values[len(values) // 2] if values else None


def parse_log(text: str) -> TrainingLog:
    log = TrainingLog()
    for it, rest in ITERATION.findall(text):
        row = {}
        for part in rest.split("|"):
            name, sep, value = part.partition(":")
            if sep:
                try:
                    row[name.strip()] = float(value)
                except ValueError:
                    pass
        if row:
            log.iterations[int(it)] = row
    log.held_out = {int(it): float(v) for it, v in VALIDATION.findall(text)}
    log.max_allocated_mb = [float(v) for v in MAX_ALLOCATED.findall(text)]
    log.allocated_mb = [float(v) for v in ALLOCATED.findall(text)]
    return log
