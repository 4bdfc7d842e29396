"""The Python side of the worked RLHF example (`rlhf/example_cpu.sh` runs it; nothing is downloaded).

    python rlhf/example.py data OUT [--config CONFIG.json]   # a tiny random model + the example's data
    python rlhf/example.py check OUT                         # the exported policy and critic in transformers

`data` writes OUT/base (an HF folder: random weights for CONFIG, default the package's tiny LLaMA, with the
package's tiny tokenizer), OUT/chats.jsonl (SFT: answers repeat the user's words), OUT/prefs.jsonl (reward
model: chosen answers say "yes right good ...", rejected ones "no wrong bad ...") and OUT/prompts.jsonl
(PPO: questions like the preference prompts). `check` loads OUT/ppo_hf with AutoModelForCausalLM and
generates from each prompt, loads OUT/critic_hf with AutoModelForSequenceClassification and reads its
per-token values, and prints one JSON line."""

from __future__ import annotations

import argparse
import json
import os
import random
import sys

GOOD = "yes right good fine true correct".split()
BAD = "no wrong bad poor false broken".split()
TOPICS = "the module returns a list of values when the function is called".split()


def _jsonl(path: str, rows: list[dict]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


def make_data(out: str, config: str | None) -> None:
    from megatron_patch.conversion.hf_io import copy_side_files
    from megatron_patch.testing import TINY_LLAMA, random_hf_model
    from megatron_patch.tokenizer import TINY_TOKENIZER

    if os.path.exists(out) and os.listdir(out):
        raise SystemExit(f"error: {out} exists and is not empty: give the example a new folder")
    with open(config or TINY_LLAMA, encoding="utf-8") as f:
        cfg = json.load(f)
    random_hf_model(cfg).save_pretrained(os.path.join(out, "base"))
    copy_side_files(TINY_TOKENIZER, os.path.join(out, "base"))
    rng = random.Random(0)

    def words(pool: list[str], k: int) -> str:
        return " ".join(rng.choice(pool) for _ in range(k))

    chats = []
    for _ in range(64):
        text = words(TOPICS, rng.randint(3, 8))
        chats.append({"messages": [{"role": "user", "content": f"Repeat: {text}"},
                                   {"role": "assistant", "content": text}]})
    _jsonl(os.path.join(out, "chats.jsonl"), chats)
    prefs = []
    for _ in range(200):
        k = rng.randint(2, 5)
        prefs.append({"prompt": f"Is {words(TOPICS, 3)}?", "chosen": words(GOOD, k), "rejected": words(BAD, k)})
    _jsonl(os.path.join(out, "prefs.jsonl"), prefs)
    _jsonl(os.path.join(out, "prompts.jsonl"), [{"prompt": f"Is {words(TOPICS, 3)}?"} for _ in range(16)])


def check(out: str) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(os.path.join(out, "ppo_hf"))
    policy = AutoModelForCausalLM.from_pretrained(os.path.join(out, "ppo_hf")).eval()
    critic = AutoModelForSequenceClassification.from_pretrained(os.path.join(out, "critic_hf")).eval()
    with open(os.path.join(out, "prompts.jsonl"), encoding="utf-8") as f:
        prompts = [json.loads(line)["prompt"] for line in f][:4]
    samples = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([tokenizer.encode(prompt, add_special_tokens=False)])
            full = policy.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                                   pad_token_id=tokenizer.pad_token_id)
            values = critic.score(critic.base_model(full).last_hidden_state)[0, :, 0]  # the value at every token
            samples.append({"prompt": prompt, "completion": tokenizer.decode(full[0, ids.shape[1]:]),
                            "new_tokens": int(full.shape[1] - ids.shape[1]), "value_last": round(float(values[-1]), 4)})
    return {"policy": os.path.join(out, "ppo_hf"), "critic": os.path.join(out, "critic_hf"), "samples": samples}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python rlhf/example.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("data", help="write the tiny start model and the example's data")
    d.add_argument("out")
    d.add_argument("--config", help="an HF config.json for the start model (default: the tiny LLaMA)")
    c = sub.add_parser("check", help="load the exported policy and critic with transformers")
    c.add_argument("out")
    args = p.parse_args(argv)
    if args.command == "data":
        make_data(args.out, args.config)
    else:
        print(json.dumps(check(args.out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
