"""Megatron-LM's legacy per-rank checkpoints (`--ckpt-format torch`): one `model_optim_rng.pt` per TP x PP
(x EP) rank holding that rank's `state_dict()` in the implementation's naming, plus `args`; written one rank
file at a time and read one pipeline stage at a time."""

from __future__ import annotations

import itertools
import os
from argparse import Namespace
from collections.abc import Callable, Iterable

import torch
from torch import Tensor

from megatron_patch.conversion.engine import ConversionError, Plan, extra_state_names, hf_to_megatron
from megatron_patch.conversion.manifest import TensorLog
from megatron_patch.conversion.mcore_io import checkpoint_args, expected_shapes, write_tracker
from megatron_patch.names import LEGACY_FILE, RANK_DIR, RELEASE
from megatron_patch.runtime.parallel import Rank


def legacy_rank_dir(step_dir: str, tp_rank: int, pp_rank: int, pp: int, ep_rank: int = 0, ep: int = 1) -> str:
    """Megatron-LM's folder name: mp_rank_TT, + _PPP with pipeline parallelism, + _EEE with expert parallelism."""
    name = f"mp_rank_{tp_rank:02d}" if pp == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"
    return os.path.join(step_dir, name + (f"_{ep_rank:03d}" if ep > 1 else ""))


def save_legacy(plan: Plan, get: Callable[[str], Tensor], hf_keys: Iterable[str], out_dir: str,
                dtype: torch.dtype | None, log: TensorLog | None = None) -> None:
    """Convert and write `out_dir/release/mp_rank_*/model_optim_rng.pt`, one rank file at a time:
    memory holds one rank's tensors, at the price of reading a stage's HF tensors once per TP rank."""
    hf_keys = list(hf_keys)
    step_dir = os.path.join(out_dir, RELEASE)
    args = checkpoint_args(plan, "legacy")
    expected = expected_shapes(plan)
    lay = plan.layout
    for stage in range(lay.pp):
        extra = dict.fromkeys(extra_state_names(plan, stage))
        for tp_rank, ep_rank in itertools.product(range(lay.tp), range(lay.ep)):
            sd = hf_to_megatron(plan, get, hf_keys, dtype, [stage], expected, [tp_rank], [ep_rank])[
                (tp_rank, stage, ep_rank)]
            folder = legacy_rank_dir(step_dir, tp_rank, stage, lay.pp, ep_rank, lay.ep)
            os.makedirs(folder)
            if log is not None:
                placed = {pl.name: pl for pl in plan.placements([stage], [ep_rank])}
                for name, tensor in sd.items():
                    log.add(f"{os.path.basename(folder)}/{name}", tensor,
                            lambda pl=placed[name]: ((h, get(h)) for h in pl.hf_names))
            torch.save({"model": {**sd, **extra}, "args": args, "checkpoint_version": 3.0, "iteration": 0},
                       os.path.join(folder, LEGACY_FILE))
            del sd
    write_tracker(out_dir)


def _safe_globals() -> list:
    """Classes a legacy checkpoint may pickle besides tensors (megatron-core's own allow-list)."""
    from megatron.core.safe_globals import SAFE_GLOBALS

    return [Namespace, *SAFE_GLOBALS]


def load_legacy_file(path: str) -> dict:
    try:
        # added for good, as megatron-core's import does: a `safe_globals` block removes its classes on exit,
        # megatron-core's own registrations included (common.pt under megatron-core 0.18 then fails to load)
        torch.serialization.add_safe_globals(_safe_globals())
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise
    except Exception as e:  # truncated / corrupt pickle or zip
        raise ConversionError(f"cannot read {path}: {e}") from None


def legacy_layout(step_dir: str) -> tuple[int, int, int]:
    """(TP, PP, EP) from the rank folders (`mp_rank_TT_NNN` is a pipeline or an expert rank: the stored
    args say which); incomplete sets are an error naming the missing folders."""
    ranks = []
    for name in sorted(os.listdir(step_dir)):
        m = RANK_DIR.match(name)
        if m:
            ranks.append(tuple(int(g) if g is not None else None for g in m.groups()))
    if not ranks:
        raise ConversionError(f"{step_dir} has no mp_rank_* folders")
    if len({sum(g is not None for g in r) for r in ranks}) > 1:
        raise ConversionError(f"{step_dir} mixes mp_rank_TT, mp_rank_TT_NNN and mp_rank_TT_PPP_EEE folders")
    tp, pp, ep = max(r[0] for r in ranks) + 1, 1, 1
    if ranks[0][2] is not None:
        pp, ep = max(r[1] for r in ranks) + 1, max(r[2] for r in ranks) + 1
    elif ranks[0][1] is not None:
        n = max(r[1] for r in ranks) + 1
        args = load_legacy_file(os.path.join(step_dir, "mp_rank_00_000", LEGACY_FILE)).get("args")
        pp, ep = (1, n) if int(getattr(args, "expert_model_parallel_size", 1) or 1) > 1 else (n, 1)
    missing = [os.path.basename(legacy_rank_dir(step_dir, t, p, pp, e, ep))
               for t in range(tp) for p in range(pp) for e in range(ep)
               if not os.path.isfile(os.path.join(legacy_rank_dir(step_dir, t, p, pp, e, ep), LEGACY_FILE))]
    if missing:
        raise ConversionError(f"incomplete legacy checkpoint {step_dir}: no {LEGACY_FILE} in {', '.join(missing)}")
    return tp, pp, ep


def load_legacy_stage(step_dir: str, tp: int, pp: int, stage: int, ep: int = 1) -> dict[Rank, dict[str, Tensor]]:
    return {(t, stage, e): load_legacy_file(os.path.join(legacy_rank_dir(step_dir, t, stage, pp, e, ep),
                                                         LEGACY_FILE))["model"]
            for t in range(tp) for e in range(ep)}
