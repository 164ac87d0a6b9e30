"""The OpenAPI document, generated from the registered routes and the body models that the
handlers validate with (``hmi.dispatcher.schemas``): one declaration for both."""

from __future__ import annotations

from pydantic.json_schema import models_json_schema

from hmi.names import NAME_PATTERN
from hmi.split.base_executor import OPERATIONS, PROJECTIONS

ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["code", "message"],
    "properties": {"code": {"type": "string"}, "message": {"type": "string"}}}}}

# (method, path) -> (summary, body models (any of), public)
ROUTE_DOCS: dict[tuple[str, str], tuple[str, tuple[str, ...], bool]] = {
    ("POST", "/v1/tenants/{tenant}/infer"): ("Run the tenant's hPLM on texts (tenant or admin token)", ("InferBody",), False),
    ("POST", "/v1/tenants/{tenant}/generate"): (
        "Generate text with a decoder tenant (hGPT); 'stream': true answers NDJSON lines as tokens come",
        ("GenerateBody",), False),
    ("POST", "/v1/completions"): (
        "OpenAI-style text completion; 'model' names the decoder tenant; 'stream' answers server-sent events",
        ("CompletionBody",), False),
    ("POST", "/v1/embeddings"): (
        "OpenAI-style embeddings: 'model' is 'root' (the shared root, any valid token) or an encoder tenant (its "
        "token or the admin's); the root's sentence pooling of the upper layers' output, through the PLOT path",
        ("EmbeddingBody",), False),
    ("GET", "/v1/models"): ("OpenAI-style model list: 'root' and the tenants the token may use", (), False),
    ("POST", "/v1/tenants"): (
        "Create a tenant hPLM: starts a fine-tune job, returns the tenant token once (admin). Decoder tenants: "
        "'model': 'decoder' with 'corpus' or 'training_text'. Private tenants (201, no job): 'model': 'private'",
        ("EncoderTenant", "DecoderTenant", "PrivateTenant"), False),
    ("GET", "/v1/tenants"): ("List tenants (admin)", (), False),
    ("GET", "/v1/tenants/{tenant}"): ("A tenant's state, spec and metrics (owner or admin)", (), False),
    ("POST", "/v1/tenants/{tenant}/update"): ("Continue training on more data: a job (owner or admin)",
                                              ("EncoderUpdate", "DecoderUpdate"), False),
    ("DELETE", "/v1/tenants/{tenant}"): ("Delete the hPLM and its adapters (owner or admin)", (), False),
    ("POST", "/v1/tenants/{tenant}/share"): (
        "Set the tenant's weight in the batches (admin): its share of the server relative to the others, 1 by default",
        ("ShareBody",), False),
    ("POST", "/v1/tenants/{tenant}/adapter"): (
        "Bring your own adapter: a zip of the adapters library's saved folder (safetensors; encoder tenants) or of "
        "PEFT's LoRA folder (?model=decoder). A new name creates a ready tenant (admin, 201 with its token); the "
        "owner of an existing tenant replaces its adapter", (), False),
    ("GET", "/v1/tenants/{tenant}/adapter"): (
        "Download the tenant's adapter as a zip in the same format (owner or admin)", (), False),
    ("POST", "/v1/domains"): ("Create a domain branch: further pretraining + pruned PLOT, a job (admin). Also accepts "
                              "multipart/form-data with the corpus as a file field 'corpus'", ("DomainCreate",), False),
    ("POST", "/v1/domains/{name}/update"): (
        "Continue further pretraining on more corpus and refresh the branch's PLOT: a job (admin)", ("DomainUpdate",), False),
    ("DELETE", "/v1/domains/{name}"): ("Delete a domain branch no tenant uses (admin)", (), False),
    ("GET", "/v1/domains"): ("The domain version tree with PLOT sizes (admin)", (), False),
    ("GET", "/v1/domains/{name}"): ("One domain (admin)", (), False),
    ("GET", "/v1/jobs"): ("All jobs (admin)", (), False),
    ("GET", "/v1/jobs/{job}"): ("A job's state, progress and metrics (owner or admin)", (), False),
    ("DELETE", "/v1/jobs/{job}"): ("Cancel a queued or running job (owner or admin)", (), False),
    ("POST", "/v1/base/lower"): (
        "Base executor: the lower layers' output as the PLOT serves it for token ids (B, T) and their mask (B, T); "
        "tensors in hmi.split.wire's format (private tenant or admin)", (), False),
    ("POST", "/v1/base/layers/{layer}/{projection}/{operation}"): (
        "Base executor: a frozen linear projection of an upper layer on a float32 tensor (..., D), batched across "
        "private tenants; hmi.split.wire's format (private tenant or admin)", (), False),
    ("GET", "/healthz"): ("Liveness", (), True),
    ("GET", "/metrics"): ("Prometheus metrics", (), True),
    ("GET", "/v1/metrics/history"): (
        "The last hour of the series the console charts, a sample every ServerConfig.metrics_history_s seconds: "
        "{interval_s, samples: [{t, metrics: [[name, labels, value]], jobs: {'<kind> <tenant or domain>': progress}}]}",
        (), True),
    ("GET", "/openapi.json"): ("This document", (), True),
    ("GET", "/v1/me"): ("Who the token belongs to: 'admin' or a tenant's name", (), False),
    ("GET", "/"): ("The web console (HTML; type a token into it)", (), True),
    ("GET", "/console/{file}"): ("The web console's static files", (), True),
}

ZIP_BODY = {("POST", "/v1/tenants/{tenant}/adapter")}
ZIP_RESPONSE = {("GET", "/v1/tenants/{tenant}/adapter")}
TENSOR_ROUTES = {("POST", "/v1/base/lower"), ("POST", "/v1/base/layers/{layer}/{projection}/{operation}")}
PATH_PARAMS = {"{job}": {"type": "string"}, "{file}": {"type": "string"}, "{layer}": {"type": "integer", "minimum": 0},
               "{projection}": {"type": "string", "enum": list(PROJECTIONS)},
               "{operation}": {"type": "string", "enum": list(OPERATIONS)}}
BINARY = {"type": "string", "format": "binary"}

ERRORS = {
    "400": "the body is not what this document describes (malformed JSON, a field of the wrong type or range, "
           "an unknown field)",
    "401": "no token, or not a valid one", "403": "the token may not act on this resource",
    "404": "no such tenant, domain, job or route", "405": "method not allowed (the Allow header lists the allowed ones)",
    "409": "conflict: the name exists, or the tenant or domain is busy or not ready",
    "413": "over a size limit: the body, the number of items, characters, examples, or the model's token limit",
    "415": "the body is not JSON (or, for an adapter upload, not a zip)",
    "422": "well-formed but inconsistent (e.g. labels of the data missing from the task's labels, a corpus too small "
           "for a domain, an uploaded adapter the server cannot batch)",
    "429": "at capacity, or this tenant has its share of requests waiting (over_share: the others are still "
           "served): retry after the Retry-After header's seconds",
    "5XX": "a server-side failure confined to this request (an unreadable adapter, a timeout, shutting down)",
}


def routes_of(app) -> list[tuple[str, str]]:
    return [(r.method, r.resource.canonical) for r in app.router.routes() if r.method not in ("HEAD", "OPTIONS")]


def openapi_document(app, models: dict) -> dict:
    used = sorted({m for _, ms, _ in ROUTE_DOCS.values() for m in ms})
    refs, defs = models_json_schema([(models[m], "validation") for m in used], ref_template="#/components/schemas/{model}")
    ref = {m: refs[(models[m], "validation")] for m in used}
    paths: dict = {}
    for method, path in routes_of(app):
        summary, bodies, public = ROUTE_DOCS.get((method, path), ("undocumented", (), False))
        responses = {"200": {"description": "success"}, "202": {"description": "accepted: a job started"}}
        responses.update({code: {"description": text, "content": {"application/json": {"schema": ERROR}}}
                          for code, text in ERRORS.items()})
        op = {"summary": summary, "responses": responses}
        params = [{"name": seg[1:-1], "in": "path", "required": True,
                   "schema": PATH_PARAMS.get(seg, {"type": "string", "pattern": f"^{NAME_PATTERN}$"})}
                  for seg in path.split("/") if seg.startswith("{")]
        if params:
            op["parameters"] = params
        if bodies:
            schema = ref[bodies[0]] if len(bodies) == 1 else {"anyOf": [ref[b] for b in bodies]}
            op["requestBody"] = {"required": True, "content": {"application/json": {"schema": schema}}}
        if (method, path) in ZIP_BODY:
            # application/octet-stream: the generic name of a byte body, which every client and
            # fuzzer can send; the server takes application/zip as well.
            op["requestBody"] = {"required": True, "description": "a zip archive of the adapter's saved folder",
                                 "content": {"application/octet-stream": {"schema": BINARY}}}
            op["parameters"] = op.get("parameters", []) + [
                {"name": "model", "in": "query", "required": False, "schema": {"type": "string", "enum": ["encoder", "decoder"]},
                 "description": "the kind of a new tenant"},
                {"name": "truncate", "in": "query", "required": False, "schema": {"type": "string", "enum": ["true", "false"]},
                 "description": "a new encoder tenant cuts texts over the token limit instead of refusing them (default false)"}]
        if (method, path) in TENSOR_ROUTES:
            op["requestBody"] = {"required": True, "description": "tensors in hmi.split.wire's binary format",
                                 "content": {"application/octet-stream": {"schema": BINARY}}}
            responses["200"] = {"description": "the result tensor(s) in the same format", "content": {
                "application/octet-stream": {"schema": BINARY}}}
            if "layers" in path:
                op["parameters"] = op.get("parameters", []) + [{"name": "priority", "in": "query", "required": False,
                                                                "schema": {"type": "string", "enum": ["inference", "training"]}}]
        if (method, path) in ZIP_RESPONSE:
            responses["200"] = {"description": "the adapter's folder as a zip", "content": {"application/zip": {
                "schema": BINARY}}}
        if (method, path) in ZIP_BODY or (method, path) == ("POST", "/v1/tenants"):
            responses["201"] = {"description": "a new tenant: its token, shown once"}
        if not public:
            op["security"] = [{"bearer": []}]
        paths.setdefault(path, {})[method.lower()] = op
    return {"openapi": "3.1.0", "info": {"title": "HMI", "version": "0.1.0"}, "paths": paths,
            "components": {"schemas": defs.get("$defs", {}),
                           "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}}}
