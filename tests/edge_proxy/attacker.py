"""Attack clients in a process of their own, so their own work (building and masking
megabyte frames) does not share the test's event loop with the proxy under test.

    python tests/edge_proxy/attacker.py WS_URL API_KEY CONNECTIONS

Each connection sends, in a loop, the frames of `attack_frames()` and waits for
their answers; prints `ROUND` after each connection's first round, and at the
end (stdin closed) one JSON line: {"rounds": n, "codes": {code: count}}.
"""

from __future__ import annotations

import asyncio
import collections
import json
import sys

from websockets.asyncio.client import connect


def attack_frames() -> list[str]:
    words = " ".join(f"w{i % 997}" for i in range(40_000))  # ~200 KB: under the byte limit, over the context
    msgs = [
        {"type": "generate", "id": "big", "prompt": "x" * 1_000_000},
        {"type": "generate", "id": "role", "messages": [{"role": "r" * 1_000_000, "content": "x"}]},
        {"type": "generate", "id": "many", "messages": [{"role": "user", "content": ""}] * 30_000},
        {"type": "generate", "id": "long", "prompt": words},
    ]
    return [json.dumps(m) for m in msgs]


async def main(url: str, key: str, n: int) -> None:
    frames = attack_frames()
    stop = asyncio.Event()
    rounds, codes = [0], collections.Counter()

    async def one() -> None:
        async with connect(url, additional_headers={"Authorization": f"Bearer {key}"}, compression=None,
                           proxy=None, max_size=None) as ws:
            first = True
            while not stop.is_set():
                for f in frames:
                    await ws.send(f)
                for _ in frames:
                    codes[json.loads(await ws.recv()).get("code", "none")] += 1
                rounds[0] += 1
                if first:
                    print("ROUND", flush=True)
                    first = False

    loop = asyncio.get_running_loop()
    tasks = [asyncio.create_task(one()) for _ in range(n)]
    await loop.run_in_executor(None, sys.stdin.read)  # until the test closes stdin
    stop.set()
    await asyncio.gather(*tasks)
    print(json.dumps({"rounds": rounds[0], "codes": codes}), flush=True)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
