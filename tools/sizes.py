"""The longest classes and functions of a package, by lines: ``python tools/sizes.py [opwatch] [N]``.

Issue 17 asks for units one can hold in one's head; this prints the N longest (default 10) so a
change can say what it did to them. Methods are counted inside their class and on their own.
"""

from __future__ import annotations

import ast
import pathlib
import sys


def units(package: pathlib.Path):
    for path in sorted(package.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                yield node.end_lineno - node.lineno + 1, f"{path.relative_to(package.parent)}:{node.lineno}", node.name


def main(argv: list[str]) -> None:
    package = pathlib.Path(argv[0] if argv else "opwatch")
    count = int(argv[1]) if len(argv) > 1 else 10
    for lines, where, name in sorted(units(package), reverse=True)[:count]:
        print(f"{lines:5d}  {name:32s} {where}")


if __name__ == "__main__":
    main(sys.argv[1:])
