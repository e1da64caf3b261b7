"""SwiGLU experts for prefill-sized batches on FP8 tensor cores (W8A8): the FP8 twin of
:mod:`elasticep.moe.experts.tiled_experts`.

DeepSeek-V3's recipe (report section 3.3, "fine-grained quantization"), as the dense
projections run it (:mod:`elasticep.models.fp8_prefill`), here for the grouped GEMM of
the experts:

- the token rows are quantized once, per token per 128 columns
  (:func:`~elasticep.moe.experts.fp8_activations.quantize_activations`: float8_e4m3fn
  plus a float32 scale per 128-column group), before the top-k pairs fan out;
- the expert weights are read as stored, float8_e4m3fn in 128 x 128 blocks with float32
  ``scale_inv`` (:mod:`elasticep.moe.experts.fp8_block`);
- a program walks K one 128-wide group at a time: ``tl.dot`` of the FP8 tiles on the
  tensor cores, then that step's partial product times the row's activation scale times
  the block's weight scale, added to a float32 accumulator. Promoting every 128
  products is the report's remedy for the narrow accumulation of Hopper's FP8 MMA;
- the intermediate ``SiLU(gate) * up`` is rounded as the bf16 kernels round it (gate,
  up, SiLU and product to the activation dtype), then quantized per token per 128
  columns again in the gate/up kernel's epilogue (a program's 128 output features are
  exactly one group), and the down projection runs W8A8 on it the same way.

The launch layout is the tiled kernels' (:func:`~elasticep.moe.experts.tiled_experts.sort_pairs`):
pairs sorted by slot on the device, one program per (row block of one slot, output
block), no host sync, padding rows a group of their own that the down kernel zeroes.

:func:`swiglu_w8a8_reference` is the same math in torch on any device: both operands
dequantized exactly to float32, the products in float32, the same roundings and the same
quantization of the intermediate. The kernels differ from it by how the tensor cores sum
a K step, by float32 order (they scale each step's sum of FP8 products, the reference
sums products of dequantized values), and so, now and then, by which way an e4m3
rounding of the intermediate goes (``elasticep_testkit/fp8_w8a8_bounds.py`` derives the bounds
the tests use).
:func:`w8a8_experts_ok` (pure) is the rule that sends a batch here.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from elasticep.moe.experts import fp8_block
from elasticep.moe.experts.fp8_activations import (
    FP8_MAX,
    GROUP,
    MIN_AMAX,
    dequantize_activations,
    quantize_activations,
    quantize_activations_reference,
)
from elasticep.moe.experts.fp8_tiles import Tile, decode_tile, device_name_of
from elasticep.moe.experts.tiled_experts import (
    MIN_ROWS_PER_SLOT,
    block_layout,
    sort_pairs,
    triton,
)


def gate_up_tile_of(t: Tile) -> tuple[int, int, int]:
    """A table tile as :func:`w8a8_gate_up`'s ``tile``: ``(BLOCK_M, warps, stages)``."""
    return t.block_m, t.num_warps, t.num_stages or 3


def down_tile_of(t: Tile) -> tuple[int, int, int, int]:
    """A table tile as :func:`w8a8_down`'s ``tile``: ``(BLOCK_M, BLOCK_N, warps, stages)``."""
    return t.block_m, t.block, t.num_warps, t.num_stages or 3


def table_tiles(hidden: int, inter: int, pairs: int, slots: int, device: torch.device
                ) -> tuple[tuple[int, int, int], tuple[int, int, int, int]]:
    """``(BLOCK_M, warps, stages)`` of the gate/up kernel (its output block is one
    128-column group) and ``(BLOCK_M, BLOCK_N, warps, stages)`` of the down kernel (K
    steps are 128) for a launch of ``pairs`` pairs over ``slots`` FP8
    slots of shape ``(hidden, inter)`` on ``device``: the device's measured table
    (:func:`~elasticep.moe.experts.fp8_tiles.decode_tile`, bucketed by pairs a slot),
    else the first guesses. Host only, from shapes (no sync).

    Raises:
        TileTableError: the device's table file is malformed.
    """
    name, per_slot = device_name_of(device), pairs / max(slots, 1)
    return (gate_up_tile_of(decode_tile("w8a8_gate_up", hidden, inter, per_slot, name)),
            down_tile_of(decode_tile("w8a8_down", hidden, inter, per_slot, name)))


# Whether grouped_swiglu sends prefill-sized FP8 batches here on an SM90 GPU. The rule is
# on; if tests/test_fp8_expert_prefill_gpu.py fails on the GPU, set this False (the
# sorted FP8 kernels then serve those batches, as before this module).
ENABLED = True
# The least compute capability taken: Hopper's, the first with FP8 wgmma behind tl.dot
# that the GPU test covers (it runs on this one and later ones).
MIN_CAPABILITY = (9, 0)

_TL_DTYPES = {}
if triton is not None:
    import triton.language as tl

    from elasticep.moe.experts.fp8_activations import quantize_groups
    from elasticep.moe.experts.sorted_experts import swiglu_round
    from elasticep.moe.experts.tiled_experts import _block_rows, down_block

    _TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16,
                  torch.float32: tl.float32}

    @triton.jit
    def _act_step(ptr, stride, rows, m_ok, scale_ptrs, scale_col, offs_k, k_ok, c):
        # the rows' FP8 values over one K group, and each row's scale of group c
        a = tl.load(ptr + rows[:, None] * stride + offs_k[None, :],
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        return a, tl.load(scale_ptrs + c * scale_col, mask=m_ok, other=0.0)

    @triton.jit
    def _weight_step(ptr, K, feats, n_ok, scale_ptrs, offs_k, k_ok, c):
        # the [K group, features] FP8 tile of a [features, K] weight, and each feature's
        # block scale for group c
        w = tl.load(ptr + feats[None, :] * K + offs_k[:, None],
                    mask=n_ok[None, :] & k_ok[:, None], other=0.0)
        return w, tl.load(scale_ptrs + c, mask=n_ok, other=0.0)

    @triton.jit
    def _w8a8_gate_up_kernel(xq_ptr, xq_stride, xs_ptr, xs_row, xs_col, order_ptr,
                             block_slot_ptr, block_first_ptr, starts_ptr, counts_ptr, w13_ptr,
                             w_slot, s13_ptr, s_slot, s_cols, aq_ptr, as_ptr, S, H, inter,
                             n_groups, DT: tl.constexpr, ROW_REPEAT: tl.constexpr,
                             BLOCK_M: tl.constexpr, G: tl.constexpr, QMAX: tl.constexpr,
                             AMAX_MIN: tl.constexpr):
        s, pos, row, m_ok, live = _block_rows(order_ptr, block_slot_ptr, block_first_ptr,
                                              starts_ptr, counts_ptr, S, BLOCK_M)
        if live & (s < S):
            src = row // ROW_REPEAT  # pair -> its token's quantized row
            group = tl.program_id(0)
            offs_n = group * G + tl.arange(0, G)
            n_ok = offs_n < inter
            base = w13_ptr + s * w_slot
            # up rows start at row `inter`, which need not be a block boundary
            s_gate = s13_ptr + s * s_slot + (offs_n // G) * s_cols
            s_up = s13_ptr + s * s_slot + ((inter + offs_n) // G) * s_cols
            gate = tl.zeros([BLOCK_M, G], dtype=tl.float32)
            up = tl.zeros([BLOCK_M, G], dtype=tl.float32)
            for k0 in range(0, H, G):
                offs_k = k0 + tl.arange(0, G)
                k_ok = offs_k < H
                c = k0 // G
                x, xs = _act_step(xq_ptr, xq_stride, src, m_ok, xs_ptr + src * xs_row, xs_col,
                                  offs_k, k_ok, c)
                wg, sg = _weight_step(base, H, offs_n, n_ok, s_gate, offs_k, k_ok, c)
                wu, su = _weight_step(base, H, inter + offs_n, n_ok, s_up, offs_k, k_ok, c)
                gate += tl.dot(x, wg) * (xs[:, None] * sg[None, :])
                up += tl.dot(x, wu) * (xs[:, None] * su[None, :])
            # masked features have gate = up = 0, so a = 0 there and the amax is the group's
            a = swiglu_round(gate, up, DT).to(tl.float32)
            y, scale = quantize_groups(a, BLOCK_M, AMAX_MIN, QMAX)  # the quantizer's own
            pos64 = pos.to(tl.int64)
            tl.store(aq_ptr + pos64[:, None] * inter + offs_n[None, :],
                     y.to(aq_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])
            tl.store(as_ptr + pos64 * n_groups + group, scale, mask=m_ok)

    @triton.jit
    def _w8a8_down_kernel(aq_ptr, as_ptr, order_ptr, block_slot_ptr, block_first_ptr,
                          starts_ptr, counts_ptr, w2_ptr, w_slot, s2_ptr, s_slot, s_cols,
                          out_ptr, S, H, inter, n_groups, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, G: tl.constexpr):
        s, pos, row, m_ok, live, offs_n, n_ok = down_block(
            out_ptr, order_ptr, block_slot_ptr, block_first_ptr, starts_ptr, counts_ptr, S, H,
            BLOCK_M, BLOCK_N)
        if live & (s < S):
            base = w2_ptr + s * w_slot
            s_row = s2_ptr + s * s_slot + (offs_n // G) * s_cols
            pos64 = pos.to(tl.int64)
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for k0 in range(0, inter, G):
                offs_k = k0 + tl.arange(0, G)
                k_ok = offs_k < inter
                c = k0 // G
                a, a_s = _act_step(aq_ptr, inter, pos64, m_ok, as_ptr + pos64 * n_groups, 1,
                                   offs_k, k_ok, c)
                w, ws = _weight_step(base, inter, offs_n, n_ok, s_row, offs_k, k_ok, c)
                acc += tl.dot(a, w) * (a_s[:, None] * ws[None, :])
            tl.store(out_ptr + row[:, None] * H + offs_n[None, :],
                     acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def w8a8_experts_ok(pairs: int, slots: int, dtype: torch.dtype,
                    capability: tuple[int, int] | None, enabled: bool) -> bool:
    """Whether a batch of packed FP8 slots on CUDA runs :func:`swiglu_tiled_fp8` (pure).

    Args:
        pairs: (row, expert) pairs of the batch, padding included.
        slots: S, the slots held.
        dtype: the activations' dtype.
        capability: the GPU's compute capability, None off CUDA.
        enabled: the switch (:data:`ENABLED`, read by the caller at each call).

    Returns:
        True for bf16/fp16 activations on a GPU of at least :data:`MIN_CAPABILITY` with
        Triton present, from :data:`~elasticep.moe.experts.tiled_experts.MIN_ROWS_PER_SLOT`
        pairs per slot on average (the bf16 tiled kernels' threshold), when enabled.
    """
    return (enabled and triton is not None and capability is not None
            and capability >= MIN_CAPABILITY and dtype in (torch.bfloat16, torch.float16)
            and pairs >= MIN_ROWS_PER_SLOT * slots)


class Intermediate(NamedTuple):
    """The gate/up kernel's result: the pairs in slot order and their quantized
    ``SiLU(gate) * up``.

    Attributes:
        q: ``[N, I]`` float8_e4m3fn, row ``p`` the pair ``layout[0][p]`` (padding rows
            unwritten).
        scale: ``[N, ceil(I/128)]`` float32, per row per 128-column group.
        layout: :func:`~elasticep.moe.experts.tiled_experts.sort_pairs`'s result.
        block_m: the rows per block that layout was cut into.
    """

    q: torch.Tensor
    scale: torch.Tensor
    layout: tuple
    block_m: int


def _check(w: torch.Tensor, s: torch.Tensor, name: str) -> None:
    if w.dtype != fp8_block.FP8_DTYPE or w.stride(-1) != 1 or w.stride(-2) != w.shape[-1]:
        raise ValueError(f"{name} must be float8_e4m3fn with contiguous slots, got {w.dtype} "
                         f"strides {list(w.stride())}")
    want = fp8_block.scale_shape(w.shape)
    if tuple(s.shape) != want or s.dtype != torch.float32 or s.stride(-1) != 1:
        raise ValueError(f"{name}'s scales must be float32 {list(want)} with unit column "
                         f"stride, got {s.dtype} {list(s.shape)}")


def w8a8_gate_up(w13: torch.Tensor, w13_scale: torch.Tensor, rows: torch.Tensor,
                 tags: torch.Tensor, row_repeat: int = 1,
                 tile: tuple[int, int, int] | None = None) -> Intermediate:
    """The gate/up half: token rows quantized, pairs sorted, SwiGLU quantized.

    Args:
        w13: ``[S, 2I, H]`` float8_e4m3fn, gate rows then up rows; each slot contiguous,
            any slot stride (a packed slot's view, :func:`fp8_block.unpack`).
        w13_scale: ``[S, ceil(2I/128), ceil(H/128)]`` float32, any slot stride.
        rows: ``[N / row_repeat, H]`` bf16/fp16 (float32 under the interpreter), unit
            column stride, any row stride.
        tags: ``[N]`` int32/int64, ``slot + 1``, 0 for a padding row. Not range-checked
            (a check would sync): a tag above S reads out of bounds.
        row_repeat: pair ``n`` reads row ``n // row_repeat``.
        tile: ``(BLOCK_M, warps, stages)``; None: :func:`table_tiles`'s.

    Returns:
        :class:`Intermediate`.

    Raises:
        ValueError: weights or scales of the wrong dtype, shape or layout, or ``tags``
            not ``row_repeat`` pairs per row.
    """
    _check(w13, w13_scale, "w13")
    n, hidden = tags.shape[0], rows.shape[1]
    if n != rows.shape[0] * row_repeat:
        raise ValueError(f"{n} tags for {rows.shape[0]} rows of {row_repeat} pairs each")
    S, inter = w13.shape[0], w13.shape[1] // 2
    bm, warps, stages = tile or table_tiles(hidden, inter, n, S, rows.device)[0]
    layout = sort_pairs(tags, S, bm)
    order, starts, counts, block_slot, block_first, grid_blocks = layout
    groups = -(-inter // GROUP)
    aq = torch.empty(n, inter, dtype=fp8_block.FP8_DTYPE, device=rows.device)
    a_s = torch.empty(n, groups, dtype=torch.float32, device=rows.device)
    if n:
        xq, xs = quantize_activations(rows)
        _w8a8_gate_up_kernel[(groups, grid_blocks)](
            xq, xq.stride(0), xs, xs.stride(0), xs.stride(1), order, block_slot, block_first,
            starts, counts, w13, w13.stride(0), w13_scale, w13_scale.stride(0),
            w13_scale.stride(1), aq, a_s, S, hidden, inter, groups,
            DT=_TL_DTYPES[rows.dtype], ROW_REPEAT=row_repeat, BLOCK_M=bm, G=GROUP,
            QMAX=FP8_MAX, AMAX_MIN=MIN_AMAX, num_warps=warps, num_stages=stages)
    return Intermediate(aq, a_s, layout, bm)


def w8a8_down(act: Intermediate, w2: torch.Tensor, w2_scale: torch.Tensor,
              out: torch.Tensor, tile: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """The down half: ``out[pair] = w2[slot] @ act`` on FP8 tensor cores, padding rows
    zeroed.

    Args:
        act: :func:`w8a8_gate_up`'s result (its rows are cut into ``tile``'s BLOCK_M
            afresh when that differs from the gate/up kernel's).
        w2: ``[S, H, I]`` float8_e4m3fn; ``w2_scale`` ``[S, ceil(H/128), ceil(I/128)]``
            float32 (layouts as :func:`w8a8_gate_up`'s weights).
        out: ``[N, H]`` contiguous, the activation dtype; written in full.
        tile: ``(BLOCK_M, BLOCK_N, warps, stages)``; None: :func:`table_tiles`'s.

    Returns:
        ``out``.

    Raises:
        ValueError: as :func:`w8a8_gate_up`.
    """
    _check(w2, w2_scale, "w2")
    order, starts, counts, block_slot, block_first, grid_blocks = act.layout
    n, inter = act.q.shape
    S, hidden = w2.shape[0], w2.shape[1]
    bm, bn, warps, stages = tile or table_tiles(hidden, inter, n, S, out.device)[1]
    if bm != act.block_m:  # the same slot order, cut into other row blocks
        block_slot, block_first, grid_blocks = block_layout(counts, n, bm)
    if n:
        _w8a8_down_kernel[(triton.cdiv(hidden, bn), grid_blocks)](
            act.q, act.scale, order, block_slot, block_first, starts, counts, w2,
            w2.stride(0), w2_scale, w2_scale.stride(0), w2_scale.stride(1), out, S, hidden,
            inter, act.scale.shape[1], BLOCK_M=bm, BLOCK_N=bn, G=GROUP, num_warps=warps,
            num_stages=stages)
    return out


def swiglu_tiled_fp8(w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor,
                     w2_scale: torch.Tensor, rows: torch.Tensor, tags: torch.Tensor,
                     out: torch.Tensor | None = None, row_repeat: int = 1,
                     gate_up_tile: tuple[int, int, int] | None = None,
                     down_tile: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """Unweighted SwiGLU of each pair with its own slot's FP8 expert, W8A8 (two Triton
    kernels after the activation quantizer; CUDA SM90, or the Triton interpreter).

    Args:
        w13, w13_scale, rows, tags, row_repeat: as :func:`w8a8_gate_up`.
        w2, w2_scale: as :func:`w8a8_down`.
        out: ``[N, H]`` contiguous result buffer in the rows' dtype, or None.
        gate_up_tile, down_tile: as :func:`w8a8_gate_up`'s and :func:`w8a8_down`'s
            ``tile`` (None: :func:`table_tiles`'s).

    Returns:
        ``[N, H]`` in the rows' dtype; zeros for padding rows.

    Raises:
        ValueError: as :func:`w8a8_gate_up` and :func:`w8a8_down`.
    """
    out = rows.new_empty(tags.shape[0], rows.shape[1]) if out is None else out
    if gate_up_tile is None or down_tile is None:  # one table lookup for the pair
        table = table_tiles(rows.shape[1], w13.shape[1] // 2, tags.shape[0], w13.shape[0],
                            rows.device)
        gate_up_tile, down_tile = gate_up_tile or table[0], down_tile or table[1]
    act = w8a8_gate_up(w13, w13_scale, rows, tags, row_repeat, gate_up_tile)
    return w8a8_down(act, w2, w2_scale, out, down_tile)


def w8a8_intermediate_reference(w13: torch.Tensor, w13_scale: torch.Tensor,
                                rows: torch.Tensor, tags: torch.Tensor,
                                row_repeat: int = 1) -> torch.Tensor:
    """``SiLU(gate) * up`` of each pair as :func:`w8a8_gate_up` computes it before the
    intermediate's quantization, in torch on any device: the token rows quantized
    (:func:`~elasticep.moe.experts.fp8_activations.quantize_activations_reference`),
    both operands dequantized exactly to float32, gate and up in float32, rounded to the
    rows' dtype, SiLU rounded, product rounded.

    Args: as :func:`w8a8_gate_up`.

    Returns:
        ``[N, I]`` in the rows' dtype, in pair order; zeros for padding rows.
    """
    dt, inter = rows.dtype, w13.shape[1] // 2
    xd = dequantize_activations(*quantize_activations_reference(rows))
    act = torch.zeros(tags.shape[0], inter, dtype=dt, device=rows.device)
    for slot in torch.unique(tags[tags > 0]).tolist():
        idx = torch.nonzero(tags == slot).squeeze(1)
        w = fp8_block.dequantize(w13[slot - 1], w13_scale[slot - 1])
        gu = xd[idx // row_repeat] @ w.T
        g, u = gu[:, :inter].to(dt).float(), gu[:, inter:].to(dt).float()
        act[idx] = ((g * torch.sigmoid(g)).to(dt).float() * u).to(dt)
    return act


def w8a8_down_reference(act_q: torch.Tensor, act_scale: torch.Tensor, w2: torch.Tensor,
                        w2_scale: torch.Tensor, tags: torch.Tensor,
                        dtype: torch.dtype) -> torch.Tensor:
    """:func:`w8a8_down` in torch: ``[N, I]`` quantized intermediate (pair order) and its
    ``[N, ceil(I/128)]`` scales dequantized exactly, times the dequantized ``w2`` of each
    pair's slot in float32, rounded once to ``dtype``; ``[N, H]``, zeros for padding."""
    ad = dequantize_activations(act_q, act_scale)
    out = torch.zeros(tags.shape[0], w2.shape[1], dtype=dtype, device=act_q.device)
    for slot in torch.unique(tags[tags > 0]).tolist():
        idx = torch.nonzero(tags == slot).squeeze(1)
        out[idx] = (ad[idx] @ fp8_block.dequantize(w2[slot - 1], w2_scale[slot - 1]).T).to(dtype)
    return out


def swiglu_w8a8_reference(w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor,
                          w2_scale: torch.Tensor, rows: torch.Tensor, tags: torch.Tensor,
                          row_repeat: int = 1) -> torch.Tensor:
    """:func:`swiglu_tiled_fp8` in torch on any device: the intermediate
    (:func:`w8a8_intermediate_reference`) quantized per token per 128 columns, then
    :func:`w8a8_down_reference`. Args and Returns as :func:`swiglu_tiled_fp8`."""
    act = w8a8_intermediate_reference(w13, w13_scale, rows, tags, row_repeat)
    q, s = quantize_activations_reference(act)
    return w8a8_down_reference(q, s, w2, w2_scale, tags, rows.dtype)
