"""SmolLM2 split into 2 stage processes whose links all run TLS (``link.tls``).

The chain serves exactly what the unsplit model serves; peers without this pipeline's
certificate are refused by a running stage with a log line naming them, and the chain
goes on serving as if they had never come.
"""

from __future__ import annotations

import concurrent.futures

import pytest
from link_support import SECRET, Chain, wait_until

from skippyd.link.dialer import query_status
from skippyd.link.keys import write_pipeline_keys
from skippyd.link.tls import LinkTls, LinkTlsError, TlsFiles
from skippyd.link.wire import LinkRefusedError

pytestmark = pytest.mark.model

SEQUENTIAL = [
    "The capital of France is", "def fibonacci(n):",
    "Water boils at a temperature of one hundred degrees Celsius at sea level, and it "
    "freezes at zero degrees. The three states of water are solid, liquid and gas. Ice "
    "floats because it is less dense than liquid water. Steam",  # longer than n_ubatch
]
# Prompts whose greedy continuation has a clear margin even in other batch shapes.
CONCURRENT = ["1, 2, 3, 4, 5,", "Monday, Tuesday, Wednesday,", "A, B, C, D,",
              "January, February, March,"]


def complete(client, prompt: str, max_tokens: int = 24):
    return client.completions.create(model="any", prompt=prompt, max_tokens=max_tokens,
                                     temperature=0)


@pytest.fixture(scope="module")
def tls_chain(tmp_path_factory, slice_dir):
    chain = Chain((0, 15, 30), tmp_path_factory.mktemp("tls-chain"), slice_dir, tls=True)
    try:
        yield chain.start()
    finally:
        chain.stop()


def test_a_tls_chain_serves_greedy_output_identical_to_the_unsplit_model(tls_chain,
                                                                        unsplit_client):
    client = tls_chain.client()
    for prompt in SEQUENTIAL:
        split, whole = complete(client, prompt), complete(unsplit_client, prompt)
        assert split.choices[0].text == whole.choices[0].text, prompt
        assert split.usage == whole.usage
    expected = [complete(unsplit_client, p, max_tokens=16).choices[0].text for p in CONCURRENT]
    with concurrent.futures.ThreadPoolExecutor(len(CONCURRENT)) as pool:
        results = list(pool.map(lambda p: complete(client, p, max_tokens=16), CONCURRENT))
    assert [r.choices[0].text for r in results] == expected


def test_a_three_stage_tls_chain_relays_through_its_middle_stage(tmp_path_factory, slice_dir,
                                                                 unsplit_client):
    """Stage 1 dials stage 2 with its own certificate, and stage 0 reaches stage 2 (the
    final stage the chain announced) for predictions."""
    chain = Chain((0, 10, 20, 30), tmp_path_factory.mktemp("tls-chain3"), slice_dir, tls=True)
    try:
        chain.start()
        prompt = SEQUENTIAL[0]
        split, whole = complete(chain.client(), prompt), complete(unsplit_client, prompt)
        assert split.choices[0].text == whole.choices[0].text
        statuses = [chain.status(i) for i in range(3)]
        assert [s["tls"] for s in statuses] == [True] * 3
        assert statuses[0]["chain"]["num_stages"] == 3
        peers = {link["role"]: link["peer"] for link in statuses[2]["links"]}
        assert peers["upstream"].startswith("stage-1 at ")
    finally:
        chain.stop()


def test_every_stage_runs_its_links_inside_tls_and_names_its_peers_by_certificate(tls_chain):
    statuses = [tls_chain.status(i) for i in range(2)]
    assert [s["tls"] for s in statuses] == [True, True]
    assert statuses[0]["chain"]["up"]
    upstream = [link["peer"] for link in statuses[1]["links"] if link["role"] == "upstream"]
    assert len(upstream) == 1 and upstream[0].startswith("stage-0 at 127.0.0.1:")


def test_peers_without_the_pipelines_certificate_are_refused_and_change_nothing(tls_chain,
                                                                              tmp_path):
    address = ("127.0.0.1", tls_chain.ports[1])
    before = [tls_chain.status(i) for i in range(2)]
    with pytest.raises(LinkRefusedError, match="this stage's link uses TLS"):
        query_status(address, SECRET.encode())  # plaintext
    tls_chain.stages[1].wait_for_line(r"link connection from 127\.0\.0\.1:\d+ rejected: TLS: "
                                      r"the peer left without starting TLS")
    write_pipeline_keys(tmp_path / "other", ["stage-0"])
    # Trusting this pipeline's CA, it gets as far as presenting its own certificate.
    stranger = LinkTls(TlsFiles(tls_chain.keys / "ca.crt", tmp_path / "other/stage-0.crt",
                                tmp_path / "other/stage-0.key"), "stage-0")
    with pytest.raises(LinkTlsError, match="refused this stage's certificate"):
        query_status(address, SECRET.encode(), tls=stranger)
    wait_until(lambda: tls_chain.status(1)["rejected"] == before[1]["rejected"] + 2, 10,
               "stage 1 to count both refusals")
    after = [tls_chain.status(i) for i in range(2)]
    # The chain stayed up on the same connection, and serves.
    assert after[0]["chain"]["epoch"] == before[0]["chain"]["epoch"]
    assert after[0]["chain"]["up"] and after[1]["chains"] == 1
    assert "Paris" in complete(tls_chain.client(), "The capital of France is", 4).choices[0].text
