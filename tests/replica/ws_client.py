"""A minimal proxy-side client of a real replica's /v1/replica WebSocket, shared by
test_api, test_faults and test_fuzz_internal."""

from __future__ import annotations

from wire import protocol as P


class ReplicaWS:
    """A minimal proxy-side client of /v1/replica."""

    def __init__(self, ws):
        self.ws, self.codec = ws, P.Codec()
        self.hello = None
        self.load = None

    async def send(self, *msgs):
        await self.ws.send(self.codec.encode(list(msgs)))

    async def recv(self):
        msgs = self.codec.decode(await self.ws.recv())
        for m in msgs:
            if isinstance(m, P.Hello):
                self.hello = m
            elif isinstance(m, P.Load):
                self.load = m
        return msgs

    async def collect(self, ids):
        """Run until every id finished; returns {id: (token ids, text, final message)}."""
        out = {i: ([], []) for i in ids}
        final = {}
        while len(final) < len(ids):
            for m in await self.recv():
                if isinstance(m, (P.Tokens, P.Finished)) and m.id in out:
                    out[m.id][0].extend(m.ids)
                    out[m.id][1].append(m.text)
                if isinstance(m, (P.Finished, P.Error)) and m.id in out:
                    final[m.id] = m
        return {i: (out[i][0], "".join(out[i][1]), final[i]) for i in ids}

    async def wait_idle(self):
        """Until a load report shows nothing running and every block free."""
        while True:
            await self.recv()
            ld = self.load
            if ld and ld.running == 0 and ld.waiting == 0 and ld.free_blocks == ld.total_blocks:
                return ld


def ws_url(url):
    return url.replace("http://", "ws://") + "/v1/replica"
