"""A decode CUDA graph captured once replays across a death, a rejoin and a scale-up,
and its logits equal eager ones (issue 27; GPU only).

Rank 0 of the deployment of :mod:`tests._simulated_peers`: launch EP3 of
``--max-ep-size 4`` with ``--min-ep-size 2``, so every rank has the slots two ranks
need. Its graphs are captured once under the launch placement (the padded all_to_all
as eager boundaries between the pieces, against simulated idle peers). Then the real
placements of a death of rank 1 (orphans re-homed into reserved slots), its rejoin and a
scale-up to 4 ranks are copied in with ``set_placement``. After each, with the
executor's ``version`` and the capture count unmoved, every decode step replays the
same graphs, and its logits equal (within the bucket-padding tolerance of
tests/test_cuda_graph_ep_gpu.py):
- the eager forward under the same placement;
- the eager forward of a second executor that kept the launch placement (the same
  experts, elsewhere), so a replay that read a stale slot or map would fail here.
"""

from __future__ import annotations

import pytest
import torch

from tests._simulated_peers import rank0, rel_err

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.timeout(300)]

STEPS_PER_PHASE = 3


@pytest.mark.parametrize("redundant", [0, 16])
@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 2e-2), (torch.float32, 1e-4)])
def test_one_capture_replays_through_death_rejoin_and_scale_up(tmp_path, dtype, tol,
                                                               redundant):
    r = rank0(tmp_path, dtype, "cuda", redundant, cuda_graph=True)
    g = r.eng.runner.graphs
    assert g is not None and g.captures == 1
    version = r.ep.version
    launch = r.placements[0][1]
    ref = r.executor_under(launch)  # eager, the launch placement all along
    r.add_requests()
    errors: dict[str, list[tuple[float, float]]] = {}
    prev = None
    for name, p in r.placements:
        if prev is not None:
            assert not torch.equal(p.phy2log, prev.phy2log), name
            r.move(p)
        assert r.ep.version == version, f"{name}: the executor's tensors changed shape"
        assert g.captures == 1 and g._background is None, f"{name}: captured again"
        assert not any(g.stale(b) for b in g.buckets), name
        assert torch.equal(r.ep.metadata.physical_to_logical_map.cpu(), p.phy2log), name
        for _ in range(STEPS_PER_PHASE):
            batch = r.next_decode_batch()
            bound = max(batch.num_tokens, 5)  # as if a peer had 5 sequences
            replays = g.replays
            graph = r.logits(batch, bound, graph=True)
            assert g.replays == replays + 1, f"{name}: the step did not replay"
            same = rel_err(graph, r.logits(batch, bound, graph=False))
            other = rel_err(graph, r.logits(batch, bound, graph=False, ex=ref))
            errors.setdefault(name, []).append((same, other))
            assert same < tol and other < tol, (name, same, other)
            r.commit_step(batch, bound)
        prev = p
    print(f"{dtype} R={redundant}: relative max error (vs eager same placement, vs eager "
          f"launch placement) per step: {errors}")
    assert g.captures == 1 and r.ep.version == version
    assert g.replays >= STEPS_PER_PHASE * len(r.placements) * 2  # compared + committed
    if redundant == 0:  # rank 1's experts had no replica: some now sit in rank 0's reserve
        dead = dict(r.placements)["death"]
        assert not torch.equal(dead.local(0), launch.local(0))
