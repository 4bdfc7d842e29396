"""Numerical check of a converted checkpoint: the HF model and the Megatron model on the same
fixed prompts, compared on logits (max abs diff), KL divergence and top-1 agreement."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from megatron_patch.models.family import Layout
from megatron_patch.runtime.logits import megatron_logits


def fixed_prompts(vocab_size: int, batch: int = 4, seq: int = 32, seed: int = 1234) -> Tensor:
    """Deterministic token ids: the same prompts on every machine and rank."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (batch, seq), generator=g)


def compare(reference: Tensor, candidate: Tensor) -> dict:
    """max |diff|, mean KL(reference || candidate) per token, top-1 agreement; computed in float64 on the
    reference's device, wherever the candidate is."""
    ref, cand = reference.double(), candidate.to(reference.device, torch.float64)
    kl = F.kl_div(F.log_softmax(cand, -1), F.log_softmax(ref, -1), log_target=True, reduction="none")
    return {
        "max_abs_logit_diff": (ref - cand).abs().max().item(),
        "kl": kl.sum(-1).mean().item(),
        "top1_agreement": (ref.argmax(-1) == cand.argmax(-1)).double().mean().item(),
    }


def hf_logits(hf_dir: str, input_ids: Tensor, dtype: torch.dtype = torch.float32,
              trust_remote_code: bool = False, weights_dtype: torch.dtype | None = None) -> Tensor:
    """Logits of the HF model in `dtype`; with `weights_dtype`, its weights are first rounded to that
    dtype (as a conversion to it rounds them), so both sides compute with the same weights."""
    from transformers import AutoModelForCausalLM

    from megatron_patch.models import get_family, load_hf_config

    family = get_family(load_hf_config(hf_dir))
    if getattr(family, "remote_code", False) and not trust_remote_code:
        raise ValueError(f"{family.name} is a remote-code architecture: the HF reference runs the modeling files "
                         f"in {hf_dir}; pass --trust-remote-code if you trust them")
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=weights_dtype or dtype, attn_implementation="eager",
                                                 trust_remote_code=trust_remote_code)
    if weights_dtype is not None and weights_dtype != dtype:
        model.to(dtype)
    with torch.no_grad():
        return model.eval()(input_ids).logits.float()


# HF config keys that do not change the model's function
_NOT_ARCHITECTURE = {"dtype", "torch_dtype", "transformers_version", "_name_or_path", "use_cache", "auto_map",
                     "tokenizer_class", "bos_token_id", "eos_token_id", "pad_token_id", "output_attentions",
                     "output_hidden_states", "return_dict", "id2label", "label2id", "pretraining_tp"}


def same_model(hf_dir: str, hf_config: dict, where: str) -> None:
    """Refuse comparing two different models: the HF folder's config must describe the model the
    checkpoint holds (same family, and the same megatron-core config after translation)."""
    from megatron_patch.models import get_family, load_hf_config

    ref = load_hf_config(hf_dir)
    family, other = get_family(ref), get_family(hf_config)

    def describe(f, cfg):
        return f.name, f.config_kwargs(cfg), f.gpt_kwargs(cfg), f.shapes(cfg, Layout())

    if family is other and describe(family, ref) == describe(other, hf_config):
        return
    keys = sorted(k for k in set(ref) | set(hf_config)
                  if k not in _NOT_ARCHITECTURE and ref.get(k) != hf_config.get(k))
    diff = ("; ".join(f"{k}: {ref.get(k)!r} vs {hf_config.get(k)!r}" for k in keys[:6])
            or f"{family.name} vs {other.name}")
    raise ValueError(f"{hf_dir} and {where} are different models ({diff}{'; ...' if len(keys) > 6 else ''})")


def default_tolerance(dtype: torch.dtype, impl: str) -> float:
    """Max abs logit diff accepted by default. fp32: 1e-4, except Transformer Engine, whose fp32
    GEMMs run in TF32 (measured on an H200: TE vs HF 0.026 on logits of std 1.6, while HF's own
    TF32-vs-fp32 difference is 0.031; tests/gpu/RESULTS.md). bf16/fp16: 5e-2 x the logit scale is
    not fixed, so the default is loose (1.0) and KL / top-1 tell more."""
    if dtype == torch.float32:
        return 5e-2 if impl == "transformer_engine" else 1e-4
    return 1.0


def exact_routing(model) -> None:
    """Route a mixture-of-experts model in fp64 (no-op for dense models). megatron-core computes router
    logits with Transformer Engine's GEMM whenever TE is installed, whatever the layer spec: TF32 for
    fp32 inputs, which moves fp32 logits by ~5e-4 and can flip near-tied expert choices; fp64 routing
    takes `torch.mm` instead (measured on an H200: tests/gpu/RESULTS.md). For fp32 parity checks."""
    if model.config.num_moe_experts:
        model.config.moe_router_dtype = "fp64"


def verify(hf_dir: str, mcore_dir: str, *, layout: Layout = Layout(), dtype: torch.dtype | None = None,
           tolerance: float | None = None, impl: str | None = None, hf_config: str | None = None,
           trust_remote_code: bool = False) -> dict:
    """Run both models on fixed prompts; returns the metrics plus `ok` (finite logits, max diff <=
    tolerance, default `default_tolerance`) and, when not ok, `problem`. `dtype`: the compute dtype of
    both (default: the checkpoint's); the HF weights are rounded to the checkpoint's dtype first.
    `impl` overrides the implementation recorded at conversion; `layout` is the Megatron side's (TP x PP
    > 1 under torchrun)."""
    from megatron_patch.conversion.megatron_checkpoint import MegatronCheckpoint, load_megatron_model

    ckpt = MegatronCheckpoint.open(mcore_dir, hf_config)
    same_model(hf_dir, ckpt.hf_config, mcore_dir)
    dtype = dtype or ckpt.dtype
    model, config = load_megatron_model(mcore_dir, layout=layout, impl=impl, dtype=dtype, hf_config=hf_config)
    from megatron_patch.models import vocab_size

    vocab = vocab_size(config)
    if dtype == torch.float32:
        exact_routing(model)
    ids = fixed_prompts(vocab)
    ref = hf_logits(hf_dir, ids, dtype, trust_remote_code, weights_dtype=ckpt.dtype)
    cand = megatron_logits(model, ids, vocab)
    run_impl = model.config.transformer_impl
    if tolerance is None:
        tolerance = default_tolerance(dtype, run_impl)
    nonfinite = {side: int((~torch.isfinite(x)).sum()) for side, x in (("hf", ref), ("megatron", cand))
                 if not torch.isfinite(x).all()}
    if nonfinite:
        result = {"max_abs_logit_diff": None, "kl": None, "top1_agreement": None, "nonfinite_logits": nonfinite}
        problem = "non-finite logits (NaN/Inf): " + ", ".join(f"{n} values from the {side} model"
                                                               for side, n in nonfinite.items())
    else:
        result = compare(ref, cand)
        problem = (f"max abs logit diff {result['max_abs_logit_diff']:.3g} exceeds {tolerance:g}"
                   if result["max_abs_logit_diff"] > tolerance else None)
    result.update(tolerance=tolerance, tp=layout.tp, pp=layout.pp, dtype=str(dtype).removeprefix("torch."),
                  checkpoint_dtype=str(ckpt.dtype).removeprefix("torch."), impl=run_impl, ok=problem is None)
    if problem:
        result["problem"] = problem
    return result
