"""Index-space tracing agrees with the real torch ops, element for element."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hp_dcp_hf.mapping.symbolic import RegionTensor, UntraceableOp
from tests.support.symbolic_check import materialize


def _both(shapes, fn):
    torch.manual_seed(0)
    real = {f"k{i}": torch.randn(s, dtype=torch.float64) for i, s in enumerate(shapes)}
    sym = {k: RegionTensor.source(k, v.shape, v.dtype) for k, v in real.items()}
    expected, traced = fn(*real.values()), fn(*sym.values())
    if isinstance(expected, torch.Tensor):
        expected, traced = [expected], [traced]
    for e, t in zip(expected, traced, strict=True):
        assert tuple(t.shape) == tuple(e.shape)
        assert torch.equal(materialize(t, real), e)
    return traced


def _rope(t, heads=3, inverse=False):
    dim0 = t.shape[0]
    head = (2, dim0 // heads // 2) if inverse else (dim0 // heads // 2, 2)
    return t.view(heads, *head, t.shape[1]).transpose(1, 2).reshape(dim0, t.shape[1])


def _interleave(t, dim=0):
    shape = list(t.shape)
    shape[dim : dim + 1] = [shape[dim] // 2, 2]
    return t.reshape(shape).transpose(dim, dim + 1).reshape(t.shape).contiguous()


def test_permute_for_rope_stays_one_piece_and_slices_exactly():
    (traced,) = _both([(24, 5)], _rope)
    assert len(traced.pieces) == 1
    _both([(24, 5)], lambda t: _rope(t)[5:17])
    _both([(24, 5)], lambda t: _rope(t, inverse=True).narrow(1, 1, 3)[7:9])
    _both([(24, 5)], lambda t: _rope(_rope(t), inverse=True))


def test_interleave_and_slices():
    _both([(10, 3)], _interleave)
    _both([(10, 3)], lambda t: _interleave(t)[3:8])
    _both([(6, 10)], lambda t: _interleave(t, 1)[:, 1:9])


def test_cat_stack_chunk_split_transpose():
    _both([(4, 6), (4, 6)], lambda a, b: torch.cat([a, b], dim=1).t().reshape(3, 2, 8)[1:, :, 3:7])
    _both([(2, 3, 4)] * 3, lambda a, b, c: torch.stack([a, b, c], dim=0).transpose(1, 3).reshape(3, -1)[:, 5:19])
    _both([(12, 4)], lambda a: torch.chunk(a, 5, dim=0))
    _both([(13, 4)], lambda a: a.chunk(3, dim=0))
    _both([(12, 4)], lambda a: torch.split(a, [5, 7], dim=0))
    _both([(2, 3)], lambda t: t.unsqueeze(0).squeeze(0).flatten().reshape(3, 2)[..., None][1:, 1])
    _both([(7, 10)], lambda t: t.reshape(5, 14)[1:4].reshape(3, 2, 7).transpose(0, 2)[2:5])


def test_untraceable_ops_are_reported():
    t = RegionTensor.source("k", (4, 4), torch.float32)
    for op in (lambda: t * 2, lambda: torch.exp(t), lambda: t[torch.tensor([0, 2])], lambda: t[::2]):
        try:
            op()
        except (UntraceableOp, TypeError):
            continue
        raise AssertionError("an op on values was traced")


@st.composite
def _programs(draw):
    shape = draw(st.lists(st.integers(1, 5), min_size=1, max_size=3))
    return shape, draw(st.lists(st.tuples(st.sampled_from("trnc"), st.integers(0, 10**6)), max_size=5))


def _run(program, t):
    for op, r in program:
        if op == "t" and t.ndim >= 2:
            a, b = r % t.ndim, (r // 7) % t.ndim
            t = t.transpose(a, b)
        elif op == "r":
            n = t.numel()
            factors = [x for x in range(1, n + 1) if n % x == 0]
            x = factors[r % len(factors)]
            t = t.reshape(x, n // x) if r % 2 else t.reshape(n // x, 1, x)
        elif op == "n":
            d = r % t.ndim
            if t.shape[d] > 1:
                start = (r // 3) % t.shape[d]
                t = t.narrow(d, start, 1 + (r // 11) % (t.shape[d] - start))
        else:
            t = torch.cat([t, t], dim=r % t.ndim)
    return t


@settings(max_examples=300, deadline=None)
@given(_programs())
def test_random_view_programs(case):
    shape, program = case
    real = torch.randn(shape, dtype=torch.float64)
    traced = _run(program, RegionTensor.source("k", shape, torch.float64))
    assert torch.equal(materialize(traced, {"k": real}), _run(program, real))
