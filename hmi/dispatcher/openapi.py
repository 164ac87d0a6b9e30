"""The OpenAPI document, generated from the registered routes and the descriptions below."""

from __future__ import annotations

ERROR = {"type": "object", "properties": {"error": {"type": "object", "properties": {
    "code": {"type": "string"}, "message": {"type": "string"}}}}}
EXAMPLE = {"type": "object", "properties": {"text": {"type": "string"}, "label": {"type": "string"},
                                            "tokens": {"type": "array", "items": {"type": "string"}},
                                            "tags": {"type": "array", "items": {"type": "string"}}}}
TRAINING = {"type": "object", "properties": {"train": {"type": "array", "items": EXAMPLE},
                                             "dev": {"type": "array", "items": EXAMPLE},
                                             "test": {"type": "array", "items": EXAMPLE}}}

DESCRIPTIONS = {
    ("POST", "/v1/tenants/{tenant}/infer"): {
        "summary": "Run the tenant's hPLM on texts (tenant or admin token)",
        "body": {"type": "object", "required": ["inputs"],
                 "properties": {"inputs": {"type": "array", "items": {"type": "string"}, "minItems": 1}}}},
    ("POST", "/v1/tenants/{tenant}/generate"): {
        "summary": "Generate text with a decoder tenant (hGPT); 'stream': true answers NDJSON lines as tokens come",
        "body": {"type": "object", "required": ["prompt"], "properties": {
            "prompt": {"type": "string"}, "max_new_tokens": {"type": "integer", "default": 32},
            "temperature": {"type": "number", "default": 0}, "top_p": {"type": "number", "default": 1},
            "seed": {"type": "integer"}, "stop": {"type": "array", "items": {"type": "string"}},
            "stream": {"type": "boolean", "default": False}}}},
    ("POST", "/v1/completions"): {
        "summary": "OpenAI-style text completion; 'model' names the decoder tenant; 'stream' answers server-sent events",
        "body": {"type": "object", "required": ["model", "prompt"], "properties": {
            "model": {"type": "string"}, "prompt": {"type": "string"}, "max_tokens": {"type": "integer", "default": 32},
            "temperature": {"type": "number"}, "top_p": {"type": "number"}, "seed": {"type": "integer"},
            "stop": {"type": "array", "items": {"type": "string"}}, "stream": {"type": "boolean"}}}},
    ("POST", "/v1/tenants"): {
        "summary": "Create a tenant hPLM: starts a fine-tune job, returns the tenant token once (admin). "
                   "Decoder tenants: 'model': 'decoder' with 'corpus' or 'training_text' (and 'adapter': {'rank', 'alpha'})",
        "body": {"type": "object", "required": ["name"], "properties": {
            "name": {"type": "string"}, "domain": {"type": "string", "default": "root"},
            "model": {"enum": ["encoder", "decoder"], "default": "encoder"}, "corpus": {"type": "string"},
            "training_text": {"type": "array", "items": {"type": "string"}},
            "task": {"type": "object", "properties": {"type": {"enum": ["classification", "tagging"]},
                                                      "labels": {"type": "array", "items": {"type": "string"}},
                                                      "pooling": {"enum": ["cls", "mean"], "default": "cls"}}},
            "adapter": {"type": "object", "properties": {"kind": {"enum": ["bottleneck", "lora", "ia3"]},
                                                         "reduction_factor": {"type": "integer"},
                                                         "rank": {"type": "integer"}, "alpha": {"type": "number"}}},
            "training_data": TRAINING, "dataset": {"type": "string"}, "max_train": {"type": "integer"},
            "epochs": {"type": "integer"}}}},
    ("GET", "/v1/tenants"): {"summary": "List tenants (admin)"},
    ("GET", "/v1/tenants/{tenant}"): {"summary": "A tenant's state, spec and metrics (owner or admin)"},
    ("POST", "/v1/tenants/{tenant}/update"): {
        "summary": "Continue training on more data: a job (owner or admin)",
        "body": {"type": "object", "properties": {"training_data": TRAINING, "dataset": {"type": "string"},
                                                  "max_train": {"type": "integer"}, "epochs": {"type": "integer"}}}},
    ("DELETE", "/v1/tenants/{tenant}"): {"summary": "Delete the hPLM and its adapters (owner or admin)"},
    ("POST", "/v1/domains"): {
        "summary": "Create a domain branch: further pretraining + pruned PLOT, a job (admin). JSON or multipart "
                   "(file field 'corpus')",
        "body": {"type": "object", "required": ["name"], "properties": {
            "name": {"type": "string"}, "parent": {"type": "string", "default": "root"},
            "alpha": {"type": "number", "default": 0.5}, "corpus": {"type": "array", "items": {"type": "string"}},
            "corpus_name": {"type": "string"}, "max_lines": {"type": "integer"}, "steps": {"type": "integer"}}}},
    ("POST", "/v1/domains/{name}/update"): {
        "summary": "Continue further pretraining on more corpus and refresh the branch's PLOT: a job (admin)",
        "body": {"type": "object", "properties": {"corpus": {"type": "array", "items": {"type": "string"}},
                                                  "corpus_name": {"type": "string"}, "steps": {"type": "integer"}}}},
    ("DELETE", "/v1/domains/{name}"): {"summary": "Delete a domain branch no tenant uses (admin)"},
    ("GET", "/v1/domains"): {"summary": "The domain version tree with PLOT sizes (admin)"},
    ("GET", "/v1/domains/{name}"): {"summary": "One domain (admin)"},
    ("GET", "/v1/jobs"): {"summary": "All jobs (admin)"},
    ("GET", "/v1/jobs/{job}"): {"summary": "A job's state, progress and metrics (owner or admin)"},
    ("DELETE", "/v1/jobs/{job}"): {"summary": "Cancel a queued or running job (owner or admin)"},
    ("GET", "/healthz"): {"summary": "Liveness", "public": True},
    ("GET", "/metrics"): {"summary": "Prometheus metrics", "public": True},
    ("GET", "/openapi.json"): {"summary": "This document", "public": True},
}


def routes_of(app) -> list[tuple[str, str]]:
    out = []
    for route in app.router.routes():
        if route.method in ("HEAD", "OPTIONS"):
            continue
        out.append((route.method, route.resource.canonical))
    return out


def openapi_document(app) -> dict:
    paths: dict = {}
    for method, path in routes_of(app):
        d = DESCRIPTIONS.get((method, path), {"summary": "undocumented"})
        op = {"summary": d["summary"], "responses": {
            "200": {"description": "success"}, "202": {"description": "accepted: a job started"},
            "4XX": {"description": "client error", "content": {"application/json": {"schema": ERROR}}}}}
        params = [{"name": seg[1:-1], "in": "path", "required": True, "schema": {"type": "string"}}
                  for seg in path.split("/") if seg.startswith("{")]
        if params:
            op["parameters"] = params
        if "body" in d:
            op["requestBody"] = {"required": True, "content": {"application/json": {"schema": d["body"]}}}
        if not d.get("public"):
            op["security"] = [{"bearer": []}]
        paths.setdefault(path, {})[method.lower()] = op
    return {"openapi": "3.0.3", "info": {"title": "HMI", "version": "0.1.0"}, "paths": paths,
            "components": {"securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}}}
