"""The HTTP plumbing that `server_routes` (the handlers) and `server_streaming` (server-sent
events) share: OpenAI-style error bodies, the mapping from an engine-side failure to the status a
client sees, and watching for a client that disconnects while its request runs.

Imported through `server_routes` only, once `server.OpenAIServer` has checked that FastAPI is
installed.
"""
from __future__ import annotations

import asyncio

from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from phalanx.inference import openai_protocol as api
from phalanx.inference.engine_loop import Aborted, RequestFailed


class ClientGone(Exception):
    """The client disconnected while its request was running."""


def error_response(err: api.RequestError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def engine_error(exc: BaseException, param: str) -> api.RequestError:
    """What a request refused or failed by the engine thread (tokenizer, limits, add_request, a
    failing step) answers."""
    if isinstance(exc, api.RequestError):
        return exc
    if isinstance(exc, (ValueError, TypeError)):
        return api.RequestError(400, str(exc), param=param)
    if isinstance(exc, Aborted):
        return api.RequestError(503, str(exc), kind="server_error")
    if isinstance(exc, RequestFailed):  # an error in an engine step; the server goes on
        return api.RequestError(500, str(exc), kind="server_error", code="engine_error")
    return api.RequestError(500, f"internal error: {exc}", kind="server_error")


async def request_error(request, err: api.RequestError):
    """The app's handler for a `RequestError` raised anywhere in a route."""
    return error_response(err)


async def http_error(request, exc: HTTPException):
    """The app's handler for Starlette's own errors (no such route, wrong method), in the OpenAI
    error shape."""
    if exc.status_code == 404:
        err = api.RequestError(404, f"no route {request.method} {request.url.path}", code="not_found")
    elif exc.status_code == 405:
        err = api.RequestError(405, f"method {request.method} not allowed on {request.url.path}")
    else:
        err = api.RequestError(exc.status_code, str(exc.detail))
    return error_response(err)


async def until_disconnect(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def run_watching(request, work, on_gone):
    """Await `work`; if the client disconnects first, call `on_gone` and raise ClientGone."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(until_disconnect(request.receive))
    try:
        try:
            await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:  # the server is stopping
            on_gone()
            task.cancel()
            raise
        if not task.done():
            on_gone()
            task.cancel()
            raise ClientGone
        return task.result()
    finally:
        watcher.cancel()
