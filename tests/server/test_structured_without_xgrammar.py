"""A server where xgrammar is not installed answers a constrained request with a 400 that
names the field and the extra to install (``latentserve[structured]``), not a 500, and
keeps serving unconstrained requests."""

import os
import sys

import httpx
import pytest

BODIES = {
    "response_format": {"response_format": {"type": "json_object"}},
    "guided_regex": {"guided_regex": "[0-9]+"},
    "structured_outputs": {"structured_outputs": {"choice": ["yes", "no"]}},
}


@pytest.fixture(scope="module")
def bare_server(tiny_model_dir, tmp_path_factory):
    """The tiny model's server with ``import xgrammar`` failing (a shadowing package)."""
    from latentserve.config import EngineConfig
    from latentserve.server.launch import start_server

    shadow = tmp_path_factory.mktemp("no-xgrammar")
    (shadow / "xgrammar").mkdir()
    (shadow / "xgrammar" / "__init__.py").write_text(
        "raise ImportError('No module named xgrammar (shadowed by the test)')\n")
    path = os.pathsep.join([str(shadow), *sys.path])
    srv = start_server(EngineConfig(model=str(tiny_model_dir), max_num_seqs=2), timeout=300,
                       env={"PYTHONPATH": path})
    yield srv
    srv.stop()


@pytest.mark.parametrize("field", sorted(BODIES))
@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
def test_a_constraint_without_xgrammar_is_a_400_naming_the_extra(bare_server, field, route):
    body = {"max_tokens": 4, **BODIES[field]}
    body |= ({"messages": [{"role": "user", "content": "hi"}]} if "chat" in route
             else {"prompt": "hi"})
    r = httpx.post(f"{bare_server.base_url}{route}", json=body, timeout=60)
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert message.startswith(field), message
    assert "needs xgrammar, which is not installed: pip install 'latentserve[structured]'" \
        in message
    plain = {k: v for k, v in body.items() if k not in BODIES[field]}
    assert httpx.post(f"{bare_server.base_url}{route}", json=plain, timeout=60).status_code == 200
