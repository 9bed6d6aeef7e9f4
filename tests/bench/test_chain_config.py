"""skippyd.bench.chain_config: the stage configs the split benchmarks start."""

from __future__ import annotations

from pathlib import Path

import pytest

from skippyd.bench.chain_config import LocalChain, write_config
from skippyd.checks import check_configs
from skippyd.config import load_config
from skippyd.link.keys import write_pipeline_keys

SECRET = "chain-config-test-secret-0123456789"


def _write_all(chain: LocalChain, model: Path, **link) -> list[Path]:
    runtime = {"ctx_size": 512, "lane_count": 2, "threads": 1,
               "slice_cache_dir": str(chain.workdir / "slices")}
    return [chain.write(i, stage={"model_path": str(model)}, runtime=runtime, link=link)
            for i in range(chain.num_stages)]


def test_a_direct_chain_passes_the_pipeline_check(tiny_model_path: Path, tmp_path: Path):
    chain = LocalChain.on_free_ports(tmp_path, (0, 1, 3, 4), SECRET)
    paths = _write_all(chain, tiny_model_path)
    report = check_configs(paths)
    assert report.exit_code == 0, report.lines()
    configs = [load_config(path) for path in paths]
    assert [c.stage.index for c in configs] == [0, 1, 2]
    assert configs[0].http is not None and configs[0].http.listen == "127.0.0.1:0"
    assert len({c.control.socket for c in configs}) == 3
    assert len(set(chain.link_ports)) == 3


def test_a_shaped_chain_dials_each_stage_through_its_shaper(tiny_model_path: Path,
                                                            tmp_path: Path):
    keys = tmp_path / "tls"
    write_pipeline_keys(keys, ["stage-0", "stage-1"])
    chain = LocalChain.on_free_ports(tmp_path, (0, 2, 4), SECRET, shaped=True, tls_keys=keys)
    stage0, stage1 = (load_config(p) for p in _write_all(chain, tiny_model_path,
                                                         activation_dtype="f16"))
    down, back = chain.shaper_ports
    assert stage0.downstream is not None and stage0.downstream.endpoint.endswith(f":{down}")
    assert stage1.link.advertise is not None and stage1.link.advertise.endswith(f":{back}")
    assert stage0.link.advertise is None
    # Shaper 0 forwards to stage 1; the last one carries the return path, to stage 1 too.
    assert chain.shaper_routes() == [(down, chain.link_ports[1]), (back, chain.link_ports[1])]
    assert stage1.upstream is not None
    assert stage1.upstream.endpoint.endswith(f":{chain.link_ports[0]}")
    for i, config in enumerate((stage0, stage1)):
        assert config.link.tls and config.link.activation_dtype == "f16"
        assert Path(config.link.tls_cert) == keys / f"stage-{i}.crt"


@pytest.mark.parametrize("bounds", [(0,), (0, 2, 2), (3, 1)])
def test_bounds_that_do_not_rise_are_refused(tmp_path: Path, bounds):
    with pytest.raises(ValueError, match="rise strictly"):
        LocalChain.on_free_ports(tmp_path, bounds, SECRET)


def test_a_stage_outside_the_chain_is_refused(tmp_path: Path):
    chain = LocalChain.on_free_ports(tmp_path, (0, 2, 4), SECRET)
    with pytest.raises(ValueError, match="not in a chain of 2"):
        chain.sections(2, runtime={})


def test_write_config_writes_the_tables_as_toml(tiny_model_path: Path, tmp_path: Path):
    path = write_config(tmp_path / "one.toml", {
        "stage": {"id": "one", "model_path": str(tiny_model_path)},
        "runtime": {"ctx_size": 512, "lane_count": 1, "kv_layout": "per_lane"},
        "http": {"listen": "127.0.0.1:0"}})
    config = load_config(path)
    assert (config.stage.id, config.runtime.ctx_size, config.runtime.kv_layout) == (
        "one", 512, "per_lane")
