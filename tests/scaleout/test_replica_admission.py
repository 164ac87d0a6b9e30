"""A Ray Serve replica hands every request it is given to its server's own admission: a tenant
flooding one replica is refused at once (429) past its share by the server's fair queue, instead
of waiting first come, first served in front of it (``benchmarks/bench_overload.py --ray``). The
replica's forwarding (``ReplicaCore``) runs here without a cluster, on the tests' tiny root."""

import asyncio
import json
from collections import Counter

from hmi.scaleout.ray_serve import Forwarded, ReplicaCore
from tests.helpers.servers import ADMIN, tiny_server, train_once

FLOOD = 300  # requests at once: more than a pooled connection limit (aiohttp's default is 100)
TENANT_QUEUE = 150


def test_a_flood_through_a_replica_meets_its_servers_fair_queue_and_is_refused_at_once_past_its_share(
        tmp_path, monkeypatch):
    monkeypatch.setenv("HMI_ADMIN_TOKEN", ADMIN)
    out = train_once(tmp_path, "alpha")
    # Batches wait up to 3 s for 512 requests: the flood is all waiting at once.
    core = ReplicaCore(lambda: tiny_server(tmp_path, shared_home=True, max_batch=512, max_wait_ms=3000,
                                           tenant_queue=TENANT_QUEUE))
    body = json.dumps({"inputs": ["a wonderful film"]}).encode()
    headers = [("Authorization", f"Bearer {out['token']}"), ("Content-Type", "application/json")]

    async def flood() -> list[Forwarded]:
        async def held(_tenant):
            return None
        return await asyncio.gather(*(core.forward(Forwarded(0, "POST", "/v1/tenants/alpha/infer", headers, body),
                                                   "", held) for _ in range(FLOOD)))

    try:
        answers = asyncio.run(flood())
    finally:
        core.close()
    codes = Counter(a.status for a in answers)
    assert set(codes) == {200, 429} and codes[429] >= FLOOD - TENANT_QUEUE - 10, codes
    refused = json.loads(next(a.body for a in answers if a.status == 429))
    assert refused["error"]["code"] == "over_share", refused
