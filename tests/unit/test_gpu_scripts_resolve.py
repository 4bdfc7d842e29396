"""The GPU suite runs only on the GPU machine, whose time is scarce: a renamed function or module must not
be found there. Every name the GPU tests and proof scripts import (also inside functions) exists here, under
every supported megatron-core: a module that refuses the installed release with a clear error
(`compat.UnsupportedVersion`, e.g. models/hybrid.py under 0.18) is checked from its source instead."""

import ast
import importlib
import importlib.util
import os
import sys

import pytest

from megatron_patch import compat

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GPU = os.path.join(ROOT, "tests", "gpu")
OURS = ("megatron_patch", "toolkits", "tests", "benchmarks")
SCRIPTS = sorted(f for f in os.listdir(GPU) if f.endswith(".py"))


def _imports(path):
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module.startswith(OURS):
            for alias in node.names:
                yield node.lineno, node.module, alias.name
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith(OURS):
                    yield node.lineno, alias.name, None


def _defined_names(path):
    """The names a module's source binds at its top level (functions, classes, assignments, imports)."""
    names = set()
    for node in ast.parse(open(path).read(), path).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


def _missing(script):
    missing = []
    for line, module, name in _imports(os.path.join(GPU, script)):
        try:
            mod = importlib.import_module(module)
        except compat.UnsupportedVersion:
            # the module exists and refuses this release on purpose: its names are read from its source
            if name is not None and name not in _defined_names(importlib.util.find_spec(module).origin):
                missing.append(f"{script}:{line}: {module}.{name}")
            continue
        except ImportError as e:
            missing.append(f"{script}:{line}: {module} ({e})")
            continue
        if name is not None and not hasattr(mod, name):
            try:
                importlib.import_module(f"{module}.{name}")
            except ImportError:
                missing.append(f"{script}:{line}: {module}.{name}")
    return missing


@pytest.mark.parametrize("script", SCRIPTS)
def test_gpu_script_imports_resolve(script):
    missing = _missing(script)
    assert not missing, missing


def test_resolves_a_module_that_refuses_the_release(monkeypatch):
    """Under megatron-core 0.18, models/hybrid.py raises UnsupportedVersion at import (CI's oldest-release run
    failed on tests/gpu/test_paths.py this way): faked here so the path runs under every release; a name the
    module does not define is still reported."""
    monkeypatch.setattr(compat, "at_least", lambda version: False)
    monkeypatch.delitem(sys.modules, "megatron_patch.models.hybrid", raising=False)
    with pytest.raises(compat.UnsupportedVersion):
        importlib.import_module("megatron_patch.models.hybrid")
    assert _missing("test_paths.py") == []
    source = importlib.util.find_spec("megatron_patch.models.hybrid").origin
    assert "to_hybrid_names" in _defined_names(source) and "no_such_name" not in _defined_names(source)
