"""``latentserve.settings``: the one registry of ``LATENTSERVE_*`` variables, its parsing,
and docs/configuration.md's table (issue 33)."""

import re
from pathlib import Path

import pytest

from latentserve import settings

ROOT = Path(__file__).resolve().parents[2]


def test_docs_table_is_the_registry():
    assert settings.table() in (ROOT / "docs" / "configuration.md").read_text()


def test_every_variable_the_package_names_is_registered_and_read_through_it():
    named, direct = set(), []
    for path in (ROOT / "src" / "latentserve").rglob("*.py"):
        text = path.read_text()
        named |= set(re.findall(r"LATENTSERVE_[A-Z][A-Z0-9_]*[A-Z0-9]", text))
        if path.name != "settings.py" and re.search(r"environ\.get\(\s*[\"']LATENTSERVE_|"
                                                    r"getenv\(\s*[\"']LATENTSERVE_", text):
            direct.append(path.name)
    assert named - set(settings.BY_NAME) == set()
    assert direct == [], f"read LATENTSERVE_* through settings.get: {direct}"


def test_values_parse_by_type_and_unset_or_empty_is_the_default():
    env = {"LATENTSERVE_MAX_LATENT": "12", "LATENTSERVE_STOP_THRESHOLD": " 0.25",
           "LATENTSERVE_USE_STOP": "off", "LATENTSERVE_DEBUG": "1", "LATENTSERVE_MIN_LATENT": " "}
    assert settings.get("LATENTSERVE_MAX_LATENT", env) == 12
    assert settings.get("LATENTSERVE_STOP_THRESHOLD", env) == 0.25
    assert settings.get("LATENTSERVE_USE_STOP", env) is False
    assert settings.get("LATENTSERVE_DEBUG", env) is True
    assert settings.get("LATENTSERVE_DEBUG", {}) is False
    assert settings.get("LATENTSERVE_MIN_LATENT", env) == 4  # empty: the default
    assert settings.get("LATENTSERVE_LMHEAD", {}) == "auto"


@pytest.mark.parametrize("name, value, message", [
    ("LATENTSERVE_MAX_LATENT", "many", "LATENTSERVE_MAX_LATENT must be an integer, got 'many'"),
    ("LATENTSERVE_DECODE_PREFETCH_MB", "x", "LATENTSERVE_DECODE_PREFETCH_MB must be a number"),
    ("LATENTSERVE_USE_STOP", "maybe", "LATENTSERVE_USE_STOP must be one of 1/0"),
    ("LATENTSERVE_LMHEAD", "fast", "LATENTSERVE_LMHEAD must be one of auto, persistent, tiled"),
])
def test_a_malformed_value_names_the_variable(name, value, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        settings.get(name, {name: value})
