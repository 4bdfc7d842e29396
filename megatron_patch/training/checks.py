"""Checks of a training command's inputs and outputs before megatron initialises, each a ValueError naming the
flag: numeric flags in range (instead of megatron's bare assertion or a division by zero), the export folders
(`--save-hf`, `--save-peft`) against `--save` and the inputs, every dataset prefix's files, and dataset splits
that hold no document (megatron's dataset builder would loop forever)."""

from __future__ import annotations

import argparse
import math
import os

from megatron_patch.names import HF_SUBDIR, RELEASE, TRACKER

# Numeric flags that must be >= 1 (when set) and >= 0; checked before megatron divides by them
_POSITIVE = ("make_vocab_size_divisible_by", "seq_length", "micro_batch_size", "global_batch_size", "train_iters",
             "train_samples", "tensor_model_parallel_size", "pipeline_model_parallel_size",
             "expert_model_parallel_size", "expert_tensor_parallel_size", "context_parallel_size", "save_interval",
             "log_interval", "eval_interval")
_NON_NEGATIVE = ("eval_iters", "num_workers", "lr", "min_lr", "weight_decay", "clip_grad", "lr_warmup_iters",
                 "lr_warmup_fraction", "hidden_dropout", "attention_dropout", "seed")


def check_numbers(args: argparse.Namespace) -> None:
    """Numeric flags in range: a ValueError naming the flag (instead of megatron's bare assertion or a
    division by zero)."""
    for key in _POSITIVE + _NON_NEGATIVE:
        value = getattr(args, key, None)
        if value is None or isinstance(value, bool):
            continue
        flag = "--" + key.replace("_", "-")
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{flag} must be a finite number, got {value}")
        if key in _POSITIVE and value < 1:
            raise ValueError(f"{flag} must be at least 1, got {value}")
        if value < 0:
            raise ValueError(f"{flag} must not be negative, got {value}")
    for key in ("hidden_dropout", "attention_dropout", "lr_warmup_fraction"):
        value = getattr(args, key, None)
        if value is not None and value >= 1:
            raise ValueError(f"--{key.replace('_', '-')} must be below 1, got {value}")
    if args.lr is not None and args.min_lr > args.lr:
        raise ValueError(f"--min-lr {args.min_lr} is above --lr {args.lr}")


def check_exports(args: argparse.Namespace) -> None:
    """--save-hf and --save-peft, written from --save after training, are checked now with the converter's own
    output check (`outputs.check_output`): each must be a new folder (the entry points have no --overwrite), not
    an input (--load-hf, --load, --hf-config, --lora-import, --tokenizer-model) nor holding one, and neither be
    nor hold --save or the other export. Inside --save (e.g. --save OUT --save-hf OUT/hf_final) an export may
    lie, but not where the checkpoints keep their own files (OUT/hf, OUT/iter_*, OUT/release)."""
    from megatron_patch.outputs import check_output

    sources = {"--load-hf": args.load_hf, "--load": args.load, "--hf-config": args.hf_config,
               "--lora-import": getattr(args, "lora_import", None), "--tokenizer-model": args.tokenizer_model}
    exports = {"--save-hf": args.save_hf, "--save-peft": getattr(args, "save_peft", None)}
    for flag, out in exports.items():
        if not out:
            continue
        others = {"--save": args.save, **{f: o for f, o in exports.items() if f != flag}}
        check_output(out, False, sources, flag=flag, overwrite_flag=None, outputs=others, created_first=[args.save])
        if args.save and not os.path.relpath(os.path.abspath(out), os.path.abspath(args.save)).startswith(".."):
            first = os.path.relpath(os.path.abspath(out), os.path.abspath(args.save)).split(os.sep)[0]
            if first in (HF_SUBDIR, TRACKER, RELEASE) or first.startswith("iter_"):
                raise ValueError(f"{flag} {out} is where the --save folder {args.save} keeps its checkpoints' own "
                                 f"files ({first}); choose another {flag}")


def check_data_paths(args: argparse.Namespace) -> None:
    """Every dataset prefix in --data-path / --{train,valid,test}-data-path has its .bin and .idx."""
    if getattr(args, "mock_data", False):
        return
    paths = [p for key in ("data_path", "train_data_path", "valid_data_path", "test_data_path")
             for p in (getattr(args, key, None) or [])]
    if not paths and not getattr(args, "data_args_path", None) and not getattr(args, "per_split_data_args_path", None):
        raise ValueError("no training data: pass --data-path PREFIX (an indexed dataset from "
                         "megatron-patch preprocess-data), or --mock-data")
    for p in paths:
        try:
            float(p)  # a blend weight
            continue
        except ValueError:
            pass
        missing = [ext for ext in (".bin", ".idx") if not os.path.isfile(p + ext)]
        if missing:
            raise ValueError(f"dataset prefix {p}: no {' or '.join(p + e for e in missing)} "
                             "(make it with megatron-patch preprocess-data)")


_SPLITS = ("training", "validation", "test")


def check_splits(args: argparse.Namespace) -> set[str]:
    """Every dataset split that --split (or a per-split data path) creates holds tokens of each dataset:
    megatron's dataset builder loops forever on an empty split, even one it draws no samples from (e.g.
    50 documents at --split 99,1,0 leave validation nothing). Returns the splits that have data."""
    if getattr(args, "mock_data", False):
        return set(_SPLITS)
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix,
        parse_and_normalize_split,
    )
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from megatron.training.utils.common_utils import get_blend_and_blend_per_split

    blend, per_split = get_blend_and_blend_per_split(args)
    if blend is not None:
        try:
            shares = parse_and_normalize_split(args.split)
        except (AssertionError, ValueError, ZeroDivisionError):
            shares = [math.nan]
        if not all(math.isfinite(x) for x in shares):
            raise ValueError(f"--split {args.split!r}: expected up to three shares that are not all 0, e.g. 99,1,0 "
                             "(train, validation, test)")
        matrix = convert_split_vector_to_split_matrix(shares)
        sources = [(prefix, i, matrix[i]) for prefix in blend[0] for i in range(3) if matrix[i] is not None]
    else:
        sources = [(prefix, i, (0.0, 1.0)) for i, b in enumerate(per_split or []) if b for prefix in b[0]]
    for prefix, i, (low, high) in sources:
        index = IndexedDataset(prefix).index
        documents = len(index.document_indices) - 1
        begin, end = int(round(low * documents)), int(round(high * documents))  # as megatron splits
        first, last = (int(index.document_indices[d]) for d in (begin, end))
        if end > begin and int(index.sequence_lengths[first:last].sum()) > 0:
            continue
        if blend is None:
            raise ValueError(f"--{('train', 'valid', 'test')[i]}-data-path {prefix} holds no tokens")
        remedy = ("give it a larger share, or more data",
                  "give it a larger share (e.g. --split 90,10,0), or none (--split 100,0,0: no validation)",
                  "give it a larger share, or none (e.g. --split 99,1,0)")[i]
        raise ValueError(f"the {_SPLITS[i]} split of {prefix} is empty: --split {args.split} gives it documents "
                         f"{begin}..{end} of {documents}, and megatron's dataset builder would wait forever for it; "
                         f"{remedy}")
    return {_SPLITS[i] for _, i, _ in sources}
