"""`Sampling`: how `megatron_patch.inference.generate` picks each new token and when a generation ends, one
checked value from the caller (the `generate` command, lm-eval's `generate_until`, RLHF rollouts) to the
engines."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


def check_stop(stop: Sequence[str], name: str = "stop") -> None:
    """Stop strings must be non-empty: every text contains the empty string. `name`: the argument or flag
    the errors name."""
    if any(s == "" for s in stop):
        raise ValueError(f"{name}: an empty string would end every generation at its first token")


@dataclass(frozen=True)
class Sampling:
    """`max_new_tokens` per prompt at most. `top_k=1` is greedy (the argmax, whatever `top_p` says: it is set
    to 0); otherwise tokens are sampled at `temperature` (> 0) with one of top-k (`top_k` > 1) or nucleus
    (`top_p` > 0) filtering, or none (`top_k=0`, `top_p=0`), from one generator seeded with `seed`. A
    generation ends before `stop_id` (the end token: left out of the result; None: no early end) or at the
    token whose addition makes its text contain one of the `stop` strings (that token is kept)."""

    max_new_tokens: int
    temperature: float = 1.0
    top_k: int = 1
    top_p: float = 0.0
    seed: int = 1234
    stop_id: int | None = None
    stop: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop", tuple(self.stop))
        check_stop(self.stop)
        if self.top_k == 1:
            object.__setattr__(self, "top_p", 0.0)  # greedy: the argmax, whatever the other filters say
        elif self.top_k > 0 and self.top_p > 0:
            raise ValueError(f"top_k {self.top_k} and top_p {self.top_p}: megatron-core samples with one of the two "
                             "filters")
        if self.top_k != 1 and self.temperature <= 0:
            raise ValueError(f"temperature must be > 0 for sampling (got {self.temperature}); greedy decoding is "
                             "top_k=1")

    def megatron_params(self):
        """megatron-core's `SamplingParams` for these settings (both engines)."""
        from megatron.core.inference.sampling_params import SamplingParams

        return SamplingParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                              num_tokens_to_generate=self.max_new_tokens,
                              termination_id=-1 if self.stop_id is None else self.stop_id)
