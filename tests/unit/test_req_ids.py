"""``Req.ids_slice`` (the model runner's per-step read of a row's ids) equals slicing
``Req.ids`` for every range: inside the prompt, inside the output, and across both."""

from latentserve.core import Req
from latentserve.sampling_params import SamplingParams


def test_ids_slice_equals_slicing_ids():
    req = Req(rid="r", prompt_ids=[10, 11, 12, 13], params=SamplingParams(), arrival=0)
    req.output_ids = [20, 21, 22]
    n = len(req.ids)
    for start in range(n + 1):
        for stop in range(start, n + 2):
            assert req.ids_slice(start, stop) == req.ids[start:stop], (start, stop)
