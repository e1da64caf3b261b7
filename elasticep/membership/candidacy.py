"""How a coordinator replica process becomes a candidate for the leader lease before
torch is loaded (``--membership-store etcd://...``).

The replica's rendezvous TCPStore needs torch, whose import takes seconds on a loaded
host; etcd's client does not. So the child (``process.main``) imports the server
module, torch with it, on a thread of its own (:class:`BackgroundImport`) and
campaigns meanwhile. A standby still loading leaves a leader key that falls vacant to
the standbys that are ready for :data:`DEFER_S` (:func:`defer_while_loading`): elected,
it could serve only once its import ends, so a ready standby should win a dead
leader's lease first. With none ready (a second leader kill while the first one's
replacement starts) it is elected about :data:`DEFER_S` after the lease expired, and
serves once its import ends, instead of campaigning only then.
"""

from __future__ import annotations

import importlib
import threading
import time
from collections.abc import Callable
from types import ModuleType

from .errors import MembershipStoreError

# A standby still importing torch leaves a vacant leader key this long (seconds) to the
# ready standbys, which try every election.POLL_S; it looks this often.
DEFER_S = 0.5
DEFER_POLL_S = 0.05


class BackgroundImport:
    """``importlib.import_module(name)`` on a daemon thread of its own, started now.

    Import what the calling thread needs before starting one: two threads importing
    the same package at once (torch and etcd3gw both import multiprocessing) can give
    one of them the package half-initialized.

    Attributes:
        done: set once the import ended (imported or failed).
    """

    def __init__(self, name: str) -> None:
        self.done = threading.Event()
        self._module: ModuleType | None = None
        self._error: BaseException | None = None
        threading.Thread(target=self._run, args=(name,), daemon=True,
                         name="coord-import").start()

    def _run(self, name: str) -> None:
        try:
            self._module = importlib.import_module(name)
        except BaseException as e:  # noqa: BLE001 - raised again by module()
            self._error = e
        finally:
            self.done.set()

    def module(self) -> ModuleType:
        """The module, once imported; raises what its import raised."""
        self.done.wait()
        if self._error is not None:
            raise self._error
        assert self._module is not None  # set before done
        return self._module


def defer_while_loading(url: str, loaded: threading.Event, gone: Callable[[], bool]) -> None:
    """Return once ``loaded`` is set, ``gone()`` is true, or the leader key under
    ``url`` (``etcd://...``) stayed vacant :data:`DEFER_S` seconds (see the module
    docstring); at once if etcd does not answer (the campaign reports that)."""
    from .election import find_leader
    from .etcd_store import EtcdMembershipStore
    from .store import parse_store_url

    store = EtcdMembershipStore(parse_store_url(url))
    vacant_since = None
    try:
        while not loaded.is_set() and not gone():
            try:
                find_leader(store, 0.0)
                vacant_since = None
            except TimeoutError:  # no leader now
                now = time.monotonic()
                vacant_since = now if vacant_since is None else vacant_since
                if now - vacant_since >= DEFER_S:
                    return
            except MembershipStoreError:
                return  # the campaign says what etcd does
            loaded.wait(DEFER_POLL_S)
    finally:
        store.close()
