"""Calling a Ray Serve deployment over HTTP from the scale-out tests."""

import http.client
import json
import urllib.request
from pathlib import Path

from tests.helpers.servers import ADMIN

REPO = str(Path(__file__).resolve().parents[2])


def call(url: str, method: str, path: str, body=None, token=ADMIN, headers=None) -> tuple[int, object, dict]:
    """(status, headers (case-insensitive), JSON body) of one request (no routing header unless given)."""
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {}),
               **(headers or {})}
    req = urllib.request.Request(url + path, method=method, data=None if body is None else json.dumps(body).encode(),
                                 headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.headers, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, e.headers, json.loads(e.read())
    except (ConnectionError, http.client.RemoteDisconnected) as e:  # a connection closed with no answer
        return 0, {}, {"error": type(e).__name__}
