"""Remote-code families (no class in `transformers`): each case builds a native reference model,
then writes the checkpoint the remote code would hold for the same function — names and fused
layouts taken from the remote modeling files, written here independently of the family's weight map
— and the remote config.json. Parity then compares our conversion of the remote checkpoint with the
native reference's logits."""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F

from tests.models import DROP, Case, hf_model, llama_config

LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def _rename(sd: dict, cfg: dict, per_layer, top: dict) -> dict:
    """Build a remote state dict: `per_layer(i, {native suffix: tensor})` -> {remote name: tensor}
    for each layer; `top` maps the non-layer native names."""
    layers: dict[int, dict] = {}
    out = {}
    for k, v in sd.items():
        m = LAYER.match(k)
        if m:
            layers.setdefault(int(m.group(1)), {})[m.group(2)] = v
        else:
            out[top[k]] = v
    for i in range(cfg["num_hidden_layers"]):
        out.update(per_layer(i, layers[i]))
    return out


def _cat(layer: dict, names: list[str]) -> torch.Tensor:
    return torch.cat([layer[n] for n in names], dim=0)


# ---- Qwen-1 (QWenLMHeadModel): c_attn = [q; k; v], w1 = up, w2 = gate, ffn counted twice --------
def _qwen1(bias: bool) -> Case:
    # no_bias=true: only c_attn biased (Qwen2's math); no_bias=false: every linear biased (LLaMA's)
    arch = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": True,
            "mlp_bias": True} if bias else {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"}
    native = llama_config("mha", **arch, rope_theta=1000000.0, head_dim=DROP)
    ref = hf_model(native)

    def layer(i, L):
        p = f"transformer.h.{i}."
        out = {p + "ln_1.weight": L["input_layernorm.weight"], p + "ln_2.weight": L["post_attention_layernorm.weight"],
               p + "attn.c_attn.weight": _cat(L, [f"self_attn.{x}_proj.weight" for x in "qkv"]),
               p + "attn.c_attn.bias": _cat(L, [f"self_attn.{x}_proj.bias" for x in "qkv"]),
               p + "attn.c_proj.weight": L["self_attn.o_proj.weight"],
               p + "mlp.w1.weight": L["mlp.up_proj.weight"], p + "mlp.w2.weight": L["mlp.gate_proj.weight"],
               p + "mlp.c_proj.weight": L["mlp.down_proj.weight"]}
        if bias:
            out.update({p + "attn.c_proj.bias": L["self_attn.o_proj.bias"], p + "mlp.w1.bias": L["mlp.up_proj.bias"],
                        p + "mlp.w2.bias": L["mlp.gate_proj.bias"], p + "mlp.c_proj.bias": L["mlp.down_proj.bias"]})
        return out

    sd = _rename(ref.state_dict(), native, layer, {"model.embed_tokens.weight": "transformer.wte.weight",
                                                    "model.norm.weight": "transformer.ln_f.weight",
                                                    "lm_head.weight": "lm_head.weight"})
    cfg = {"architectures": ["QWenLMHeadModel"], "model_type": "qwen", "auto_map": {},
           "hidden_size": native["hidden_size"], "num_attention_heads": native["num_attention_heads"],
           "num_hidden_layers": native["num_hidden_layers"], "intermediate_size": 2 * native["intermediate_size"],
           "kv_channels": native["hidden_size"] // native["num_attention_heads"],
           "layer_norm_epsilon": native["rms_norm_eps"], "rotary_emb_base": native["rope_theta"], "rotary_pct": 1.0,
           "no_bias": not bias, "seq_length": 128, "max_position_embeddings": 256, "vocab_size": native["vocab_size"],
           "use_dynamic_ntk": True, "use_logn_attn": True, "tie_word_embeddings": False, "scale_attn_weights": True}
    return Case(cfg, sd, ref)


class _NoRotary(torch.nn.Module):
    def __init__(self, head_dim: int):
        super().__init__()
        self.head_dim = head_dim

    def forward(self, x, position_ids):
        shape = (*position_ids.shape, self.head_dim)
        return torch.ones(shape, dtype=x.dtype, device=x.device), torch.zeros(shape, dtype=x.dtype, device=x.device)


class AlibiReference(torch.nn.Module):
    """Reference for the ALiBi Baichuan-13B models: transformers' LLaMA block with its rotary embedding
    made the identity (cos 1, sin 0) and Bloom's ALiBi (transformers.models.bloom.build_alibi_tensor:
    slope_h * key position) added to the scaled scores through a 4D float attention mask on top of the
    causal mask — what Baichuan-13B's modeling file computes (its `alibi_mask` + causal mask added to
    q.k / sqrt(d), no rotary)."""

    def __init__(self, llama):
        super().__init__()
        self.llama, self.config = llama, llama.config
        llama.model.rotary_emb = _NoRotary(llama.config.head_dim)

    def forward(self, ids):
        from transformers.models.bloom.modeling_bloom import build_alibi_tensor

        b, s = ids.shape
        heads = self.config.num_attention_heads
        alibi = build_alibi_tensor(torch.ones(b, s, device=ids.device), heads, torch.float32).view(b, heads, 1, s)
        causal = torch.full((s, s), float("-inf"), device=ids.device).triu(1)
        return self.llama(ids, attention_mask=causal + alibi)


# ---- Baichuan-7B / Baichuan2-7B / -13B: W_pack = [q; k; v]; Baichuan2's NormHead; 13B: ALiBi ------
def _baichuan(v2: bool, alibi: bool = False) -> Case:
    native = llama_config("mha", vocab_size=1024, rope_theta=10000.0)  # Baichuan's fixed rotary base
    ref = hf_model(native)

    def layer(i, L):
        p = f"model.layers.{i}."
        out = {p + k: v for k, v in L.items() if not k.startswith("self_attn.") or k.startswith("self_attn.o_proj")}
        out[p + "self_attn.W_pack.weight"] = _cat(L, [f"self_attn.{x}_proj.weight" for x in "qkv"])
        return out

    sd = _rename(ref.state_dict(), native, layer, {k: k for k in ("model.embed_tokens.weight", "model.norm.weight",
                                                                  "lm_head.weight")})
    cfg = {k: native[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_hidden_layers",
                                  "rms_norm_eps", "vocab_size", "max_position_embeddings", "hidden_act")}
    cfg.update(architectures=["BaichuanForCausalLM" if v2 or alibi else "BaiChuanForCausalLM"],
               model_type="baichuan", tie_word_embeddings=False)
    if alibi:  # the 13B configs: model_max_length, no max_position_embeddings
        cfg["model_max_length"] = cfg.pop("max_position_embeddings")
    if v2:
        # NormHead (the remote code normalises lm_head rows in every forward): the checkpoint keeps
        # the raw rows; the reference runs on normalised ones
        cfg.update(z_loss_weight=0, model_max_length=4096)
        sd["lm_head.weight"] = sd["lm_head.weight"] * torch.linspace(0.5, 2.0, native["vocab_size"])[:, None]
        with torch.no_grad():
            ref.lm_head.weight.copy_(F.normalize(sd["lm_head.weight"], dim=-1))
    return Case(cfg, sd, AlibiReference(ref) if alibi else ref)


# ---- InternLM2: wqkv reshaped (kv_heads, groups + 2, head_dim) = [q.., k, v] per kv head ----------
def _internlm2(variant: str, **extra) -> Case:
    native = llama_config(variant, **extra)
    ref = hf_model(native)
    g, d = native["num_key_value_heads"], native["head_dim"]

    def layer(i, L):
        p = f"model.layers.{i}."
        q, k, v = (L[f"self_attn.{x}_proj.weight"] for x in "qkv")
        wqkv = torch.cat([q.view(g, -1, q.shape[-1]), k.view(g, d, -1), v.view(g, d, -1)], dim=1)
        return {p + "attention_norm.weight": L["input_layernorm.weight"], p + "ffn_norm.weight":
                L["post_attention_layernorm.weight"], p + "attention.wqkv.weight": wqkv.reshape(-1, q.shape[-1]),
                p + "attention.wo.weight": L["self_attn.o_proj.weight"],
                p + "feed_forward.w1.weight": L["mlp.gate_proj.weight"],
                p + "feed_forward.w3.weight": L["mlp.up_proj.weight"],
                p + "feed_forward.w2.weight": L["mlp.down_proj.weight"]}

    sd = _rename(ref.state_dict(), native, layer, {"model.embed_tokens.weight": "model.tok_embeddings.weight",
                                                    "model.norm.weight": "model.norm.weight",
                                                    "lm_head.weight": "output.weight"})
    cfg = {k: v for k, v in native.items() if k not in ("attention_bias", "mlp_bias")}
    cfg.update(architectures=["InternLM2ForCausalLM"], model_type="internlm2", bias=False)
    return Case(cfg, sd, ref)


# ---- Yi (YiForCausalLM, first release): LLaMA with ln1 / ln2 ------------------------------------
def _yi() -> Case:
    native = llama_config("gqa", rope_theta=5000000.0)
    ref = hf_model(native)
    ren = {"input_layernorm.weight": "ln1.weight", "post_attention_layernorm.weight": "ln2.weight"}
    sd = _rename(ref.state_dict(), native,
                 lambda i, L: {f"model.layers.{i}.{ren.get(k, k)}": v for k, v in L.items()},
                 {k: k for k in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")})
    return Case({**native, "architectures": ["YiForCausalLM"], "model_type": "Yi"}, sd, ref)


# ---- ChatGLM2/3, GLM-4-chat (ChatGLMModel): the remote naming of GlmForCausalLM -------------------
def _chatglm(groups: int, rope_ratio: float) -> Case:
    native = llama_config("gqa", architectures=["GlmForCausalLM"], model_type="glm", attention_bias=True,
                          partial_rotary_factor=0.5, num_key_value_heads=groups, head_dim=16,
                          rope_theta=10000.0 * rope_ratio, vocab_size=1024, mlp_bias=DROP, pad_token_id=0)
    ref = hf_model(native)

    def layer(i, L):
        p = f"transformer.encoder.layers.{i}."
        return {p + "input_layernorm.weight": L["input_layernorm.weight"],
                p + "post_attention_layernorm.weight": L["post_attention_layernorm.weight"],
                p + "self_attention.query_key_value.weight": _cat(L, [f"self_attn.{x}_proj.weight" for x in "qkv"]),
                p + "self_attention.query_key_value.bias": _cat(L, [f"self_attn.{x}_proj.bias" for x in "qkv"]),
                p + "self_attention.dense.weight": L["self_attn.o_proj.weight"],
                p + "mlp.dense_h_to_4h.weight": L["mlp.gate_up_proj.weight"],
                p + "mlp.dense_4h_to_h.weight": L["mlp.down_proj.weight"]}

    sd = _rename(ref.state_dict(), native, layer,
                 {"model.embed_tokens.weight": "transformer.embedding.word_embeddings.weight",
                  "model.norm.weight": "transformer.encoder.final_layernorm.weight",
                  "lm_head.weight": "transformer.output_layer.weight"})
    d = native["head_dim"]
    sd["transformer.rotary_pos_emb.inv_freq"] = 1.0 / (10000 ** (torch.arange(0, d // 2, 2).float() / (d // 2)))
    cfg = {"architectures": ["ChatGLMModel"], "model_type": "chatglm", "num_layers": native["num_hidden_layers"],
           "hidden_size": native["hidden_size"], "ffn_hidden_size": native["intermediate_size"], "kv_channels": d,
           "num_attention_heads": native["num_attention_heads"], "multi_query_attention": True,
           "multi_query_group_num": groups, "padded_vocab_size": native["vocab_size"],
           "layernorm_epsilon": native["rms_norm_eps"], "add_qkv_bias": True, "add_bias_linear": False,
           "rmsnorm": True, "post_layer_norm": True, "apply_residual_connection_post_layernorm": False,
           "seq_length": 256, "rope_ratio": rope_ratio, "original_rope": True, "tie_word_embeddings": False,
           "hidden_dropout": 0.0, "attention_dropout": 0.0}
    return Case(cfg, sd, ref)


REMOTE_VARIANTS = {
    "qwen1": lambda: _qwen1(bias=False),
    "qwen1_bias": lambda: _qwen1(bias=True),
    "baichuan": lambda: _baichuan(v2=False),
    "baichuan2": lambda: _baichuan(v2=True),
    "baichuan_13b": lambda: _baichuan(v2=False, alibi=True),
    "baichuan2_13b": lambda: _baichuan(v2=True, alibi=True),
    "internlm2": lambda: _internlm2("gqa"),
    "internlm2_dynamic_rope": lambda: _internlm2("mha", rope_scaling={"type": "dynamic", "factor": 2.0}),
    "yi": _yi,
    "chatglm2": lambda: _chatglm(groups=2, rope_ratio=1.0),
    "glm4_chat": lambda: _chatglm(groups=4, rope_ratio=500.0),
}
