"""Each room imports only downward: checked on the sources (AST) and in a fresh interpreter.

* ``engine/policy`` is pure: the standard library and itself, no threads, sockets or loop.
* ``http``, ``link``, ``control`` and ``tui`` never import llama_cpp, directly or through
  a chain of imports.
* Nothing imports upward: the engine never reaches the HTTP API, the link, the control
  socket, the daemon, the TUI or the CLI; ``model_files`` and ``config`` reach nothing of the
  rest of skippyd; the API, link and control socket never reach the daemon, and the TUI
  sees a daemon only through the control socket.
* Inside ``http``, the rooms by concern import as the layers they are: ``parsing`` and
  ``observability`` only the shared modules beside them (``backend``, ``event_relay``,
  ``api_errors``); ``shaping`` and ``guard`` those and ``parsing`` and
  ``observability``; only ``api`` imports every room, and no room imports ``api``.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

import skippyd

PACKAGE_DIR = Path(skippyd.__file__).parent

#: Room -> module prefixes its sources must not import.
UPWARD = ("skippyd.http", "skippyd.link", "skippyd.control", "skippyd.daemon", "skippyd.tui",
          "skippyd.cli")
RULES: dict[str, tuple[str, ...]] = {
    "engine": UPWARD,
    "model_files": ("skippyd.engine", *UPWARD, "skippyd.config", "skippyd.bench", "llama_cpp"),
    "config": ("skippyd.engine", *UPWARD, "skippyd.model_files", "skippyd.bench"),
    "http": ("llama_cpp", "skippyd.daemon", "skippyd.tui", "skippyd.cli"),
    "link": ("llama_cpp", "skippyd.daemon", "skippyd.tui", "skippyd.cli"),
    "control": ("llama_cpp", "skippyd.daemon", "skippyd.tui", "skippyd.cli"),
    "tui": ("llama_cpp", "skippyd.daemon", "skippyd.http", "skippyd.link",
            "skippyd.engine.runtime", "skippyd.cli"),
}
#: Room of ``http`` -> the sibling rooms it may import (the shared modules always).
HTTP_ROOMS: dict[str, tuple[str, ...]] = {
    "parsing": (),
    "observability": (),
    "shaping": ("parsing", "observability"),
    "guard": ("parsing", "observability"),
    "api": ("parsing", "observability", "shaping", "guard"),
}
#: What the policy must not import even from the standard library.
POLICY_BANNED = ("threading", "asyncio", "socket", "llama_cpp",
                 "skippyd.engine.worker", "skippyd.engine.runtime")
#: What importing the policy must not load (the interpreter itself loads threading).
POLICY_BANNED_LOADED = ("asyncio", "socket", "concurrent.futures", "llama_cpp",
                        "skippyd.engine.worker", "skippyd.engine.runtime")
#: Importing each of these in a fresh interpreter must not load llama_cpp.
NO_LLAMA_ENTRY_POINTS = (
    "skippyd.http.api.routes", "skippyd.http.observability.metrics",
    "skippyd.link.wire", "skippyd.link.relay", "skippyd.link.listener", "skippyd.link.dialer",
    "skippyd.control.client", "skippyd.control.server",
    "skippyd.tui", "skippyd.tui.app", "skippyd.tui.status",
)


def module_name(path: Path, root: Path) -> str:
    """The dotted name of ``path``, a source file under ``root`` (a package's parent)."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_names(path: Path, root: Path) -> set[str]:
    """Every module a source file imports anywhere (lazy ones too), relative ones resolved.

    ``from a.b import c`` yields both ``a.b`` and ``a.b.c`` (``c`` may be a module).
    """
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def is_banned(name: str, banned: tuple[str, ...]) -> bool:
    return any(name == root or name.startswith(root + ".") for root in banned)


def offenders(directory: Path, root: Path, banned: tuple[str, ...]) -> dict[str, list[str]]:
    """Source files under ``directory`` that import a banned module, with what they import."""
    found = {}
    for path in sorted(directory.rglob("*.py")):
        bad = sorted(n for n in imported_names(path, root) if is_banned(n, banned))
        if bad:
            found[str(path.relative_to(root))] = bad
    return found


def non_stdlib(directory: Path, root: Path, own: str) -> dict[str, list[str]]:
    """Imports under ``directory`` that are neither the standard library nor ``own``."""
    found = {}
    for path in sorted(directory.rglob("*.py")):
        bad = sorted(n for n in imported_names(path, root)
                     if n.split(".")[0] not in sys.stdlib_module_names
                     and n != own and not n.startswith(own + "."))
        if bad:
            found[str(path.relative_to(root))] = bad
    return found


def loaded_modules(module: str) -> list[str]:
    """``sys.modules`` of a fresh interpreter after ``import module``."""
    code = f"import json, sys; import {module}; print(json.dumps(sorted(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True, timeout=60)
    return json.loads(result.stdout)


# -- the rules, on the real sources ---------------------------------------------------------

def test_every_room_has_sources() -> None:
    for room in [*RULES, "engine/policy"]:
        assert len(list((PACKAGE_DIR / room).rglob("*.py"))) >= 2, room


@pytest.mark.parametrize("room", sorted(RULES))
def test_room_imports_nothing_it_must_not(room: str) -> None:
    assert offenders(PACKAGE_DIR / room, PACKAGE_DIR.parent, RULES[room]) == {}


def test_every_http_module_sits_in_a_room_or_is_shared() -> None:
    http = PACKAGE_DIR / "http"
    shared = sorted(p.name for p in http.glob("*.py"))
    assert shared == ["__init__.py", "api_errors.py", "backend.py", "event_relay.py"]
    assert sorted(p.name for p in http.iterdir() if p.is_dir() and p.name != "__pycache__") \
        == sorted(HTTP_ROOMS)


@pytest.mark.parametrize("room", sorted(HTTP_ROOMS))
def test_http_room_imports_only_the_rooms_below_it(room: str) -> None:
    banned = tuple(f"skippyd.http.{other}" for other in HTTP_ROOMS
                   if other != room and other not in HTTP_ROOMS[room])
    assert offenders(PACKAGE_DIR / "http" / room, PACKAGE_DIR.parent, banned) == {}


def test_policy_sources_import_only_the_standard_library() -> None:
    policy = PACKAGE_DIR / "engine" / "policy"
    assert non_stdlib(policy, PACKAGE_DIR.parent, "skippyd.engine.policy") == {}
    assert offenders(policy, PACKAGE_DIR.parent, POLICY_BANNED) == {}


def test_importing_the_policy_loads_no_runtime_or_event_loop_modules() -> None:
    loaded = loaded_modules("skippyd.engine.policy")
    assert "skippyd.engine.policy.scheduler" in loaded
    assert [m for m in loaded if is_banned(m, POLICY_BANNED_LOADED)] == []
    project = [m for m in loaded if m.startswith("skippyd")]
    assert [m for m in project if m not in {"skippyd", "skippyd.engine"}
            and not m.startswith("skippyd.engine.policy")] == []


@pytest.mark.parametrize("module", NO_LLAMA_ENTRY_POINTS)
def test_importing_a_client_side_room_does_not_load_llama_cpp(module: str) -> None:
    loaded = loaded_modules(module)
    assert module in loaded
    assert [m for m in loaded if is_banned(m, ("llama_cpp",))] == []


# -- the checks themselves can fail ---------------------------------------------------------

def test_the_source_check_finds_banned_imports_of_every_form(tmp_path: Path) -> None:
    room = tmp_path / "pkg" / "engine"
    (room / "sub").mkdir(parents=True)
    (room / "__init__.py").write_text("")
    (room / "sub" / "__init__.py").write_text("from ...http import routes\n")
    (room / "top.py").write_text("import llama_cpp.llama_cpp as L\n")
    (room / "lazy.py").write_text("def f():\n    from pkg.daemon.lifecycle import run\n")
    (room / "clean.py").write_text("import json\nfrom pkg.engine import sub\n")
    banned = ("pkg.http", "pkg.daemon", "llama_cpp")
    assert offenders(room, tmp_path, banned) == {
        "pkg/engine/lazy.py": ["pkg.daemon.lifecycle", "pkg.daemon.lifecycle.run"],
        "pkg/engine/sub/__init__.py": ["pkg.http", "pkg.http.routes"],
        "pkg/engine/top.py": ["llama_cpp.llama_cpp"],
    }


def test_the_stdlib_check_finds_a_third_party_import(tmp_path: Path) -> None:
    room = tmp_path / "pkg" / "policy"
    room.mkdir(parents=True)
    (room / "ok.py").write_text("from __future__ import annotations\nimport dataclasses\n"
                                "from . import other\nfrom pkg.policy.other import x\n")
    (room / "bad.py").write_text("import numpy as np\n")
    assert non_stdlib(room, tmp_path, "pkg.policy") == {"pkg/policy/bad.py": ["numpy"]}


def test_the_fresh_interpreter_check_sees_llama_cpp_when_it_is_loaded() -> None:
    loaded = loaded_modules("skippyd.engine.runtime.llama")
    assert [m for m in loaded if is_banned(m, ("llama_cpp",))] != []
