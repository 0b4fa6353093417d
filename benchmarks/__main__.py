"""``python -m benchmarks``: list the benchmarks; ``python -m benchmarks NAME [args]``: run one.

NAME is a module of this package, written with '-' or '_' (``train-dtype`` or ``train_dtype``);
``python -m benchmarks.NAME [args]`` does the same.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
from pathlib import Path
from types import ModuleType


def benchmark_names() -> list[str]:
    """Every benchmark module of this package (the public modules; readme included), sorted."""
    return sorted(info.name for info in pkgutil.iter_modules([str(Path(__file__).parent)]) if not info.name.startswith("_"))


def load(name: str) -> ModuleType:
    """The benchmark module called ``name`` ('-' or '_'); SystemExit(2) with the choices if there is none."""
    module = name.replace("-", "_")
    if module not in benchmark_names():
        print(f"python -m benchmarks: no benchmark {name!r}; choose from {', '.join(benchmark_names())}", file=sys.stderr)
        raise SystemExit(2)
    return importlib.import_module(f"benchmarks.{module}")


def listing() -> str:
    """One line per benchmark: its name and DESCRIPTION."""
    modules = {name: load(name) for name in benchmark_names()}
    width = max(map(len, modules))
    lines = ["usage: python -m benchmarks.NAME [args]   (or python -m benchmarks NAME [args]; --help after NAME for its options)", ""]
    lines += [f"  {name:<{width}}  {getattr(module, 'DESCRIPTION', '')}" for name, module in modules.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """List the benchmarks, or run the one named first in argv with the arguments after it."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(listing())
        return 0
    module = load(args[0])
    if argv is None:
        # What the benchmark records as its command line is then what `python -m benchmarks.NAME` would show.
        sys.argv = [sys.argv[0], *args[1:]]
    return int(module.main(args[1:]) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
