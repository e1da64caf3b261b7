"""One EP rank in-process, with its peers simulated (not a test module).

The graph tests of issue 27 need a rank whose placement goes through a death, a rejoin
and a scale-up, without more processes. Here rank 0 is a real model with a real
:class:`~elasticep.moe.cuda_executor.CudaEPMoEExecutor`; its padded all_to_all (an eager
boundary, also between the pieces of a replayed graph) is :class:`SimulatedPeers`,
which computes what idle peers would answer: every other active rank sends only
padding rows and runs its own experts (its slots under the current placement, weights
drawn from the same dummy checkpoint) on the rows rank 0 sent it; an inactive rank
receives nothing (checked) and sends zeros, as the elastic group zero-fills it.

The placements are the real ones (:mod:`elasticep.eplb.elastic`): launch EP3 of
``--max-ep-size 4`` with ``--min-ep-size 2``, the death of rank 1 (orphans re-homed into
reserved slots), its rejoin, and the scale-up to 4 ranks.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from elasticep.elastic.rank_model import CheckpointExperts, attach_ep_executor, load_rank_weights
from elasticep.elastic.step_header import agreed_max_tokens
from elasticep.engine.llm_engine import EngineConfig, LLMEngine
from elasticep.engine.request import GenerateRequest, SamplingParams
from elasticep.engine.scheduler import ScheduledBatch
from elasticep.eplb.elastic import reconcile_placement, repair_placement
from elasticep.eplb.metadata import ExpertLocationMetadata
from elasticep.eplb.placement import Placement, initial_placement
from elasticep.models.config import load_model_config
from elasticep.moe.cuda_executor import CudaEPMoEExecutor
from elasticep.moe.exchange.padded_exchange import split_rows
from elasticep.moe.experts.expert_compute import grouped_swiglu
from elasticep_testkit.paths import DEMO_MODEL

EP_SIZE, MAX_EP_SIZE, MIN_EP_SIZE, VICTIM = 3, 4, 2, 1


def membership_placements(num_layers: int, num_experts: int, redundant: int
                          ) -> list[tuple[str, Placement]]:
    """(name, placement) of launch, death of rank 1, its rejoin, scale-up to 4 ranks."""
    mask = lambda *r: torch.tensor([i in r for i in range(MAX_EP_SIZE)])  # noqa: E731
    launch = initial_placement(num_layers, num_experts, redundant, EP_SIZE,
                               max_ep_size=MAX_EP_SIZE, min_ep_size=MIN_EP_SIZE)
    dead = repair_placement(launch, mask(0, 2))
    back = reconcile_placement(dead, mask(0, 1, 2))
    up = reconcile_placement(back, mask(0, 1, 2, 3))
    return [("launch", launch), ("death", dead), ("rejoin", back), ("scale-up", up)]


def _own(p: Placement) -> Placement:
    """A copy of ``p`` with tensors of its own. An executor's metadata on the CPU
    aliases its placement's tensors (``.to("cpu")`` copies nothing), and a same-shape
    ``set_placement`` copies into them, which would rewrite the caller's placement."""
    return Placement(p.phy2log.clone(), p.num_logical_experts, p.slots_per_rank,
                     p.active_ranks.clone())


class ExpertBank:
    """Every (layer, expert)'s weights from the dummy checkpoint, read once.

    Args:
        load_fn: ``(layer, expert) -> (w13 [2I, H], w2 [H, I])``.
        moe_layers: the layers that have experts.
        num_experts: E (a slot holding E is EMPTY: zero weights).
    """

    def __init__(self, load_fn: CheckpointExperts, moe_layers: list[int], num_experts: int):
        self.moe_layers, self.E = moe_layers, num_experts
        # per layer [E + 1, 2I, H] / [E + 1, H, I]; row E (EMPTY) is zeros
        self._w13: dict[int, torch.Tensor] = {}
        self._w2: dict[int, torch.Tensor] = {}
        for layer in moe_layers:
            pairs = [load_fn(layer, e) for e in range(num_experts)]
            a, b = (torch.stack([*ts, torch.zeros_like(ts[0])]) for ts in zip(*pairs, strict=True))
            self._w13[layer], self._w2[layer] = a, b

    def rank_weights(self, p: Placement, rank: int, num_layers: int
                     ) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]]:
        """Per layer ``[S, 2I, H]`` / ``[S, H, I]`` of ``rank``'s slots under ``p`` (EMPTY
        slots zero; None for a dense layer)."""
        w13: list[torch.Tensor | None] = [None] * num_layers
        w2: list[torch.Tensor | None] = [None] * num_layers
        for layer in self.moe_layers:
            idx = p.local(rank)[layer].to(self._w13[layer].device)
            w13[layer] = self._w13[layer][idx].contiguous()
            w2[layer] = self._w2[layer][idx].contiguous()
        return w13, w2


class SimulatedPeers:
    """The padded all_to_all of rank ``me`` against idle simulated peers (an
    :data:`~elasticep.moe.exchange.padded_exchange.Exchange`).

    A call whose rows are wider than ``hidden_size`` (they carry the tag) is a dispatch,
    else the combine of the last dispatch. Dispatches go layer by layer over the bank's
    ``moe_layers``, forward after forward (:attr:`dispatches` counts them; a forward
    makes ``len(moe_layers)``).

    Raises (from a call):
        AssertionError: a pair was sent to an inactive rank (nothing is counted then).
    """

    def __init__(self, bank: ExpertBank, placement: Placement, num_layers: int,
                 hidden_size: int, me: int = 0) -> None:
        self.bank, self.num_layers, self.H, self.me = bank, num_layers, hidden_size, me
        self.dispatches = 0
        self._sent: torch.Tensor | None = None
        self._layer = -1
        self.set_placement(placement)

    def set_placement(self, p: Placement) -> None:
        """Follow a new placement (the peers' slots and weights)."""
        self.placement = p
        self._peer_weights = {d: self.bank.rank_weights(p, d, self.num_layers)
                              for d in p.live_ranks() if d != self.me}

    def __call__(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        # a graph replay calls the exchange between its pieces outside inference mode, on
        # buffers made inside it at capture; a real collective writes them without
        # autograd's check, and so must this stand-in
        with torch.inference_mode():
            self._exchange(out, inp)

    def _exchange(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        p, me, layers = self.placement, self.me, self.bank.moe_layers
        G = p.max_ep_size
        C = inp.shape[0] // G

        def block(t: torch.Tensor, d: int) -> torch.Tensor:
            return t[d * C:(d + 1) * C]

        if inp.shape[1] != self.H:  # a dispatch; peers are idle: they send only padding
            tags = split_rows(inp, self.H)[1].view(G, C)
            if bool((tags[~p.active_ranks.to(tags.device)] != 0).any()):
                raise AssertionError("a pair was sent to an inactive rank")
            self._layer = layers[self.dispatches % len(layers)]
            self.dispatches += 1
            self._sent = inp.clone()
            out.zero_()
            block(out, me).copy_(block(inp, me))
            return
        out.zero_()
        block(out, me).copy_(block(inp, me))
        for d, (w13, w2) in self._peer_weights.items():  # each peer runs my rows sent to it
            recv = torch.zeros_like(self._sent)
            block(recv, me).copy_(block(self._sent, d))
            rows, tags = split_rows(recv, self.H)
            y = grouped_swiglu(w13[self._layer], w2[self._layer], rows, tags, sync_free=True)
            block(out, d).copy_(block(y, me))


@dataclass
class Rank0:
    """Rank 0 of the simulated deployment: its engine, executor and peers.

    Attributes:
        eng: the engine (decode graphs captured at start-up when on CUDA).
        ep: its executor (the model's ``executor.inner``).
        sim: its exchange.
        bank: the experts' weights.
        placements: :func:`membership_placements`.
    """

    eng: LLMEngine
    ep: CudaEPMoEExecutor
    sim: SimulatedPeers
    bank: ExpertBank
    placements: list[tuple[str, Placement]]

    def move(self, p: Placement) -> None:
        """Apply ``p`` to rank 0 and its peers, as a survivor's ``set_placement`` does
        (weights of the new placement copied into the current tensors)."""
        w13, w2 = self.bank.rank_weights(p, 0, len(self.ep.w13))
        dev = self.ep.metadata.physical_to_logical_map.device
        self.ep.set_placement(ExpertLocationMetadata.from_placement(_own(p), 0, dev), w13, w2)
        self.sim.set_placement(p)

    def executor_under(self, p: Placement) -> CudaEPMoEExecutor:
        """A second executor for rank 0 under ``p``, with its own simulated peers (the
        eager reference of another placement)."""
        n = len(self.ep.w13)
        w13, w2 = self.bank.rank_weights(p, 0, n)
        dev = self.ep.metadata.physical_to_logical_map.device
        ex = CudaEPMoEExecutor(ExpertLocationMetadata.from_placement(_own(p), 0, dev), w13, w2,
                               None)
        ex.token_buckets = self.ep.token_buckets
        ex._exchange = SimulatedPeers(self.bank, p, n, self.sim.H)
        return ex

    def logits(self, batch: ScheduledBatch, bound: int, graph: bool,
               ex: CudaEPMoEExecutor | None = None) -> torch.Tensor:
        """``[B, V]`` float32 logits of a decode ``batch`` (a copy), as if the step's
        agreed largest batch were ``bound``: through the captured graphs (``graph``, with
        :attr:`ep`) or eagerly through ``ex`` (default :attr:`ep`). Commits nothing.

        Raises:
            AssertionError: the forward left the exchange between layers (its
                dispatches are not a whole number of forwards).
        """
        ex = self.ep if ex is None else ex
        runner, hooked = self.eng.runner, self.eng.model.executor
        saved = hooked.inner, runner.graphs
        hooked.inner = ex
        if not graph:
            runner.graphs = None
        try:
            with agreed_max_tokens(ex, bound):
                out = runner.forward(batch).clone()
        finally:
            hooked.inner, runner.graphs = saved
        n = ex._exchange.dispatches
        assert n % len(self.bank.moe_layers) == 0, n
        return out

    def commit_step(self, batch: ScheduledBatch, bound: int) -> None:
        """Run ``batch`` as the serving loop does (graphs where they apply) and commit."""
        with agreed_max_tokens(self.ep, bound):
            self.eng.commit(batch, self.eng.execute(batch))

    def add_requests(self, lengths: tuple[int, ...] = (5, 33, 17), max_tokens: int = 40,
                     seed: int = 0) -> None:
        """Greedy requests of random prompts (token ids in [10, 8000)) of ``lengths``."""
        gen = torch.Generator().manual_seed(seed)
        for i, n in enumerate(lengths):
            prompt = torch.randint(10, 8000, (n,), generator=gen).tolist()
            self.eng.add_request(GenerateRequest(
                f"r{i}", tuple(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True)))

    def next_decode_batch(self) -> ScheduledBatch:
        """Run (and commit) prefill steps until the scheduled batch is a decode step of
        every request; return it (not run).

        Raises:
            AssertionError: no decode step came within 10 steps.
        """
        for _ in range(10):
            batch = self.eng.schedule()
            if batch.items and all(it.end - it.start == 1 for it in batch.items):
                return batch
            self.commit_step(batch, max(batch.num_tokens, 1))
        raise AssertionError("no decode step within 10 steps")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """``max |a - b| / max |b|`` (0 for empty tensors)."""
    assert a.shape == b.shape, (a.shape, b.shape)
    return float((a - b).abs().max() / b.abs().max()) if b.numel() else 0.0


def rank0(tmp_path: Path, dtype: torch.dtype, device: str, redundant: int,
          cuda_graph: bool) -> Rank0:
    """Rank 0 under the launch placement, demo model with dummy weights.

    Raises:
        RuntimeError: torch.distributed is initialized (the executor would check the
            default group's size against ``--max-ep-size``).
    """
    import torch.distributed as dist
    if dist.is_initialized():
        raise RuntimeError("needs no process group (an earlier test left one)")
    shutil.copy(DEMO_MODEL / "config.json", tmp_path / "config.json")
    cfg = load_model_config(tmp_path)
    placements = membership_placements(cfg.num_hidden_layers, cfg.num_experts, redundant)
    launch = placements[0][1]
    model = load_rank_weights(tmp_path, launch, 0, dtype, device, load_format="dummy")
    ep, _ = attach_ep_executor(model, _own(launch), 0, None, "static")
    if not isinstance(ep, CudaEPMoEExecutor):  # CPU tensors: the same executor, by hand
        model.executor.inner = ep = CudaEPMoEExecutor(ep.metadata, ep.w13, ep.w2, None)
    moe_layers = [i for i, w in enumerate(ep.w13) if w is not None]
    bank = ExpertBank(CheckpointExperts(model, tmp_path, "dummy"), moe_layers, cfg.num_experts)
    eng = LLMEngine(model, EngineConfig(max_total_tokens=4096, max_num_seqs=8,
                                        forward_empty_batches=True,
                                        enable_cuda_graph=cuda_graph))
    sim = SimulatedPeers(bank, launch, cfg.num_hidden_layers, cfg.hidden_size)
    ep._exchange = sim  # read at every call, by eager steps and by graph replays alike
    return Rank0(eng, ep, sim, bank, placements)
