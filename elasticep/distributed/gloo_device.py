"""Which network interface this process's inner Gloo groups use.

Torch's ``ProcessGroupGloo(store, rank, size, timeout)`` binds the address that the
machine's hostname resolves to, and falls back to loopback when that address is not
usable. Each rank publishes that address in the store for its peers to connect to, so a
hostname that resolves to 127.0.0.1 (common in /etc/hosts), or to an address of another
network namespace, gives peers on other hosts an address they cannot reach: the group's
rendezvous hangs until its timeout.

The rule here, in order:

1. ``GLOO_SOCKET_IFNAME`` (Gloo's own variable; serve and join set it from
   ``--gloo-socket-ifname``): the named interface(s), comma-separated, as torch does;
2. otherwise the local address of this process's control connection to the
   coordinator: the address the kernel routes towards ``--dist-init-addr``, which on a
   single machine is 127.0.0.1 and across hosts the interface facing node 0.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch.distributed as dist

IFNAME_ENV = "GLOO_SOCKET_IFNAME"

_devices: dict[str, list] = {}  # local address -> Gloo devices (one set per process)


def gloo_devices(local_addr: str) -> list:
    """The Gloo devices for this process's groups (see the module doc for the rule).

    Args:
        local_addr: this process's address towards the coordinator (the local end of
            its control connection).

    Returns:
        ``ProcessGroupGloo.Device`` objects, one per interface named in
        ``GLOO_SOCKET_IFNAME``, else one bound to ``local_addr``.

    Raises:
        RuntimeError: torch cannot open a named interface (its message names it).
    """
    names = [n for n in os.environ.get(IFNAME_ENV, "").split(",") if n]
    key = f"if:{','.join(names)}" if names else local_addr
    if key not in _devices:
        make = dist.ProcessGroupGloo.create_device
        _devices[key] = ([make(interface=n) for n in names] if names
                         else [make(hostname=local_addr)])
    return _devices[key]


def new_gloo_group(store: dist.Store, rank: int, size: int, timeout: timedelta,
                   local_addr: str) -> dist.ProcessGroupGloo:
    """A ``ProcessGroupGloo`` of ``size`` members on the interface :func:`gloo_devices`
    picks; blocks until every member has joined through ``store``.

    Args:
        store: the rendezvous store (already prefixed for this group).
        rank: this member's index in [0, size).
        timeout: bound of the rendezvous and of every op.
        local_addr: this process's address towards the coordinator.

    Raises:
        RuntimeError: a member did not join within ``timeout``, or the interface failed.
    """
    opts = dist.ProcessGroupGloo._Options()
    opts._devices = gloo_devices(local_addr)
    opts._timeout = timeout
    return dist.ProcessGroupGloo(store, rank, size, opts)
