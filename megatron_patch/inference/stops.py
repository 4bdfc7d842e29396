"""Stop strings, the same for both engines: a generation ends at the token whose addition makes its text
contain a stop string, found by decoding only the newest tokens."""

from __future__ import annotations

from collections.abc import Sequence


def stop_window(stop: Sequence[str]) -> int:
    """How many of the newest tokens a stop string completed by the newest one lies within: a character
    spans at most 4 byte-level tokens, plus a margin so that the tail's first tokens (a partial
    character, a dropped leading space) stay clear of it. Decoding only that tail keeps a step's cost
    independent of the length generated so far."""
    return 4 * max((len(s) for s in stop), default=0) + 8


def holds_stop(tokenizer, tail: list[int], stop: Sequence[str]) -> bool:
    text = tokenizer.detokenize(tail)
    return any(s in text for s in stop)
