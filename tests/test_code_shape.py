"""The package stays readable: no function over 60 lines and no class over 250 in src/agoq, unless
the line above it says why (a comment containing "long on purpose")."""

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "agoq"
LIMITS = {ast.FunctionDef: 60, ast.AsyncFunctionDef: 60, ast.ClassDef: 250}


def test_no_function_over_60_lines_and_no_class_over_250():
    too_long = []
    for path in sorted(SRC.rglob("*.py")):
        lines = path.read_text().splitlines()
        for node in ast.walk(ast.parse("\n".join(lines))):
            limit = LIMITS.get(type(node))
            if limit is None:
                continue
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            length = node.end_lineno - node.lineno + 1
            excused = first >= 2 and "long on purpose" in lines[first - 2]
            if length > limit and not excused:
                too_long.append(f"{path.relative_to(SRC)}:{node.lineno} {node.name} ({length} lines > {limit})")
    assert not too_long, "\n".join(too_long)
