"""A disaggregated-serving proxy for vLLM's KV connectors: one OpenAI-compatible endpoint in
front of a prefill and a decode `vllm serve`.

    python proxy.py --port 18000 --prefill http://127.0.0.1:18101 --decode http://127.0.0.1:18102

For each `/v1/completions` request it asks the prefill server for the prompt's KV with one
output token and `kv_transfer_params: {"do_remote_decode": true}`; the prefill answers with the
parameters the decode server needs to fetch that KV (the prefill's engine, block ids, host and
side-channel port), and the proxy sends the original request with those to the decode server,
whose answer goes back to the client unchanged. This is the protocol of vLLM's own toy proxy
(tests/v1/kv_connector/nixl_integration in vLLM's repository), written for this harness.

A failed prefill or decode answer is passed back with its status (502 when a server cannot be
reached), never retried here: the e2e run counts what fails.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import time

import aiohttp
from aiohttp import web


log = logging.getLogger("proxy")


class Proxy:
    def __init__(self, prefill: list[str], decode: list[str], timeout_s: float):
        self._prefill = itertools.cycle(prefill)
        self._decode = itertools.cycle(decode)
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None

    async def start(self, _app) -> None:
        self._session = aiohttp.ClientSession(timeout=self._timeout)

    async def stop(self, _app) -> None:
        if self._session is not None:
            await self._session.close()

    async def _post(self, url: str, body: dict) -> tuple[int, dict]:
        assert self._session is not None
        try:
            async with self._session.post(url, json=body) as r:
                text = await r.text()
                try:
                    return r.status, json.loads(text)
                except json.JSONDecodeError:
                    return r.status, {"error": {"message": text[:500]}}
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            return 502, {"error": {"message": f"{url}: {type(e).__name__}: {e}"}}

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        t0 = time.monotonic()
        prefill_body = {k: v for k, v in body.items() if k not in ("min_tokens", "stream",
                                                                     "stream_options")}
        prefill_body.update(
            max_tokens=1,
            kv_transfer_params={"do_remote_decode": True, "do_remote_prefill": False},
        )
        status, answer = await self._post(next(self._prefill) + "/v1/completions", prefill_body)
        t_prefill = time.monotonic() - t0
        if status != 200:
            log.info("prefill %s after %.3f s: %s", status, t_prefill, str(answer)[:200])
            answer.setdefault("proxy", {})["stage"] = "prefill"
            return web.json_response(answer, status=status)
        params = answer.get("kv_transfer_params")
        if not params:
            return web.json_response(
                {"error": {"message": "the prefill server returned no kv_transfer_params: is "
                           "it running with --kv-transfer-config?"}, "proxy": {"stage": "prefill"}},
                status=502,
            )
        decode_body = dict(body)
        decode_body["kv_transfer_params"] = params
        decode_url = next(self._decode) + "/v1/completions"
        if not body.get("stream"):
            status, answer = await self._post(decode_url, decode_body)
            log.info("decode %s after %.3f s (prefill %.3f s)", status, time.monotonic() - t0,
                     t_prefill)
            answer.setdefault("proxy", {}).update(
                stage="decode", prefill_s=t_prefill, total_s=time.monotonic() - t0
            )
            return web.json_response(answer, status=status)
        # Streaming: the decode server's events go to the client as they come. A decode that
        # breaks off mid-stream ends the client's stream with an error event, never silently.
        assert self._session is not None
        out: web.StreamResponse | None = None
        try:
            async with self._session.post(decode_url, json=decode_body) as r:
                if r.status != 200:
                    text = await r.text()
                    log.info("decode %s after %.3f s: %s", r.status, time.monotonic() - t0,
                             text[:200])
                    return web.json_response(
                        {"error": {"message": text[:500]}, "proxy": {"stage": "decode"}},
                        status=r.status,
                    )
                out = web.StreamResponse(
                    status=200, headers={"Content-Type": "text/event-stream",
                                         "X-Prefill-Seconds": f"{t_prefill:.6f}"}
                )
                await out.prepare(request)
                async for chunk in r.content.iter_any():
                    await out.write(chunk)
                await out.write_eof()
                log.info("decode 200 streamed after %.3f s (prefill %.3f s)",
                         time.monotonic() - t0, t_prefill)
                return out
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            message = f"{decode_url}: {type(e).__name__}: {e}"
            log.info("decode failed after %.3f s: %s", time.monotonic() - t0, message)
            if out is None:
                return web.json_response(
                    {"error": {"message": message}, "proxy": {"stage": "decode"}}, status=502)
            event = {"error": {"message": message, "type": "decode_server_lost"}}
            await out.write(f"data: {json.dumps(event)}\n\n".encode())
            await out.write_eof()
            return out

    async def health(self, _request: web.Request) -> web.Response:
        return web.json_response({"ok": True})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--prefill", action="append", required=True, help="a prefill server's URL")
    ap.add_argument("--decode", action="append", required=True, help="a decode server's URL")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per upstream call")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    proxy = Proxy(args.prefill, args.decode, args.timeout)
    app = web.Application(client_max_size=16 << 20)
    app.on_startup.append(proxy.start)
    app.on_cleanup.append(proxy.stop)
    app.router.add_post("/v1/completions", proxy.completions)
    app.router.add_get("/health", proxy.health)
    web.run_app(app, host=args.host, port=args.port, print=None, access_log=None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
