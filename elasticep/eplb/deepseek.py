"""DeepSeek-EPLB compatible load balancer (our implementation of the published algorithm).

Hierarchical policy, used when ``num_groups % num_nodes == 0``:
  1. pack expert groups onto nodes so node loads are balanced;
  2. replicate experts inside each node, always giving the next replica to the expert
     with the largest load per replica;
  3. pack the node's physical experts onto its GPUs, an equal number per GPU.
The global policy is the same with one group and one node.

Tie-breaking follows the reference so its published README example is reproduced:
items are packed in order of descending weight (equal weights by ascending index),
onto the lightest non-full pack (lowest index first), and a replica goes to the first
expert with the largest load per replica.
"""

from __future__ import annotations

import torch


def balanced_packing(weight: torch.Tensor, num_packs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pack n weighted items into ``num_packs`` packs of n / num_packs items each.

    Args:
        weight: [X, n] float, the weight of every item, one packing per row.
        num_packs: number of packs; must divide n.

    Returns:
        pack_index: [X, n] int64, the pack of each item.
        rank_in_pack: [X, n] int64, the position of each item inside its pack.

    Raises:
        ValueError: if ``num_packs`` does not divide n.
    """
    rows, n = weight.shape
    if num_packs <= 0 or n % num_packs:
        raise ValueError(f"{n} items cannot fill {num_packs} equal packs")
    per_pack = n // num_packs
    pack_index = torch.empty(rows, n, dtype=torch.int64)
    rank_in_pack = torch.empty(rows, n, dtype=torch.int64)
    if per_pack == 1:
        # One item per pack: the identity, as the reference does.
        pack_index[:] = torch.arange(n)
        rank_in_pack.zero_()
        return pack_index, rank_in_pack
    weight = weight.float().cpu()
    for x in range(rows):
        load = torch.zeros(num_packs, dtype=torch.float32)
        fill = torch.zeros(num_packs, dtype=torch.int64)
        for item in torch.sort(weight[x], descending=True, stable=True).indices.tolist():
            candidates = torch.where(fill < per_pack, load, torch.inf)
            pack = int(torch.argmin(candidates))
            pack_index[x, item] = pack
            rank_in_pack[x, item] = fill[pack]
            load[pack] += weight[x, item]
            fill[pack] += 1
    return pack_index, rank_in_pack


def replicate_experts(weight: torch.Tensor, num_phy: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Spread ``num_log`` experts over ``num_phy`` replicas, minimising the largest load per replica.

    Args:
        weight: [X, num_log] float, the load of every logical expert.
        num_phy: total replicas, at least ``num_log``.

    Returns:
        phy2log: [X, num_phy] int64, the logical expert of each replica; replica i < num_log
            is expert i, later ones are the redundant copies in the order they were made.
        replica_rank: [X, num_phy] int64, the index of each replica among its expert's.
        logcnt: [X, num_log] int64, the replica count of each expert.

    Raises:
        ValueError: if ``num_phy < num_log``.
    """
    rows, num_log = weight.shape
    if num_phy < num_log:
        raise ValueError(f"{num_phy} replicas cannot hold {num_log} experts")
    weight = weight.float()
    phy2log = torch.empty(rows, num_phy, dtype=torch.int64)
    replica_rank = torch.zeros(rows, num_phy, dtype=torch.int64)
    phy2log[:, :num_log] = torch.arange(num_log)
    logcnt = torch.ones(rows, num_log, dtype=torch.int64)
    row_ids = torch.arange(rows)
    for i in range(num_log, num_phy):
        # argmax returns the first maximum, which is the reference's tie-break.
        busiest = torch.argmax(weight / logcnt, dim=-1)
        phy2log[:, i] = busiest
        replica_rank[:, i] = logcnt[row_ids, busiest]
        logcnt[row_ids, busiest] += 1
    return phy2log, replica_rank, logcnt


def _inverse(perm: torch.Tensor) -> torch.Tensor:
    """Row-wise inverse of a permutation [X, n]."""
    inv = torch.empty_like(perm)
    inv.scatter_(1, perm, torch.arange(perm.shape[1]).expand_as(perm).contiguous())
    return inv


def rebalance_experts_hierarchical(
    weight: torch.Tensor, num_physical_experts: int, num_groups: int, num_nodes: int, num_gpus: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Hierarchical placement of replicas on nodes then GPUs.

    Args:
        weight: [L, E] float CPU, the load of every logical expert.
        num_physical_experts: replicas per layer, a multiple of ``num_gpus``.
        num_groups: expert groups; must divide E and be a multiple of ``num_nodes``.
        num_nodes: server nodes.
        num_gpus: GPUs, a multiple of ``num_nodes``.

    Returns:
        phy2log: [L, num_physical_experts] int64, the logical expert of every slot.
        replica_rank: [L, num_physical_experts] int64, each slot's index among its expert's.
        logcnt: [L, E] int64, replicas per logical expert.

    Raises:
        ValueError: when the sizes do not divide as required.
    """
    L, E = weight.shape
    if E % num_groups or num_groups % num_nodes or num_gpus % num_nodes:
        raise ValueError(f"bad grouping: E={E} groups={num_groups} nodes={num_nodes} gpus={num_gpus}")
    if num_physical_experts % num_gpus or num_physical_experts < E:
        raise ValueError(f"{num_physical_experts} replicas do not fit {num_gpus} GPUs / {E} experts")
    group_size = E // num_groups
    groups_per_node = num_groups // num_nodes
    experts_per_node = E // num_nodes
    phy_per_node = num_physical_experts // num_nodes
    phy_per_gpu = num_physical_experts // num_gpus

    # Step 1: groups -> nodes. "mlog" numbers experts node by node, so node n owns the
    # contiguous range [n * experts_per_node, (n + 1) * experts_per_node).
    group_load = weight.view(L, num_groups, group_size).sum(-1)
    node_of_group, pos_in_node = balanced_packing(group_load, num_nodes)
    group_start = (node_of_group * groups_per_node + pos_in_node) * group_size
    log2mlog = (group_start.unsqueeze(-1) + torch.arange(group_size)).flatten(1)
    mlog2log = _inverse(log2mlog)

    # Step 2: replicate inside each node; rows are (layer, node).
    mlog_load = weight.gather(1, mlog2log).view(L * num_nodes, experts_per_node)
    phy2mlog, replica_rank, mlogcnt = replicate_experts(mlog_load, phy_per_node)

    # Step 3: the node's replicas -> its GPUs, balancing the load per replica.
    replica_load = (mlog_load / mlogcnt).gather(1, phy2mlog)
    gpu, pos_in_gpu = balanced_packing(replica_load, num_gpus // num_nodes)
    slot_of_phy = gpu * phy_per_gpu + pos_in_gpu
    phy_of_slot = _inverse(slot_of_phy)

    node_offset = (torch.arange(num_nodes) * experts_per_node).repeat(L).unsqueeze(-1)
    slot2mlog = phy2mlog.gather(1, phy_of_slot) + node_offset
    phy2log = mlog2log.gather(1, slot2mlog.view(L, num_physical_experts))
    slot_rank = replica_rank.gather(1, phy_of_slot).view(L, num_physical_experts)
    logcnt = mlogcnt.view(L, E).gather(1, log2mlog)
    return phy2log, slot_rank, logcnt


def rebalance_experts(
    weight: torch.Tensor, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Entry point, compatible with DeepSeek EPLB's ``rebalance_experts``.

    Args:
        weight: [layers, num_logical_experts], load statistics (any real dtype/device).
        num_replicas: physical experts per layer, a multiple of ``num_gpus``.
        num_groups: expert groups.
        num_nodes: server nodes; hierarchical policy when it divides ``num_groups``.
        num_gpus: GPUs (EP ranks), a multiple of ``num_nodes``.

    Returns:
        phy2log: [layers, num_replicas] int64 CPU, the logical expert of every slot.
        log2phy: [layers, num_logical_experts, X] int64 CPU, each expert's slots in
            replica order, padded with -1; X is the largest replica count.
        logcnt: [layers, num_logical_experts] int64 CPU, replicas per expert.

    Raises:
        ValueError: when the sizes do not divide as required.
    """
    if weight.dim() != 2:
        raise ValueError(f"weight must be [layers, experts], got {tuple(weight.shape)}")
    weight = weight.float().cpu()
    L, E = weight.shape
    if num_groups > 0 and num_groups % num_nodes == 0:
        phy2log, rank, logcnt = rebalance_experts_hierarchical(weight, num_replicas, num_groups, num_nodes, num_gpus)
    else:
        phy2log, rank, logcnt = rebalance_experts_hierarchical(weight, num_replicas, 1, 1, num_gpus)
    X = int(logcnt.max())
    log2phy = torch.full((L, E * X), -1, dtype=torch.int64)
    log2phy.scatter_(1, phy2log * X + rank, torch.arange(num_replicas).expand(L, -1).contiguous())
    return phy2log, log2phy.view(L, E, X), logcnt
