"""``link.tls`` in a config: its three files, the checks of what they hold, and the
pipeline's agreement (every stage TLS or none, one CA). Keys are made for real."""

from __future__ import annotations

import datetime
import os
from pathlib import Path
from typing import Any

import pytest

from skippyd.checks import check_link_tls
from skippyd.config import ConfigError, check_pipeline, load_config, parse_config
from skippyd.link.keys import (
    cert_pem,
    issue_stage_cert,
    key_pem,
    read_certificate,
    read_private_key,
    write_pipeline_keys,
)

SECRET = "0123456789abcdef-test-secret"


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("tls") / "keys"
    write_pipeline_keys(directory, ["stage-0", "stage-1"])
    return directory


@pytest.fixture(scope="module")
def other_keys(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("other") / "keys"
    write_pipeline_keys(directory, ["stage-0", "stage-1"])
    return directory


def tls_table(keys: Path, stage_id: str) -> dict[str, Any]:
    return {"tls": True, "tls_ca": str(keys / "ca.crt"),
            "tls_cert": str(keys / f"{stage_id}.crt"), "tls_key": str(keys / f"{stage_id}.key")}


def stage(index: int, link: dict[str, Any]) -> dict[str, Any]:
    """Stage ``index`` of a 2-stage pipeline cut at layer 15, its [link] merged with ``link``."""
    data: dict[str, Any] = {
        "stage": {"id": f"stage-{index}", "index": index, "layer_start": 15 * index},
        "link": {"listen": f"127.0.0.1:910{index + 1}", "secret": SECRET, **link},
    }
    if index == 0:
        data["stage"]["layer_end"] = 15
        data["downstream"] = {"stage_id": "stage-1", "endpoint": "127.0.0.1:9102"}
    else:
        data["upstream"] = {"stage_id": "stage-0", "endpoint": "127.0.0.1:9101"}
    return data


def issues_of(data: dict[str, Any]) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse_config(data)
    return [str(issue) for issue in info.value.issues]


def tls_issues(data: dict[str, Any]) -> list[str]:
    with pytest.raises(ConfigError) as info:
        check_link_tls(parse_config(data))
    return [str(issue) for issue in info.value.issues]


def test_tls_needs_its_three_files(keys):
    assert issues_of(stage(1, {"tls": True})) == [
        f"link.{key}: required when link.tls = true (skippyd link keygen writes the "
        "pipeline's certificates)" for key in ("tls_ca", "tls_cert", "tls_key")]


def test_tls_files_without_tls_are_an_error_not_a_silent_plaintext_link(keys):
    table = tls_table(keys, "stage-1")
    table["tls"] = False
    issues = issues_of(stage(1, table))
    assert len(issues) == 3
    assert issues[0] == ("link.tls_ca: set, but link.tls is false: the link would run without "
                         "TLS; set link.tls = true, or remove it")


def test_a_missing_tls_file_is_named_with_its_key(keys, tmp_path):
    table = tls_table(keys, "stage-1")
    table["tls_cert"] = str(tmp_path / "nowhere.crt")
    assert issues_of(stage(1, table)) == [f"link.tls_cert: file not found: {tmp_path}/nowhere.crt"]


def test_relative_tls_paths_are_taken_from_the_config_file_directory(keys):
    path = keys.parent / "stage1.toml"
    path.write_text('[stage]\nid = "stage-1"\nindex = 1\nlayer_start = 15\n'
                    f'[link]\nlisten = "127.0.0.1:9102"\nsecret = "{SECRET}"\ntls = true\n'
                    'tls_ca = "keys/ca.crt"\ntls_cert = "keys/stage-1.crt"\n'
                    'tls_key = "keys/stage-1.key"\n'
                    '[upstream]\nstage_id = "stage-0"\nendpoint = "127.0.0.1:9101"\n')
    config = load_config(path)
    assert config.link.tls_cert == str(keys / "stage-1.crt")
    check_link_tls(config)  # this stage's, signed by the CA, valid: no error


def test_a_certificate_of_another_stage_is_refused(keys):
    table = {**tls_table(keys, "stage-1"), "tls_cert": str(keys / "stage-0.crt"),
             "tls_key": str(keys / "stage-0.key")}
    assert tls_issues(stage(1, table)) == [
        "link.tls_cert: the certificate is for stage 'stage-0', this stage is 'stage-1' "
        "(stage.id)"]


def test_a_certificate_of_another_ca_and_a_key_of_another_certificate_are_refused(keys,
                                                                                  other_keys):
    table = {**tls_table(keys, "stage-1"), "tls_cert": str(other_keys / "stage-1.crt"),
             "tls_key": str(keys / "stage-0.key")}
    issues = tls_issues(stage(1, table))
    assert issues[0].startswith("link.tls_cert: not signed by the CA of link.tls_ca "
                                "(skippyd pipeline CA ")
    assert issues[1] == f"link.tls_key: {keys}/stage-0.key is not the key of link.tls_cert"


def test_an_expired_certificate_is_refused_with_its_end_date(keys, tmp_path):
    ca, ca_key = read_certificate(keys / "ca.crt"), read_private_key(keys / "ca.key")
    end = datetime.datetime(2024, 3, 1, 12, 0, tzinfo=datetime.UTC)
    cert, key = issue_stage_cert(ca, ca_key, "stage-1", not_before=end - datetime.timedelta(9),
                                 not_after=end)
    (tmp_path / "old.crt").write_bytes(cert_pem(cert))
    (tmp_path / "old.key").write_bytes(key_pem(key))
    os.chmod(tmp_path / "old.key", 0o600)
    table = {**tls_table(keys, "stage-1"), "tls_cert": str(tmp_path / "old.crt"),
             "tls_key": str(tmp_path / "old.key")}
    assert tls_issues(stage(1, table)) == [
        "link.tls_cert: the certificate expired on 2024-03-01 12:00 UTC: make new "
        "certificates (skippyd link keygen)"]


def test_a_file_that_is_no_certificate_is_named(keys, tmp_path):
    (tmp_path / "ca.crt").write_text("not a certificate\n")
    table = {**tls_table(keys, "stage-1"), "tls_ca": str(tmp_path / "ca.crt")}
    (issue,) = tls_issues(stage(1, table))
    assert issue.startswith(f"link.tls_ca: {tmp_path}/ca.crt is not a PEM certificate")


def test_every_stage_of_a_pipeline_uses_tls_or_none_does(keys):
    configs = [parse_config(stage(0, tls_table(keys, "stage-0"))), parse_config(stage(1, {}))]
    with pytest.raises(ConfigError) as info:
        check_pipeline(configs)
    assert [str(i) for i in info.value.issues] == [
        "stages[1].link.tls: must equal stages[0].link.tls: every stage of a pipeline runs "
        "its links with TLS, or none does"]
    check_pipeline([parse_config(stage(0, tls_table(keys, "stage-0"))),
                    parse_config(stage(1, tls_table(keys, "stage-1")))])


def test_every_stage_of_a_pipeline_trusts_the_same_ca(keys, other_keys):
    configs = [parse_config(stage(0, tls_table(keys, "stage-0"))),
               parse_config(stage(1, tls_table(other_keys, "stage-1")))]
    with pytest.raises(ConfigError) as info:
        check_pipeline(configs)
    assert [str(i) for i in info.value.issues] == [
        "stages[1].link.tls_ca: is not the CA of stages[0].link.tls_ca: every stage must "
        "trust the same pipeline CA"]
