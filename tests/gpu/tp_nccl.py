"""TP=2 and PP=2 over NCCL (two GPUs) vs TP=1, for the families whose modules touch TP: ALiBi slopes
per rank (Bloom, 6 heads = 3 per rank), parallel attention + MLP (Falcon-7B/40B, Falcon2-11B), one kv
head replicated over TP (Falcon-7B, StarCoder), post norms (GLM-4), sliding window (Mistral), LLaMA;
both implementations, fp32 on the device.

Run: torchrun --nproc_per_node 2 tests/gpu/tp_nccl.py OUT.json   (tests/gpu/test_tp_nccl.py does)"""

import json
import os
import sys

import torch
import torch.distributed as dist

VARIANTS = ["gqa", "bloom_6heads", "falcon_7b", "falcon_40b", "falcon_11b", "glm4", "mistral_swa", "baichuan2_13b",
            "starcoder"]
LAYOUTS = [(1, 1), (2, 1), (1, 2)]


def main(out_path: str) -> None:
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_patch.conversion.engine import hf_to_megatron, load_rank_state_dict, make_plan
    from megatron_patch.conversion.verify import compare, fixed_prompts
    from megatron_patch.models import Layout, build_model
    from megatron_patch.runtime.logits import megatron_logits
    from tests.models import case

    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    cases = {v: case(v) for v in VARIANTS}  # seeded: identical on both ranks
    logits = {}
    for tp, pp in LAYOUTS:
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
        model_parallel_cuda_manual_seed(0, inference_rng_tracker=True, force_reset_rng=True)
        for v, c in cases.items():
            ids = fixed_prompts(c.vocab_size, batch=2, seq=48)
            for impl in ("local", "transformer_engine"):
                plan = make_plan(c.cfg, Layout(tp, pp), impl)
                ranks = hf_to_megatron(plan, c.sd.__getitem__, c.sd.keys())
                model = build_model(c.cfg, layout=Layout(tp, pp), impl=impl).eval()
                load_rank_state_dict(model, ranks[(ps.get_tensor_model_parallel_rank(),
                                                   ps.get_pipeline_model_parallel_rank(), 0)])
                logits[(v, impl, tp, pp)] = megatron_logits(model, ids, c.vocab_size)
    if dist.get_rank() == 0:
        rows = []
        for (v, impl, tp, pp), out in logits.items():
            if (tp, pp) != (1, 1):
                rows.append(dict(variant=v, impl=impl, tp=tp, pp=pp, vs_tp1=compare(logits[(v, impl, 1, 1)], out)))
        with open(out_path, "w") as f:
            json.dump(rows, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.path.insert(0, os.getcwd())
    main(sys.argv[1])
