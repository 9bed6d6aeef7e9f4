"""The ``skippyd`` command line: serve, config, model, link, bench, top, status.

Commands stay thin: they build a config, call one library function and map typed errors
to an exit code (:class:`skippyd.exitcodes.ExitCode`) with a message on stderr. Heavy
imports (llama.cpp, uvicorn, Textual,
httpx) happen inside the commands, so ``skippyd --help``, shell completion and
``skippyd config check`` stay fast. Messages are printed verbatim: text from a config or
a path is escaped for Rich (``[downstream]`` is not markup) and never hard-wrapped.
"""

from __future__ import annotations

import contextlib
import json
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from skippyd import __version__
from skippyd.bench.command import app as bench_app
from skippyd.checks import check_config_file
from skippyd.config import ConfigError, StageConfig, config_to_dict, example_config_toml
from skippyd.exitcodes import ExitCode
from skippyd.logs import journal_stream

if TYPE_CHECKING:
    from rich.progress import Progress

    from skippyd.split_plan import ModelCosts, Work

app = typer.Typer(
    help="skippyd: a llama.cpp stage daemon with continuous batching and an OpenAI API.",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
)
config_app = typer.Typer(help="Write, check and show stage configs.", no_args_is_help=True)
model_app = typer.Typer(help="Inspect, slice and synthesize GGUF models.", no_args_is_help=True)
link_app = typer.Typer(help="The stage link of a split pipeline: TLS keys.", no_args_is_help=True)
app.add_typer(config_app, name="config")
app.add_typer(model_app, name="model")
app.add_typer(link_app, name="link")
app.add_typer(bench_app)  # no name: `skippyd bench` is a top-level command

# NOTE: soft_wrap: a message piped to a file or the journal keeps its lines whole.
stdout = Console(soft_wrap=True)
stderr = Console(stderr=True, soft_wrap=True)

ConfigPath = Annotated[
    Path, typer.Argument(help="Stage config (TOML).", envvar="SKIPPYD_CONFIG", show_default=False)
]
JsonFlag = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]


def fail(message: str, code: ExitCode = ExitCode.FAILURE) -> typer.Exit:
    """Print ``message`` (plain text, not markup) on stderr and return the Exit to raise.

    Under systemd every line carries the error priority, so ``journalctl -p err`` shows
    why a service did not start.
    """
    if journal_stream(sys.stderr):
        for line in f"error: {message}".splitlines():
            print(f"<3>{line}", file=sys.stderr, flush=True)
    else:
        stderr.print(f"[bold red]error:[/] {escape(message)}", highlight=False)
    return typer.Exit(code)


def load_checked_config(path: Path | None, *, size_context: bool = True,
                        **overrides) -> StageConfig:
    """Load (or default) a config, apply CLI overrides and check it against its model."""
    from skippyd.model_files.model_info import ModelFileError

    try:
        return check_config_file(path, size_context=size_context, **overrides)
    except ConfigError as exc:
        raise fail(f"invalid config {exc.source or ''}\n{exc}", ExitCode.CONFIG) from None
    except ModelFileError as exc:
        raise fail(str(exc), ExitCode.MODEL) from None


@app.callback(invoke_without_command=True)
def main_callback(
    version: Annotated[bool, typer.Option("--version", help="Print the version and exit.")] = False,
) -> None:
    """skippyd: serve GGUF models with llama.cpp, one layer range per process."""
    if version:
        stdout.print(f"skippyd {__version__}")
        raise typer.Exit()


# -- serve -----------------------------------------------------------------------------
@app.command()
def serve(
    config: Annotated[Path | None, typer.Option("--config", "-c", envvar="SKIPPYD_CONFIG",
                                                help="Stage config (TOML); default: the embedded model.")] = None,
    listen: Annotated[str | None, typer.Option(help="HTTP host:port (overrides http.listen).")] = None,
    api_key: Annotated[str | None, typer.Option(envvar="SKIPPYD_API_KEY",
                                                help="Bearer key clients must send.")] = None,
    model: Annotated[Path | None, typer.Option(help="GGUF model (overrides stage.model_path).")] = None,
    ctx_size: Annotated[int | None, typer.Option(help="KV cell pool size in tokens.")] = None,
    lanes: Annotated[int | None, typer.Option(help="Concurrent sequences (runtime.lane_count).")] = None,
    threads: Annotated[int | None, typer.Option(help="CPU threads for llama.cpp.")] = None,
    log_level: Annotated[str | None, typer.Option(help="debug, info, warning or error.")] = None,
    chat_template_file: Annotated[Path | None, typer.Option(
        help="Jinja chat template to use instead of the model's (http.chat_template_file).")] = None,
) -> None:
    """Serve a model (or a layer range of one) behind an OpenAI-compatible API."""
    from skippyd.daemon.lifecycle import run_daemon
    from skippyd.logs import configure_logging

    stage = load_checked_config(config, size_context=False, listen=listen, api_key=api_key, model_path=model,
                                ctx_size=ctx_size, lane_count=lanes, threads=threads,
                                log_level=log_level, chat_template_file=chat_template_file)
    configure_logging(stage.telemetry.log_level, stage.telemetry.log_format)
    raise typer.Exit(run_daemon(stage))


# -- watching a daemon -----------------------------------------------------------------
SocketOption = Annotated[Path | None, typer.Option("--socket", help="Daemon control socket.")]
ConfigOption = Annotated[Path | None, typer.Option(
    "--config", "-c", envvar="SKIPPYD_CONFIG", help="Stage config (for control.socket).")]


@app.command()
def top(
    socket: SocketOption = None,
    config: ConfigOption = None,
    once: Annotated[bool, typer.Option(
        "--once", help="Print one snapshot and exit, as `skippyd status` does.")] = False,
    as_json: JsonFlag = False,
) -> None:
    """Watch a running daemon live: queues, lanes, KV, cache, throughput, latency, events."""
    from skippyd.tui import run_top

    raise typer.Exit(run_top(socket, config, once, as_json))


@app.command()
def status(socket: SocketOption = None, config: ConfigOption = None, as_json: JsonFlag = False) -> None:
    """Print a one-screen summary of a running daemon.

    Exit 0 when it is healthy, 1 when it answers but is not serving, 6 when nothing
    answers, 4 for a bad config.
    """
    from skippyd.tui.status import run_status

    raise typer.Exit(run_status(socket, config, as_json))


# -- config ----------------------------------------------------------------------------
@config_app.command("init")
def config_init(
    path: Annotated[Path | None, typer.Argument(help="Where to write (default: stdout).")] = None,
    force: Annotated[bool, typer.Option("--force", help="Overwrite an existing file.")] = False,
) -> None:
    """Write a complete example stage config."""
    text = example_config_toml()
    if path is None:
        typer.echo(text, nl=False)
        return
    if path.exists() and not force:
        raise fail(f"{path} exists; pass --force to overwrite it")
    path.write_text(text, encoding="utf-8")
    stderr.print(f"wrote {escape(str(path))}")


@config_app.command("check")
def config_check(
    paths: Annotated[list[Path], typer.Argument(
        help="Stage config (TOML); give every stage's config to check a split pipeline.",
        show_default=False)],
    as_json: Annotated[bool, typer.Option("--json", help="Print the verdict as JSON.")] = False,
) -> None:
    """Validate configs against their model; several configs must chain into one pipeline.

    Every config is checked and every problem reported. Exit 0 when valid, 4 on a config
    error, 5 when a model file cannot be read. With several configs (any order), their
    indexes, layer ranges, peers, secrets and capacities must line up into one pipeline.
    """
    from skippyd.checks import check_configs

    report = check_configs(paths)
    if as_json:
        typer.echo(json.dumps(report.to_dict(), indent=2))
    else:
        for line in report.lines():
            console = stdout if line.ok else stderr
            mark = "[green]ok[/]" if line.ok else "[bold red]error:[/]"
            console.print(f"{mark} {escape(line.text)}", highlight=False)
    raise typer.Exit(report.exit_code)


@config_app.command("show")
def config_show(path: ConfigPath, as_json: JsonFlag = False) -> None:
    """Print the resolved config, defaults included."""
    from skippyd.config import config_to_toml

    config = load_checked_config(path)
    if as_json:
        typer.echo(json.dumps(config_to_dict(config), indent=2))
    else:
        typer.echo(config_to_toml(config), nl=False)


@config_app.command("split")
def config_split(
    model: Annotated[Path, typer.Argument(help="The whole model (GGUF).", show_default=False)],
    stages: Annotated[int, typer.Option("--stages", min=1, help="How many stages.")] = 2,
    output: Annotated[Path, typer.Option("--output", "-o", help="Directory for the configs "
                                         "(created if missing).")] = Path("split"),
    hosts: Annotated[str | None, typer.Option(
        help="Each stage's host, comma-separated (default: all on 127.0.0.1).")] = None,
    memory: Annotated[str | None, typer.Option(
        help="Each stage's memory for its weights and KV cache, comma-separated (16G,8G).")]
        = None,
    ctx_size: Annotated[int | None, typer.Option(
        help="Tokens one request may hold on every stage; each lane's KV stream gets that "
             "many cells (default: the model's trained context).")] = None,
    lanes: Annotated[int, typer.Option(min=1, help="Lanes of every stage.")] = 4,
    tls: Annotated[bool, typer.Option("--tls", help="Write the pipeline's TLS keys into "
                                      "OUTPUT/tls and set link.tls on every stage.")] = False,
    force: Annotated[bool, typer.Option("--force", help="Overwrite existing configs.")] = False,
    measure: Annotated[bool, typer.Option(
        "--measure", help="Time the layers and the output head on this machine and balance "
        "by time instead of weight bytes (about a minute; run it on an idle host like "
        "the stages').")] = False,
    threads: Annotated[int | None, typer.Option(
        min=1, help="llama.cpp threads for --measure (default: this machine's CPUs).")]
        = None,
) -> None:
    """Cut a model into stages of balanced work and write one config per stage.

    A layer's work is the bytes of its weight matrices, or with --measure its time here;
    the final stage also computes the output head. The cut keeps the busiest stage as
    light as possible, within each host's memory when given. Links get distinct ports,
    one fresh secret is shared by all, stage 0 serves HTTP. Check the result with
    `skippyd config check OUTPUT/*.toml`.
    """
    from skippyd.model_files.model_info import ModelFileError, inspect_model
    from skippyd.split_plan import (
        SplitError,
        kv_bytes_per_layer,
        model_costs,
        parse_size,
        plan_split,
        render_configs,
    )

    try:
        info = inspect_model(model)
        costs = model_costs(model)
    except ModelFileError as exc:
        raise fail(str(exc), ExitCode.MODEL) from None
    host_list = [h.strip() for h in hosts.split(",")] if hosts else None
    try:
        limits = [parse_size(m) for m in memory.split(",")] if memory else None
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--memory") from None
    ctx = ctx_size or info.n_ctx_train or 4096
    try:
        work = _measured_work(model, costs, threads) if measure else None
        plans = plan_split(costs, stages, work=work,
                           kv_bytes_per_layer=kv_bytes_per_layer(info, ctx * lanes),
                           memory=limits, hosts=host_list)
    except SplitError as exc:
        raise fail(str(exc), ExitCode.USAGE) from None
    existing = [output / f"stage-{plan.index}.toml" for plan in plans
                if (output / f"stage-{plan.index}.toml").exists()]
    if existing and not force:
        raise fail(f"{existing[0]} exists; pass --force to overwrite it")
    output.mkdir(parents=True, exist_ok=True)
    configs = render_configs(model.resolve(), plans, output, ctx_size=ctx * lanes,
                             lane_count=lanes,
                             tls_paths=_split_keys(output, stages) if tls else None)
    for config in configs:
        config.path.write_text(config.text, encoding="utf-8")
    table = Table("stage", "host", "layers", "work", *(["ms/step"] if measure else []),
                  "memory")
    total = sum(plan.work for plan in plans) or 1.0
    for plan in plans:
        table.add_row(str(plan.index), plan.host,
                      f"{plan.layer_start}-{plan.layer_end - 1}",
                      f"{plan.work / total:.0%}",
                      *([f"{plan.work:.1f}"] if measure else []),
                      f"{plan.memory_bytes / 2**30:.2f} GiB")
    stdout.print(table)
    stderr.print(f"wrote {len(configs)} configs to {escape(str(output))}; check them with "
                 f"skippyd config check {escape(str(output))}/*.toml", highlight=False)


def _measured_work(model: Path, costs: ModelCosts, threads: int | None) -> Work:
    from skippyd.config.defaults import available_cpus
    from skippyd.split_measure import MEASURE_ROWS, Timing, measure_work

    threads = threads or available_cpus()
    stderr.print(f"timing decode steps of {MEASURE_ROWS} rows on {threads} thread(s)…",
                 highlight=False)

    def report(timing: Timing) -> None:
        part = f"layers {timing.layer_start}-{timing.layer_end - 1}" + (
            " and the output head" if timing.head else "")
        stderr.print(f"  {part}: {timing.ms:.1f} ms", highlight=False)

    return measure_work(model, costs, threads=threads, report=report)


def _split_keys(directory: Path, stages: int) -> dict[int, tuple[str, str, str]]:
    """The TLS files of each stage under ``directory/tls``: a stage that has its
    certificate and key there keeps them (splitting again keeps the pipeline's keys),
    the others get new ones from the pipeline CA there (made if missing)."""
    from skippyd.link.keys import CA_CERT_FILE, KeygenError, write_pipeline_keys

    keys_dir = directory / "tls"
    ids = [f"stage-{i}" for i in range(stages)]
    files = {i: (keys_dir / f"{i}.crt", keys_dir / f"{i}.key") for i in ids}
    kept = [i for i, pair in files.items() if all(path.exists() for path in pair)]
    missing = [i for i in ids if i not in kept]
    try:
        if kept and not (keys_dir / CA_CERT_FILE).exists():
            raise KeygenError(f"{files[kept[0]][0]} has no pipeline CA beside it "
                              f"({keys_dir / CA_CERT_FILE}); remove {keys_dir} or restore it")
        written = write_pipeline_keys(keys_dir, missing) if missing else None
    except KeygenError as exc:
        raise fail(str(exc)) from None
    except OSError as exc:
        raise fail(f"cannot write {keys_dir}: {exc}") from None
    if kept:
        stderr.print(f"kept the TLS keys of {', '.join(kept)} in {escape(str(keys_dir))}",
                     highlight=False)
    if written is not None and written.ca_created:
        stderr.print(f"wrote the pipeline CA and its key {escape(str(written.ca_key))} (it "
                     "signs new certificates: keep it off the stages' machines)",
                     highlight=False)
    ca = str((keys_dir / CA_CERT_FILE).relative_to(directory))
    return {int(i.removeprefix("stage-")): (ca, str(cert.relative_to(directory)),
                                             str(key.relative_to(directory)))
            for i, (cert, key) in files.items()}


def _quantized_size(source: Path, quant: str) -> int:
    from skippyd.engine.runtime.quantize import BITS_PER_WEIGHT

    return int(source.stat().st_size * BITS_PER_WEIGHT.get(quant, 16.0) / 16.0)


@contextlib.contextmanager
def _output_growth(progress: Progress, description: str, output: Path,
                   expected: int) -> Iterator[None]:
    """A progress bar that follows ``output`` growing towards ``expected`` bytes while
    the block runs (a call into native code that reports no progress of its own)."""
    task = progress.add_task(description, total=expected)
    done = threading.Event()

    def follow() -> None:
        while not done.wait(0.5):
            with contextlib.suppress(OSError):
                progress.update(task, completed=min(output.stat().st_size, expected))

    watcher = threading.Thread(target=follow, name="quantize-progress", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join()
    with contextlib.suppress(OSError):
        size = output.stat().st_size
        progress.update(task, total=size, completed=size)


# -- model -----------------------------------------------------------------------------
@model_app.command("inspect")
def model_inspect(
    path: Annotated[Path, typer.Argument(help="GGUF model file.")],
    as_json: JsonFlag = False,
) -> None:
    """Print a model's architecture, size, quantization and per-layer recurrent state."""
    from skippyd.model_files.model_info import ModelFileError, inspect_model

    try:
        info = inspect_model(path)
    except ModelFileError as exc:
        raise fail(str(exc), ExitCode.MODEL) from None
    if as_json:
        typer.echo(json.dumps(info.to_dict(), indent=2))
        return
    table = Table(show_header=False, title=escape(str(path)))
    rows = [
        ("architecture", info.architecture), ("name", info.name or "-"),
        ("layers", info.n_layer), ("n_embd", info.n_embd), ("vocab", info.n_vocab),
        ("trained context", info.n_ctx_train or "-"), ("quantization", info.quantization),
        ("file size", f"{info.file_bytes / 2**20:.1f} MiB"),
        ("chat template", "yes" if info.has_chat_template else "no"),
        ("recurrent state/seq", f"{info.recurrent_bytes()} bytes"),
    ]
    for key, value in rows:
        table.add_row(key, escape(str(value)))
    nonzero = [f"{i}:{b}" for i, b in enumerate(info.recurrent_state_bytes_per_layer) if b]
    table.add_row("recurrent layers", ", ".join(nonzero) or "none (pure attention)")
    stdout.print(table)


def parse_layers(text: str) -> tuple[int, int]:
    try:
        start, end = (int(part) for part in text.split(":"))
    except ValueError:
        raise typer.BadParameter("expected START:END, e.g. 0:15") from None
    return start, end


@model_app.command("slice")
def model_slice(
    path: Annotated[Path, typer.Argument(help="Source GGUF model.")],
    layers: Annotated[str, typer.Option("--layers", help="Layer range START:END (end exclusive).")],
    output: Annotated[Path, typer.Option("-o", "--output", help="Stage GGUF to write.")],
) -> None:
    """Write the stage model for a layer range: a shallower GGUF stock llama.cpp loads."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn

    from skippyd.model_files.model_info import ModelFileError
    from skippyd.model_files.slice import slice_model

    start, end = parse_layers(layers)
    columns = ("[progress.description]{task.description}", BarColumn(), DownloadColumn(),
               TimeRemainingColumn())
    with Progress(*columns, console=stderr, transient=False) as progress:
        task = progress.add_task(f"slicing {start}:{end}", total=None)
        try:
            slice_model(path, start, end, output,
                        progress=lambda done, total: progress.update(task, completed=done, total=total))
        except ModelFileError as exc:
            raise fail(str(exc), ExitCode.MODEL) from None
    stdout.print(f"wrote {escape(str(output))} (layers {start}:{end} of {escape(path.name)})")


@model_app.command("synth")
def model_synth(
    shape: Annotated[str, typer.Option("--shape", help="0.5b (Qwen2.5-0.5B widths), 1b "
                                       "(TinyLlama-1.1B), 3b (Llama-3.2-3B) or 8b (Llama-3-8B).")],
    output: Annotated[Path, typer.Option("-o", "--output", help="GGUF file to write.")],
    quant: Annotated[str, typer.Option("--quant", help="Q4_0, Q4_K_M, Q8_0, or F16 (none).")]
        = "Q4_0",
    ctx: Annotated[int, typer.Option("--ctx", min=1, help="Trained context written into the model.")]
        = 8192,
    vocab: Annotated[int | None, typer.Option("--vocab", min=1, help="Vocabulary size "
                     "(default: the real model's).", show_default=False)] = None,
    layers: Annotated[int | None, typer.Option("--layers", min=1, help="Override the number of "
                      "layers (a shallower model of the same widths).", show_default=False)] = None,
    seed: Annotated[int, typer.Option("--seed", min=0, help="Seeds the random weights.")] = 0,
) -> None:
    """Write a random-weight model of a real model's shape: real cost per token, noise for text.

    It has the embedded model's tokenizer and chat template, its vocabulary padded (or cut)
    to the real model's size, and is quantized by llama.cpp's own quantizer.
    """
    from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn

    from skippyd.config.defaults import available_cpus, default_model_path
    from skippyd.model_files.model_info import ModelFileError
    from skippyd.model_files.synth import read_tokenizer, shape_named, write_f16_model

    quant = quant.upper()
    quants = ("Q4_0", "Q4_K_M", "Q8_0", "F16")
    if quant not in quants:
        raise typer.BadParameter(f"choose one of {', '.join(quants)}", param_hint="--quant")
    try:
        model_shape = shape_named(shape, n_layer=layers, n_vocab=vocab)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--shape") from None
    if output.is_dir():
        raise fail(f"{output} is a directory; -o names the file to write")
    if not output.parent.is_dir():
        raise fail(f"{output.parent} does not exist")
    partial = output.with_name(output.name + ".f16.partial")
    columns = ("[progress.description]{task.description}", BarColumn(), DownloadColumn(),
               TimeRemainingColumn())
    try:
        tokenizer = read_tokenizer(default_model_path())
        with Progress(*columns, console=stderr, transient=False) as progress:
            task = progress.add_task(f"writing {shape} weights", total=None)
            write_f16_model(model_shape, partial, tokenizer, n_ctx=ctx, seed=seed,
                            progress=lambda done, total: progress.update(task, completed=done,
                                                                         total=total))
            if quant == "F16":
                partial.replace(output)
            else:
                from skippyd.engine.runtime.quantize import QuantizeError, quantize_model

                try:
                    with _output_growth(progress, f"quantizing to {quant} (llama.cpp)",
                                        output, _quantized_size(partial, quant)):
                        quantize_model(partial, output, quant, threads=available_cpus())
                except QuantizeError as exc:
                    raise fail(str(exc), ExitCode.MODEL) from None
    except ConfigError as exc:
        raise fail(str(exc), ExitCode.CONFIG) from None
    except (ModelFileError, ValueError) as exc:
        raise fail(str(exc), ExitCode.MODEL) from None
    except OSError as exc:
        raise fail(f"cannot write {output}: {exc}") from None
    finally:
        partial.unlink(missing_ok=True)
    size = output.stat().st_size / 2**20
    stdout.print(f"wrote {escape(str(output))}: {model_shape.like} shape, "
                 f"{model_shape.parameter_count() / 1e9:.2f} B parameters, {model_shape.n_layer} "
                 f"layers, vocab {model_shape.n_vocab}, context {ctx}, {quant}, {size:.0f} MiB")


# -- link ------------------------------------------------------------------------------
@link_app.command("keygen")
def link_keygen(
    directory: Annotated[Path, typer.Argument(help="Where to write the CA, certificates and "
                                              "keys (created owner-only if missing).")],
    stages: Annotated[int, typer.Option("--stages", min=0, help="Certificates for stage-0 "
                                        "... stage-(N-1).")] = 0,
    ids: Annotated[list[str] | None, typer.Option("--id", help="A certificate for this stage.id "
                   "(repeat it; also for a monitoring tool that reads STATUS).",
                   show_default=False)] = None,
    days: Annotated[int, typer.Option("--days", min=1, help="How long the certificates are "
                                      "valid.")] = 730,
) -> None:
    """Write a pipeline CA and a certificate and key per stage, for link.tls.

    Certificates name a stage id, not a host, so a stage may move between machines. An
    existing CA in DIRECTORY is reused (a stage joins the same pipeline); no existing
    file is ever overwritten. Prints the lines each stage's config needs.
    """
    from skippyd.link.keys import KeygenError, write_pipeline_keys

    wanted = [f"stage-{i}" for i in range(stages)] + list(ids or [])
    if not wanted:
        raise typer.BadParameter("give --stages N, or --id ID for each certificate",
                                 param_hint="--stages")
    try:
        written = write_pipeline_keys(directory, wanted, days=days)
    except KeygenError as exc:
        raise fail(str(exc)) from None
    except OSError as exc:
        raise fail(f"cannot write {directory}: {exc}") from None
    ca = written.ca_cert.absolute()
    if written.ca_created:
        stderr.print(f"wrote the pipeline CA {escape(str(ca))} and its key "
                     f"{escape(str(written.ca_key.absolute()))} (it signs new certificates: "
                     "keep it off the stages' machines)", highlight=False)
    else:
        stderr.print(f"reused the pipeline CA {escape(str(ca))}", highlight=False)
    stderr.print(f"wrote {len(written.stages)} certificate(s) valid for {days} days; each "
                 "stage's machine needs ca.crt and its own .crt and .key", highlight=False)
    for keys in written.stages:
        typer.echo(f"# {keys.stage_id}: add to its [link] table\n"
                   f'tls = true\ntls_ca = "{ca}"\ntls_cert = "{keys.cert.absolute()}"\n'
                   f'tls_key = "{keys.key.absolute()}"\n')


def main() -> None:
    app()


if __name__ == "__main__":
    main()
