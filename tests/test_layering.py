"""Lower layers never import higher ones (docs/ARCHITECTURE.md: each layer imports only the ones below it), and
nothing in the package imports the benchmarks (benchmarks/, outside it, above every layer)."""

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "agoq"
# Outside the package, above every layer: the benchmarks may import any of agoq, agoq none of them.
BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
ALLOWED = {
    "quant": set(),
    "activation": {"quant"},
    "gradient": {"quant"},
    "models": {"activation", "quant"},
    # Tensor parallelism's collectives record their bytes in gradient.counter's CommCounter.
    "parallel": {"models", "activation", "gradient", "quant"},
    # Corpus, tokenizer and token cache: files and numpy, with torch only for the batches.
    "data": set(),
    # One rank's loop, optimizer, checkpoints and metrics, built from explicit parts (no config).
    "train": {"models", "activation", "gradient", "parallel", "quant"},
    # From a config to running ranks: the config, the choices, the launcher and the component builders.
    "launch": {"models", "activation", "gradient", "parallel", "quant", "data", "train", "plan"},
    # The planner models what the trainer allocates; a training config reaches it through launch/planning.py.
    "plan": {"models", "activation", "gradient", "parallel", "quant", "train"},
    # Other libraries' models and loops (transformers) get the activation ops and the 8-bit gradients.
    "integrations": {"models", "activation", "gradient", "quant"},
}
# Below every layer: modules of the standard library alone, so that the launcher can use them before
# it imports torch (inductor_cache: the folder a torch held to another instruction set compiles into).
# nofollow: file writes that never follow a link, for every layer that writes (it raises errors' ConfigError).
# values: typed config values from text, for agoq train's config and agoq plan's --model-field.
BASE = {"inductor_cache", "errors", "nofollow", "values"}
# Below every layer too, above torch alone: the one home of torch names newer than the floor and of
# private torch names (tests/test_compat.py).
TORCH_BASE = {"compat"}


def _agoq_imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""] if isinstance(node, ast.ImportFrom) else []
        for name in names:
            parts = name.split(".")
            if parts[0] == "agoq" and len(parts) > 1:
                found.add(parts[1])
    return found


def _top_level_imports(path: Path) -> set[str]:
    """The top-level packages ``path`` imports, eagerly or inside functions (import_module("x.y") included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) in ("import_module", "__import__"):
            if node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
                found.add(node.args[0].value.split(".")[0])
            elif node.args and isinstance(node.args[0], ast.JoinedStr) and node.args[0].values:
                head = node.args[0].values[0]
                if isinstance(head, ast.Constant):
                    found.add(str(head.value).split(".")[0])
    return found


def test_every_package_has_a_place_in_the_layers():
    packages = {p.name for p in SRC.iterdir() if (p / "__init__.py").exists()}
    assert packages == set(ALLOWED), f"unplaced: {sorted(packages - set(ALLOWED))}, gone: {sorted(set(ALLOWED) - packages)}"


def test_each_layer_imports_only_the_layers_below_it():
    violations = []
    for layer, allowed in ALLOWED.items():
        for path in (SRC / layer).rglob("*.py"):
            for dep in _agoq_imports(path) - allowed - BASE - TORCH_BASE - {layer}:
                violations.append(f"{path.relative_to(SRC)} imports agoq.{dep}")
    assert not violations, "\n".join(violations)


def test_the_base_modules_import_only_the_standard_library():
    import sys

    for name in BASE:
        path = SRC / f"{name}.py"
        outside = _top_level_imports(path) - set(sys.stdlib_module_names) - {"__future__", "agoq"}
        inside = _agoq_imports(path) - BASE  # a base module may use another
        assert not outside and not inside, f"{name}.py imports {sorted(outside | inside)}"


def test_nothing_in_the_package_imports_the_benchmarks():
    offenders = [str(path.relative_to(SRC)) for path in SRC.rglob("*.py") if "benchmarks" in _top_level_imports(path)]
    assert not offenders, f"agoq modules that import the benchmarks package: {offenders}"


def test_the_benchmarks_import_agoq_layers_that_exist():
    # The benchmarks sit above every layer and may use any of them (public or internal modules);
    # what they import must be a real part of agoq, not a package that is no longer there.
    layers = {p.name for p in SRC.iterdir() if p.is_dir() and (p / "__init__.py").exists()} | {p.stem for p in SRC.glob("*.py")}
    paths = sorted(BENCHMARKS.rglob("*.py"))
    assert any(_agoq_imports(p) for p in paths), "no benchmark imports agoq"
    missing = [f"{p.relative_to(BENCHMARKS)} imports agoq.{dep}" for p in paths for dep in sorted(_agoq_imports(p) - layers)]
    assert not missing, "\n".join(missing)


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


def test_the_compat_module_imports_torch_and_the_standard_library_alone():
    import sys

    path = SRC / "compat.py"
    outside = _top_level_imports(path) - set(sys.stdlib_module_names) - {"__future__", "torch"}
    assert not outside and not _agoq_imports(path), f"compat.py imports {sorted(outside | _agoq_imports(path))}"


def _module_imports() -> dict[str, set[str]]:
    """Each module of the package and the package's modules it imports, at its top or inside a function."""
    modules = {}
    for path in SRC.rglob("*.py"):
        parts = path.relative_to(SRC.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = (
                    ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + [node.module or ""]).strip(".")
                    if node.level
                    else node.module or ""
                )
                found.add(base)
                found |= {f"{base}.{a.name}" for a in node.names}  # a submodule imported by name
        graph[name] = {m for m in found if m in modules and m != name}
    return graph


def test_the_package_has_no_import_cycles():
    """No module reaches itself through the modules it imports, lazily imported ones included: each
    is understood, tested and replaced without the ones that depend on it."""
    graph = _module_imports()
    assert "agoq.gradient.sync" in graph["agoq.gradient.sharded"]  # the graph sees the imports
    cycles, done = [], set()

    def visit(name: str, path: list[str]) -> None:
        if name in path:
            cycles.append(" -> ".join(path[path.index(name) :] + [name]))
            return
        if name in done:
            return
        for dep in sorted(graph[name]):
            visit(dep, path + [name])
        done.add(name)

    for name in sorted(graph):
        visit(name, [])
    assert not cycles, "\n".join(cycles)


def _names_and_imports(path: Path) -> tuple[set[str], set[str]]:
    """Every identifier ``path`` uses (names and attributes) and every agoq module it imports."""
    names, modules = set(), set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, ast.Import):
            modules |= {a.name for a in node.names if a.name.startswith("agoq.")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("agoq"):
            modules |= {f"{node.module}.{a.name}" if node.module == "agoq" else node.module for a in node.names}
            names |= {a.name for a in node.names}
    return names, modules


def test_the_whole_train_config_is_read_only_in_the_launch_layer():
    # The Trainer and every component take their own section or explicit values (agoq.launch.components
    # builds them); only agoq.launch and the command line above it see a TrainConfig or import launch.
    readers = []
    for path in SRC.rglob("*.py"):
        rel = path.relative_to(SRC)
        if rel.parts[0] == "launch" or rel == Path("cli.py"):
            continue
        names, modules = _names_and_imports(path)
        if "TrainConfig" in names or any(m == "agoq.launch" or m.startswith("agoq.launch.") for m in modules):
            readers.append(str(rel))
    assert not readers, f"modules outside agoq.launch that read the whole training config or import launch: {sorted(readers)}"
