"""A model given as ``dir`` and as ``dir/`` is one model: one served name in /v1/models and
the metrics, and two ``--model`` flags naming it both ways are refused as a duplicate."""

import httpx
import pytest

from latentserve.config import EngineConfig
from latentserve.server.launch import check_model_names, served_model_name


def test_a_trailing_slash_gives_the_same_served_name(tmp_path):
    assert EngineConfig(model=f"{tmp_path}/").model == str(tmp_path)
    assert served_model_name(EngineConfig(model=f"{tmp_path}//")) == str(tmp_path)
    with pytest.raises(ValueError, match="would both be served as"):
        check_model_names([EngineConfig(model=str(tmp_path)),
                           EngineConfig(model=f"{tmp_path}/")])


def test_server_lists_and_counts_a_slashed_dir_under_its_plain_name(tiny_model_dir):
    from latentserve.server.launch import start_server

    srv = start_server(EngineConfig(model=f"{tiny_model_dir}/", max_num_seqs=2), timeout=300)
    try:
        with httpx.Client(base_url=srv.base_url, timeout=60) as http:
            assert [m["id"] for m in http.get("/v1/models").json()["data"]] == \
                [str(tiny_model_dir)]
            r = http.post("/v1/completions", json={"model": str(tiny_model_dir),
                                                   "prompt": "hi", "max_tokens": 2})
            assert r.status_code == 200 and r.json()["model"] == str(tiny_model_dir), r.text
            metrics = http.get("/metrics").text
        assert f'model_name="{tiny_model_dir}"' in metrics
        assert f'model_name="{tiny_model_dir}/"' not in metrics
    finally:
        srv.stop()
