"""Names under ``skippyd/`` say which thing they mean: no module basename (apart from
``__init__.py``) and no public class name is used twice, so a name found in a traceback,
a grep or an import points at one place; and no module or subpackage is named like a
package skippyd imports, so ``gguf`` in an import means one thing.
"""

from __future__ import annotations

import ast
import sys
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


def imported_roots() -> set[str]:
    """The top-level names of every module skippyd's sources import (absolute imports)."""
    roots: set[str] = set()
    for path in sources():
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                roots.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                roots.add(node.module.split(".")[0])
    return roots - {"skippyd"}


def test_no_module_is_named_like_the_standard_library_or_a_package_it_imports() -> None:
    imported = imported_roots()
    own = {path.parent.name if path.name == "__init__.py" else path.stem
           for path in sources()} - {"skippyd"}
    clashes = own & imported
    # skippyd.http is the HTTP API; the standard library's http is never imported here, so
    # the two cannot be confused in skippyd's own imports.
    clashes |= (own & sys.stdlib_module_names) - ({"http"} - imported)
    assert sorted(clashes) == []
