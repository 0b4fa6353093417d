"""Lower layers never import higher ones (DESIGN.md: data flows config -> model -> parallel -> trainer)."""

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "agoq"
ALLOWED = {
    "quant": set(),
    "activation": {"quant"},
    "gradient": {"quant"},
    "models": {"activation", "quant"},
    "parallel": {"models", "activation", "quant"},
    "train": {"models", "activation", "gradient", "parallel", "quant"},
    # The planner models what the trainer allocates for a given training config.
    "plan": {"models", "activation", "gradient", "parallel", "quant", "train"},
}


def _agoq_imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""] if isinstance(node, ast.ImportFrom) else []
        for name in names:
            parts = name.split(".")
            if parts[0] == "agoq" and len(parts) > 1:
                found.add(parts[1])
    return found


def test_each_layer_imports_only_the_layers_below_it():
    violations = []
    for layer, allowed in ALLOWED.items():
        for path in (SRC / layer).rglob("*.py"):
            for dep in _agoq_imports(path) - allowed - {layer}:
                violations.append(f"{path.relative_to(SRC)} imports agoq.{dep}")
    assert not violations, "\n".join(violations)


def _quant_modules(path: Path) -> set[str]:
    """The agoq.quant modules ``path`` imports, eagerly or inside functions (e.g. 'backend', 'triton')."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            parts = node.module.split(".")
            if parts[:2] == ["agoq", "quant"]:
                found |= {parts[2]} if len(parts) > 2 else {a.name for a in node.names}
        elif isinstance(node, ast.Import):
            for a in node.names:
                parts = a.name.split(".")
                if parts[:2] == ["agoq", "quant"] and len(parts) > 2:
                    found.add(parts[2])
    return found


def test_quantization_dispatch_runs_one_way():
    # dispatch -> backend -> kernels (compiled, triton) -> the reference (qtensor): the reference
    # and the kernels never reach back up, not even from inside a function.
    quant = SRC / "quant"
    kernels = [quant / "compiled.py", *(quant / "triton").rglob("*.py")]
    for path in [quant / "qtensor.py", *kernels]:
        assert not _quant_modules(path) & {"dispatch", "backend"}, path.relative_to(SRC)
    assert "compiled" not in _quant_modules(quant / "qtensor.py") and "triton" not in _quant_modules(quant / "qtensor.py")
