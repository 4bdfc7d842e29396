"""What every toolkit CLI does around its work: one JSON summary line on success (exit 0), and for
bad input an `error: ...` line on stderr with exit 1 (130 for Ctrl-C); the tools write atomically, so
nothing is left behind either way. MEGATRON_PATCH_TRACEBACK=1 adds the traceback."""

from __future__ import annotations

import json
import os
import sys
import traceback
import warnings
from collections.abc import Callable


def run(work: Callable[[], dict]) -> tuple[int, dict | None]:
    # megatron-core warns at import about optional extras (Apex, TE, absl, NVRx) the tools do without
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
    try:
        result = work()
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        if os.environ.get("MEGATRON_PATCH_TRACEBACK"):
            traceback.print_exc()
        print(f"\nerror: {e}", file=sys.stderr)  # newline: a progress bar may own the current line
        return 1, None
    except KeyboardInterrupt:
        print("\nerror: interrupted; no output was left behind", file=sys.stderr)
        return 130, None
    if is_first_rank():  # under torchrun, one summary
        print(json.dumps(result))
    return 0, result


def is_first_rank() -> bool:
    import torch.distributed as dist

    return not dist.is_initialized() or dist.get_rank() == 0
