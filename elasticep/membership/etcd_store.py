"""The membership state in etcd (``--membership-store etcd://...``), through etcd's JSON
gateway with the ``etcd3gw`` client (see docs/design/ha_membership.md for why).

Keys, all under ``/elasticep/<prefix>/``:
- ``owner`` — the id of the deployment that claimed the prefix (a second deployment
  with the same prefix is refused);
- ``state`` — the :class:`MembershipState` JSON; its ``mod_revision`` is the revision a
  commit must name (fencing);
- ``leader`` — the elected coordinator, held by a lease (``election.py``).

:class:`EtcdKV` sends each request to one member and moves to the next member when one
does not answer, so a dead member costs one timeout, not the deployment.
"""

from __future__ import annotations

import base64
import logging
from collections.abc import Sequence
from typing import Any

import etcd3gw
import requests
from etcd3gw import exceptions as etcd_errors

from .durable_state import MembershipState
from .errors import (
    FencedCommitError,
    MembershipStoreError,
    PrefixInUseError,
    StoreUnavailableError,
)
from .store import StoreSpec, parse_store_url

log = logging.getLogger("elasticep.membership")

REQUEST_TIMEOUT_S = 1.0  # one member's answer; a commit needs a quorum's, well under this


def b64(data: str | bytes) -> str:
    """etcd's gateway wants keys and values in base64."""
    raw = data.encode() if isinstance(data, str) else data
    return base64.b64encode(raw).decode()


def unb64(text: str) -> bytes:
    return base64.b64decode(text)


class EtcdKV:
    """The few etcd v3 calls the coordinator uses, over every member given.

    Args:
        endpoints: ``(host, port)`` of the etcd members' client URLs.
        timeout_s: how long one member may take to answer (seconds).
    """

    def __init__(self, endpoints: Sequence[tuple[str, int]],
                 timeout_s: float = REQUEST_TIMEOUT_S) -> None:
        if not endpoints:
            raise ValueError("EtcdKV needs at least one endpoint")
        self.endpoints = list(endpoints)
        self._clients = [etcd3gw.Etcd3Client(host=h, port=p, timeout=timeout_s,
                                             api_path="/v3/") for h, p in endpoints]
        self._current = 0

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST ``body`` to the v3 API ``path`` (``"kv/txn"``) on the first member that
        answers, starting with the one that answered last.

        Raises:
            StoreUnavailableError: no member answered (all down, no quorum, or not etcd:
                an answer that is not a JSON object).
            MembershipStoreError: a member answered with an error (a lease it does not
                know, a malformed request).
        """
        errors = []
        n = len(self._clients)
        # read once: a lease keep-alive thread shares this object, and a start it moves
        # mid-loop would send this call back to a member it already tried and skip one
        start = self._current
        for i in range(n):
            k = (start + i) % n
            c = self._clients[k]
            try:
                out = c.post(c.get_url(path), json=body)
            except ValueError:  # requests' JSONDecodeError: another server on that port
                out = None
            except (etcd_errors.ConnectionFailedError, etcd_errors.ConnectionTimeoutError,
                    etcd_errors.InternalServerError,
                    requests.RequestException) as e:  # a reply cut short, say
                errors.append(f"{c.host}:{c.port}: {type(e).__name__}")
                continue
            except etcd_errors.Etcd3Exception as e:
                raise MembershipStoreError(f"etcd at {c.host}:{c.port} refused {path}: "
                                           f"{' '.join(str(e).split())[:200]}") from None
            if not isinstance(out, dict):
                errors.append(f"{c.host}:{c.port}: not an etcd gateway: its answer is not "
                              "a JSON object")
                continue
            self._current = k
            return out
        raise StoreUnavailableError("no etcd member answered (" + "; ".join(errors) + ")")

    def get(self, key: str) -> tuple[bytes | None, int, int]:
        """``(value, mod_revision, create_revision)`` of ``key``; ``(None, 0, 0)`` if
        it does not exist."""
        kvs = self.post("kv/range", {"key": b64(key)}).get("kvs") or []
        if not kvs:
            return None, 0, 0
        kv = kvs[0]
        return (unb64(kv.get("value", "")), int(kv.get("mod_revision", 0)),
                int(kv.get("create_revision", 0)))

    def txn(self, compare: list[dict], success: list[dict],
            failure: Sequence[dict] = ()) -> tuple[bool, dict]:
        """One etcd transaction: ``(succeeded, response)``."""
        out = self.post("kv/txn", {"compare": compare, "success": success,
                                   "failure": list(failure)})
        return bool(out.get("succeeded", False)), out

    def status(self) -> dict:
        """The answering member's status (raises StoreUnavailableError if none)."""
        return self.post("maintenance/status", {})

    def close(self) -> None:
        for c in self._clients:
            c.session.close()


def _put(key: str, value: str | bytes, lease: int | None = None) -> dict:
    req: dict[str, Any] = {"key": b64(key), "value": b64(value)}
    if lease is not None:
        req["lease"] = lease
    return {"request_put": req}


def _range(key: str) -> dict:
    return {"request_range": {"key": b64(key)}}


class EtcdMembershipStore:
    """:class:`~elasticep.membership.store.MembershipStore` on etcd.

    Args:
        spec: the parsed ``--membership-store`` (kind ``etcd``).
        kv: an :class:`EtcdKV` to use instead of opening one on ``spec.endpoints``.
        leader_id: if set, a commit also requires the ``leader`` key to name this id
            (the candidate of this replica's lease), so a replica whose lease passed to
            another cannot commit even before its successor has (fencing on the
            revision alone would then depose the successor instead).
    """

    def __init__(self, spec: StoreSpec, kv: EtcdKV | None = None,
                 leader_id: str | None = None) -> None:
        self.spec = spec
        self.kv = kv if kv is not None else EtcdKV(spec.endpoints)
        self.root = f"/elasticep/{spec.prefix}/"
        self.leader_id = leader_id

    def key(self, name: str) -> str:
        """The full key of record ``name`` (``owner``, ``state``, ``leader``)."""
        return self.root + name

    def claim(self, deployment_id: str) -> None:
        """See :class:`~elasticep.membership.store.MembershipStore`. A prefix whose
        deployment has no elected coordinator (it stopped, or died a lease TTL ago) is
        taken over: its state is deleted in the same transaction, so its coordinator,
        should it come back, finds its commits fenced."""
        owner = self.key("owner")
        ok, out = self.txn_create(owner, deployment_id)
        if ok:
            log.info("membership store: prefix %s claimed by deployment %s", self.root,
                     deployment_id)
            return
        held = _range_value(out)
        if held == deployment_id.encode():
            return
        leader = self.key("leader")
        ok, _ = self.kv.txn(
            [{"key": b64(owner), "result": "EQUAL", "target": "VALUE", "value": b64(held or b"")},
             {"key": b64(leader), "result": "EQUAL", "target": "CREATE", "create_revision": 0}],
            [_put(owner, deployment_id), {"request_delete_range": {"key": b64(self.key("state"))}}])
        name = (held or b"?").decode(errors="replace")
        if ok:
            log.warning("membership store: prefix %s taken over from deployment %s, which "
                        "has no coordinator", self.root, name)
            return
        raise PrefixInUseError(
            f"etcd prefix {self.root} is held by deployment {name!r}, whose coordinator is "
            f"running; give this deployment another prefix (etcd://HOST:PORT/PREFIX)")

    def txn_create(self, key: str, value: str, lease: int | None = None) -> tuple[bool, dict]:
        """Create ``key`` if it does not exist; on failure the response holds its value."""
        return self.kv.txn([{"key": b64(key), "result": "EQUAL", "target": "CREATE",
                             "create_revision": 0}], [_put(key, value, lease)], [_range(key)])

    def load(self) -> tuple[MembershipState | None, int]:
        value, mod_rev, _ = self.kv.get(self.key("state"))
        return (None if value is None else MembershipState.from_json(value)), mod_rev

    def commit(self, state: MembershipState, expected_revision: int) -> int:
        key = self.key("state")
        compare = [{"key": b64(key), "result": "EQUAL", "target": "MOD",
                    "mod_revision": expected_revision}]
        if self.leader_id is not None:
            compare.append({"key": b64(self.key("leader")), "result": "EQUAL",
                            "target": "VALUE", "value": b64(self.leader_id)})
        ok, out = self.kv.txn(compare, [_put(key, state.to_json())])
        if not ok:
            raise FencedCommitError(f"membership state under {self.root} changed since "
                                    f"revision {expected_revision}, or {self.leader_id} no "
                                    "longer leads: this coordinator is deposed")
        return int(out["header"]["revision"])

    def close(self) -> None:
        self.kv.close()


def _range_value(txn_out: dict) -> bytes | None:
    """The value the failure branch's range read, if any."""
    for r in txn_out.get("responses", []):
        kvs = (r.get("response_range") or {}).get("kvs") or []
        if kvs:
            return unb64(kvs[0].get("value", ""))
    return None


def open_etcd_store(spec: StoreSpec, deployment_id: str) -> EtcdMembershipStore:
    """Connect to etcd and claim ``spec.prefix`` for ``deployment_id``: what `serve`
    does before it starts anything, so a bad store is refused at once.

    Raises:
        StoreUnavailableError: no member answered.
        PrefixInUseError: another deployment holds the prefix.
    """
    store = EtcdMembershipStore(spec)
    try:
        store.kv.status()
        store.claim(deployment_id)
    except BaseException:
        store.close()
        raise
    return store


def find_coordinator(url: str, timeout_s: float, quiet: bool = False) -> str:
    """The address (``HOST:PORT``) of the coordinator elected under ``url``
    (``--membership-store etcd://...``), waiting up to ``timeout_s`` seconds for one.
    ``quiet``: log the find at debug level (clients that look it up on each reconnect).

    Raises:
        StoreUnavailableError: etcd did not answer.
        TimeoutError: no coordinator leads there within ``timeout_s``.
    """
    from .election import find_leader  # election imports this module

    store = EtcdMembershipStore(parse_store_url(url))
    try:
        address = find_leader(store, timeout_s)
    finally:
        store.close()
    log.log(logging.DEBUG if quiet else logging.INFO, "coordinator %s found through etcd "
            "(%s)", address, store.root)
    return address
