"""Which tenant's turn a request waits for: fairness only between tenants someone vouches for.

The queue takes turns between tenants (kvgate/gate/queue.py), so a tenant is a share of the
backend. A tenant named by a trusted gateway's header (--tenant-header) is vouched for: it has
its own turn. Without one, the tenant is a digest of the API key, which kvgate cannot check
(vLLM checks keys after admission, and only when run with --api-key): a client inventing a new
key per request used to become that many tenants and take that many turns, starving an honest
key (issue 28: 10 x 429 queue_timeout). So an unchecked key earns a turn of its own only from
its second request on; a key seen for the first time waits in one turn shared by all new keys.
A client rotating made-up keys therefore holds one turn however many keys it invents, and at
most --max-tenants keys that came back hold turns of their own (the least recently seen is
forgotten first). Keys seen once are remembered in a separate list, so that a flood of new keys
cannot push out the keys that have come back.
"""

from __future__ import annotations

from collections import OrderedDict

# The turn every key seen for the first time shares. Tenant names are never empty (a blank
# header counts as absent, a key digest has 12 hex digits), so it cannot be a real tenant's.
NEW_KEYS = ""
# Keys seen once that are remembered, per --max-tenants of keys that came back.
_SEEN_ONCE_PER_TENANT = 4


class TenantTurns:
    """Maps a request's tenant to the queue turn it waits for; bounded memory (5 x max_tenants keys)."""

    def __init__(self, max_tenants: int) -> None:
        if max_tenants < 1:
            raise ValueError(f"max_tenants must be at least 1, got {max_tenants}")
        self.max_tenants = max_tenants
        self._returning: OrderedDict[str, None] = OrderedDict()  # least recently seen first
        self._seen_once: OrderedDict[str, None] = OrderedDict()

    def turn(self, tenant: str, vouched: bool) -> str:
        """The turn for a request of `tenant`; `vouched`: named by the trusted gateway's header."""
        if vouched:
            return tenant
        if tenant in self._returning:
            self._returning.move_to_end(tenant)
            return tenant
        if tenant in self._seen_once:
            del self._seen_once[tenant]
            self._returning[tenant] = None
            if len(self._returning) > self.max_tenants:
                self._returning.popitem(last=False)
            return tenant
        self._seen_once[tenant] = None
        if len(self._seen_once) > _SEEN_ONCE_PER_TENANT * self.max_tenants:
            self._seen_once.popitem(last=False)
        return NEW_KEYS

    @property
    def returning(self) -> int:
        """Keys that hold turns of their own now."""
        return len(self._returning)
