"""Checkpoints are loaded safely: every `torch.load` call of the library and the command-line tools passes
`weights_only=True` (no pickled code runs from a checkpoint file)."""

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_every_torch_load_is_weights_only():
    unsafe = []
    for folder in ("megatron_patch", "toolkits"):
        for root, _, names in os.walk(os.path.join(ROOT, folder)):
            for n in (n for n in names if n.endswith(".py")):
                path = os.path.join(root, n)
                for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
                    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                            and node.func.attr == "load" and getattr(node.func.value, "id", None) == "torch"):
                        continue
                    flag = next((k.value for k in node.keywords if k.arg == "weights_only"), None)
                    if not (isinstance(flag, ast.Constant) and flag.value is True):
                        unsafe.append(f"{os.path.relpath(path, ROOT)}:{node.lineno}")
    assert not unsafe, f"torch.load without weights_only=True: {unsafe}"
