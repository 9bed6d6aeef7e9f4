"""Small C helpers compiled at run time, once per process, with a Python fallback.

Building llama-cpp-python needs a C compiler, so one is there wherever skippyd was
installed from source. A few hot spots that Python pays for on every graph node or every
sampled token are compiled here into a private shared library the first time they are
needed (:mod:`~skippyd.engine.runtime.capture_native`,
:mod:`~skippyd.engine.runtime.greedy_native`). When the compiler is missing or fails,
:class:`CompiledOnce` remembers why, logs it once, and callers take their Python path.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Generic, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")


def build_shared_library(source: str, library: Path, *, link: Sequence[str] = ()) -> Path:
    """Compile C ``source`` into the shared library ``library`` with the system compiler
    (``$CC``, else ``cc`` or ``gcc``); the source file goes beside it.

    Args:
        source: The C source text.
        library: Where the ``.so`` goes.
        link: Extra linker arguments (``-ldl``).

    Raises:
        OSError: No C compiler, or it failed.
    """
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise OSError("no C compiler (cc) found")
    source_path = library.with_suffix(".c")
    source_path.write_text(source, encoding="utf-8")
    result = subprocess.run([compiler, "-O2", "-shared", "-fPIC", "-o", str(library),
                             str(source_path), *link],
                            capture_output=True, text=True, timeout=60, check=False)
    if result.returncode != 0:
        raise OSError(f"{compiler} failed: {result.stderr.strip()[:400]}")
    return library


class CompiledOnce(Generic[T]):
    """The result of ``build`` (run on first use, thread-safe), or None if it failed.

    Args:
        build: Compiles and loads the helper; raises OSError or SubprocessError.
        what: The helper, for the log line (``"native greedy pick"``).
        without: What callers do instead, for the log line (``"picking with numpy"``).
        level: Log level of that line.
    """

    def __init__(self, build: Callable[[], T], what: str, without: str,
                 level: int = logging.INFO) -> None:
        self._build = build
        self._what = what
        self._without = without
        self._level = level
        self._lock = threading.Lock()
        self._result: T | None = None
        self.unavailable: str | None = None
        """Why the build failed, once it did."""

    def get(self) -> T | None:
        """The built helper, or None when it cannot be built (tried once per process)."""
        with self._lock:
            if self._result is None and self.unavailable is None:
                try:
                    self._result = self._build()
                except (OSError, subprocess.SubprocessError) as exc:
                    self.unavailable = str(exc)
                    logger.log(self._level, "%s unavailable (%s); %s", self._what, exc,
                               self._without)
            return self._result

    def forget(self) -> None:
        """Build again at the next :meth:`get` (tests change the compiler)."""
        with self._lock:
            self._result = None
            self.unavailable = None
