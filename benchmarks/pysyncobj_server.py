"""A minimal HTTP front for PySyncObj's ReplDict, for the comparison benchmark.

    python pysyncobj_server.py SELF_ADDR PARTNERS HTTP_PORT JOURNAL on|off

Routes mirror ledgerkv's: PUT /v1/kv/{key}; GET /v1/kv/{key}?consistency=linearizable|stale
(linearizable: a replicated no-op first, PySyncObj having no read index); GET /status.
PySyncObj 0.3.x writes its journal through mmap and never fsyncs it.
"""

import asyncio
import sys

from aiohttp import web
from pysyncobj import FAIL_REASON, SyncObj, SyncObjConf, SyncObjConsumer, replicated
from pysyncobj.batteries import ReplDict


class Barrier(SyncObjConsumer):
    @replicated
    def touch(self):
        return None


def main() -> None:
    self_addr, partners, http_port, journal, batching = sys.argv[1:6]
    conf = SyncObjConf(journalFile=journal, appendEntriesUseBatch=batching == "on", commandsWaitLeader=True, dynamicMembershipChange=False)
    data, barrier = ReplDict(), Barrier()
    obj = SyncObj(self_addr, partners.split(","), conf=conf, consumers=[data, barrier])

    async def replicated_call(method, *args):
        loop = asyncio.get_running_loop()
        fut = loop.create_future()

        def done(result, error):
            loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(error))

        method(*args, callback=done)
        return await fut

    async def put(request):
        err = await replicated_call(data.set, request.match_info["key"], await request.read())
        return web.Response(status=200 if err == FAIL_REASON.SUCCESS else 503, text="{}")

    async def get(request):
        if request.query.get("consistency", "linearizable") != "stale":
            if await replicated_call(barrier.touch) != FAIL_REASON.SUCCESS:
                return web.Response(status=503, text="{}")
        value = data.get(request.match_info["key"])
        return web.Response(status=404) if value is None else web.Response(body=value)

    async def status(request):
        return web.json_response({"leader": obj._isLeader()})

    app = web.Application()
    app.router.add_put("/v1/kv/{key:.+}", put)
    app.router.add_get("/v1/kv/{key:.+}", get)
    app.router.add_get("/status", status)
    web.run_app(app, host="127.0.0.1", port=int(http_port), print=None, access_log=None)


if __name__ == "__main__":
    main()
