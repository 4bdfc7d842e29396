"""The GPU suite runs only on the GPU machine, whose time is scarce: a renamed function or module must not
be found there. Every name the GPU tests and proof scripts import (also inside functions) exists here."""

import ast
import importlib
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GPU = os.path.join(ROOT, "tests", "gpu")
OURS = ("megatron_patch", "toolkits", "tests", "benchmarks")


def _imports(path):
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module.startswith(OURS):
            for alias in node.names:
                yield node.lineno, node.module, alias.name
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith(OURS):
                    yield node.lineno, alias.name, None


@pytest.mark.parametrize("script", sorted(f for f in os.listdir(GPU) if f.endswith(".py")))
def test_gpu_script_imports_resolve(script):
    missing = []
    for line, module, name in _imports(os.path.join(GPU, script)):
        try:
            mod = importlib.import_module(module)
        except ImportError as e:
            missing.append(f"{script}:{line}: {module} ({e})")
            continue
        if name is not None and not hasattr(mod, name):
            try:
                importlib.import_module(f"{module}.{name}")
            except ImportError:
                missing.append(f"{script}:{line}: {module}.{name}")
    assert not missing, missing
