"""The base executor's transport: HTTP/1.1 on a kept-alive connection against a websocket, on
loopback, side by side in one run (rounds interleaved).

Usage: python benchmarks/bench_transport.py [--quick]

An aiohttp server (the product's server library) answers each body with a body of the same size
(what a projection call does, without the GEMM): ``POST /echo`` read with ``request.read()``, as
the executor's routes read a call; and binary messages on a websocket (``GET /ws``, aiohttp's
``WebSocketResponse``).  Clients: ``http.client`` on one kept-alive connection (as
``hmi.split.client.BaseClient``) and the ``websockets`` library's synchronous client.  Payloads
are a private call's sizes on MiniLM (8 texts x 64 tokens = 512 rows: 0.75 MiB at width 384,
3 MiB at width 1536) and a small one; 1 and 8 clients at once (threads).
"""

from __future__ import annotations

import asyncio
import http.client
import statistics
import threading
import time

from common import finish, machine, start, table

SIZES = {"16 KiB": 16 << 10, "0.75 MiB": 768 << 10, "3 MiB": 3 << 20}


def serve():
    """Starts the echo server on a free loopback port in a thread; returns (port, stop)."""
    from aiohttp import WSMsgType, web

    async def echo(request):
        return web.Response(body=await request.read(), content_type="application/octet-stream")

    async def ws(request):
        sock = web.WebSocketResponse(max_msg_size=64 << 20)
        await sock.prepare(request)
        async for msg in sock:
            if msg.type == WSMsgType.BINARY:
                await sock.send_bytes(msg.data)
        return sock

    app = web.Application(client_max_size=64 << 20)
    app.add_routes([web.post("/echo", echo), web.get("/ws", ws)])
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = site._server.sockets[0].getsockname()[1]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def stop():
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)

    return port, stop


def http_client(port: int):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)

    def call(body: bytes) -> bytes:
        conn.request("POST", "/echo", body=body, headers={"Content-Type": "application/octet-stream"})
        return conn.getresponse().read()

    return call, conn.close


def ws_client(port: int):
    from contextlib import ExitStack

    from websockets.sync.client import connect

    stack = ExitStack()
    sock = stack.enter_context(connect(f"ws://127.0.0.1:{port}/ws", max_size=64 << 20, compression=None))

    def call(body: bytes) -> bytes:
        sock.send(body)
        return sock.recv()

    return call, stack.close


def run(make, port: int, body: bytes, clients: int, calls: int) -> tuple[list[float], float]:
    """(seconds of each call, wall seconds) of ``clients`` threads making ``calls`` calls each,
    all started at once."""
    conns = [make(port) for _ in range(clients)]
    for call, _ in conns:
        assert len(call(body)) == len(body)  # warm, and checked
    times, barrier = [], threading.Barrier(clients)

    def work(call):
        barrier.wait()
        for _ in range(calls):
            t = time.perf_counter()
            call(body)
            times.append(time.perf_counter() - t)

    threads = [threading.Thread(target=work, args=(c,)) for c, _ in conns]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    for _, close in conns:
        close()
    return times, wall


def main() -> None:
    args = start(__doc__)
    port, stop = serve()
    rounds, calls = (3, 20) if args.quick else (5, 60)
    got: dict[tuple, list] = {}
    try:
        for _ in range(rounds):
            for size, n in SIZES.items():
                body = bytes(range(256)) * (n // 256)
                for clients in (1, 8):
                    for name, make in (("HTTP keep-alive", http_client), ("websocket", ws_client)):
                        times, wall = run(make, port, body, clients, calls)
                        entry = got.setdefault((size, clients, name), [[], 0.0, 0])
                        entry[0].extend(times)
                        entry[1] += wall
                        entry[2] += len(times)
    finally:
        stop()
    rows, res = [], {}
    for (size, clients, name), (times, wall, n) in got.items():
        p50 = statistics.median(times) * 1e6
        mib_s = 2 * n * SIZES[size] / wall / 2**20
        rows.append((size, clients, name, f"{p50:.0f}", f"{sorted(times)[int(0.99 * (len(times) - 1))] * 1e6:.0f}",
                     f"{n / wall:.0f}", f"{mib_s:.0f}"))
        res[f"{name.split()[0].lower()}_{size.replace(' ', '').replace('.', '_')}_{clients}_p50_us"] = round(p50, 1)
    for size in SIZES:
        for clients in (1, 8):
            h = statistics.median(got[size, clients, "HTTP keep-alive"][0])
            w = statistics.median(got[size, clients, "websocket"][0])
            res[f"websocket_over_http_p50_{size.replace(' ', '').replace('.', '_')}_{clients}"] = round(w / h, 3)
    text = (f"An aiohttp echo server and its clients in one process on loopback ({machine()}); {rounds} rounds of "
            f"{calls} calls a client, transports interleaved. Both directions carry the payload.\n\n"
            + table(rows, ("payload", "clients", "transport", "p50 us", "p99 us", "calls/s", "MiB/s both ways")))
    finish("bench_transport", text, res, "python benchmarks/bench_transport.py" + (" --quick" if args.quick else ""))


if __name__ == "__main__":
    main()
