"""agoq/compat.py is the one home of torch names newer than the floor and of private torch names.

Run on each torch of the compatibility run (python -m benchmarks.compat), the last test finds any
``torch.*`` name the package spells that the installed torch lacks: on 2.11 that is an API newer
than the floor, wherever it is.
"""

import ast
import importlib
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from agoq import compat

SRC = Path(__file__).resolve().parents[1] / "src" / "agoq"
# The names 2.13 deprecated in favour of NEWER_THAN_FLOOR's: calling them elsewhere warns per call.
RENAMED = {"all_gather_into_tensor", "reduce_scatter_tensor"}


def _modules() -> list[Path]:
    return sorted(p for p in SRC.rglob("*.py") if p.name != "compat.py")


def _aliases(tree: ast.AST) -> dict[str, str]:
    """Each local name bound to a torch module or object by an import, and its dotted torch path."""
    found = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "torch":
                    found[a.asname or a.name.split(".")[0]] = a.name if a.asname else "torch"
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and node.module.split(".")[0] == "torch":
            for a in node.names:
                found[a.asname or a.name] = f"{node.module}.{a.name}"
    return found


def _torch_paths(path: Path) -> list[tuple[int, str]]:
    """Every dotted torch name ``path`` spells (``dist.all_gather_single`` -> ``torch.distributed.all_gather_single``), with its line."""
    tree = ast.parse(path.read_text())
    aliases = _aliases(tree)
    # A chain's inner links (``dist`` of ``dist.all_gather_single``) are read through its outermost node.
    links = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and node.module.split(".")[0] == "torch":
            out += [(node.lineno, f"{node.module}.{a.name}") for a in node.names if a.name != "*"]
        elif isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "torch"]
        elif isinstance(node, ast.Attribute) and id(node) not in links:
            parts, inner = [], node
            while isinstance(inner, ast.Attribute):
                parts.append(inner.attr)
                inner = inner.value
            if isinstance(inner, ast.Name) and inner.id in aliases:
                out.append((node.lineno, ".".join([aliases[inner.id], *reversed(parts)])))
    return out


def _resolves(dotted: str) -> bool:
    """Whether the installed torch has ``dotted``: the longest importable module, then attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            if not hasattr(obj, name):
                return False
            obj = getattr(obj, name)
        return True
    return False


def _private(dotted: str) -> bool:
    return any(part.startswith("_") and not (part.startswith("__") and part.endswith("__")) for part in dotted.split(".")[1:])


def test_no_module_outside_compat_calls_a_name_newer_than_the_floor_or_its_old_spelling():
    banned = set(compat.NEWER_THAN_FLOOR) | RENAMED
    found = [
        f"{p.relative_to(SRC)}:{node.lineno} uses {node.attr}"
        for p in _modules()
        for node in ast.walk(ast.parse(p.read_text()))
        if isinstance(node, ast.Attribute) and node.attr in banned
    ]
    assert not found, "call agoq.compat's names instead:\n" + "\n".join(found)


def test_no_module_outside_compat_reaches_into_a_private_torch_name():
    found = [f"{p.relative_to(SRC)}:{line} uses {dotted}" for p in _modules() for line, dotted in _torch_paths(p) if _private(dotted)]
    assert not found, "private torch names go through agoq.compat:\n" + "\n".join(found)


def test_every_torch_name_the_package_spells_exists_in_the_installed_torch():
    paths = [(p, line, dotted) for p in sorted(SRC.rglob("*.py")) for line, dotted in _torch_paths(p)]
    assert len(paths) > 200  # the walk sees the package's torch names, not none of them
    missing = sorted({f"{p.relative_to(SRC)}:{line} {dotted}" for p, line, dotted in paths if not _resolves(dotted)})
    assert not missing, f"torch {torch.__version__} lacks:\n" + "\n".join(missing)


def test_the_collectives_take_the_newest_name_and_fall_back_to_the_old_one():
    expected = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    assert compat.all_gather_single is expected
    assert compat._newest("no_such_collective", "all_gather_into_tensor") is dist.all_gather_into_tensor
    with pytest.raises(ImportError, match="has none of torch.distributed.no_such_a, no_such_b"):
        compat._newest("no_such_a", "no_such_b")


def test_the_collectives_gather_and_reduce_scatter_in_a_one_rank_group(tmp_path):
    if dist.is_initialized():
        pytest.skip("a process group is already up in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        x = torch.arange(6, dtype=torch.float32)
        out = torch.empty(6)
        compat.all_gather_single(out, x)
        assert torch.equal(out, x)
        scattered = torch.empty(6)
        compat.reduce_scatter_single(scattered, x * 2)
        assert torch.equal(scattered, x * 2)
    finally:
        dist.destroy_process_group()


def test_the_floor_is_the_one_pyproject_declares():
    text = (SRC.parents[1] / "pyproject.toml").read_text()
    floor = ".".join(map(str, compat.TORCH_FLOOR))
    assert f'"torch>={floor},' in text
    assert compat.torch_version() >= compat.TORCH_FLOOR
