#!/usr/bin/env python3
"""Issue 40's code measures of a source tree: capability probes, module and class sizes.

  python tools/code_measures.py            this checkout
  python tools/code_measures.py DIR        another tree (e.g. `git archive REV | tar -x -C DIR`)

Counted over runtime/outrider and plugins (tests and tools aside): calls of getattr/hasattr (what
stands for a contract among them is read by hand: see docs/ARCHITECTURE.md's contracts table),
modules over 400 and over 500 lines, and classes over 300 lines, largest first.
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PARTS = ("runtime/outrider", "plugins")


def measure(tree: Path) -> dict:
    probes, modules, classes = 0, [], []
    for part in PARTS:
        for path in sorted((tree / part).rglob("*.py")):
            source = path.read_text()
            parsed = ast.parse(source)
            for node in ast.walk(parsed):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr",
                                                                                                       "hasattr"):
                    probes += 1
                elif isinstance(node, ast.ClassDef):
                    classes.append((node.end_lineno - node.lineno + 1, f"{path.relative_to(tree)}:{node.name}"))
            modules.append((source.count("\n"), str(path.relative_to(tree))))
    return {"probes": probes, "modules": sorted(modules, reverse=True), "classes": sorted(classes, reverse=True)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("tree", nargs="?", type=Path, default=ROOT)
    args = parser.parse_args()
    found = measure(args.tree)
    print(f"getattr/hasattr calls: {found['probes']}")
    print(f"modules over 500 lines: {sum(n > 500 for n, _ in found['modules'])}, "
          f"over 400: {sum(n > 400 for n, _ in found['modules'])}")
    for lines, name in found["modules"]:
        if lines > 400:
            print(f"  {lines:5d}  {name}")
    print("classes over 300 lines:")
    for lines, name in found["classes"]:
        if lines > 300:
            print(f"  {lines:5d}  {name}")


if __name__ == "__main__":
    main()
