"""hmi.client sends a request without side effects again when its answer was lost between the
client and HMI (a proxy's plain 5xx, a gateway's 502, a dropped connection: a Ray Serve replica
killed or replaced); HMI's own errors and requests with side effects are never repeated."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

import hmi.client
from hmi.client import ApiError, Client

OK = json.dumps({"tenant": "t", "outputs": [{"label": "pos"}]}).encode()
HMI_500 = json.dumps({"error": {"code": "internal", "message": "boom"}}).encode()


@pytest.fixture
def scripted(monkeypatch):
    """A server answering each request with the next scripted answer: (status, content type,
    body), or "drop" to close the connection without an answer."""
    monkeypatch.setattr(hmi.client, "RETRY_DELAYS_S", (0.01, 0.01))
    script, seen = [], []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _answer(self):
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            seen.append((self.command, self.path))
            step = script.pop(0) if script else (200, "application/json", OK)
            if step == "drop":
                self.close_connection = True
                return
            status, ctype, body = step
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = do_DELETE = _answer

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield Client(f"http://127.0.0.1:{httpd.server_port}", token="x"), script, seen
    httpd.shutdown()


def test_an_inference_whose_answer_a_proxy_or_a_dropped_connection_lost_is_sent_again(scripted):
    client, script, seen = scripted
    script += [(500, "text/plain", b"Internal Server Error"), "drop"]
    assert client.infer("t", ["a text"]) == [{"label": "pos"}]
    assert seen == [("POST", "/v1/tenants/t/infer")] * 3


def test_a_lost_answer_is_sent_again_twice_at_most(scripted):
    client, script, seen = scripted
    script += [(502, "text/plain", b"Bad Gateway")] * 3
    with pytest.raises(ApiError) as err:
        client.infer("t", ["a text"])
    assert err.value.status == 502 and len(seen) == 3


def test_hmis_own_errors_and_requests_with_side_effects_are_not_repeated(scripted):
    client, script, seen = scripted
    script += [(500, "application/json", HMI_500)]
    with pytest.raises(ApiError) as err:
        client.infer("t", ["a text"])
    assert (err.value.status, err.value.code) == (500, "internal") and len(seen) == 1
    script += [(500, "text/plain", b"Internal Server Error")]
    with pytest.raises(ApiError):
        client.create_tenant("new", ["a", "b"], training_data={"train": []})
    assert seen[1:] == [("POST", "/v1/tenants")]
    script += ["drop"]
    with pytest.raises(ConnectionError):
        client.delete_tenant("t")
    assert len(seen) == 3
