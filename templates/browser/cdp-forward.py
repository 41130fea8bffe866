"""Forward the guest's port LISTEN (all addresses) to Chromium's DevTools port TARGET on 127.0.0.1.

    python3 cdp-forward.py 9222 9223

Chromium binds its DevTools server to loopback whatever --remote-debugging-address says, and the node agent
reaches guest ports on the guest's own address (the ports proxy, the computer-use calls). This relays bytes
both ways per connection (HTTP and WebSocket alike; Chromium checks the Host header, which stays the
client's). It listens only once TARGET accepts connections, so a readiness check on LISTEN (the template
build's --ready-port) means Chromium is up.
"""

import asyncio
import sys

LISTEN, TARGET = int(sys.argv[1]), int(sys.argv[2])


async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
    except OSError:
        pass
    finally:
        writer.close()


async def handle(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
    try:
        up_r, up_w = await asyncio.open_connection("127.0.0.1", TARGET)
    except OSError:
        client_w.close()
        return
    await asyncio.gather(pipe(client_r, up_w), pipe(up_r, client_w))


async def main() -> None:
    while True:  # until Chromium listens
        try:
            _, w = await asyncio.open_connection("127.0.0.1", TARGET)
            w.close()
            break
        except OSError:
            await asyncio.sleep(0.2)
    server = await asyncio.start_server(handle, "0.0.0.0", LISTEN)
    async with server:
        await server.serve_forever()


asyncio.run(main())
