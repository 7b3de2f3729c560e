"""The Gated DeltaNet layer's batched paths equal the delta rule run token by token.

- The chunk form of the rule (`chunk_delta_rule`) against `delta_rule`, in float32, for
  lengths on both sides of a chunk's edge and from a nonzero state.
- The layer's torch path, which pads a batch's requests to the longest and runs them at
  once, against each request run alone through the per-token reference.
- Our Triton kernels (kernels/gated_delta.py, in Triton's interpreter on a CPU) against the
  torch path: a decode step, and a prefill of requests of different lengths, with padding
  requests in the dummy slot (one of them empty) that must leave every other slot alone.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from helpers import hopper_report

from minisgl.core import Context, set_global_ctx
from minisgl.env import ENV
from minisgl.kernels import gated_delta
from minisgl.kvcache.state_pool import RecurrentStatePool, gated_delta_kernels
from minisgl.layers.gated_deltanet import (
    GatedDeltaNet,
    _l2norm,
    causal_conv,
    chunk_delta_rule,
    delta_rule,
)
from minisgl.models.families import LinearAttention

SHAPE = LinearAttention(num_key_heads=2, num_value_heads=4, key_head_dim=16,
                        value_head_dim=32, conv_kernel=4)  # fmt: skip
HIDDEN, SLOTS = 32, 6
DUMMY = SLOTS - 1  # the padding requests' slot
triton_only = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs a GPU or Triton's interpreter",
)


def close(got: torch.Tensor, want: torch.Tensor, tol: float) -> bool:
    """Equal up to `tol`, relative to the larger values' size."""
    return (got - want).abs().max().item() <= tol * max(1.0, want.abs().max().item())


def rule_inputs(reqs: int, n: int, heads: int = 3, dk: int = 8, dv: int = 12, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q, k = (_l2norm(torch.randn(reqs, n, heads, dk, generator=gen)) for _ in range(2))
    v = torch.randn(reqs, n, heads, dv, generator=gen)
    g = -torch.rand(reqs, n, heads, generator=gen) * 0.5  # decays of 1 down to 0.6
    beta = torch.rand(reqs, n, heads, generator=gen)
    state = torch.randn(reqs, heads, dk, dv, generator=gen)
    return q * dk**-0.5, k, v, g, beta, state


@pytest.mark.parametrize("n", [1, 3, 63, 64, 65, 130])
def test_chunk_form_equals_the_token_by_token_rule(n: int) -> None:
    args = rule_inputs(2, n, seed=n)
    want, want_state = delta_rule(*args)
    got, got_state = chunk_delta_rule(*args)
    assert got.shape == want.shape
    assert close(got, want, 1e-5)
    assert close(got_state, want_state, 1e-5)
    small, small_state = chunk_delta_rule(*args, chunk=16)  # many chunks, a partial last
    assert close(small, want, 1e-5)
    assert close(small_state, want_state, 1e-5)


# ---- the layer, on a batch of requests of different lengths


def make_layer(seed: int = 0) -> GatedDeltaNet:
    torch.manual_seed(seed)
    layer = GatedDeltaNet(HIDDEN, SHAPE, 1e-6, index=1)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
        layer.A_log.uniform_(-2.0, 0.5)
        layer.norm.weight.add_(1.0)
    return layer


def make_pool(seed: int = 1) -> RecurrentStatePool:
    """Two layers of nonzero states: the layer is the second."""
    pool = RecurrentStatePool(2, SLOTS, SHAPE, torch.float32, torch.device("cpu"))
    gen = torch.Generator().manual_seed(seed)
    pool.conv.copy_(torch.randn(pool.conv.shape, generator=gen))
    pool.ssm.copy_(torch.randn(pool.ssm.shape, generator=gen) * 0.3)
    return pool


def run(layer: GatedDeltaNet, pool: RecurrentStatePool, x: torch.Tensor, lengths: list[int],
        slots: list[int], kernels: str, two_pass: bool = False) -> torch.Tensor:  # fmt: skip
    """The layer's forward over packed tokens x of requests of `lengths` in `slots`."""
    offsets = torch.tensor([0, *lengths]).cumsum(0)
    batch = SimpleNamespace(
        state_slots=torch.tensor(slots), state_offsets=offsets, padded_size=len(slots),
        padded_reqs=[SimpleNamespace(extend_len=n) for n in lengths],
        is_decode=max(lengths) == 1 and min(lengths) == 1, phase="prefill",
    )  # fmt: skip
    pool.kernels, pool.two_pass = kernels, two_pass
    ctx = Context(None)  # type: ignore[arg-type]
    ctx.state_pool = pool
    set_global_ctx(ctx)
    try:
        with ctx.forward_batch(batch), torch.no_grad():  # type: ignore[arg-type]
            return layer(x)
    finally:
        set_global_ctx(None)


def alone(layer: GatedDeltaNet, x: torch.Tensor, conv: torch.Tensor, ssm: torch.Tensor):
    """One request through the layer in plain words: the conv after its state, then the
    rule token by token. (output, conv state after, SSM state after)."""
    s = layer.shape
    with torch.no_grad():
        qkv, z = layer.in_proj_qkv(x), layer.in_proj_z(x)
        beta = layer.in_proj_b(x).sigmoid()
        g = -layer.A_log.exp() * F.softplus(layer.in_proj_a(x) + layer.dt_bias)
        mixed, conv = causal_conv(qkv[None], conv[None], layer.conv1d.weight.squeeze(1))
        key = s.num_key_heads * s.key_head_dim
        q, k, v = mixed[0].split([key, key, mixed.size(-1) - 2 * key], dim=-1)
        r = s.num_value_heads // s.num_key_heads
        q, k = (_l2norm(t.view(-1, s.num_key_heads, s.key_head_dim)).repeat_interleave(r, 1)
                for t in (q, k))  # fmt: skip
        v = v.view(-1, s.num_value_heads, s.value_head_dim)
        o, ssm = delta_rule(q[None] * s.key_head_dim**-0.5, k[None], v[None], g[None],
                            beta[None], ssm[None])  # fmt: skip
        out = layer.out_proj(layer.norm(o[0], z.view_as(o[0])).flatten(1))
    return out, conv[0], ssm[0]


LENGTHS, SLOT_OF = [5, 1, 70, 3], [3, 0, 2, 4]  # slot 1 is nobody's


def test_torch_path_batches_requests_as_each_alone() -> None:
    layer, pool = make_layer(), make_pool()
    before = make_pool()
    x = torch.randn(sum(LENGTHS), HIDDEN, generator=torch.Generator().manual_seed(2))
    got = run(layer, pool, x, LENGTHS, SLOT_OF, "torch")
    start = 0
    for n, slot in zip(LENGTHS, SLOT_OF):
        want, conv, ssm = alone(
            layer, x[start : start + n], before.conv[1, slot], before.ssm[1, slot]
        )
        assert close(got[start : start + n], want, 1e-5)
        assert close(pool.conv[1, slot], conv, 1e-6)
        assert close(pool.ssm[1, slot], ssm, 1e-5)
        start += n
    assert torch.equal(pool.ssm[1, 1], before.ssm[1, 1]) and torch.equal(pool.ssm[0], before.ssm[0])
    # a decode step: one token each, the states where the prefill left them
    x1 = torch.randn(len(SLOT_OF), HIDDEN, generator=torch.Generator().manual_seed(3))
    mid = [(pool.conv[1, s].clone(), pool.ssm[1, s].clone()) for s in SLOT_OF]
    got = run(layer, pool, x1, [1] * len(SLOT_OF), SLOT_OF, "torch")
    for i, (conv, ssm) in enumerate(mid):
        want, _, ssm_after = alone(layer, x1[i : i + 1], conv, ssm)
        assert close(got[i], want[0], 1e-5)
        assert close(pool.ssm[1, SLOT_OF[i]], ssm_after, 1e-5)


# ---- our Triton kernels against the torch path


def both_paths(
    lengths: list[int], slots: list[int], two_pass: bool = False, split_decode: bool | None = False
):
    """(torch's output and pool, the kernels' output and pool) from the same start."""
    layer = make_layer()
    x = torch.randn(sum(lengths), HIDDEN, generator=torch.Generator().manual_seed(4))
    out = []
    for kernels in ("torch", "triton"):
        pool = make_pool()
        pool.split_decode = split_decode
        out.append((run(layer, pool, x, lengths, slots, kernels, two_pass), pool))
    return out


def assert_same_states(want: RecurrentStatePool, got: RecurrentStatePool, slots: list[int]):
    """Every slot but the dummy's equal (padding rows race for the dummy's)."""
    before = make_pool()
    for slot in range(SLOTS - 1):
        assert close(got.conv[:, slot], want.conv[:, slot], 1e-6), slot
        assert close(got.ssm[:, slot], want.ssm[:, slot], 1e-5), slot
        if slot not in slots:  # nobody's: untouched
            assert torch.equal(got.ssm[:, slot], before.ssm[:, slot])
            assert torch.equal(got.conv[:, slot], before.conv[:, slot])
    assert torch.equal(got.ssm[0], before.ssm[0])  # another layer's states


@triton_only
@pytest.mark.parametrize("early", [128, 0])
def test_decode_kernel_equals_the_torch_path(early: int, monkeypatch) -> None:
    """Three requests and a padding row in the dummy slot; each state asked for first (few
    programs) or in its turn (many)."""
    monkeypatch.setattr(gated_delta, "EARLY_PROGRAMS", early)
    slots = [3, 0, 4, DUMMY]
    (want, want_pool), (got, got_pool) = both_paths([1] * 4, slots)
    assert got.shape == want.shape
    assert close(got[:3], want[:3], 1e-5)
    assert_same_states(want_pool, got_pool, slots)


@triton_only
@pytest.mark.parametrize("columns", [8, 32])
def test_split_decode_kernels_equal_the_torch_path(columns: int, monkeypatch) -> None:
    """The decode step in two kernels, the recurrence's programs holding blocks of 8 value
    columns (several a head: every block reads q and k, only the second kernel shifts their
    conv state) or a whole head; two value heads share each key head, so the first of them
    shifts q's and k's channels."""
    monkeypatch.setattr(gated_delta, "SPLIT_DV", columns)
    slots = [3, 0, 4, DUMMY]
    (want, want_pool), (got, got_pool) = both_paths([1] * 4, slots, split_decode=True)
    assert got.shape == want.shape
    assert close(got[:3], want[:3], 1e-5)
    assert_same_states(want_pool, got_pool, slots)


@triton_only
def test_a_decode_step_splits_where_the_fused_kernel_has_few_programs(monkeypatch) -> None:
    """By default (MINISGL_GATED_DELTA_DECODE=auto) a batch whose fused kernel would have
    EARLY_PROGRAMS programs or fewer (one per request and key head) takes the two kernels;
    either way the step equals the torch path."""
    sizes = []
    split = gated_delta._decode_split
    monkeypatch.setattr(
        gated_delta, "_decode_split", lambda *a: sizes.append(len(a[0])) or split(*a)
    )
    monkeypatch.setattr(gated_delta, "EARLY_PROGRAMS", 2 * SHAPE.num_key_heads)  # 2 requests
    for n in (1, 2, 3):
        slots = [3, 0, 4][:n]
        (want, want_pool), (got, got_pool) = both_paths([1] * n, slots, split_decode=None)
        assert close(got, want, 1e-5)
        assert_same_states(want_pool, got_pool, slots)
    assert sizes == [1, 2]


def test_a_prefill_takes_two_passes_where_its_requests_are_few_and_long() -> None:
    """MINISGL_GATED_DELTA_PREFILL=auto: two passes where the batch's requests (empty ones
    left out) average more than TWO_PASS_FROM tokens, decided as the batch is prepared."""
    from minisgl.kvcache import state_pool

    pool = make_pool()
    assert pool.prefill_rule == "auto"
    long = state_pool.TWO_PASS_FROM
    for lengths, two in (
        ([2 * long], True), ([long], False), ([long + 8, 8, 0], False),
        ([2 * long, 2 * long, 0, 0], True), ([long // 2] * 4, False), ([16] * 3, False),
    ):  # fmt: skip
        reqs = [
            SimpleNamespace(table_idx=i, extend_len=n, cached_len=1) for i, n in enumerate(lengths)
        ]
        pool.prepare(SimpleNamespace(padded_reqs=reqs))  # type: ignore[arg-type]
        assert pool.two_pass == two, lengths


@triton_only
@pytest.mark.parametrize("two_pass", [False, True])
def test_prefill_kernels_equal_the_torch_path(two_pass: bool) -> None:
    """Requests of 6, 1 and 9 tokens (6 and 1 shorter than the conv's window), then a
    filler of 3 tokens and an empty request, both in the dummy slot, as a prefill graph
    pads a batch; the recurrence in one pass and in two."""
    lengths, slots = [6, 1, 9, 3, 0], [3, 0, 2, DUMMY, DUMMY]
    (want, want_pool), (got, got_pool) = both_paths(lengths, slots, two_pass)
    assert close(got[:16], want[:16], 1e-5)
    assert_same_states(want_pool, got_pool, slots)


def test_triton_needs_a_gpu_or_the_interpreter(monkeypatch) -> None:
    monkeypatch.setattr(ENV.GATED_DELTA, "value", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="MINISGL_GATED_DELTA=triton .* need a CUDA device"):
        gated_delta_kernels(torch.device("cpu"))
    monkeypatch.setattr(ENV.GATED_DELTA, "value", "torch")
    assert gated_delta_kernels(torch.device("cpu")) == "torch"


@triton_only
def test_chunked_and_recurrent_kernels_agree() -> None:
    """The prefill recurrence two ways: token by token, and 16 tokens at a step (a request
    of 40 tokens spans three chunks, the last one partial)."""
    from minisgl.kernels import gated_delta

    s, lengths, slots = SHAPE, [40, 3, 0], torch.tensor([2, 0, DUMMY])
    gen = torch.Generator().manual_seed(5)
    mixed = torch.randn(sum(lengths), s.conv_dim, generator=gen)
    a, b = torch.randn(2, sum(lengths), s.num_value_heads, generator=gen)
    A_log, dt_bias = torch.rand(s.num_value_heads, generator=gen), torch.randn(s.num_value_heads)
    offsets = torch.tensor([0, *lengths]).cumsum(0)
    out = {}
    for kernel in (gated_delta.recurrent_varlen, gated_delta.chunked_varlen):
        pool = make_pool()
        o = kernel(mixed, a, b, A_log, dt_bias, pool.ssm[1], slots, offsets, s)
        out[kernel.__name__] = o, pool.ssm
    (o1, s1), (o2, s2) = out.values()
    assert close(o2, o1, 1e-5) and close(s2, s1, 1e-5)
    assert not torch.equal(s1[1, 2], make_pool().ssm[1, 2])  # it did write


@triton_only
def test_the_rule_in_all_layers_at_once_equals_a_layer_at_a_time() -> None:
    """`recurrent_layers` (the roll back's one launch): each layer's own tokens, gates, gate
    parameters and states, as `recurrent_varlen` a layer at a time leaves them; tokens whose
    gates are -inf (rejected drafts) leave a state as it was. Without `keep` (a verify's
    forward) the slots are only read."""
    from minisgl.kernels import gated_delta

    s, lengths, slots = SHAPE, [5, 0, 3], torch.tensor([2, 0, 1])
    layers, tokens, heads = 2, sum(lengths), s.num_value_heads
    gen = torch.Generator().manual_seed(7)
    mixed = torch.randn(layers, tokens, s.conv_dim, generator=gen)
    a, b = torch.randn(2, layers, tokens, heads, generator=gen)
    a[1, 5:], b[1, 5:] = float("-inf"), float("-inf")  # layer 1's third request: all rejected
    A_log, dt_bias = torch.rand(layers, heads, generator=gen), torch.randn(layers, heads)
    offsets = torch.tensor([0, *lengths]).cumsum(0)
    one, each = make_pool(), make_pool()
    gated_delta.recurrent_layers(mixed, a, b, A_log, dt_bias, one.ssm, slots, offsets, s)
    for i in range(layers):
        args = (mixed[i], a[i], b[i], A_log[i], dt_bias[i], each.ssm[i], slots, offsets, s)
        gated_delta.recurrent_varlen(*args)
    assert close(one.ssm, each.ssm, 1e-6)
    fresh = make_pool().ssm
    assert not torch.equal(one.ssm[0, 1], fresh[0, 1]) and not torch.equal(
        one.ssm[1, 2], fresh[1, 2]
    )
    assert close(one.ssm[1, 1], fresh[1, 1], 1e-6)  # decay 1, write strength 0: as it was
    assert torch.equal(one.ssm[:, 0], fresh[:, 0])  # the empty request's slot
    # a verify's forward: the same output, its slots read and left as they were
    args = (mixed[0], a[0], b[0], A_log[0], dt_bias[0])
    kept, read = make_pool(), make_pool()
    o_kept = gated_delta.recurrent_varlen(*args, kept.ssm[0], slots, offsets, s)
    o_read = gated_delta.recurrent_varlen(*args, read.ssm[0], slots, offsets, s, keep=False)
    assert torch.equal(o_read, o_kept) and torch.equal(read.ssm, fresh)


@triton_only
def test_a_verify_rolls_back_to_its_accepted_drafts() -> None:
    """The roll back's two kernels: the rule over each request's last token and accepted
    drafts only (as the later tokens' gates at -inf would leave it), and each conv state the
    last K - 1 of (the state before, the verify's inputs) up to the last accepted token,
    from the state before where fewer inputs were accepted than the conv holds."""
    from minisgl.kernels import gated_delta

    s, lengths, slots = SHAPE, [5, 0, 4, 5], torch.tensor([2, 0, 1, 4])
    accepted = torch.tensor([2, 0, 0, 4])  # drafts taken: some, none (empty), none, all
    layers, tokens, heads = 2, sum(lengths), s.num_value_heads
    gen = torch.Generator().manual_seed(9)
    mixed, qkv = torch.randn(2, layers, tokens, s.conv_dim, generator=gen)
    a, b = torch.randn(2, layers, tokens, heads, generator=gen)
    A_log, dt_bias = torch.rand(layers, heads, generator=gen), torch.randn(layers, heads)
    offsets = torch.tensor([0, *lengths]).cumsum(0)
    walked, masked = make_pool(), make_pool()
    args = (A_log, dt_bias)
    gated_delta.recurrent_layers(mixed, a, b, *args, walked.ssm, slots, offsets, s, accepted)
    t = torch.arange(tokens)
    req = torch.searchsorted(offsets[1:], t, right=True)
    later = (t - offsets[req] > accepted[req])[None, :, None]
    a_m, b_m = a.masked_fill(later, float("-inf")), b.masked_fill(later, float("-inf"))
    gated_delta.recurrent_layers(mixed, a_m, b_m, *args, masked.ssm, slots, offsets, s)
    assert close(walked.ssm, masked.ssm, 1e-6)
    assert not torch.equal(walked.ssm[:, 2], make_pool().ssm[:, 2])

    width = s.conv_kernel - 1
    before = torch.randn(layers, 4, s.conv_dim, width, generator=gen)
    pool = make_pool()
    gated_delta.conv_roll_back(qkv, before, pool.conv, slots, offsets, accepted)
    for r, (slot, acc) in enumerate(zip(slots.tolist(), accepted.tolist())):
        start, end = offsets[r].item(), offsets[r + 1].item()
        if end == start:  # nothing ran: its slot as it was
            assert torch.equal(pool.conv[:, slot], make_pool().conv[:, slot])
            continue
        seen = torch.cat([before[:, r], qkv[:, start : start + acc + 1].transpose(1, 2)], 2)
        assert torch.equal(pool.conv[:, slot], seen[..., -width:]), (r, acc)


@triton_only
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 3e-3)])
def test_two_pass_kernels_equal_the_token_by_token_recurrence(dtype, tol) -> None:
    """kernels/gated_delta_chunks.py against the token-by-token kernel in float32: requests
    of 130 tokens (two whole chunks of 64 and two tokens), 3, none, exactly 64 and 65, from
    nonzero states; every chunk of the batch found by its program, the empty request's slot
    left. In float16, the GPU's path: scratch in float16, the walk's matmuls on float16
    operands (the interpreter cannot multiply bf16)."""
    from minisgl.kernels import gated_delta_chunks

    s, lengths = SHAPE, [130, 3, 0, 64, 65]
    slots = torch.tensor([2, 0, 4, 1, 3])
    gen = torch.Generator().manual_seed(5)
    mixed = torch.randn(sum(lengths), s.conv_dim, generator=gen)
    a, b = torch.randn(2, sum(lengths), s.num_value_heads, generator=gen)
    A_log, dt_bias = torch.rand(s.num_value_heads, generator=gen), torch.randn(s.num_value_heads)
    offsets = torch.tensor([0, *lengths]).cumsum(0)
    out = {}
    for kernel, t in ((gated_delta.recurrent_varlen, torch.float32),
                      (gated_delta_chunks.chunks_varlen, dtype)):  # fmt: skip
        pool = make_pool()
        o = kernel(mixed.to(t), a.to(t), b.to(t), A_log, dt_bias, pool.ssm[1], slots, offsets, s)
        out[kernel.__name__] = o, pool.ssm
    (o1, s1), (o2, s2) = out.values()
    assert close(o2, o1, tol) and close(s2, s1, tol)
    assert torch.equal(s2[1, 4], make_pool().ssm[1, 4])  # the empty request's
    assert not torch.equal(s2[1, 1], make_pool().ssm[1, 1])  # the 64 tokens' did change


def test_the_fused_decode_capped_at_128_registers_spills_nothing() -> None:
    """Built for sm_90 on the CPU at 8 warps (tools/kernel_report.py) and capped at 128
    registers a thread (maxnreg, MINISGL_GATED_DELTA_REGISTERS=128: two programs an SM), the
    fused decode kernel of Qwen3.5's 0.8B and 9B heads stays within them and spills nothing
    (no stack frame). As the compiler leaves it, Triton 3.6 takes 148 and 138: one program."""
    rows = hopper_report("gated-delta")
    capped = {name: cells for name, cells in rows.items() if name.endswith("at most 128")}
    assert len(rows) == 4 and len(capped) == 2, rows
    for registers, stack, _, fit, *_ in capped.values():
        assert int(registers) <= 128 and int(stack) == 0 and int(fit) >= 2, rows
