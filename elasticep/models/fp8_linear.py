"""``y = x @ W.T (+ b)`` with ``W`` kept in block FP8: the dense projections' matmul.

``W [N, K]`` is float8_e4m3fn with float32 ``scale_inv [ceil(N/128), ceil(K/128)]``
(DeepSeek-V3's and HF's ``weight_block_size [128, 128]``, see
:mod:`elasticep.moe.experts.fp8_block`); the activations ``x [M, K]`` stay in the model
dtype (weight-only FP8: no activation quantization).

- :func:`fp8_linear_reference` (the CPU path, and the reference of the tests):
  ``W`` dequantized exactly to float32, the product in float32, cast once.
- :func:`fp8_linear_triton` (CUDA, bf16/fp16 activations): each program owns a
  ``BLOCK_M x BLOCK_N`` output tile and walks K one scale block (128 columns) at a
  time: the FP8 tile is widened to the activation dtype in registers (exact: every e4m3
  value is a bf16 and an fp16 value), multiplied on tensor cores with float32
  accumulation, and that block's partial sum is multiplied by its scale, one multiply
  per output feature per block. At decode sizes (M up to 64) one M tile covers the
  batch, so every weight byte is read once; when the N tiles alone would leave SMs
  idle, K is split over programs that write float32 partials, summed in a fixed order by
  a second kernel (deterministic, no atomics). Nothing reads the host, and the only
  allocation is the partials buffer, whose size is a function of the shapes, so the
  call is CUDA-graph safe.

The kernel and the reference round at the same point (once, at the end); they differ by
float32 summation order only (the reference multiplies each weight by its scale before
summing, the kernel after summing a block), which can move that final rounding by one
unit of the activation dtype.
"""

from __future__ import annotations

import functools

import torch

from elasticep.moe.experts import fp8_block

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs may lack triton: the reference serves them
    triton = None

_CHUNK = fp8_block.BLOCK[1]  # the K step: one scale block, so a step has one scale a row
DECODE_MAX_M = 64
# decode tiles (BLOCK_N, warps, stages); the M tile is the batch rounded up to a power of
# two, at least 16 (tl.dot's smallest)
DECODE_TILE = (32, 4, 4)
# prefill tiles (BLOCK_M, BLOCK_N, warps, stages)
PREFILL_TILE = (128, 128, 8, 3)
# Split K until the grid has about this many programs per SM, keeping at least
# MIN_SPLIT_CHUNKS scale blocks in each program. A split costs a second kernel, and a
# program already keeps its next stages' loads in flight, so only grids with fewer tiles
# than SMs split (Qwen3-30B-A3B's o_proj and DeepSeek-V3's q_a and kv_a at decode sizes;
# not the fused qkv). These tiles are not tuned on a GPU yet: `python -m
# bench.fp8_linear --sweep` times the alternatives.
PROGRAMS_PER_SM = 1
MIN_SPLIT_CHUNKS = 4
MAX_SPLIT = 16


def check_fp8_weight(q: torch.Tensor, scale_inv: torch.Tensor) -> None:
    """Raise ValueError unless ``q [N, K]`` is float8_e4m3fn with unit column stride and
    ``scale_inv`` is float32 ``[ceil(N/128), ceil(K/128)]`` with unit column stride."""
    if q.dim() != 2 or q.dtype != fp8_block.FP8_DTYPE:
        raise ValueError(f"an FP8 linear weight must be a float8_e4m3fn matrix, got "
                         f"{q.dtype} {list(q.shape)}")
    want = fp8_block.scale_shape(q.shape)
    if scale_inv.dtype != torch.float32 or tuple(scale_inv.shape) != want:
        raise ValueError(f"the scales of a {list(q.shape)} FP8 weight must be float32 "
                         f"{list(want)}, got {scale_inv.dtype} {list(scale_inv.shape)}")
    if q.stride(1) != 1 or scale_inv.stride(1) != 1:
        raise ValueError("FP8 weights and scales need unit column stride")


def fp8_linear_reference(x: torch.Tensor, q: torch.Tensor, scale_inv: torch.Tensor,
                         bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ dequantize(q, scale_inv).T + bias`` in float32, cast to ``x``'s dtype.

    Args:
        x: ``[..., K]`` activations, any float dtype, any device.
        q: ``[N, K]`` float8_e4m3fn weight on ``x``'s device.
        scale_inv: ``[ceil(N/128), ceil(K/128)]`` float32 block scales.
        bias: ``[N]`` or None.

    Returns:
        ``[..., N]`` in ``x``'s dtype.

    Raises:
        ValueError: a weight or scales of the wrong dtype or shape.
    """
    check_fp8_weight(q, scale_inv)
    w = fp8_block.dequantize(q, scale_inv, torch.float32)
    y = torch.nn.functional.linear(x.float(), w, None if bias is None else bias.float())
    return y.to(x.dtype)


def fp8_linear_ok(x: torch.Tensor) -> bool:
    """True when the Triton kernel can run for ``x``: CUDA, bf16/fp16 (else the reference;
    :func:`elasticep.models.fp8_prefill.fp8_project` decides)."""
    return triton is not None and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)


if triton is not None:

    # M follows the decode batch (every captured bucket) and split_chunks the plan: one
    # compiled kernel serves them all instead of one per value
    @triton.jit(do_not_specialize=["M", "split_chunks"])
    def _fp8_linear_kernel(x_ptr, x_stride, w_ptr, w_stride, s_ptr, s_stride, b_ptr, out_ptr,
                           out_stride, part_ptr, M, N, K, split_chunks,
                           HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr, CHUNK: tl.constexpr):
        pid_k = tl.program_id(2)
        offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        m_ok = offs_m < M
        n_ok = offs_n < N
        rows_x = x_ptr + offs_m.to(tl.int64)[:, None] * x_stride
        rows_w = w_ptr + offs_n.to(tl.int64)[:, None] * w_stride
        rows_s = s_ptr + (offs_n // CHUNK) * s_stride
        dt = x_ptr.dtype.element_ty
        k_lo = pid_k * split_chunks * CHUNK
        k_hi = tl.minimum(K, k_lo + split_chunks * CHUNK)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(k_lo, k_hi, CHUNK):
            offs_k = k0 + tl.arange(0, CHUNK)
            k_ok = offs_k < K
            x = tl.load(rows_x + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(rows_w + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            sc = tl.load(rows_s + k0 // CHUNK, mask=n_ok, other=0.0)
            acc += tl.dot(x, tl.trans(w.to(tl.float32).to(dt))) * sc[None, :]
        ok = m_ok[:, None] & n_ok[None, :]
        if SPLIT == 1:
            if HAS_BIAS:
                acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            tl.store(out_ptr + offs_m.to(tl.int64)[:, None] * out_stride + offs_n[None, :],
                     acc.to(out_ptr.dtype.element_ty), mask=ok)
        else:
            part = part_ptr + (pid_k * M + offs_m.to(tl.int64))[:, None] * N + offs_n[None, :]
            tl.store(part, acc, mask=ok)

    @triton.jit(do_not_specialize=["M"])
    def _split_sum_kernel(part_ptr, b_ptr, out_ptr, out_stride, M, N, HAS_BIAS: tl.constexpr,
                          SPLIT: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < N
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for s in tl.static_range(SPLIT):  # a fixed order: the same sum on every call
            acc += tl.load(part_ptr + (s * M + row) * N + offs, mask=ok, other=0.0)
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * out_stride + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


@functools.cache
def sm_count(device: torch.device) -> int:
    """The SMs of a CUDA ``device`` (what :func:`plan` fills)."""
    if device.type != "cuda":
        return 132  # the interpreter: plan as an H100 would, so its tests cover the split
    return torch.cuda.get_device_properties(device).multi_processor_count


def plan(M: int, N: int, K: int, sms: int) -> tuple[int, int, int, int, int]:
    """The launch of an ``[M, K] x [N, K]^T`` product on ``sms`` SMs (pure):
    ``(BLOCK_M, BLOCK_N, split, warps, stages)``; ``split`` programs share each output
    tile's K range, whole scale blocks each."""
    chunks = -(-K // _CHUNK)
    if M <= DECODE_MAX_M:
        bm = max(16, 1 << (M - 1).bit_length())
        bn, warps, stages = DECODE_TILE
    else:
        bm, bn, warps, stages = PREFILL_TILE
    tiles = -(-M // bm) * -(-N // bn)
    split = min(-(-PROGRAMS_PER_SM * sms // tiles), chunks // MIN_SPLIT_CHUNKS, MAX_SPLIT)
    return bm, bn, max(1, split), warps, stages


def fp8_linear_triton(x: torch.Tensor, q: torch.Tensor, scale_inv: torch.Tensor,
                      bias: torch.Tensor | None = None,
                      tile: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """:func:`fp8_linear_reference` as Triton kernels (CUDA, or CPU tensors under
    ``TRITON_INTERPRET=1``).

    Args:
        x: ``[..., K]`` activations: bf16/fp16 on CUDA (float32 only under the
            interpreter: compiled, a float32 ``tl.dot`` would run in TF32).
        q, scale_inv, bias: as :func:`fp8_linear_reference`, on ``x``'s device.
        tile: ``(BLOCK_M, BLOCK_N, split, warps, stages)`` to launch instead of
            :func:`plan`'s (the bench's sweep).

    Returns:
        ``[..., N]`` in ``x``'s dtype.

    Raises:
        ValueError: as :func:`fp8_linear_reference`, or ``x``'s last dimension is not K.
    """
    check_fp8_weight(q, scale_inv)
    N, K = q.shape
    if x.shape[-1] != K:
        raise ValueError(f"activations [..., {x.shape[-1]}] do not match an FP8 weight "
                         f"[{N}, {K}]")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    out = x.new_empty(M, N)
    if M == 0:
        return out.view(*lead, N)
    bm, bn, split, warps, stages = tile or plan(M, N, K, sm_count(x.device))
    chunks = -(-K // _CHUNK)
    split_chunks = -(-chunks // split)
    split = -(-chunks // split_chunks)  # no program left without a scale block
    part = torch.empty(split, M, N, dtype=torch.float32, device=x.device) if split > 1 else out
    b = bias if bias is not None else out
    _fp8_linear_kernel[(-(-M // bm), -(-N // bn), split)](
        x2, x2.stride(0), q, q.stride(0), scale_inv, scale_inv.stride(0), b, out, out.stride(0),
        part, M, N, K, split_chunks, HAS_BIAS=bias is not None, SPLIT=split, BLOCK_M=bm,
        BLOCK_N=bn, CHUNK=_CHUNK, num_warps=warps, num_stages=stages)
    if split > 1:
        block = min(1024, triton.next_power_of_2(N))
        _split_sum_kernel[(M, -(-N // block))](part, b, out, out.stride(0), M, N,
                                               HAS_BIAS=bias is not None, SPLIT=split,
                                               BLOCK=block, num_warps=4)
    return out.view(*lead, N)
