"""A small Python client of the HMI HTTP API (standard library only)."""

from __future__ import annotations

import http.client
import json
import os
import re
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Callable

from hmi.home import hmi_home

TENANT_PATH = re.compile(r"^/v1/tenants/([^/?]+)(?:[/?]|$)")
# Names a request's tenant to Ray Serve's proxy (``hmi serve --ray``), which then routes it to a
# replica holding that tenant; servers without Ray Serve ignore it.
ROUTING_HEADER = "serve_multiplexed_model_id"
# Requests without side effects, sent again when the answer was lost on the way (a proxy's 5xx
# without HMI's JSON error, a gateway's 502-504, a dropped connection): a replica killed or
# replaced under ``hmi serve --ray`` costs a retry, not an error.
SAFE_TO_REPEAT = re.compile(r"^(GET|HEAD) |^POST /v1/tenants/[^/?]+/infer(?:\?|$)")
RETRY_DELAYS_S = (0.5, 2.0)


def tenant_of(path: str) -> str:
    """The tenant a request path names (``/v1/tenants/{tenant}`` and below), or ""."""
    m = TENANT_PATH.match(path)
    return urllib.parse.unquote(m.group(1)) if m else ""


class ApiError(RuntimeError):
    def __init__(self, status: int, code: str, message: str):
        super().__init__(f"{status} {code}: {message}")
        self.status, self.code, self.message = status, code, message


def default_token() -> str | None:
    """``HMI_TOKEN``, else ``HMI_ADMIN_TOKEN``, else the admin token file of ``HMI_HOME``."""
    for var in ("HMI_TOKEN", "HMI_ADMIN_TOKEN"):
        if os.environ.get(var):
            return os.environ[var]
    p = hmi_home() / "admin_token"
    return p.read_text().strip() if p.exists() else None


def lost_on_the_way(err: ApiError) -> bool:
    """Whether an error answer came from between the client and HMI (a proxy or gateway: its
    errors are not HMI's JSON with a code), or from a server shutting down: another may answer."""
    return err.status in (502, 504) or err.code == "shutting_down" or (err.status >= 500 and err.code == "http_error")


def _api_error(exc: urllib.error.HTTPError) -> ApiError:
    raw = exc.read()
    try:
        err = json.loads(raw)["error"]
        return ApiError(exc.code, err["code"], err["message"])
    except (ValueError, KeyError, TypeError):
        return ApiError(exc.code, "http_error", raw.decode(errors="replace")[:500])


class Client:
    def __init__(self, url: str = "http://127.0.0.1:8080", token: str | None = None, timeout: float = 120):
        self.url = url.rstrip("/")
        self.token = token if token is not None else default_token()
        self.timeout = timeout

    def request(self, method: str, path: str, body: dict | None = None) -> dict:
        data = None if body is None else json.dumps(body).encode()
        raw, ctype = self._send(method, path, data, "application/json")
        return json.loads(raw) if raw and ctype == "application/json" else {"text": raw.decode()}

    def _send(self, method: str, path: str, data: bytes | None, ctype: str) -> tuple[bytes, str]:
        """(body, content type) of one request; HTTP errors become ApiError."""
        req = urllib.request.Request(self.url + path, data=data, method=method)
        if tenant_of(path):
            req.add_header(ROUTING_HEADER, tenant_of(path))
        if data is not None:
            req.add_header("Content-Type", ctype)
        if self.token:
            req.add_header("Authorization", f"Bearer {self.token}")
        delays = RETRY_DELAYS_S if SAFE_TO_REPEAT.match(f"{method} {path}") else ()
        for attempt in range(len(delays) + 1):
            try:
                with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                    return resp.read(), resp.headers.get_content_type()
            except urllib.error.HTTPError as exc:
                err = _api_error(exc)
                if attempt == len(delays) or not lost_on_the_way(err):
                    raise err from None
            except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
                reason = getattr(exc, "reason", exc)
                if attempt == len(delays) or isinstance(reason, (ConnectionRefusedError, TimeoutError)):
                    raise ConnectionError(f"cannot reach the HMI server at {self.url}: {reason}") from None
            time.sleep(delays[attempt])
        raise AssertionError("unreachable")

    def import_adapter(self, name: str, archive: bytes | str | Path, model: str = "encoder",
                       truncate: bool = False) -> dict:
        """Uploads an adapter (a zip of the adapters library's saved folder, or of PEFT's LoRA
        folder for ``model="decoder"``): creates the tenant (its token comes back once; with
        ``truncate`` it cuts texts over the token limit) or replaces its adapter."""
        data = archive if isinstance(archive, bytes) else Path(archive).read_bytes()
        query = f"model={model}" + ("&truncate=true" if truncate else "")
        raw, _ = self._send("POST", f"/v1/tenants/{name}/adapter?{query}", data, "application/zip")
        return json.loads(raw)

    def export_adapter(self, name: str) -> bytes:
        """The tenant's adapter as a zip in the same format."""
        return self._send("GET", f"/v1/tenants/{name}/adapter", None, "")[0]

    def infer(self, tenant: str, inputs: list[str], truncate: bool | None = None) -> list[dict]:
        """The tenant's answers; ``truncate`` (default: the tenant's setting) cuts texts over the
        server's token limit instead of having them refused."""
        body = {"inputs": inputs} if truncate is None else {"inputs": inputs, "truncate": truncate}
        return self.request("POST", f"/v1/tenants/{tenant}/infer", body)["outputs"]

    def generate(self, tenant: str, prompt: str, **options) -> dict:
        return self.request("POST", f"/v1/tenants/{tenant}/generate", {"prompt": prompt, **options})

    def generate_stream(self, tenant: str, body: dict):
        """Yields the NDJSON messages of a streaming generation: {"text"} pieces, then {"done": true, ...}."""
        req = urllib.request.Request(f"{self.url}/v1/tenants/{tenant}/generate",
                                     data=json.dumps({**body, "stream": True}).encode(), method="POST")
        req.add_header("Content-Type", "application/json")
        req.add_header("Authorization", f"Bearer {self.token}")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as r:
                for line in r:
                    if line.strip():
                        yield json.loads(line)
        except urllib.error.HTTPError as exc:
            raise _api_error(exc) from None
        except urllib.error.URLError as exc:
            raise ConnectionError(f"cannot reach the HMI server at {self.url}: {exc.reason}") from None

    def create_decoder_tenant(self, name: str, corpus: str | None = None, training_text: list[str] | None = None,
                              max_train: int | None = None, epochs: int | None = None, rank: int | None = None) -> dict:
        body = {"name": name, "model": "decoder"}
        for k, v in (("corpus", corpus), ("training_text", training_text), ("max_train", max_train), ("epochs", epochs)):
            if v is not None:
                body[k] = v
        if rank is not None:
            body["adapter"] = {"rank": rank}
        return self.request("POST", "/v1/tenants", body)

    def create_tenant(self, name: str, labels: list[str], task_type: str = "classification", training_data=None,
                      dataset: str | None = None, domain: str = "root", adapter: dict | None = None,
                      max_train: int | None = None, epochs: int | None = None, pooling: str | None = None,
                      truncate: bool = False, max_eval: int | None = None, distil: bool | None = None,
                      serving: str | None = None) -> dict:
        body = {"name": name, "domain": domain, "task": {"type": task_type, "labels": labels}, "truncate": truncate}
        if pooling is not None:
            body["task"]["pooling"] = pooling
        for k, v in (("training_data", training_data), ("dataset", dataset), ("adapter", adapter),
                     ("max_train", max_train), ("max_eval", max_eval), ("epochs", epochs), ("distil", distil),
                     ("serving", serving)):
            if v is not None:
                body[k] = v
        return self.request("POST", "/v1/tenants", body)

    def update_tenant(self, name: str, training_data=None, dataset=None, max_train=None, epochs=None,
                      distil: bool | None = None, serving: str | None = None) -> dict:
        body = {k: v for k, v in (("training_data", training_data), ("dataset", dataset), ("max_train", max_train),
                                  ("epochs", epochs), ("distil", distil), ("serving", serving)) if v is not None}
        return self.request("POST", f"/v1/tenants/{name}/update", body)

    def delete_tenant(self, name: str) -> dict:
        return self.request("DELETE", f"/v1/tenants/{name}")

    def tenants(self) -> list[dict]:
        return self.request("GET", "/v1/tenants")["tenants"]

    def tenant(self, name: str) -> dict:
        return self.request("GET", f"/v1/tenants/{name}")

    def job(self, job_id: str) -> dict:
        return self.request("GET", f"/v1/jobs/{job_id}")

    def jobs(self) -> list[dict]:
        return self.request("GET", "/v1/jobs")["jobs"]

    def cancel_job(self, job_id: str) -> dict:
        return self.request("DELETE", f"/v1/jobs/{job_id}")

    def domains(self) -> list[dict]:
        return self.request("GET", "/v1/domains")["domains"]

    def create_domain(self, name: str, parent: str = "root", corpus: list[str] | None = None,
                      corpus_name: str | None = None, alpha: float = 0.5, steps: int | None = None,
                      objective: str | None = None) -> dict:
        body = {"name": name, "parent": parent, "alpha": alpha}
        for k, v in (("corpus", corpus), ("corpus_name", corpus_name), ("steps", steps), ("objective", objective)):
            if v is not None:
                body[k] = v
        return self.request("POST", "/v1/domains", body)

    def update_domain(self, name: str, corpus: list[str] | None = None, corpus_name: str | None = None,
                      steps: int | None = None, objective: str | None = None) -> dict:
        body = {k: v for k, v in (("corpus", corpus), ("corpus_name", corpus_name), ("steps", steps),
                                  ("objective", objective)) if v is not None}
        return self.request("POST", f"/v1/domains/{name}/update", body)

    def delete_domain(self, name: str) -> dict:
        return self.request("DELETE", f"/v1/domains/{name}")

    def wait_job(self, job_id: str, timeout: float | None = 1800, poll: float = 1.0,
                 on_poll: Callable[[dict], None] | None = None) -> dict:
        """The job once it has ended (succeeded, failed or cancelled), asked for every ``poll``
        seconds, each answer passed to ``on_poll``; ``TimeoutError`` after ``timeout`` seconds
        (None: no limit)."""
        end = None if timeout is None else time.time() + timeout
        while end is None or time.time() < end:
            job = self.job(job_id)
            if on_poll is not None:
                on_poll(job)
            if job["state"] in ("succeeded", "failed", "cancelled"):
                return job
            time.sleep(poll)
        raise TimeoutError(f"job {job_id} did not finish within {timeout} s")


def load_rows(path: str) -> list[dict]:
    """Training examples from a JSON Lines file (blank lines skipped).  Raises ``ValueError`` naming
    the file, and the line where one is not a JSON object, instead of an error without either."""
    try:
        lines = Path(path).read_text().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror if isinstance(exc, OSError) else exc}") from exc
    rows = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            row = None
        if not isinstance(row, dict):
            raise ValueError(f"{path} line {n} is not a JSON object (JSON Lines of examples): {line[:60]!r}")
        rows.append(row)
    return rows
