"""Building blocks megatron-core does not ship, plugged in through layer specs or after `GPTModel`
is built — never by editing megatron-core."""

import dataclasses
import functools


def norm_class(impl: str):
    """The norm module megatron-core's layer specs use for `impl` (TE's, or Apex/torch for local)."""
    if impl == "transformer_engine":
        from megatron.core.extensions.transformer_engine import TENorm

        return TENorm
    from megatron.core.models.gpt.gpt_layer_specs import LNImpl

    return LNImpl


def replace_mlp(mlp, module=None, submodules=None):
    """A layer spec's MLP entry — a ModuleSpec, or megatron-core 0.19's `functools.partial` of
    `MLP.as_mlp_submodule` — with its class and/or submodules (`submodules(old) -> new`) replaced."""
    if isinstance(mlp, functools.partial):
        kw = dict(mlp.keywords)
        if submodules is not None:
            kw["submodules"] = submodules(kw["submodules"])
        return functools.partial(mlp.func if module is None else module.as_mlp_submodule, **kw)
    return dataclasses.replace(mlp, module=module or mlp.module,
                               submodules=mlp.submodules if submodules is None else submodules(mlp.submodules))


def mlp_class(mlp) -> type | None:
    """The module class of a layer spec's MLP entry (a ModuleSpec, megatron-core 0.19's partial of
    `<cls>.as_mlp_submodule`, or a class)."""
    cls = getattr(mlp, "func", getattr(mlp, "module", mlp))
    cls = getattr(cls, "__self__", cls)  # `MLP.as_mlp_submodule`, a bound classmethod
    return cls if isinstance(cls, type) else None
