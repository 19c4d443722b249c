"""``x-latent-budget`` header parsing (server/params.latent_budget): every malformed or
out-of-range value is a 400 naming the header, never a 500."""

import pytest

from latentserve.latent.spec import LatentSpec
from latentserve.server.errors import APIError
from latentserve.server.params import latent_budget
from latentserve.server.protocol import CompletionRequest

COCONUT = LatentSpec(kind="feedback", family="coconut", default_budget=6, max_budget=16)


class _Req:
    def __init__(self, headers):
        self.headers = headers


def _budget(raw):
    return latent_budget(_Req({"x-latent-budget": raw}), CompletionRequest(prompt="hi"), COCONUT)


def test_header_in_range_is_the_budget():
    assert _budget(" 3 ") == 3 and _budget("16") == 16


@pytest.mark.parametrize("raw", ["17", "9" * 50, "9" * 5000, "-1", "1.5", "abc", "", "\u0663"])
def test_bad_header_is_a_400_naming_it(raw):
    with pytest.raises(APIError) as exc:
        _budget(raw)
    assert exc.value.param == "x-latent-budget" and "x-latent-budget" in str(exc.value)
