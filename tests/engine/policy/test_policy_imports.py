"""The policy stays pure: no threads, sockets, event loop or llama.cpp behind it."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import skippyd.engine.policy as policy

POLICY_DIR = Path(policy.__file__).parent
BANNED_SOURCE_IMPORTS = ("threading", "asyncio", "llama_cpp", "socket",
                         "skippyd.engine.worker", "skippyd.engine.runtime")
BANNED_LOADED_MODULES = ("asyncio", "llama_cpp", "socket", "concurrent.futures",
                         "skippyd.engine.worker", "skippyd.engine.runtime")


def _imported_names(path: Path) -> set[str]:
    names: set[str] = set()
    package = "skippyd.engine.policy"
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base]) if base else ".".join(parts)
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def _is_banned(name: str, banned: tuple[str, ...]) -> bool:
    return any(name == root or name.startswith(root + ".") or name.startswith(root + "_")
               for root in banned)


def test_policy_sources_import_no_threads_sockets_loop_or_runtime():
    sources = sorted(POLICY_DIR.glob("*.py"))
    assert len(sources) >= 5
    offenders = {
        path.name: sorted(n for n in _imported_names(path) if _is_banned(n, BANNED_SOURCE_IMPORTS))
        for path in sources
    }
    assert {name: bad for name, bad in offenders.items() if bad} == {}


def test_importing_the_policy_loads_no_runtime_or_event_loop_modules():
    code = "import json, sys; import skippyd.engine.policy; print(json.dumps(sorted(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True, timeout=60)
    loaded = json.loads(result.stdout)
    assert "skippyd.engine.policy.scheduler" in loaded
    assert [m for m in loaded if _is_banned(m, BANNED_LOADED_MODULES)] == []
    project = [m for m in loaded if m.startswith("skippyd")]
    allowed = {"skippyd", "skippyd.engine"}
    assert [m for m in project
            if m not in allowed and not m.startswith("skippyd.engine.policy")] == []
