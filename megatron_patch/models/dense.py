"""The dense decoder every LLaMA-shaped family shares: pre-norm blocks, rotary attention (MHA / GQA /
MQA), gated or plain MLP -> megatron-core `GPTModel`.

A family is a subclass that states facts and nothing else:

- `names`: where its checkpoint keeps each tensor (`DenseNames`; fused q|k|v and gate|up tensors are
  described by giving one name instead of several);
- `translate(config)`: its `config.json` keys -> the LLaMA key vocabulary read here (`num_hidden_layers`,
  `intermediate_size`, `num_key_value_heads`, `rms_norm_eps`, `rope_theta`, ...), for remote-code
  families whose configs name things differently;
- `defaults`: keys its transformers class fills in when a config.json omits them;
- the switches below (`qkv_bias`, `attn_out_bias`, `linear_bias`, `qk_layernorm`, `norm`, `gated_mlp`,
  `rotary_interleaved`, `rotary_fraction`, `sliding_window`, `post_norms`, `norm_head`, `output_bias`).

The weight map, `TransformerConfig` fields, `GPTModel` kwargs and layer specs are derived from those
facts here once, so family files hold no mapping blocks of their own.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass
from typing import Any

import torch.nn.functional as F

from megatron_patch.models.family import (
    Impl,
    Layout,
    ModelFamily,
    UnsupportedConfig,
    as_dict,
    rope_parameters,
)
from megatron_patch.models.mappings import (
    QKV,
    ColumnParallel,
    Drop,
    GatedMLP,
    GroupedQKV,
    Mapping,
    PackedQKV,
    Replicated,
    RowParallel,
    Shapes,
    VocabParallel,
)

# megatron-core's llama3 rope scaling hard-codes these (rotary_pos_embedding._apply_scaling); only
# `factor` is a GPTModel argument.
_MCORE_LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 8192}

# HF hidden_act -> megatron-core activation_func (applied to the gate half when the MLP is gated:
# silu -> SwiGLU, gelu -> GeGLU). "gelu_pytorch_tanh" and "gelu_new" are the same function.
_GELU_TANH = functools.partial(F.gelu, approximate="tanh")
_ACTIVATIONS = {"silu": F.silu, "swish": F.silu, "gelu": F.gelu,
                "gelu_pytorch_tanh": _GELU_TANH, "gelu_new": _GELU_TANH}


@dataclass(frozen=True)
class DenseNames:
    """Module paths of one checkpoint naming scheme (`.weight` / `.bias` are appended). `{layer}` is
    the global layer index. `qkv`: three names (q, k, v), or one name of a tensor holding
    [all q; all k; all v] (`qkv_grouped=True`: already in Megatron's per-group [q.., k, v] order).
    `mlp_in`: (gate, up), or one name ([gate; up] when the MLP is gated, else the up projection)."""

    embed: str = "model.embed_tokens"
    position_embed: str = ""  # learned absolute positions (GPTBigCode's `transformer.wpe`)
    embed_norm: str = ""  # LayerNorm on the embeddings (Bloom's `word_embeddings_layernorm`)
    layer: str = "model.layers.{layer}."
    input_norm: str = "input_layernorm"
    qkv: tuple[str, str, str] | str = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
    qkv_grouped: bool = False
    attn_out: str = "self_attn.o_proj"
    q_norm: str = "self_attn.q_norm"
    k_norm: str = "self_attn.k_norm"
    post_attn_out_norm: str = "post_self_attn_layernorm"  # only with post_norms (GLM-4-0414)
    pre_mlp_norm: str = "post_attention_layernorm"
    mlp_in: tuple[str, str] | str = ("mlp.gate_proj", "mlp.up_proj")
    mlp_out: str = "mlp.down_proj"
    post_mlp_out_norm: str = "post_mlp_layernorm"  # only with post_norms
    final_norm: str = "model.norm"
    lm_head: str = "lm_head"
    # tensors some exports store and nobody needs (rotary caches)
    layer_drops: tuple[str, ...] = ("self_attn.rotary_emb.inv_freq",)
    drops: tuple[str, ...] = ()


class ArchConfig(dict):
    """An HF config translated to the LLaMA key vocabulary (`DenseDecoder.canonical`)."""


class DenseDecoder(ModelFamily):
    names = DenseNames()
    model_type = "llama"
    norm = "RMSNorm"  # or "LayerNorm" (with biases)
    gated_mlp = True  # down(act(gate(x)) * up(x)); else down(act(up(x)))
    rotary_interleaved = False  # GLM rotates adjacent pairs instead of halves
    post_norms = False  # GLM-4-0414: RMSNorm on the attention and MLP outputs before the residual add
    embedding_norm = False  # Bloom: LayerNorm on the word embeddings
    remote_code = False  # no class in transformers: the config.json cannot be rebuilt from Megatron's
    # config.json keys the family's transformers class defaults when a file omits them
    defaults: dict = {}

    # ---- facts a family overrides ----------------------------------------------------------
    def translate(self, config: dict) -> dict:
        """The family's config.json -> LLaMA-named keys (identity for LLaMA-named configs)."""
        return config

    def qkv_bias(self, c: ArchConfig) -> bool:
        """Biases on q/k/v (megatron-core `add_qkv_bias`)."""
        return self.linear_bias(c)

    def attn_out_bias(self, c: ArchConfig) -> bool:
        """A bias on the attention output projection (o_proj); megatron-core ties it to `linear_bias`,
        a family stating otherwise gets `modules/attn_bias.py`."""
        return self.linear_bias(c)

    def linear_bias(self, c: ArchConfig) -> bool:
        """Biases on every linear layer (megatron-core `add_bias_linear`: o_proj and the MLP too; a family
        whose attention is biased otherwise states `qkv_bias` / `attn_out_bias`)."""
        attn, mlp = bool(c.get("attention_bias", False)), bool(c.get("mlp_bias", False))
        if attn != mlp:
            raise UnsupportedConfig(
                f"attention_bias={attn} with mlp_bias={mlp}: megatron-core's add_bias_linear switches "
                "the biases of attention and MLP projections together"
            )
        return attn

    def qk_layernorm(self, c: ArchConfig) -> bool:
        """Per-head RMSNorm of queries and keys before rotary (Qwen3's q_norm / k_norm)."""
        return False

    def sliding_window(self, c: ArchConfig) -> int | None:
        """Tokens each query sees (itself included) in every layer; None = full causal attention."""
        return None

    def positions(self, c: ArchConfig) -> str:
        """'rope', 'alibi' (modules/alibi.py) or 'learned' (absolute position embeddings)."""
        return "rope"

    def parallel_attention(self, c: ArchConfig) -> str | None:
        """None (sequential blocks), or attention and MLP side by side on the layer input
        (modules/parallel_attn.py) with 'separate' norms or one 'shared' norm."""
        return None

    def names_for(self, c: ArchConfig) -> DenseNames:
        """The checkpoint names for this config (a family whose fused layout depends on the config
        overrides it)."""
        return self.names

    def norm_head(self, c: ArchConfig) -> bool:
        """Baichuan2's NormHead: lm_head rows L2-normalised in every forward."""
        return False

    def output_bias(self, c: ArchConfig) -> bool:
        """A bias on the output layer (GPT-J's `lm_head.bias`; `modules/output_bias.py`)."""
        return False

    # ---- derived ----------------------------------------------------------------------------
    def canonical(self, hf_config: Any) -> ArchConfig:
        if isinstance(hf_config, ArchConfig):
            return hf_config
        return ArchConfig(self.translate({**self.defaults, **as_dict(hf_config)}))

    def activation(self, c: ArchConfig):
        act = c.get("hidden_act", "silu")
        if act not in _ACTIVATIONS:
            raise UnsupportedConfig(f"hidden_act={act!r}: supported are {sorted(_ACTIVATIONS)}")
        return _ACTIVATIONS[act]

    def config_kwargs(self, hf_config: Any) -> dict:
        c = self.canonical(hf_config)
        heads = int(c["num_attention_heads"])
        hidden = int(c["hidden_size"])
        window = self.sliding_window(c)
        kw = dict(
            num_layers=int(c["num_hidden_layers"]),
            hidden_size=hidden,
            ffn_hidden_size=int(c["intermediate_size"]),
            num_attention_heads=heads,
            num_query_groups=int(c.get("num_key_value_heads") or heads),
            kv_channels=int(c.get("head_dim") or hidden // heads),
            normalization=self.norm,
            layernorm_epsilon=float(c.get("rms_norm_eps", 1e-6)),
            gated_linear_unit=self.gated_mlp,
            activation_func=self.activation(c),
            add_bias_linear=self.linear_bias(c),
            add_qkv_bias=self.qkv_bias(c),
            qk_layernorm=self.qk_layernorm(c),
            rotary_interleaved=self.rotary_interleaved,
            hidden_dropout=0.0,
            attention_dropout=float(c.get("attention_dropout", 0.0)),
            init_method_std=float(c.get("initializer_range", 0.02)),
        )
        if window is not None:
            # HF: query i sees keys i - window + 1 .. i; megatron-core/TE: (left, right) extents
            kw["window_size"] = (int(window) - 1, 0)
        return kw

    def gpt_kwargs(self, hf_config: Any) -> dict:
        c = self.canonical(hf_config)
        tied = bool(c.get("tie_word_embeddings", False))
        if self.positions(c) != "rope":
            kind = "learned_absolute" if self.positions(c) == "learned" else "none"
            return dict(position_embedding_type=kind, share_embeddings_and_output_weights=tied)
        theta, scaling = rope_parameters(c)
        kw = dict(
            position_embedding_type="rope",
            rotary_base=theta,
            rotary_percent=self.rotary_fraction(c),
            share_embeddings_and_output_weights=tied,
        )
        if scaling is None:
            return kw
        kind = scaling["rope_type"]
        if kind == "linear":
            return {**kw, "seq_len_interpolation_factor": float(scaling["factor"])}
        if kind == "llama3":
            self.llama3_parameters(c)  # other low/high_freq_factor, original_max_position_embeddings: `finalize`
            return {**kw, "rope_scaling": True, "rope_scaling_factor": float(scaling["factor"])}
        if kind == "dynamic":
            # Dynamic NTK only rescales the frequencies for sequences longer than
            # max_position_embeddings; up to that length it is plain rope, which is what we build.
            warnings.warn(f"{self.name}: rope_scaling 'dynamic' is plain rope up to "
                          f"max_position_embeddings={self.max_sequence_length(c)}; megatron-core does "
                          "not rescale beyond it", stacklevel=2)
            return kw
        raise UnsupportedConfig(f"rope_scaling of type {kind!r} (supported: llama3, linear, dynamic)")

    def llama3_parameters(self, c: ArchConfig) -> dict | None:
        """llama3 rope scaling's parameters when they are not the ones megatron-core's `GPTModel` builds
        with (it passes only `factor`), else None."""
        _, scaling = rope_parameters(c)
        if scaling is None or scaling["rope_type"] != "llama3":
            return None
        fixed = {k: float(scaling.get(k, v)) for k, v in _MCORE_LLAMA3_FIXED.items()}
        if fixed == _MCORE_LLAMA3_FIXED:
            return None
        if fixed["high_freq_factor"] <= fixed["low_freq_factor"]:
            raise UnsupportedConfig(f"llama3 rope_scaling with high_freq_factor <= low_freq_factor: {fixed}")
        return {**fixed, "factor": float(scaling["factor"])}

    def rotary_fraction(self, c: ArchConfig) -> float:
        params = c.get("rope_parameters") or {}
        return float(c.get("partial_rotary_factor") or params.get("partial_rotary_factor") or 1.0)

    def max_sequence_length(self, hf_config: Any) -> int:
        return int(self.canonical(hf_config).get("max_position_embeddings") or 4096)

    def shapes(self, hf_config: Any, layout: Layout) -> Shapes:
        return super().shapes(self.canonical(hf_config), layout)

    def layer_spec(self, hf_config: Any, impl: Impl):
        from megatron.core.models.gpt import gpt_layer_specs as specs

        c = self.canonical(hf_config)
        qk = self.qk_layernorm(c)
        if impl == "transformer_engine":
            spec = specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk)
        else:
            spec = specs.get_gpt_layer_local_spec(normalization=self.norm, qk_layernorm=qk)
        if self.post_norms:
            from megatron_patch.models.modules.post_norm import with_post_norms

            spec = with_post_norms(spec, impl)
        if self.positions(c) == "alibi":
            from megatron_patch.models.modules.alibi import with_alibi

            spec = with_alibi(spec, impl)
        # megatron-core biases linear_qkv when add_bias_linear or add_qkv_bias, linear_proj when add_bias_linear
        linear, proj = self.linear_bias(c), self.attn_out_bias(c)
        unbiased_qkv = linear and not self.qkv_bias(c)
        if unbiased_qkv or proj != linear:
            from megatron_patch.models.modules.attn_bias import with_attention_biases

            spec = with_attention_biases(spec, qkv=False if unbiased_qkv else None,
                                         proj=proj if proj != linear else None)
        if self.parallel_attention(c):
            from megatron_patch.models.modules.parallel_attn import with_parallel_attention

            spec = with_parallel_attention(spec, impl, shared_norm=self.parallel_attention(c) == "shared")
        return spec

    def finalize(self, model, hf_config: Any) -> None:
        c = self.canonical(hf_config)
        if self.norm_head(c) and getattr(model, "post_process", False):
            from megatron_patch.models.modules.norm_head import use_norm_head

            use_norm_head(model)
        if self.embedding_norm:
            from megatron_patch.models.modules import norm_class
            from megatron_patch.models.modules.embedding_norm import add_embedding_norm

            add_embedding_norm(model, norm_class(model.config.transformer_impl))
        if self.output_bias(c) and getattr(model, "post_process", False):
            from megatron_patch.models.modules.output_bias import add_output_bias

            add_output_bias(model)
        llama3 = self.llama3_parameters(c)
        if llama3 is not None and self.positions(c) == "rope":
            from megatron_patch.models.modules.rope_scaling import use_llama3_scaling

            gk = self.gpt_kwargs(c)
            use_llama3_scaling(model, rotary_base=gk["rotary_base"], rotary_percent=gk["rotary_percent"], **llama3)

    def weight_map(self, hf_config: Any) -> list[Mapping | Drop]:
        c = self.canonical(hf_config)
        n = self.names_for(c)
        hf, mc = n.layer, "decoder.layers.{layer}."
        biased = ["weight", "bias"] if self.norm == "LayerNorm" else ["weight"]
        m: list[Mapping | Drop] = [VocabParallel(f"{n.embed}.weight", "embedding.word_embeddings.weight")]
        if self.positions(c) == "learned":
            m.append(Replicated(f"{n.position_embed}.weight", "embedding.position_embeddings.weight"))

        def norm(hf_name: str, megatron: str, prefix: tuple[str, str] = (hf, mc)) -> None:
            m.extend(Replicated(f"{prefix[0]}{hf_name}.{p}", f"{prefix[1]}{megatron}.{p}") for p in biased)

        def linear(kind, hf_name, megatron: str, params: list[str]) -> None:
            for p in params:
                if kind is QKV:
                    if isinstance(hf_name, str):
                        op = (GroupedQKV if n.qkv_grouped else PackedQKV)(f"{hf}{hf_name}.{p}", f"{mc}{megatron}.{p}")
                    else:
                        op = QKV(*(f"{hf}{h}.{p}" for h in hf_name), f"{mc}{megatron}.{p}")
                elif kind is GatedMLP:
                    gate, up = (hf_name, None) if isinstance(hf_name, str) else hf_name
                    op = GatedMLP(f"{hf}{gate}.{p}", up and f"{hf}{up}.{p}", f"{mc}{megatron}.{p}")
                elif kind is RowParallel and p == "bias":
                    op = Replicated(f"{hf}{hf_name}.{p}", f"{mc}{megatron}.{p}")
                else:
                    op = kind(f"{hf}{hf_name}.{p}", f"{mc}{megatron}.{p}")
                m.append(op)

        bias = ["weight", "bias"] if self.linear_bias(c) else ["weight"]
        norm(n.input_norm, "input_layernorm")
        linear(QKV, n.qkv, "self_attention.linear_qkv", ["weight", "bias"] if self.qkv_bias(c) else ["weight"])
        linear(RowParallel, n.attn_out, "self_attention.linear_proj", ["weight", "bias"] if self.attn_out_bias(c)
               else ["weight"])
        if self.qk_layernorm(c):
            norm(n.q_norm, "self_attention.q_layernorm")
            norm(n.k_norm, "self_attention.k_layernorm")
        if self.parallel_attention(c) != "shared":  # a shared norm is input_layernorm, applied twice
            norm(n.pre_mlp_norm, "pre_mlp_layernorm")
        linear(GatedMLP if self.gated_mlp else ColumnParallel, n.mlp_in, "mlp.linear_fc1", bias)
        linear(RowParallel, n.mlp_out, "mlp.linear_fc2", bias)
        if self.post_norms:
            norm(n.post_attn_out_norm, "self_attention.post_layernorm")
            norm(n.post_mlp_out_norm, "mlp.post_layernorm")
        norm(n.final_norm, "decoder.final_layernorm", ("", ""))
        if self.embedding_norm:
            norm(n.embed_norm, "embedding.word_embeddings_layernorm", ("", ""))
        m += [Drop(hf + d, "recomputed from the config") for d in n.layer_drops]
        m += [Drop(d, "recomputed from the config") for d in n.drops]
        if self.tied_embeddings(c):
            # in-memory state dicts (and some exports) repeat the tied matrix
            m.append(Drop(f"{n.lm_head}.weight", f"tied to {n.embed}.weight"))
        else:
            m.append(VocabParallel(f"{n.lm_head}.weight", "output_layer.weight"))
        if self.output_bias(c):
            m.append(VocabParallel(f"{n.lm_head}.bias", "output_layer.bias"))
        return m

    # ---- Megatron config -> HF config.json (LLaMA-named; families rename or drop keys) -------
    def hf_config_from_megatron(self, config: Any, gpt_kwargs: dict, vocab_size: int) -> dict:
        if self.remote_code:
            raise UnsupportedConfig(f"{self.name} is a remote-code architecture: its config.json cannot be rebuilt "
                                    "from Megatron's; pass the original one (--hf-config)")
        out = {
            "architectures": list(self.architectures),
            "model_type": self.model_type,
            "vocab_size": vocab_size,
            "hidden_size": config.hidden_size,
            "intermediate_size": config.ffn_hidden_size,
            "num_hidden_layers": config.num_layers,
            "num_attention_heads": config.num_attention_heads,
            "num_key_value_heads": config.num_query_groups or config.num_attention_heads,
            "head_dim": config.kv_channels,
            "hidden_act": next(k for k, f in _ACTIVATIONS.items() if f is config.activation_func),
            "rms_norm_eps": config.layernorm_epsilon,
            "attention_bias": config.add_qkv_bias,
            "mlp_bias": config.add_bias_linear,
            "attention_dropout": config.attention_dropout,
            "initializer_range": config.init_method_std,
            "tie_word_embeddings": bool(gpt_kwargs.get("share_embeddings_and_output_weights")),
            "rope_theta": gpt_kwargs.get("rotary_base", 10000.0),
        }
        if gpt_kwargs.get("rope_scaling"):
            out["rope_scaling"] = {"rope_type": "llama3", "factor": gpt_kwargs["rope_scaling_factor"],
                                   **_MCORE_LLAMA3_FIXED}
        elif gpt_kwargs.get("seq_len_interpolation_factor"):
            out["rope_scaling"] = {"rope_type": "linear", "factor": gpt_kwargs["seq_len_interpolation_factor"]}
        if config.window_size is not None:
            out["sliding_window"] = config.window_size[0] + 1
        return out
