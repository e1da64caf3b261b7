"""The per-row expert kernels of decode against the bandwidth they could reach.

For Qwen3-30B-A3B's expert shape (H 2048, moe_intermediate 768, bf16) and a few rows,
each on its own expert (as at decode batch 1: 8 rows, 8 experts), it times
:func:`elasticep.moe.experts.small_batch_experts.swiglu_rows` under several tile choices and
the grouped GEMM path, and divides the expert bytes they must read by the time. The
bound is a device-to-device copy measured in the same run (2 x bytes / time).

Prints one JSON line per variant. GPU only.

    python -m bench.expert_gemv [--rows 8] [--experts 128]
    python -m bench.expert_gemv --exchange-forms 2,4   # the exchange's forms at one token
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from bench._commit import commit
from bench.gpu_run import _time_cuda as cuda_ms  # noqa: E402 - one CUDA-event median timer
from elasticep.moe.exchange.padded_exchange import row_width, split_rows
from elasticep.moe.experts.expert_compute import grouped_swiglu
from elasticep.moe.experts.small_batch_experts import swiglu_rows
from elasticep.moe.experts.sorted_experts import swiglu_sorted


def copy_bandwidth(dev: torch.device, nbytes: int = 1 << 30) -> float:
    """Bytes per second of a device-to-device copy (read + write counted)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    return 2 * nbytes / (cuda_ms(lambda: dst.copy_(src), 10) / 1e3)


def sorted_vs_grouped(w13: torch.Tensor, w2: torch.Tensor, counts: list[int],
                      copy_bw: float) -> None:
    """The sorted-rows kernels against the grouped GEMM (and the per-row kernels where
    they apply) for rows drawn uniformly over the experts, as at decode batch N/k."""
    S, two_i, H = w13.shape
    inter = two_i // 2
    gen = torch.Generator(device=w13.device).manual_seed(0)
    tiles = [None, ((16, 128, 128, 4), (16, 128, 128, 4)), ((16, 64, 256, 4), (16, 64, 256, 4)),
             ((16, 32, 256, 4), (16, 32, 256, 4)), ((32, 64, 128, 4), (32, 64, 128, 4))]
    for n in counts:
        rows = torch.randn(n, H, device=w13.device, dtype=w13.dtype, generator=gen)
        tags = torch.randint(1, S + 1, (n,), device=w13.device, generator=gen, dtype=torch.int32)
        need = int(tags.unique().numel()) * 3 * inter * H * w13.element_size()
        ref = grouped_swiglu(w13, w2, rows, tags, use_grouped=False).float()
        cases = {"grouped_gemm": lambda r=rows, t=tags: grouped_swiglu(w13, w2, r, t,
                                                                       use_grouped=True)}
        if n <= 64:
            cases["per-row"] = lambda r=rows, t=tags: swiglu_rows(w13, w2, r, t)
        for tile in tiles:
            name = "sorted" + ("" if tile is None else f" gate_up={tile[0]} down={tile[1]}")
            cases[name] = (lambda r=rows, t=tags, tile=tile: swiglu_sorted(
                w13, w2, r, t, gate_up_tile=tile and tile[0], down_tile=tile and tile[1]))
        for name, fn in cases.items():
            err = float((fn().float() - ref).abs().max() / ref.abs().max())
            ms = cuda_ms(fn, 30)
            print(json.dumps({"bench": "expert_sorted", "variant": name, "rows": n,
                              "experts_touched": int(tags.unique().numel()), "ms": round(ms, 4),
                              "fraction_of_copy_bw": round(need / (ms / 1e3) / copy_bw, 3),
                              "rel_err": err}), flush=True)


def graph_us_per_layer(layer_fn, layers: int, reps: int = 20) -> float:
    """Microseconds per layer of ``layer_fn(l)`` for l in range(layers), captured in one
    CUDA graph and replayed (launch gaps as in a decode step's graph, none from Python)."""
    for layer in range(layers):  # compile and warm outside the capture
        layer_fn(layer)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for layer in range(layers):
            layer_fn(layer)
    return cuda_ms(graph.replay, reps) * 1e3 / layers


def exchange_forms(H: int, inter: int, rows_per_source: int, group_size: int,
                   layers: int = 48, experts: int = 16) -> None:
    """The decode MoE stages of one layer at one token (``rows_per_source`` pairs, each on
    its own expert), per layer of a graph of ``layers`` layers with their own weights: the
    in-process engine's two expert kernels on the pairs' rows, against the same-host
    exchange on rank 0 of ``group_size`` slots with no peer active (``--ep-size 1
    --max-ep-size G``): its expert kernels with the fused down-and-send (``plain``), the
    unfused expert kernels plus the combine send, and the fused dispatch send, to G slots
    and to one; and the router's top-k kernel followed by the dispatch send against the
    dispatch send that routes the token itself. Prints one JSON line."""
    from elasticep.models.fused_routing import fused_softmax_topk
    from elasticep.moe.exchange.ipc_exchange import IpcExchange, IpcHandle
    from elasticep.moe.experts.small_batch_experts import gate_up_rows
    from elasticep.moe.fused_exchange import FusedForms
    from elasticep.moe.softmax_topk import SoftmaxTopk

    dev, dt, C, G = torch.device("cuda"), torch.bfloat16, rows_per_source, group_size
    gen = torch.Generator(device=dev).manual_seed(0)
    w13 = [torch.randn(experts, 2 * inter, H, device=dev, dtype=dt, generator=gen) / H**0.5
           for _ in range(layers)]
    w2 = [torch.randn(experts, H, inter, device=dev, dtype=dt, generator=gen) / inter**0.5
          for _ in range(layers)]
    ex = IpcExchange(0, G, C, H, dt, 1, dev)
    fex = FusedForms(ex)
    rows, tags = split_rows(ex.recv0[:G * C], H)
    rows.copy_(torch.randn(G * C, H, device=dev, dtype=dt, generator=gen))
    tags.zero_()
    tags[:C].copy_((torch.randperm(experts, device=dev, generator=gen)[:C] + 1).to(torch.int32))
    bound = ex.tag_cap(experts)
    own_rows, own_tags = rows[:C].contiguous(), tags[:C].contiguous()
    act = rows.new_empty(G * C, inter)
    out = rows.new_empty(G * C, H)
    # the exchange's handle as the dispatch of layer 0 leaves it (its pairs' rows unused)
    handle = IpcHandle(torch.arange(C, device=dev), C, dt, 0, experts)

    # every stage through the exchange's own calls, as layer 0 of its one MoE layer
    def plain(layer: int) -> None:
        gate_up_rows(w13[layer], rows, tags, act, tag_bound=(bound, C))
        fex.send_combine_down(act, tags, w2[layer], handle)

    forms = {
        "engine": lambda layer: swiglu_rows(w13[layer], w2[layer], own_rows, own_tags),
        "plain": plain,
        "unfused": lambda layer: ex.send_combine(
            swiglu_rows(w13[layer], w2[layer], rows, tags, out=out, tag_bound=(bound, C)),
            handle),
    }
    # the dispatch send of the token's pairs (the fused kernel at this size), into
    # exchanges of their own (it rewrites the receive rows), to G slots and to one
    hidden = torch.randn(1, H, device=dev, dtype=dt, generator=gen)
    ids = torch.randperm(experts, device=dev, generator=gen)[:C].view(1, C)
    l2p = torch.arange(experts, device=dev)
    for name, e in (("dispatch", IpcExchange(0, G, C, H, dt, 1, dev)),
                    ("dispatch_one_destination", IpcExchange(0, 1, C, H, dt, 1, dev))):
        forms[name] = lambda layer, e=FusedForms(e): e.send_dispatch_static(
            hidden, ids, l2p, experts, C, 0)
    # the router's top-k kernel then the dispatch, against the routing inside the send
    # (Qwen3-30B-A3B: 128 logical experts, top-8, renormalised)
    logits = torch.randn(1, 128, device=dev, dtype=dt, generator=gen)
    rule = SoftmaxTopk(C, True)
    l2p128 = torch.randperm(128, device=dev, generator=gen) % (G * experts)
    e_route = FusedForms(IpcExchange(0, G, C, H, dt, 1, dev))
    forms["router_then_dispatch"] = lambda layer: e_route.send_dispatch_static(
        hidden, fused_softmax_topk(logits, C, True, 1.0, dt)[0], l2p128, experts, C, 0)
    forms["routed_dispatch"] = lambda layer: e_route.send_dispatch_routed(
        hidden, logits, rule, l2p128, experts, C, 0)
    result = {name: round(graph_us_per_layer(fn, layers), 2) for name, fn in forms.items()}
    # the combine rows of the exchange's forms against the engine's output
    ref = swiglu_rows(w13[0], w2[0], own_rows, own_tags).float()
    errs = {}
    for name in ("plain", "unfused"):
        ex.recv1.zero_()
        forms[name](0)
        errs[name] = float((ex.recv1[:C].float() - ref).abs().max() / ref.abs().max())
    print(json.dumps({"bench": "expert_exchange_forms", "commit": commit(), "hidden": H, "inter": inter,
                      "rows_per_source": C, "group_size": G, "layers": layers,
                      "us_per_layer": result, "rel_err": errs}), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--sorted-rows", default="64,128,256,512,2048",
                    help="row counts for the sorted-rows kernels against the grouped GEMM")
    ap.add_argument("--only-sorted", action="store_true", help="skip the tile and layout runs")
    ap.add_argument("--exchange-forms", default="",
                    help="only the exchange's decode expert forms, for these max_ep_size "
                         "values (comma-separated), at one token")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("expert_gemv: needs CUDA", file=sys.stderr)
        return 2
    if args.exchange_forms:
        for g in args.exchange_forms.split(","):
            exchange_forms(args.hidden, args.inter, args.rows, int(g))
        return 0
    dev, dt = torch.device("cuda"), torch.bfloat16
    S, H, inter, n = args.experts, args.hidden, args.inter, args.rows
    w13 = torch.randn(S, 2 * inter, H, device=dev, dtype=dt) / H**0.5
    w2 = torch.randn(S, H, inter, device=dev, dtype=dt) / inter**0.5
    rows = torch.randn(n, H, device=dev, dtype=dt)
    tags = (torch.randperm(S, device=dev)[:n] + 1).to(torch.int32)  # distinct experts
    copy_bw = copy_bandwidth(dev)
    sorted_vs_grouped(w13, w2, [int(x) for x in args.sorted_rows.split(",") if x], copy_bw)
    if args.only_sorted:
        return 0
    need = n * 3 * inter * H * 2  # each row's expert: w13 and w2
    ref = grouped_swiglu(w13, w2, rows, tags, use_grouped=False).float()
    variants = {"grouped_gemm": lambda: grouped_swiglu(w13, w2, rows, tags, use_grouped=True)}
    # the default tiles on each layout the kernels are given in the engine: contiguous
    # rows, the exchange's strided view, and one token's row repeated (stride 0, EP1)
    recv = torch.zeros(n, row_width(H, dt), device=dev, dtype=dt)
    srows, stags = split_rows(recv, H)
    srows.copy_(rows)
    stags.copy_(tags)
    one = rows[:1].expand(n, H)
    ref_one = grouped_swiglu(w13, w2, one.contiguous(), tags, use_grouped=False).float()
    layouts = {"layout contiguous": (lambda: swiglu_rows(w13, w2, rows, tags), ref),
               "layout exchange view": (lambda: swiglu_rows(w13, w2, srows, stags), ref),
               "layout stride-0 rows": (lambda: swiglu_rows(w13, w2, one, tags), ref_one),
               "layout stride-0 rows copied": (
                   lambda: swiglu_rows(w13, w2, one.contiguous(), tags), ref_one)}
    for gu in ((16, 256, 4), (8, 256, 4), (32, 256, 4), (16, 512, 4), (16, 512, 8), (8, 512, 2),
               (32, 128, 4), (64, 128, 8)):
        for dn in ((32, 128, 4), (16, 256, 4), (64, 128, 8), (32, 256, 4), (16, 128, 2)):
            variants[f"rows gate_up={gu} down={dn}"] = (
                lambda gu=gu, dn=dn: swiglu_rows(w13, w2, rows, tags, gate_up_tile=gu, down_tile=dn))
    cases = {**{k: (fn, ref) for k, fn in variants.items()}, **layouts}
    for name, (fn, expect) in cases.items():
        err = float((fn().float() - expect).abs().max() / expect.abs().max())
        ms = cuda_ms(fn, 50)
        print(json.dumps({"bench": "expert_gemv", "variant": name, "rows": n, "ms": round(ms, 4),
                          "gb_per_s": round(need / (ms / 1e3) / 1e9, 1),
                          "fraction_of_copy_bw": round(need / (ms / 1e3) / copy_bw, 3),
                          "copy_tb_per_s": round(copy_bw / 1e12, 3), "rel_err": err}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
