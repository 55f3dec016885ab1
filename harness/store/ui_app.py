"""The application ``python -m harness ui`` serves (:mod:`harness.store.ui_server`): MLflow's
tracking server application unchanged, except that its index page, the one HTML page of
the UI (every address is ``/`` plus a ``#/...`` route), sets the browser's defaults before
the UI reads them, where the browser holds none of its own (:func:`defaults`):

- the workflow, model training (:data:`DEFAULTS`; and the assistant panel kept from
  opening by itself). Without it, an address without ``?workflowType=machine_learning``
  (the bare one, an experiment's, a logged model's, the compare page) opens MLflow's
  generative-AI view: traces, token usage, and a runs list without metric columns;
- each experiment's runs page, in the experiment's saved view *Metric learning*
  (:mod:`harness.store.runs_view`): the UI keeps a runs page's state in ``localStorage``
  under :func:`runs_page_key`, and opens MLflow's own table (no metric column) where that
  is empty. So the bare address, an experiment's link and a run's breadcrumb open the
  view, on the first visit and on every later one, until the user changes the page.

The choices stay the user's: the UI's own controls overwrite these keys, and the page sets
a key only while it is unset.

Imported by the server's worker processes, never by the harness's commands.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from typing import Any

import mlflow
from mlflow.server.fastapi_app import app as mlflow_app

from harness.store.runs_view import TAG_PREFIX, VERSION_FIELD, VIEW_KEY, saved_state

__all__ = [
    "app",
    "WORKFLOW_KEY",
    "WORKFLOW",
    "ASSISTANT_OPENED_KEY",
    "DEFAULTS",
    "runs_page_key",
    "defaults",
    "with_defaults",
]

#: The ``localStorage`` key the MLflow UI reads its workflow from (its ``useLocalStorage``
#: stores key ``mlflow.workflowType`` of version 1 as ``<key>_v<version>``, JSON-encoded).
WORKFLOW_KEY = "mlflow.workflowType_v1"
WORKFLOW = "machine_learning"
#: The key that records that the UI opened its assistant panel once by itself: a local
#: server's UI opens it on the first visit, a third of a 1400 px window beside the runs.
ASSISTANT_OPENED_KEY = "mlflow.assistant.fab.autoOpenedOnFirstLoad_v1"
#: What the index page sets where the browser holds nothing yet (JSON values).
DEFAULTS = {WORKFLOW_KEY: WORKFLOW, ASSISTANT_OPENED_KEY: True}
#: Request headers that let a server answer "not modified": the browser would keep an
#: index page cached from a plain ``mlflow server``, without the script.
_CONDITIONAL = {b"if-none-match", b"if-modified-since"}


def runs_page_key(experiment: str) -> str:
    """The ``localStorage`` key under which the MLflow UI keeps the state of experiment id
    ``experiment``'s runs page (MLflow 3.17: its ``LocalStorageUtils`` store, version 1.1,
    of component ``ExperimentPage`` for the experiment ids as a JSON list)."""
    ids = json.dumps([experiment], separators=(",", ":"))
    return f"MLflowLocalStorage-1.1-ExperimentPage-{ids}-ReactComponentState"


def defaults(experiments: dict[str, dict]) -> dict[str, str]:
    """The ``localStorage`` entries the index page sets where unset: :data:`DEFAULTS`, and
    for each experiment id of ``experiments`` (id -> tags) with a readable saved view
    *Metric learning*, its runs page's state."""
    entries = {key: json.dumps(value) for key, value in DEFAULTS.items()}
    for experiment, tags in experiments.items():
        state = saved_state(tags.get(TAG_PREFIX + VIEW_KEY))
        if state is not None:
            state = {k: v for k, v in state.items() if k != VERSION_FIELD}
            entries[runs_page_key(experiment)] = json.dumps(state)
    return entries


def with_defaults(page: bytes, entries: dict[str, str]) -> bytes:
    """The index page ``page`` with a script first in its head, before MLflow's bundle
    runs, that sets each ``localStorage`` entry of ``entries`` the browser does not hold; a
    page without a head is returned as it is."""
    head = page.find(b"<head>")
    if head < 0:
        return page
    data = json.dumps(entries).replace("<", "\\u003c")  # no "</script>" inside the script
    script = (
        "<script>try{var s=window.localStorage,d="
        + data
        + ";for(var k in d){if(s.getItem(k)===null){s.setItem(k,d[k])}}}catch(e){}</script>"
    ).encode()
    at = head + len(b"<head>")
    return page[:at] + script + page[at:]


def _experiment_tags() -> dict[str, dict]:
    """The tags of every active experiment of the served store, by id (the server's
    environment names the store: ``MLFLOW_TRACKING_URI``); none where the store cannot be
    read, so that the page still loads."""
    try:
        client = mlflow.MlflowClient(os.environ.get("MLFLOW_TRACKING_URI"))
        found, token = {}, None
        while True:
            page = client.search_experiments(max_results=1000, page_token=token)
            found.update({e.experiment_id: e.tags for e in page})
            token = page.token
            if not token:
                return found
    except Exception as err:  # the UI must load without the defaults of the runs pages
        print(
            f"harness ui: experiments not read for the runs pages' defaults: {err}", file=sys.stderr
        )
        return {}


class _Application:
    """MLflow's application, with the index page (``GET /``) passed through
    :func:`with_defaults`: its headers (MLflow's security headers among them) kept, its
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
    complete, then sends it with the defaults' script."""

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
            page = with_defaults(page, defaults(await asyncio.to_thread(_experiment_tags)))
            dropped = (b"etag", b"last-modified", b"cache-control")
            headers = [(k, v) for k, v in headers if k.lower() not in dropped]
            headers.append((b"cache-control", b"no-cache"))
        headers.append((b"content-length", str(len(page)).encode()))
        await self.send({**self.start, "headers": headers})
        await self.send({"type": "http.response.body", "body": page})


app = _Application()
