"""The stage configs of a chain that a split benchmark runs on this host.

Every stage listens for its upstream neighbour on a link port of its own and dials its
downstream neighbour, directly or through a traffic shaper: shaper ``i`` forwards to
stage ``i + 1``, and the last shaper carries the return path to the final stage (the
final stage advertises it, and stage 0 dials it). Stage 0 serves HTTP on a free port.
What differs between benchmarks (the runtime keys, the model, link options such as the
activation type) is passed in as tables.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tomli_w

from skippyd.bench.process import free_port

Table = Mapping[str, Any]


def write_config(path: Path, sections: Mapping[str, Table]) -> Path:
    """Write ``sections`` (table name -> keys) to ``path`` as TOML; returns ``path``."""
    path.write_text(tomli_w.dumps({name: dict(keys) for name, keys in sections.items()}),
                    encoding="utf-8")
    return path


@dataclass(frozen=True, slots=True)
class LocalChain:
    """Where each stage of a chain on this host listens and whom it dials.

    Attributes:
        workdir: Where the configs and the control sockets go.
        bounds: ``(0, cut, ..., n_layer)``: stage ``i`` runs layers ``bounds[i]`` to
            ``bounds[i + 1]``.
        link_ports: Each stage's link port.
        secret: The link secret every stage shares.
        shaper_ports: Empty for direct links; else one per stage (see the module).
        tls_keys: A directory of the pipeline's TLS keys (``ca.crt``,
            ``stage-<i>.crt``, ``stage-<i>.key``), or None for plain links.
    """

    workdir: Path
    bounds: tuple[int, ...]
    link_ports: tuple[int, ...]
    secret: str
    shaper_ports: tuple[int, ...] = ()
    tls_keys: Path | None = None

    @classmethod
    def on_free_ports(cls, workdir: Path, bounds: Sequence[int], secret: str, *,
                      shaped: bool = False, tls_keys: Path | None = None) -> LocalChain:
        """A chain whose link (and shaper) ports are free ones of this host."""
        stages = len(bounds) - 1
        if stages < 1 or any(b <= a for a, b in zip(bounds, bounds[1:], strict=False)):
            raise ValueError(f"bounds must rise strictly (got {tuple(bounds)})")
        return cls(workdir, tuple(bounds), tuple(free_port() for _ in range(stages)), secret,
                   tuple(free_port() for _ in range(stages)) if shaped else (), tls_keys)

    @property
    def num_stages(self) -> int:
        return len(self.bounds) - 1

    def stage_id(self, i: int) -> str:
        return f"stage-{i}"

    def shaper_routes(self) -> list[tuple[int, int]]:
        """``(listen port, target port)`` of each shaper: the next stage's link port, and
        for the last shaper the final stage's (the return path)."""
        targets = [*self.link_ports[1:], self.link_ports[-1]]
        return list(zip(self.shaper_ports, targets, strict=True))

    def sections(self, i: int, *, runtime: Table, stage: Table | None = None,
                 link: Table | None = None) -> dict[str, dict[str, Any]]:
        """Stage ``i``'s config as tables; ``stage``, ``runtime`` and ``link`` add keys."""
        if not 0 <= i < self.num_stages:
            raise ValueError(f"stage {i} is not in a chain of {self.num_stages}")
        last = self.num_stages - 1
        link_keys: dict[str, Any] = {"listen": f"127.0.0.1:{self.link_ports[i]}",
                                     "secret": self.secret, **(link or {})}
        if self.tls_keys is not None:
            link_keys.update(tls=True, tls_ca=str(self.tls_keys / "ca.crt"),
                             tls_cert=str(self.tls_keys / f"stage-{i}.crt"),
                             tls_key=str(self.tls_keys / f"stage-{i}.key"))
        if i == last and self.shaper_ports:
            link_keys["advertise"] = f"127.0.0.1:{self.shaper_ports[-1]}"
        tables: dict[str, dict[str, Any]] = {
            "stage": {"id": self.stage_id(i), "index": i, **(stage or {}),
                      "layer_start": self.bounds[i], "layer_end": self.bounds[i + 1]},
            "runtime": dict(runtime),
            "control": {"socket": str(self.workdir / f"stage{i}.sock")},
            "link": link_keys,
        }
        if i == 0:
            tables["http"] = {"listen": "127.0.0.1:0"}
        else:
            tables["upstream"] = {"stage_id": self.stage_id(i - 1),
                                  "endpoint": f"127.0.0.1:{self.link_ports[i - 1]}"}
        if i < last:
            port = self.shaper_ports[i] if self.shaper_ports else self.link_ports[i + 1]
            tables["downstream"] = {"stage_id": self.stage_id(i + 1),
                                    "endpoint": f"127.0.0.1:{port}"}
        return tables

    def write(self, i: int, *, runtime: Table, stage: Table | None = None,
              link: Table | None = None) -> Path:
        """Write stage ``i``'s config to ``workdir/stage<i>.toml``; returns its path."""
        return write_config(self.workdir / f"stage{i}.toml",
                            self.sections(i, runtime=runtime, stage=stage, link=link))
