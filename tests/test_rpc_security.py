"""The RPC against hostile clients, on a real ``ferry agent`` process on loopback: every route
but /healthz refuses a missing or wrong token (routes taken from docs/openapi.yaml, which must
list exactly the routes the app serves), oversized bodies get 413, and schemathesis fuzzes the
spec: no 500, no crash, no file written outside the hot dir. Each test runs against a plain
agent and a TLS one (certificates made by tests/tlscerts.py): the same answers over HTTPS."""

from __future__ import annotations

import os
import re
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import schemathesis
import yaml
from hypothesis import HealthCheck, settings

from agent.daemon.config import load_config
from agent.rpc.app import create_app
from tests.harness import TOKEN, Node, get_json, make_node
from tests.tlscerts import authority

REPO = Path(__file__).resolve().parents[1]
SPEC = REPO / "docs" / "openapi.yaml"
# per operation (11 of them): ~20 s in CI; more with FERRY_FUZZ_EXAMPLES=1000
FUZZ_EXAMPLES = int(os.environ.get("FERRY_FUZZ_EXAMPLES", "50"))
_METHODS = ("get", "post", "put", "delete", "patch")


def spec_routes() -> list[tuple[str, str]]:
    doc = yaml.safe_load(SPEC.read_text())
    return [
        (method.upper(), path)
        for path, item in doc["paths"].items()
        for method in item
        if method in _METHODS
    ]


def concrete(path: str) -> str:
    return re.sub(r"\{[^}]+\}", "a" * 64, path)


def request(
    node: Node,
    path: str,
    method: str,
    token: str | None,
    scheme: str = "Bearer",
    body: bytes | None = None,
) -> int:
    req = urllib.request.Request(node.url + path, method=method, data=body)
    if token is not None:
        req.add_header("Authorization", f"{scheme} {token}")
    if body is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=30, context=node.tls()) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


@pytest.fixture(scope="module", params=["http", "https"])
def node(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Node]:
    root = tmp_path_factory.mktemp("rpc")
    (root / "store").mkdir()
    tls: dict[str, str] = {}
    if request.param == "https":
        ca = authority(tmp_path_factory.mktemp("pki"), "rpc-ca")
        leaf = ca.leaf("agent", 10)
        tls = {
            "FERRY_TLS_CERT_FILE": str(leaf.cert),
            "FERRY_TLS_KEY_FILE": str(leaf.key),
            "FERRY_TLS_CA_FILE": str(ca.pem),
        }
    n = make_node(root, "sec", [str(root / "store")], **tls)
    n.start()
    try:
        yield n
    finally:
        n.close()


def test_the_spec_lists_exactly_the_routes_the_agent_serves(tmp_path: Path) -> None:
    env = {"FERRY_NODE": "x", "FERRY_HOT_DIR": str(tmp_path), "FERRY_TIERS": str(tmp_path)}
    app = create_app(load_config(None, env), "t")
    served = {
        (r.method, r.resource.canonical)
        for r in app.router.routes()
        if r.method != "HEAD" and r.resource is not None
    }
    assert served == set(spec_routes())


@pytest.mark.parametrize(("method", "path"), [r for r in spec_routes() if r[1] != "/healthz"])
def test_every_route_but_health_needs_the_token(node: Node, method: str, path: str) -> None:
    url = concrete(path)
    body = b"{}" if method == "POST" else None
    assert request(node, url, method, None, body=body) == 401
    assert request(node, url, method, "wrong-token", body=body) == 401
    assert request(node, url, method, TOKEN + "x", body=body) == 401  # a longer one is wrong too
    assert request(node, url, method, TOKEN, scheme="Basic", body=body) == 401
    assert request(node, url, method, TOKEN, body=body) != 401


def test_health_needs_no_token_and_unknown_routes_still_need_one(node: Node) -> None:
    assert request(node, "/healthz", "GET", None) == 200
    assert request(node, "/v1/nothing-here", "GET", None) == 401
    assert request(node, "/v1/nothing-here", "GET", TOKEN) == 404


@pytest.mark.parametrize("path", ["/v1/prefetch", "/v1/pins"])
def test_oversized_bodies_get_413(node: Node, path: str) -> None:
    huge = b'{"job": "' + b"x" * (2 << 20) + b'"}'  # over the 1 MiB default limit
    assert request(node, path, "POST", TOKEN, body=huge) == 413
    assert request(node, path, "POST", None, body=huge) == 401  # never read unauthenticated
    assert get_json(node.url + "/healthz", token=None, context=node.tls())["ok"]


schema = schemathesis.openapi.from_path(str(SPEC))


@pytest.mark.slow  # ~20 s: every route's examples against a live agent
@schema.parametrize()
@settings(
    max_examples=FUZZ_EXAMPLES,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    derandomize=True,  # the same requests on every run: a failure reproduces
)
def test_fuzz_the_spec(case: schemathesis.Case, node: Node) -> None:
    # schemathesis's checks: no 5xx, replies conform to the spec (status codes, schemas,
    # content types), valid requests are accepted. Not "every invalid request is refused": the
    # agent ignores query parameters it does not know, as HTTP APIs do.
    response = case.call_and_validate(
        base_url=node.url,
        headers={"Authorization": f"Bearer {TOKEN}"},
        verify=node.env.get("FERRY_TLS_CA_FILE", True),  # over HTTPS: verified by the test CA
        excluded_checks=[schemathesis.checks.negative_data_rejection],
    )
    assert response.status_code < 500, response.text
    assert node.proc is not None and node.proc.poll() is None, node.logs()


def test_after_fuzzing_the_agent_is_alive_and_wrote_nothing_outside_its_dirs(node: Node) -> None:
    assert get_json(node.url + "/healthz", token=None, context=node.tls())["ok"]
    root = node.hot.parent
    allowed = {node.hot, root / "store", root / "token", node.log}
    strays = [p for p in root.iterdir() if p not in allowed]
    assert not strays, strays
    # in the hot dir: only prefetched checkpoints' job dirs and the agent's state
    for p in node.hot.rglob("*"):
        assert not p.is_symlink(), p
        assert p.resolve().is_relative_to(node.hot.resolve()), p
