"""How many grammar rows filled ahead (``mask_ahead.MasksAhead``) a step's bitmask took."""

from latentserve import token_masks


def hits(filled) -> int:
    """How many rows of ``filled`` (``token_masks.FilledRows`` or None) the last
    ``batch_bitmask`` given it took: those whose matcher took no token since (it feeds the
    matchers before it looks)."""
    if filled is None:
        return 0
    return sum(r.constraint.consumed == consumed for r, _, consumed in filled.rows.values())


def counting(used: list):
    """A ``token_masks.batch_bitmask`` that appends to ``used`` the :func:`hits` of each call
    (for ``monkeypatch.setattr(token_masks, "batch_bitmask", ...)``)."""
    real = token_masks.batch_bitmask

    def batch_bitmask(reqs, vocab_size, known=None, out=None, ahead=None):
        res = real(reqs, vocab_size, known, out, ahead)
        used.append(hits(ahead))
        return res

    return batch_bitmask
