"""``skippyd link keygen`` through Typer's CliRunner: real keys, real files, and the
config lines it prints making a pipeline that ``skippyd config check`` accepts."""

from __future__ import annotations

import stat
from pathlib import Path

from cryptography import x509
from link_support import tiny_stage
from typer.testing import CliRunner

from skippyd.cli import app
from skippyd.exitcodes import ExitCode
from skippyd.link.keys import read_certificate, signed_by, stage_id_of

runner = CliRunner()


def keygen(*args: str):
    return runner.invoke(app, ["link", "keygen", *args])


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_keygen_writes_a_ca_and_an_owner_only_key_per_stage(tmp_path):
    directory = tmp_path / "keys"
    result = keygen(str(directory), "--stages", "2", "--id", "monitor")
    assert result.exit_code == 0, result.output
    ca = read_certificate(directory / "ca.crt")
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    for stage_id in ("stage-0", "stage-1", "monitor"):
        cert = read_certificate(directory / f"{stage_id}.crt")
        assert stage_id_of(cert) == stage_id and signed_by(cert, ca)
        # No host name or address: a stage keeps its certificate on another machine.
        assert not any(isinstance(e.value, x509.SubjectAlternativeName)
                       for e in cert.extensions)
        assert _mode(directory / f"{stage_id}.key") == 0o600
    assert _mode(directory / "ca.key") == 0o600 and _mode(directory) == 0o700
    assert (f'# stage-1: add to its [link] table\ntls = true\ntls_ca = "{directory}/ca.crt"\n'
            f'tls_cert = "{directory}/stage-1.crt"\ntls_key = "{directory}/stage-1.key"\n'
            ) in result.stdout


def test_keygen_never_overwrites_and_adds_stages_under_the_same_ca(tmp_path):
    directory = tmp_path / "keys"
    assert keygen(str(directory), "--stages", "2").exit_code == 0
    before = {p.name: p.read_bytes() for p in directory.iterdir()}
    again = keygen(str(directory), "--id", "stage-2", "--stages", "2")
    assert again.exit_code == ExitCode.FAILURE
    assert "stage-0.crt exists; keygen never overwrites" in again.output
    assert {p.name: p.read_bytes() for p in directory.iterdir()} == before  # nothing written
    more = keygen(str(directory), "--id", "stage-2")
    assert more.exit_code == 0, more.output
    assert "reused the pipeline CA" in more.output
    ca = read_certificate(directory / "ca.crt")
    assert (directory / "ca.crt").read_bytes() == before["ca.crt"]
    assert signed_by(read_certificate(directory / "stage-2.crt"), ca)


def test_keygen_refuses_bad_input_and_writes_nothing(tmp_path):
    directory = tmp_path / "keys"
    assert keygen(str(directory)).exit_code == ExitCode.USAGE
    bad = keygen(str(directory), "--id", "not a stage id")
    assert bad.exit_code == ExitCode.FAILURE
    assert "stage id 'not a stage id': must be 1-64 letters" in bad.output
    assert not directory.exists()


def _with_tls(config: str, printed: str, stage_id: str) -> str:
    block = printed.split(f"# {stage_id}: add to its [link] table\n")[1].split("\n\n")[0]
    return config.replace("[link]\n", f"[link]\n{block}\n")


def test_the_printed_lines_make_a_pipeline_config_check_accepts(tmp_path, tiny_model_path):
    keys = keygen(str(tmp_path / "keys"), "--id", "tiny-0", "--id", "tiny-1")
    assert keys.exit_code == 0, keys.output
    plain = [tiny_stage(tiny_model_path, tmp_path, index=i, layers=((0, 2), (2, 4))[i],
                        n_batch=128, ports=[9101, 9102]) for i in (0, 1)]
    paths = [tmp_path / f"tiny{i}.toml" for i in (0, 1)]
    for i, path in enumerate(paths):
        path.write_text(_with_tls(plain[i], keys.stdout, f"tiny-{i}"))
    result = runner.invoke(app, ["config", "check", *map(str, paths)])
    assert result.exit_code == 0, result.output
    assert "pipeline: 2 stages" in result.output
    paths[1].write_text(plain[1])  # stage 1 without TLS
    result = runner.invoke(app, ["config", "check", *map(str, paths)])
    assert result.exit_code == ExitCode.CONFIG
    assert "stages[1].link.tls: must equal stages[0].link.tls" in result.output


def test_config_check_and_serve_name_the_key_of_a_certificate_of_another_stage(
        tmp_path, tiny_model_path):
    keys = keygen(str(tmp_path / "keys"), "--id", "tiny-0", "--id", "tiny-1")
    config = tiny_stage(tiny_model_path, tmp_path, index=1, layers=(2, 4), n_batch=128,
                        ports=[9101, 9102])
    path = tmp_path / "tiny1.toml"
    path.write_text(_with_tls(config, keys.stdout, "tiny-0"))  # stage 0's files
    expected = ("link.tls_cert: the certificate is for stage 'tiny-0', this stage is "
                "'tiny-1' (stage.id)")
    for command in (["config", "check", str(path)], ["serve", "--config", str(path)]):
        result = runner.invoke(app, command)
        assert result.exit_code == ExitCode.CONFIG, result.output
        assert expected in " ".join(result.output.split())
