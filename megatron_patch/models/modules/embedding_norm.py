"""A LayerNorm on the word embeddings (Bloom's `word_embeddings_layernorm`), which megatron-core's
`LanguageModelEmbedding` does not have. `family.finalize` adds it to a built `GPTModel`'s embedding
(first pipeline stage only) as `embedding.word_embeddings_layernorm` and narrows the embedding's class so
its output goes through the norm (Bloom has no embedding dropout, so norm-after-dropout is the same
function). Under sequence parallelism the embedding output is a sequence shard, which a per-token norm
does not mind."""

from __future__ import annotations

from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding


class NormedLanguageModelEmbedding(LanguageModelEmbedding):
    def forward(self, *args, **kwargs):
        return self.word_embeddings_layernorm(super().forward(*args, **kwargs))


def add_embedding_norm(model, norm_class) -> None:
    emb = getattr(model, "embedding", None)
    if emb is None:  # not the first pipeline stage
        return
    if type(emb) is not LanguageModelEmbedding:
        raise TypeError(f"embedding norm expects megatron-core's LanguageModelEmbedding, got {type(emb)}")
    config = emb.config
    emb.word_embeddings_layernorm = norm_class(config=config, hidden_size=config.hidden_size,
                                               eps=config.layernorm_epsilon)
    emb.__class__ = NormedLanguageModelEmbedding
