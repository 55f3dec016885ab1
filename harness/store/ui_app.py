"""The application ``python -m harness ui`` serves (:mod:`harness.store.ui_server`): MLflow's
tracking server application unchanged, except that its index page, the one HTML page of
the UI (every address is ``/`` plus a ``#/...`` route), sets the browser's choice of
workflow to model training before the UI reads it, unless the browser holds one already
(:data:`DEFAULTS`; and keeps the assistant panel from opening by itself).

Without it, an address without ``?workflowType=machine_learning`` (the bare one, an
experiment's, a logged model's, the compare page) opens MLflow's generative-AI view:
traces, token usage, and a runs list without metric columns. The choice stays the
user's: the UI's own switch overwrites the key, and the page sets it only when unset.

Imported by the server's worker processes, never by the harness's commands.
"""

from __future__ import annotations

import json
from typing import Any

from mlflow.server.fastapi_app import app as mlflow_app

__all__ = ["app", "WORKFLOW_KEY", "WORKFLOW", "ASSISTANT_OPENED_KEY", "DEFAULTS", "with_workflow"]

#: The ``localStorage`` key the MLflow UI reads its workflow from (its ``useLocalStorage``
#: stores key ``mlflow.workflowType`` of version 1 as ``<key>_v<version>``, JSON-encoded).
WORKFLOW_KEY = "mlflow.workflowType_v1"
WORKFLOW = "machine_learning"
#: The key that records that the UI opened its assistant panel once by itself: a local
#: server's UI opens it on the first visit, a third of a 1400 px window beside the runs.
ASSISTANT_OPENED_KEY = "mlflow.assistant.fab.autoOpenedOnFirstLoad_v1"
#: What the index page sets where the browser holds nothing yet (JSON values).
DEFAULTS = {WORKFLOW_KEY: WORKFLOW, ASSISTANT_OPENED_KEY: True}
_SCRIPT = (
    "<script>try{var s=window.localStorage,d="
    + json.dumps({key: json.dumps(value) for key, value in DEFAULTS.items()})
    + ";for(var k in d){if(s.getItem(k)===null){s.setItem(k,d[k])}}}catch(e){}</script>"
).encode()
#: Request headers that let a server answer "not modified": the browser would keep an
#: index page cached from a plain ``mlflow server``, without the script.
_CONDITIONAL = {b"if-none-match", b"if-modified-since"}


def with_workflow(page: bytes) -> bytes:
    """The index page ``page`` with the script setting :data:`DEFAULTS` first in its head,
    before MLflow's bundle runs; a page without a head is returned as it is."""
    head = page.find(b"<head>")
    if head < 0:
        return page
    at = head + len(b"<head>")
    return page[:at] + _SCRIPT + page[at:]


class _Application:
    """MLflow's application, with the index page (``GET /``) passed through
    :func:`with_workflow`: its headers (MLflow's security headers among them) kept, its
    length corrected, its caching validators dropped. An instance, not a function: MLflow
    starts a function named by ``--app-name`` as a factory of the application."""

    async def __call__(self, scope: dict[str, Any], receive, send) -> None:
        if scope["type"] != "http" or scope["method"] != "GET" or scope["path"] != "/":
            await mlflow_app(scope, receive, send)
            return
        scope = {**scope, "headers": [(k, v) for k, v in scope["headers"] if k not in _CONDITIONAL]}
        await mlflow_app(scope, receive, _IndexPage(send))


class _IndexPage:
    """The ``send`` of the index page's response: holds the response until its body is
    complete, then sends it with the workflow script."""

    def __init__(self, send):
        self.send, self.start, self.body = send, {}, []

    async def __call__(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            self.start = dict(message)
            return
        self.body.append(message.get("body", b""))
        if message.get("more_body"):
            return
        page = b"".join(self.body)
        headers = [
            (k, v) for k, v in self.start.get("headers", []) if k.lower() != b"content-length"
        ]
        html = any(k.lower() == b"content-type" and b"text/html" in v for k, v in headers)
        encoded = any(k.lower() == b"content-encoding" for k, _ in headers)
        if self.start.get("status") == 200 and html and not encoded:
            page = with_workflow(page)
            dropped = (b"etag", b"last-modified", b"cache-control")
            headers = [(k, v) for k, v in headers if k.lower() not in dropped]
            headers.append((b"cache-control", b"no-cache"))
        headers.append((b"content-length", str(len(page)).encode()))
        await self.send({**self.start, "headers": headers})
        await self.send({"type": "http.response.body", "body": page})


app = _Application()
