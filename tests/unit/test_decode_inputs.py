"""``ops.kernels.decode_inputs``: a decode batch's packed index vectors unpacked into static
buffers in one launch equal what the torch ops of ``ModelRunner.run`` and
``CudaGraphRunner.replay`` produce (pending ids substituted, each token's slot from the page
table, padded rows set to the dummy row), run under the Triton interpreter on CPU."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton or the kernels

import pytest

pytest.importorskip("triton")

import torch

from latentserve.ops.kernels.decode_inputs import unpack_decode_inputs
from tests.support.triton_interpreter import patch_triton_interpreter

patch_triton_interpreter()


def _batch(n, num_pending, extra, seed):
    """A packed decode batch: ids | positions | page-table row per token | rows | kv_lens |
    ``extra`` latent entries | dst | src, the page table, and the previous step's tokens."""
    g = torch.Generator().manual_seed(seed)
    table = torch.randint(1, 10_000, (80, 300), generator=g)
    rows = torch.randperm(79, generator=g)[:n]  # row 79 is the dummy row
    pos = torch.randint(0, 300, (n,), generator=g)
    ids = torch.randint(0, 1000, (n,), generator=g)
    dst = torch.randperm(n, generator=g)[:num_pending]
    ids[dst] = -1
    pending = torch.randint(0, 1000, (num_pending + 5,), generator=g)
    src = torch.randperm(num_pending + 5, generator=g)[:num_pending]
    packed = torch.cat([ids, pos, rows, rows, pos + 1, torch.full((extra,), 7), dst, src])
    return packed, table, pending, ids, pos, rows, dst, src


def test_not_launched_with_pdl(monkeypatch):
    """The kernel writes the batch metadata that decode attention reads before its PDL wait,
    so it must not itself be a PDL launch (which could let later kernels start early)."""
    from latentserve.ops.kernels import decode_inputs

    seen = []

    class Spy:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: seen.append(kwargs)

    monkeypatch.setattr(decode_inputs, "_decode_inputs_kernel", Spy())
    packed, table, pending, *_ = _batch(5, 3, 0, 1)
    bufs = [torch.zeros(8, dtype=torch.int64) for _ in range(3)]
    unpack_decode_inputs(packed, 5, 8, 3, pending, table, 79, *bufs[:2],
                         torch.zeros(8, dtype=torch.int64), torch.zeros(8, dtype=torch.int32),
                         bufs[2])
    assert len(seen) == 1 and not {"launch_pdl", "PDL"} & set(seen[0])


@pytest.mark.parametrize("n,b,num_pending,extra", [
    (64, 64, 64, 0), (5, 8, 3, 0), (5, 8, 0, 0), (70, 80, 70, 70), (1, 1, 1, 0), (0, 4, 0, 0)])
def test_unpack_equals_the_torch_ops(n, b, num_pending, extra):
    packed, table, pending, ids, pos, rows, dst, src = _batch(n, num_pending, extra, n + b)
    want_ids = ids.clone()
    want_ids[dst] = pending[src]
    want_slots = table[rows, pos]
    bufs = [torch.full((96,), -5, dtype=torch.int64) for _ in range(4)]
    kv_lens = torch.full((96,), -5, dtype=torch.int32)
    out_ids, out_pos, out_rows, out_slots = bufs
    unpack_decode_inputs(packed, n, b, num_pending, pending if num_pending else None, table,
                         79, out_ids, out_pos, out_rows, kv_lens, out_slots)
    assert torch.equal(out_ids[:n], want_ids)
    assert torch.equal(out_pos[:n], pos)
    assert torch.equal(out_rows[:n], rows)
    assert torch.equal(kv_lens[:n], (pos + 1).int())
    assert torch.equal(out_slots[:n], want_slots)
    # padded rows: dummy row, one key, slot 0; their ids and positions untouched
    assert bool((out_rows[n:b] == 79).all()) and bool((kv_lens[n:b] == 1).all())
    assert bool((out_slots[n:b] == 0).all())
    assert bool((out_ids[n:] == -5).all()) and bool((out_pos[n:] == -5).all())
    # past the bucket nothing is written
    for buf in (out_rows, kv_lens, out_slots):
        assert bool((buf[b:] == -5).all())


@pytest.mark.parametrize("kwargs,match", [
    (dict(n=9, b=8), "n must be in"),
    (dict(n=4, b=8, short="kv_lens"), "kv_lens must be contiguous with >= 8"),
    (dict(n=4, b=4, num_pending=9, pending=torch.zeros(9, dtype=torch.int64)), "packed holds"),
    (dict(n=4, b=4, num_pending=2), "pending must be"),
])
def test_bad_arguments_name_the_field(kwargs, match):
    n, b = kwargs["n"], kwargs["b"]
    packed = torch.zeros(5 * n + 8, dtype=torch.int64)
    bufs = {k: torch.zeros(16, dtype=torch.int64) for k in ("ids", "pos", "rows", "out_slots")}
    bufs["kv_lens"] = torch.zeros(16, dtype=torch.int32)
    if "short" in kwargs:
        bufs[kwargs["short"]] = bufs[kwargs["short"]][:4]
    with pytest.raises(ValueError, match=match):
        unpack_decode_inputs(packed, n, b, kwargs.get("num_pending", 0), kwargs.get("pending"),
                             torch.zeros(4, 8, dtype=torch.int64), 3, **bufs)


@pytest.mark.parametrize("n,b,m,seed", [(64, 64, 64, 0), (5, 8, 7, 1), (70, 80, 130, 2),
                                        (3, 4, 0, 3), (0, 4, 6, 4)])
def test_staged_page_table_writes(n, b, m, seed):
    """Staged writes (``PageTable.stage``) are made by the kernel: every cell gets its slot,
    and a token whose cell is written in the same launch reads the new slot, not the old
    cell (which another program may not have written yet)."""
    packed, table, _, ids, pos, rows, _, _ = _batch(n, 0, 0, seed)
    g = torch.Generator().manual_seed(100 + seed)
    # half the batch's own cells (as a decode step's grows), the rest elsewhere; distinct
    own = torch.randperm(n, generator=g)[: min(n, m // 2)]
    cells = {(int(rows[i]), int(pos[i])) for i in own}
    while len(cells) < m:
        cells.add((int(torch.randint(0, 79, (1,), generator=g)),
                   int(torch.randint(0, 300, (1,), generator=g))))
    cells = sorted(cells, key=lambda c: hash(c) % 997)
    w_rows = torch.tensor([c[0] for c in cells], dtype=torch.int64)
    w_cols = torch.tensor([c[1] for c in cells], dtype=torch.int64)
    slots = torch.randint(20_000, 30_000, (m,), generator=g)
    want = table.clone()
    want[w_rows, w_cols] = slots
    want_slots = want[rows, pos]
    packed = torch.cat([packed, w_rows, w_cols])
    bufs = [torch.full((96,), -5, dtype=torch.int64) for _ in range(4)]
    kv_lens = torch.full((96,), -5, dtype=torch.int32)
    unpack_decode_inputs(packed, n, b, 0, None, table, 79, bufs[0], bufs[1], bufs[2], kv_lens,
                         bufs[3], m, slots)
    assert torch.equal(table, want)
    assert torch.equal(bufs[3][:n], want_slots)
    assert torch.equal(bufs[0][:n], ids) and torch.equal(bufs[2][:n], rows)
    assert bool((bufs[3][n:b] == 0).all()) and bool((bufs[3][b:] == -5).all())


def test_staged_writes_need_their_slots():
    packed = torch.zeros(40, dtype=torch.int64)
    bufs = [torch.zeros(8, dtype=torch.int64) for _ in range(4)]
    with pytest.raises(ValueError, match=r"slots must be \[num_writes=3\]"):
        unpack_decode_inputs(packed, 2, 2, 0, None, torch.zeros(4, 8, dtype=torch.int64), 3,
                             *bufs[:3], torch.zeros(8, dtype=torch.int32), bufs[3], 3,
                             torch.zeros(2, dtype=torch.int64))
