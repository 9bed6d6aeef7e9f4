"""Helpers for the split-serving tests: stage configs and a chain of real processes.

A module of its own (not conftest) so tests import it by a name no other test
directory uses.
"""

from __future__ import annotations

import contextlib
import socket
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
from openai import OpenAI

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
from serve_process import ServeProcess  # noqa: E402

from skippyd.link.dialer import query_status  # noqa: E402
from skippyd.link.keys import write_pipeline_keys  # noqa: E402
from skippyd.link.tls import LinkTls, TlsFiles  # noqa: E402

SECRET = "link-tests-shared-secret-0123456789"
N_UBATCH = 32
LANES = 4
STAGE_READY = r"skippyd stage \S+ serving layers \S+ on link \S+"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    """Re-check ``predicate`` every 50 ms until it holds; fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)


def runtime_section(slice_dir: Path, threads: int) -> str:
    # NOTE: one llama.cpp thread per process: worker threads spin at barriers, and on a
    # busy two-core test machine a two-thread server can stall for seconds. Thread
    # count does not change the arithmetic, so outputs still compare bit for bit.
    return f"""
[runtime]
ctx_size = 8192
lane_count = {LANES}
n_ubatch = {N_UBATCH}
threads = {threads}
threads_batch = {threads}
slice_cache_dir = "{slice_dir}"
"""


def tiny_stage(model, workdir, *, index: int, layers: tuple[int, int], n_batch: int,
               ports: list[int], lanes: int = 2, kv_layout: str = "unified") -> str:
    """Stage ``index`` of a 2-stage chain of the suite's tiny model.

    Slices go to ``workdir/slices`` and the control socket is ``workdir/tiny<index>.sock``.
    """
    text = (f'[stage]\nid = "tiny-{index}"\nindex = {index}\nmodel_path = "{model}"\n'
            f"layer_start = {layers[0]}\nlayer_end = {layers[1]}\n"
            f"[runtime]\nctx_size = 512\nlane_count = {lanes}\nthreads = 1\nthreads_batch = 1\n"
            f'n_batch = {n_batch}\nn_ubatch = 32\nkv_layout = "{kv_layout}"\n'
            f'slice_cache_dir = "{workdir / "slices"}"\n'
            f'[link]\nlisten = "127.0.0.1:{ports[index]}"\nsecret = "{SECRET}"\n'
            f'[control]\nsocket = "{workdir / f"tiny{index}.sock"}"\n')
    if index == 0:
        return text + (f'[http]\nlisten = "127.0.0.1:0"\n[downstream]\nstage_id = "tiny-1"\n'
                       f'endpoint = "127.0.0.1:{ports[1]}"\n')
    return text + f'[upstream]\nstage_id = "tiny-0"\nendpoint = "127.0.0.1:{ports[0]}"\n'


@contextlib.contextmanager
def tiny_chain(model, workdir: Path, *,
               n_batch: tuple[int, int] = (128, 128),
               lanes: tuple[int, int] = (2, 2),
               env: tuple[dict[str, str] | None, dict[str, str] | None] = (None, None),
               kv_layout: str = "unified") -> Iterator[tuple[ServeProcess, ...]]:
    """Stages 0 (layers 0-2, HTTP) and 1 (layers 2-4) of the tiny model, both started
    (``env``: each one's environment); yields (head, later) once each printed its ready
    line, stops both afterwards."""
    ports = [free_port(), free_port()]
    procs = []
    try:
        for index, layers in reversed(list(enumerate([(0, 2), (2, 4)]))):
            directory = workdir / f"s{index}"
            directory.mkdir()
            procs.append(ServeProcess(tiny_stage(model, workdir, index=index, layers=layers,
                                                 n_batch=n_batch[index], ports=ports,
                                                 lanes=lanes[index], kv_layout=kv_layout),
                                      directory, env=env[index]))
        later, head = procs
        later.wait_for_line(STAGE_READY, timeout=60)
        head.wait_ready()
        yield head, later
    finally:
        for proc in reversed(procs):
            proc.stop()


class Chain:
    """A split pipeline of ``len(bounds) - 1`` stage processes.

    ``tls``: every link runs TLS, with keys made for the chain in ``workdir/tls`` (and
    one for the tests' own STATUS queries, ``monitor``). ``max_chains``: each later
    stage's ``link.max_chains`` (2 lets the abuse tests dial a chain beside stage 0's;
    1 is the default of a real stage).
    """

    def __init__(self, bounds: tuple[int, ...], workdir: Path, slice_dir: Path, *,
                 tls: bool = False, max_chains: int = 2) -> None:
        self.bounds = bounds
        self.max_chains = max_chains
        self.workdir = workdir
        self.slice_dir = slice_dir
        self.ports = [free_port() for _ in bounds[:-1]]
        self.stages: list[ServeProcess | None] = [None] * (len(bounds) - 1)
        self.keys: Path | None = None
        self.monitor: LinkTls | None = None
        if tls:
            self.keys = workdir / "tls"
            write_pipeline_keys(self.keys, [*(f"stage-{i}" for i in range(len(self.ports))),
                                            "monitor"])
            self.monitor = self.tls_of("monitor")

    def tls_of(self, stage_id: str) -> LinkTls:
        """The TLS settings of ``stage_id``'s certificate of this chain's CA."""
        assert self.keys is not None
        return LinkTls(TlsFiles(self.keys / "ca.crt", self.keys / f"{stage_id}.crt",
                                self.keys / f"{stage_id}.key"), stage_id)

    def config(self, i: int) -> str:
        last = len(self.ports) - 1
        text = (f'[stage]\nid = "stage-{i}"\nindex = {i}\nlayer_start = {self.bounds[i]}\n'
                f"layer_end = {self.bounds[i + 1]}\n")
        text += runtime_section(self.slice_dir, threads=1)
        if i == 0:
            text += '[http]\nlisten = "127.0.0.1:0"\n'
        text += f'[link]\nlisten = "127.0.0.1:{self.ports[i]}"\nsecret = "{SECRET}"\n'
        if self.keys is not None:
            text += (f'tls = true\ntls_ca = "{self.keys / "ca.crt"}"\n'
                     f'tls_cert = "{self.keys / f"stage-{i}.crt"}"\n'
                     f'tls_key = "{self.keys / f"stage-{i}.key"}"\n')
        text += f"max_chains = {self.max_chains}\n"
        text += f'[control]\nsocket = "{self.workdir / f"stage{i}.sock"}"\n'
        if i > 0:
            text += (f'[upstream]\nstage_id = "stage-{i - 1}"\n'
                     f'endpoint = "127.0.0.1:{self.ports[i - 1]}"\n')
        if i < last:
            text += (f'[downstream]\nstage_id = "stage-{i + 1}"\n'
                     f'endpoint = "127.0.0.1:{self.ports[i + 1]}"\n')
        return text

    def launch(self, i: int) -> ServeProcess:
        workdir = self.workdir / f"stage{i}"
        workdir.mkdir(exist_ok=True)
        self.stages[i] = ServeProcess(self.config(i), workdir)
        return self.stages[i]

    def start(self) -> Chain:
        for i in reversed(range(len(self.stages))):
            self.launch(i)
        for i, proc in enumerate(self.stages):
            if i == 0:
                proc.wait_ready()
            else:
                proc.wait_for_line(STAGE_READY, timeout=120)
        self.wait_healthy()
        return self

    @property
    def head(self) -> ServeProcess:
        return self.stages[0]

    def health(self) -> dict:
        return httpx.get(self.head.base_url + "/health", timeout=5).json()

    def wait_healthy(self, timeout: float = 30) -> None:
        wait_until(lambda: self.health()["status"] == "ok", timeout, "the pipeline to connect")

    def status(self, i: int) -> dict:
        return query_status(("127.0.0.1", self.ports[i]), SECRET.encode(), tls=self.monitor)

    def client(self) -> OpenAI:
        return OpenAI(base_url=self.head.url, api_key="unused", max_retries=0, timeout=60)

    def stop(self) -> None:
        for proc in self.stages:
            if proc is not None:
                proc.stop()
