"""Rules that span several keys of one config, and of the configs of a pipeline.

Each rule skips keys already reported bad (:meth:`IssueCollector.clean`), so one
mistake gives one message.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Sequence
from itertools import pairwise
from pathlib import Path

from skippyd.config.errors import ConfigError, IssueCollector
from skippyd.config.schema import (
    MAX_SOCKET_PATH_BYTES,
    UNQUANTIZED_CACHE_TYPES,
    LinkSection,
    PeerConfig,
    RuntimeSection,
    StageConfig,
    parse_host_port,
)

logger = logging.getLogger(__name__)

_WILDCARD_HOSTS = frozenset({"0.0.0.0", "::"})


def check_rules(config: StageConfig, present: set[str], issues: IssueCollector) -> None:
    """Apply every cross-field rule to ``config``.

    Args:
        config: The tree built from the valid keys (bad keys hold their defaults).
        present: The sections the input named.
        issues: Receives the problems; keys already in ``issues.bad`` are skipped.
    """
    for rule in (_layer_rules, _runtime_rules, _http_rules, _peer_rules, _link_rules,
                 _control_rules, _metrics_rules, _speculative_rules):
        rule(config, present, issues)


def _speculative_rules(config: StageConfig, present: set[str],
                       issues: IssueCollector) -> None:
    spec = config.speculative
    if (issues.clean("speculative.min_draft", "speculative.max_draft")
            and spec.min_draft > spec.max_draft):
        issues.add("speculative.min_draft", f"must be at most max_draft "
                   f"(got {spec.min_draft} > {spec.max_draft})")
    if (issues.clean("speculative.mode", "speculative.draft_model_path")
            and spec.mode == "draft" and spec.draft_model_path is None):
        issues.add("speculative.draft_model_path", 'required with mode = "draft"')


def _layer_rules(config: StageConfig, present: set[str], issues: IssueCollector) -> None:
    stage = config.stage
    if (stage.layer_end is not None and issues.clean("stage.layer_start", "stage.layer_end")
            and stage.layer_end <= stage.layer_start):
        issues.add("stage.layer_end", f"must be greater than layer_start "
                   f"(got {stage.layer_end} <= {stage.layer_start})")
    if not issues.clean("stage.index", "stage.layer_start"):
        return
    if stage.index == 0 and stage.layer_start > 0:
        issues.add("stage.layer_start",
                   f"must be 0 when stage.index is 0 (got {stage.layer_start})")
    elif stage.index > 0 and stage.layer_start == 0:
        issues.add("stage.layer_start", f"must be greater than 0 when stage.index is "
                   f"{stage.index} (only stage 0 starts at layer 0)")


def _runtime_rules(config: StageConfig, present: set[str], issues: IssueCollector) -> None:
    runtime = config.runtime
    if issues.clean("runtime.n_batch", "runtime.n_ubatch") and runtime.n_ubatch > runtime.n_batch:
        issues.add("runtime.n_ubatch",
                   f"must be at most n_batch (got {runtime.n_ubatch} > {runtime.n_batch})")
    # NOTE: llama.cpp refuses a quantized V cache without flash attention.
    if (issues.clean("runtime.cache_type_v", "runtime.flash_attn")
            and runtime.flash_attn == "disabled"
            and runtime.cache_type_v not in UNQUANTIZED_CACHE_TYPES):
        issues.add("runtime.cache_type_v", "a quantized V cache needs flash attention "
                   f'(got "{runtime.cache_type_v}" with flash_attn = "disabled")')


def _http_rules(config: StageConfig, present: set[str], issues: IssueCollector) -> None:
    stage = config.stage
    if ("http" in present and not stage.is_first
            and issues.clean("stage.index", "stage.layer_start")):
        issues.add("http", f"only the first stage serves HTTP (stage.index {stage.index}, "
                   f"layer_start {stage.layer_start}); remove [http]")
    http = config.http
    if http is None:
        return
    room = config.runtime.session_tokens
    if (issues.clean("http.max_prompt_tokens", "runtime.ctx_size", "runtime.lane_count")
            and http.max_prompt_tokens is not None and room is not None
            and http.max_prompt_tokens > room):
        issues.add("http.max_prompt_tokens", "must be at most what one request may hold "
                   f"(got {http.max_prompt_tokens} > {room})")
    if (issues.clean("http.default_max_tokens", "http.max_tokens_limit")
            and http.default_max_tokens is not None
            and http.default_max_tokens > http.max_tokens_limit):
        issues.add("http.default_max_tokens", f"must be at most max_tokens_limit "
                   f"(got {http.default_max_tokens} > {http.max_tokens_limit})")
    if (http.protocol == "httptools" and issues.clean("http.protocol")
            and importlib.util.find_spec("httptools") is None):
        issues.add("http.protocol", '"httptools" is not installed (pip install httptools), '
                   'or use "h11"')
    if issues.clean("http.chat_template_file") and http.chat_template_file is not None:
        problem = _template_problem(http.chat_template_file)
        if problem is not None:
            issues.add("http.chat_template_file", problem)


def _template_problem(path: str) -> str | None:
    """Why a chat template file cannot be used, or None."""
    import jinja2  # only configs that name a template pay for the import

    try:
        source = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        return f"cannot read {path}: {exc}"
    try:
        jinja2.Environment().parse(source)
    except jinja2.TemplateSyntaxError as exc:
        return f"{path} is not a valid Jinja template: line {exc.lineno}: {exc.message}"
    return None


def _peer_rules(config: StageConfig, present: set[str], issues: IssueCollector) -> None:
    stage = config.stage
    if issues.clean("stage.index", "stage.layer_start", "upstream"):
        if not stage.is_first and config.upstream is None:
            issues.add("upstream", "required on a stage after the first "
                       f"(stage.index {stage.index}, layer_start {stage.layer_start})")
        elif stage.is_first and config.upstream is not None:
            issues.add("upstream", "not allowed on the first stage (stage.index 0, "
                       "layer_start 0)")
        elif config.upstream is not None:
            _peer_index_rule("upstream", config.upstream, stage.index - 1, "- 1", issues)
    if config.downstream is not None:
        _peer_index_rule("downstream", config.downstream, stage.index + 1, "+ 1", issues)
        if stage.layer_end is None and issues.clean("stage.layer_end"):
            issues.add("stage.layer_end", "required when [downstream] is set "
                       "(the next stage owns the layers after it)")
    for name, peer in (("upstream", config.upstream), ("downstream", config.downstream)):
        if (peer is not None and peer.stage_id == stage.id
                and issues.clean(f"{name}.stage_id", "stage.id")):
            issues.add(f"{name}.stage_id", f'must differ from stage.id (both "{stage.id}")')


def _peer_index_rule(
    name: str, peer: PeerConfig, expected: int, offset: str, issues: IssueCollector
) -> None:
    if issues.clean(f"{name}.stage_index", "stage.index") and peer.stage_index != expected:
        issues.add(f"{name}.stage_index",
                   f"must be stage.index {offset} = {expected} (got {peer.stage_index})")


def _link_rules(config: StageConfig, present: set[str], issues: IssueCollector) -> None:
    link = config.link
    if (present & {"upstream", "downstream"} and link.secret is None
            and issues.clean("link.secret")):
        issues.add("link.secret", "required when [upstream] or [downstream] is set")
    if (not config.is_first and link.listen is None
            and issues.clean("link.listen", "stage.index", "stage.layer_start")):
        issues.add("link.listen", "required on a stage after the first "
                   "(the upstream stage connects to it)")
    if link.advertise is not None and not config.is_final and issues.clean("link.advertise"):
        issues.add("link.advertise", "only the final stage announces a return endpoint "
                   "(stage 0 dials it for predictions)")
    if (config.http is not None and link.listen is not None
            and issues.clean("link.listen", "http.listen")):
        port = parse_host_port(link.listen)[1]
        if port != 0 and port == config.http.address[1]:
            issues.add("link.listen", f"must use another port than http.listen "
                       f"(both use {port})")
    _tls_rules(link, issues)


_TLS_FILE_KEYS = ("tls_ca", "tls_cert", "tls_key")


def _tls_rules(link: LinkSection, issues: IssueCollector) -> None:
    """``link.tls`` needs its three files, and they are no use without it.

    Whether the files hold what they should is checked with the model
    (``skippyd.link.tls.check_tls_files``): that needs the ``cryptography`` package.
    """
    for name in _TLS_FILE_KEYS:
        key, path = f"link.{name}", getattr(link, name)
        if not issues.clean(key, "link.tls"):
            continue
        if link.tls and path is None:
            issues.add(key, "required when link.tls = true (skippyd link keygen writes the "
                            "pipeline's certificates)")
        elif not link.tls and path is not None:
            issues.add(key, "set, but link.tls is false: the link would run without TLS; "
                            "set link.tls = true, or remove it")
        elif path is not None and not os.path.isfile(path):
            issues.add(key, f"file not found: {path}")


def _control_rules(config: StageConfig, present: set[str], issues: IssueCollector) -> None:
    size = len(os.fsencode(config.control.socket))
    if size > MAX_SOCKET_PATH_BYTES and issues.clean("control.socket", "stage.id"):
        issues.add("control.socket", f"must be at most {MAX_SOCKET_PATH_BYTES} bytes for a "
                   f"Unix socket (got {size}); set a shorter path")


def _metrics_rules(config: StageConfig, present: set[str], issues: IssueCollector) -> None:
    listen = config.telemetry.metrics_listen
    if listen is None or not issues.clean("telemetry.metrics_listen"):
        return
    port = parse_host_port(listen)[1]
    others = {"http.listen": config.http.listen if config.http is not None else None,
              "link.listen": config.link.listen}
    for key, other in others.items():
        if port != 0 and other is not None and issues.clean(key) \
                and parse_host_port(other)[1] == port:
            issues.add("telemetry.metrics_listen",
                       f"must use another port than {key} (both use {port})")


def check_pipeline(configs: Sequence[StageConfig]) -> None:
    """Check that stage configs, listed in pipeline order, chain into one pipeline.

    Issue keys are prefixed with the stage's position: ``stages[1].stage.layer_start``.

    Args:
        configs: Each stage's validated config, stage 0 first.

    Raises:
        ConfigError: Indexes, layer ranges, peers, endpoints, secrets or model ids do
            not line up, or a later stage has fewer lanes, a smaller context, less room
            per session (``ctx_size / lane_count``) or a smaller ``n_batch`` than stage 0
            (stage 0 would refuse that chain).
        ValueError: ``configs`` is empty.
    """
    if not configs:
        raise ValueError("check_pipeline needs at least one stage config")
    issues = IssueCollector()
    for position, config in enumerate(configs):
        if config.stage.index != position:
            issues.add(f"stages[{position}].stage.index",
                       f"must be {position} (got {config.stage.index})")
    last = len(configs) - 1
    if configs[-1].downstream is not None:
        issues.add(f"stages[{last}].downstream", "the last stage must have no [downstream]")
    for position, (before, after) in enumerate(pairwise(configs)):
        _check_hop(position, before, after, issues)
    head = configs[0].runtime
    for position, config in enumerate(configs[1:], start=1):
        for name in ("lane_count", "ctx_size", "n_batch"):
            have, need = getattr(config.runtime, name), getattr(head, name)
            if have is not None and need is not None and have < need:
                # Every stage holds every session of stage 0, and a batch crosses the
                # chain whole: stage 0 refuses a chain that cannot carry its own load.
                issues.add(f"stages[{position}].runtime.{name}",
                           f"must be at least stages[0].runtime.{name} = {need} (got {have})")
        _check_session_room(position, head, config.runtime, issues)
    if issues:
        raise ConfigError(issues.items, "<pipeline>")


def _check_session_room(position: int, head: RuntimeSection, runtime: RuntimeSection,
                        issues: IssueCollector) -> None:
    """Every stage holds every session of stage 0: a later stage must give a session at
    least the room stage 0 does (the whole pool when unified, ``ctx_size / lane_count``
    per lane)."""
    have, need = runtime.session_tokens, head.session_tokens
    key = f"stages[{position}].runtime.ctx_size"
    if have is not None and need is not None and have < need and issues.clean(key):
        issues.add(key, f"{have} tokens per session ({runtime.kv_layout} layout, ctx_size "
                        f"{runtime.ctx_size}, {runtime.lane_count} lanes) must be at least "
                        f"stage 0's {need}")


def _check_hop(i: int, before: StageConfig, after: StageConfig, issues: IssueCollector) -> None:
    j = i + 1
    if before.stage.layer_end != after.stage.layer_start:
        issues.add(f"stages[{j}].stage.layer_start", f"must equal stages[{i}].stage.layer_end "
                   f"(got {after.stage.layer_start}, expected {before.stage.layer_end})")
    if before.stage.model_id != after.stage.model_id:
        issues.add(f"stages[{j}].stage.model_id", f'must equal stages[{i}].stage.model_id '
                   f'(got "{after.stage.model_id}", expected "{before.stage.model_id}")')
    if before.link.secret != after.link.secret:
        issues.add(f"stages[{j}].link.secret", f"must equal stages[{i}].link.secret")
    if before.link.tls != after.link.tls:
        issues.add(f"stages[{j}].link.tls", f"must equal stages[{i}].link.tls: every stage "
                   "of a pipeline runs its links with TLS, or none does")
    elif before.link.tls and not _same_ca(before.link.tls_ca, after.link.tls_ca):
        issues.add(f"stages[{j}].link.tls_ca", f"is not the CA of stages[{i}].link.tls_ca: "
                   "every stage must trust the same pipeline CA")
    _check_peer(f"stages[{i}].downstream", before.downstream, after, f"stages[{j}]", issues)
    _check_peer(f"stages[{j}].upstream", after.upstream, before, f"stages[{i}]", issues,
                dialled=False)


def _check_peer(
    key: str, peer: PeerConfig | None, target: StageConfig, label: str, issues: IssueCollector,
    *, dialled: bool = True,
) -> None:
    """``peer`` must name ``target``; a peer that is dialled must reach its link.listen.

    NOTE: nothing dials an ``[upstream]`` peer (each stage dials downstream), so a
    stage 0 without ``link.listen`` is fine; when it listens, the endpoint must match.
    """
    if peer is None:
        issues.add(key, f"missing; {label} ({target.stage.id}) is next to it")
        return
    if peer.stage_id != target.stage.id:
        issues.add(f"{key}.stage_id", f'must be "{target.stage.id}" (got "{peer.stage_id}")')
    listen = target.link.listen
    if listen is None:
        if dialled:
            issues.add(f"{key}.endpoint", f"{label} has no link.listen for it to reach")
    elif not _reaches(peer.endpoint, listen):
        issues.add(f"{key}.endpoint", f'must reach {label}.link.listen "{listen}" '
                   f'(got "{peer.endpoint}")')


def _reaches(endpoint: str, listen: str) -> bool:
    """Whether a peer dialling ``endpoint`` reaches a socket bound to ``listen``.

    Hosts are compared as written; a wildcard listen host matches any.
    """
    host, port = parse_host_port(endpoint)
    listen_host, listen_port = parse_host_port(listen)
    return port == listen_port and (listen_host in _WILDCARD_HOSTS or host == listen_host)


def _same_ca(first: str | None, second: str | None) -> bool:
    """Whether two CA files hold the same certificate (True when either is unreadable:
    the stage's own check reports that)."""
    if first is None or second is None or first == second:
        return True
    try:
        return _der(first) == _der(second)
    except (OSError, ValueError):
        return True


def _der(path: str) -> bytes:
    import ssl  # only pipelines with link.tls pay for the import

    return ssl.PEM_cert_to_DER_cert(Path(path).read_text(encoding="ascii"))
