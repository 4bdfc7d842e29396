"""Building blocks megatron-core does not ship, plugged in through layer specs or after `GPTModel`
is built — never by editing megatron-core."""


def norm_class(impl: str):
    """The norm module megatron-core's layer specs use for `impl` (TE's, or Apex/torch for local)."""
    if impl == "transformer_engine":
        from megatron.core.extensions.transformer_engine import TENorm

        return TENorm
    from megatron.core.models.gpt.gpt_layer_specs import LNImpl

    return LNImpl
