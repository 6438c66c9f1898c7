"""A MkDocs hook: renders http/openapi.json (the spec every node serves at
/v1/openapi.json) into the HTTP reference page, in place of the `<!-- openapi -->` marker,
so that the reference can never drift from the spec."""

from __future__ import annotations

import json
import os

MARKER = "<!-- openapi -->"
SPEC = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "http", "openapi.json")
METHODS = ("get", "put", "post", "delete")


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _ref(schema: dict) -> str:
    """A schema, briefly: a link to a named one, or its type."""
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[1]
        return f"[{name}](#schema-{name.lower()})"
    if schema.get("type") == "array":
        return f"array of {_ref(schema.get('items', {}))}"
    if "oneOf" in schema or "anyOf" in schema:
        return " or ".join(_ref(s) for s in schema.get("oneOf") or schema.get("anyOf"))
    kind = schema.get("type", "any")
    if "enum" in schema:
        kind += " (" + ", ".join(f"`{v}`" for v in schema["enum"]) + ")"
    return kind


def _resolve(spec: dict, obj: dict) -> dict:
    while "$ref" in obj:
        section, name = obj["$ref"].split("/")[-2:]
        obj = spec["components"][section][name]
    return obj


def render(spec: dict) -> str:
    out = []
    for path, ops in spec["paths"].items():
        for method in METHODS:
            op = ops.get(method)
            if op is None:
                continue
            out.append(f"### `{method.upper()} {path}`\n")
            if op.get("summary"):
                out.append(op["summary"] + "\n")
            if op.get("description"):
                out.append(op["description"] + "\n")
            params = [_resolve(spec, p) for p in ops.get("parameters", []) + op.get("parameters", [])]
            if params:
                out.append("| parameter | in | required | what |\n| --- | --- | --- | --- |")
                for p in params:
                    out.append(f"| `{p['name']}` | {p['in']} | {'yes' if p.get('required') else 'no'} | {_cell(p.get('description', ''))} |")
                out.append("")
            body = op.get("requestBody")
            if body:
                body = _resolve(spec, body)
                kinds = ", ".join(f"`{ct}`: {_ref(c.get('schema', {}))}" for ct, c in body.get("content", {}).items())
                out.append(f"Body: {kinds}. {_cell(body.get('description', ''))}\n")
            out.append("| status | meaning | body |\n| --- | --- | --- |")
            for status, resp in op.get("responses", {}).items():
                resp = _resolve(spec, resp)
                schema = next(iter(resp.get("content", {}).values()), {}).get("schema")
                out.append(f"| {status} | {_cell(resp.get('description', ''))} | {_ref(schema) if schema else ''} |")
            out.append("")
    out.append("## Schemas\n")
    for name, schema in spec["components"].get("schemas", {}).items():
        out.append(f'### {name} {{ #schema-{name.lower()} }}\n')
        if schema.get("description"):
            out.append(schema["description"] + "\n")
        props = schema.get("properties")
        if props:
            required = set(schema.get("required", ()))
            out.append("| field | type | required | what |\n| --- | --- | --- | --- |")
            for field, p in props.items():
                out.append(f"| `{field}` | {_ref(p)} | {'yes' if field in required else 'no'} | {_cell(p.get('description', ''))} |")
            out.append("")
        else:
            out.append(f"{_ref(schema)}\n")
    return "\n".join(out)


def on_page_markdown(markdown: str, page, config, files) -> str:
    if MARKER not in markdown:
        return markdown
    with open(SPEC) as f:
        return markdown.replace(MARKER, render(json.load(f)))
