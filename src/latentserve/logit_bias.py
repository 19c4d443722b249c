"""A batch's logit bias (``SamplingParams.logit_bias``, OpenAI's and vLLM's): built on the host
from the requests' params each step, copied to the device without waiting.
Design notes: docs/internals.md, "latentserve.logit_bias"."""

from __future__ import annotations

from array import array

import torch

from latentserve.sampling import LogitBias


def batch_logit_bias(reqs, copies) -> LogitBias | None:
    """The :class:`~latentserve.sampling.LogitBias` of the rows of ``reqs`` (``core.Req``)
    whose request sets ``logit_bias`` and whose token may be an answer token
    (``core.Req.samples_answer``); None when no row has one.
    ``copies``: the ``staging.HostToDevice`` that makes the one int64 copy (rows | ids | the
    values' float64 bits), queued without waiting."""
    rows, ids, values = array("q"), array("q"), array("d")
    for b, r in enumerate(reqs):
        bias = r.params.logit_bias
        if bias and r.samples_answer:
            rows.extend([b] * len(bias))
            ids.extend(bias)
            values.extend(bias.values())
    k = len(rows)
    if not k:
        return None
    rows.extend(ids)
    rows.frombytes(values.tobytes())
    packed = copies.copy(rows)
    return LogitBias(packed[:k], packed[k : 2 * k], packed[2 * k :].view(torch.float64))
