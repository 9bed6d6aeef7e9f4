"""Names under ``skippyd/`` say which thing they mean: no module basename (apart from
``__init__.py``) and no public class name is used twice, so a name found in a traceback,
a grep or an import points at one place."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import skippyd

PACKAGE_DIR = Path(skippyd.__file__).parent


def sources() -> list[Path]:
    return sorted(PACKAGE_DIR.rglob("*.py"))


def repeated(where: dict[str, list[str]]) -> dict[str, list[str]]:
    return {name: paths for name, paths in sorted(where.items()) if len(paths) > 1}


def test_no_module_basename_appears_twice() -> None:
    where: dict[str, list[str]] = defaultdict(list)
    for path in sources():
        if path.name != "__init__.py":
            where[path.name].append(str(path.relative_to(PACKAGE_DIR)))
    assert repeated(where) == {}


def test_no_public_class_name_is_defined_twice() -> None:
    where: dict[str, list[str]] = defaultdict(list)
    for path in sources():
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                where[node.name].append(f"{path.relative_to(PACKAGE_DIR)}:{node.lineno}")
    assert repeated(where) == {}
