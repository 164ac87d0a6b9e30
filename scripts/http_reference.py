"""The HTTP reference page, rendered from the server's OpenAPI document (what ``GET /openapi.json``
answers with the default limits): every route with its summary, who may call it, its path
parameters and its body's fields.  ``tests/test_docs_site.py`` checks that the page in the
repository is the one this renders.

Usage: python scripts/http_reference.py [--check]   (writes docs/reference/openapi.md)
"""

from __future__ import annotations

import sys
from pathlib import Path

PAGE = Path(__file__).resolve().parents[1] / "docs" / "reference" / "openapi.md"
CONSTRAINTS = ("minLength", "maxLength", "minimum", "maximum", "exclusiveMinimum", "minItems", "maxItems", "pattern")


def document() -> dict:
    """The OpenAPI document of the routes, with the default server limits (no server started)."""
    from aiohttp import web

    from hmi.dispatcher.app import ROUTES
    from hmi.dispatcher.openapi import openapi_document
    from hmi.dispatcher.schemas import build_models
    from hmi.services.server import ServerConfig

    app = web.Application()
    for method, path, handler in ROUTES:
        app.router.add_route(method, path, handler)
    return openapi_document(app, build_models(ServerConfig()))


def type_of(schema: dict) -> str:
    """A field's type as a reader writes it: ``string``, ``array of TextExample``, ``integer or null``."""
    if "$ref" in schema:
        return f"`{schema['$ref'].rsplit('/', 1)[-1]}`"
    if "anyOf" in schema:
        return " or ".join(type_of(s) for s in schema["anyOf"])
    if "enum" in schema:
        return "one of " + ", ".join(f"`{v}`" for v in schema["enum"])
    if schema.get("type") == "array":
        return "array of " + type_of(schema.get("items", {}))
    return schema.get("type", "any")


def constraints(schema: dict) -> str:
    parts = [f"{k} {schema[k]!r}" if k == "pattern" else f"{k} {schema[k]}" for k in CONSTRAINTS if k in schema]
    for option in schema.get("anyOf", []):
        parts += [p for p in constraints(option).split("; ") if p]
    return "; ".join(parts)


def fields_table(name: str, schema: dict) -> list[str]:
    """A body model's fields: name, type, required, default, constraints, description."""
    props, required = schema.get("properties", {}), set(schema.get("required", []))
    lines = [f"**`{name}`**" + (f": {schema['description']}" if schema.get("description") else ""), "",
             "| field | type | required | default | constraints | what |", "|---|---|---|---|---|---|"]
    for field, s in props.items():
        default = f"`{s['default']}`" if "default" in s else ""
        what = (s.get("description") or "").replace("|", "\\|").replace("\n", " ")
        lines.append(f"| `{field}` | {type_of(s)} | {'yes' if field in required else ''} | {default} | "
                     f"{constraints(s).replace('|', chr(92) + '|')} | {what} |")
    return lines + [""]


def markdown(doc: dict) -> str:
    from hmi.dispatcher.openapi import ERRORS, ROUTE_DOCS

    out = ["# The HTTP API, route by route", "",
           "Rendered by `python scripts/http_reference.py` from the server's OpenAPI document (`GET /openapi.json`, "
           "with the default limits); a test checks that this page is current. The overview with examples: "
           "[http.md](http.md).", "",
           "Every route answers a client's mistake with a 4xx and `{\"error\": {\"code\", \"message\"}}`:", ""]
    out += [f"- **{code}**: {text}" for code, text in ERRORS.items()] + [""]
    schemas = doc.get("components", {}).get("schemas", {})
    used: list[str] = []
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            public = ROUTE_DOCS.get((method.upper(), path), ("", (), False))[2]
            out += [f"## `{method.upper()} {path}`", "", op["summary"] + ("" if not public else " (no token needed)"), ""]
            for p in op.get("parameters", []):
                out.append(f"- path parameter `{p['name']}`: {type_of(p['schema'])}"
                           + (f" ({constraints(p['schema'])})" if constraints(p["schema"]) else ""))
            body = op.get("requestBody", {}).get("content", {})
            for ctype, content in body.items():
                schema = content.get("schema", {})
                refs = [schema] if "$ref" in schema else schema.get("anyOf", [])
                names = [r["$ref"].rsplit("/", 1)[-1] for r in refs if "$ref" in r]
                out.append(f"- body ({ctype}): " + (" or ".join(f"`{n}`" for n in names) if names else type_of(schema)))
                used += [n for n in names if n not in used]
            out.append("")
    out += ["## Bodies", ""]
    todo = list(used)
    while todo:  # the bodies and every model they refer to, each once
        name = todo.pop(0)
        schema = schemas[name]
        out += fields_table(name, schema)
        for s in schema.get("properties", {}).values():
            for ref in _refs(s):
                if ref not in used:
                    used.append(ref)
                    todo.append(ref)
    return "\n".join(out).rstrip() + "\n"


def _refs(schema) -> list[str]:
    if isinstance(schema, dict):
        found = [schema["$ref"].rsplit("/", 1)[-1]] if "$ref" in schema else []
        return found + [r for v in schema.values() for r in _refs(v)]
    if isinstance(schema, list):
        return [r for v in schema for r in _refs(v)]
    return []


def main() -> int:
    text = markdown(document())
    if "--check" in sys.argv:
        return 0 if PAGE.exists() and PAGE.read_text() == text else 1
    PAGE.write_text(text)
    print(f"wrote {PAGE}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    raise SystemExit(main())
