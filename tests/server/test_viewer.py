"""``GET /viewer/``: the viewer's static files, served from the package (server/viewer/),
open without the API key while every API call the page makes needs it (security.py)."""

import httpx
import pytest
from server_testlib import API_KEY


def test_viewer_redirects_to_its_directory(server):
    r = httpx.get(f"{server.base_url}/viewer", follow_redirects=False)
    assert r.status_code == 307 and r.headers["location"] == "viewer/"


def test_page_is_served_without_the_key(server):
    r = httpx.get(f"{server.base_url}/viewer/")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/html")
    assert '<script src="viewer.js">' in r.text and 'id="key"' in r.text
    assert '<link rel="icon" href="data:,">' in r.text  # no /favicon.ico request (a 404)


@pytest.mark.parametrize("name,kind", [("viewer.js", "javascript"), ("viewer.css", "text/css"),
                                       ("index.html", "text/html")])
def test_static_files_have_their_types(server, name, kind):
    r = httpx.get(f"{server.base_url}/viewer/{name}")
    assert r.status_code == 200 and kind in r.headers["content-type"]


def test_unknown_file_is_404(server):
    assert httpx.get(f"{server.base_url}/viewer/nope.js").status_code == 404


def test_the_api_the_page_calls_needs_the_key(server):
    assert httpx.get(f"{server.base_url}/v1/models").status_code == 401
    ok = httpx.get(f"{server.base_url}/v1/models",
                   headers={"Authorization": f"Bearer {API_KEY}"})
    assert ok.status_code == 200


def test_page_sends_the_key_as_a_bearer_header(server):
    js = httpx.get(f"{server.base_url}/viewer/viewer.js").text
    assert 'h.Authorization = "Bearer " + key' in js


def test_files_ship_in_the_package():
    """pyproject's package-data names the viewer's files (a wheel without them would serve a
    404 page)."""
    import tomllib
    from pathlib import Path

    import latentserve

    package = Path(latentserve.__file__).parent
    pyproject = package.parents[1] / "pyproject.toml"
    globs = tomllib.loads(pyproject.read_text())["tool"]["setuptools"]["package-data"][
        "latentserve"]
    shipped = {p.name for g in globs for p in package.glob(g)}
    assert shipped >= {"index.html", "viewer.css", "viewer.js"}
