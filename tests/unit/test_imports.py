"""The package's import graph (every `import` / `from ... import` of megatron_patch, at module level and
inside functions): no circle, and the library never imports its command-line folder `toolkits/`."""

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE = os.path.join(ROOT, "megatron_patch")


def _module_name(path: str) -> str:
    rel = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
    return rel[: -len(".__init__")] if rel.endswith(".__init__") else rel


def _graph() -> dict[str, set[str]]:
    modules = {}
    for root, _, names in os.walk(PACKAGE):
        for n in names:
            if n.endswith(".py"):
                modules[_module_name(os.path.join(root, n))] = os.path.join(root, n)
    graph = {}
    for name, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                # `from a import b`: the module b when it is one, else a (the package's own names: its
                # __init__ imports nothing at module level; `megatron_patch.Bridge` is resolved lazily)
                named = {f"{node.module}.{a.name}" for a in node.names} & set(modules)
                targets |= named if len(named) == len(node.names) else named | {node.module}
        # an import of a.b.c also runs a and a.b: count the deepest module of ours it names
        graph[name] = {t for t in targets if t in modules and t != name} | {t for t in targets
                                                                         if t.startswith("toolkits")}
    return graph


def test_no_import_circle_and_no_toolkits():
    graph = _graph()
    assert not {m: sorted(t for t in ts if t.startswith("toolkits")) for m, ts in graph.items()
                if any(t.startswith("toolkits") for t in ts)}
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if nxt.startswith("toolkits"):
                continue
            if state.get(nxt) == 1:
                raise AssertionError("import circle: " + " -> ".join(path[path.index(nxt):] + [nxt]))
            if nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])


def test_package_root_imports_nothing_at_load():
    """`import megatron_patch` stays light and outside every circle: its __init__ has no module-level import
    (the public names, `Bridge` and `Layout`, are imported on first use by its `__getattr__`)."""
    tree = ast.parse(open(os.path.join(PACKAGE, "__init__.py"), encoding="utf-8").read())
    assert not [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]


def test_the_moved_pipeline_module_keeps_its_old_name():
    """docs/python-api.md's `megatron_patch.models.pipeline` moved to `megatron_patch.runtime.pipeline`: the old
    name still gives the same functions, with a DeprecationWarning."""
    import importlib
    import sys
    import warnings

    from megatron_patch.runtime import pipeline

    sys.modules.pop("megatron_patch.models.pipeline", None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        old = importlib.import_module("megatron_patch.models.pipeline")
    assert any(issubclass(w.category, DeprecationWarning) and "runtime.pipeline" in str(w.message) for w in caught)
    assert old.forward_backward is pipeline.forward_backward
    assert old.share_embedding_grads is pipeline.share_embedding_grads


def test_the_converter_and_preprocessing_commands_are_imported_by_no_library_module():
    """`megatron_patch.convert`, `megatron_patch.preprocess_data` and the `megatron-patch` dispatcher are the
    command layer: only the dispatcher names them (by module name), no library module imports them."""
    commands = {"megatron_patch.convert", "megatron_patch.preprocess_data", "megatron_patch.__main__"}
    graph = _graph()
    assert not {m: sorted(ts & commands) for m, ts in graph.items() if ts & commands}
