"""The Matrix specification's OpenAPI definitions, loaded for validation.

Source: the spec's own `data/api/*` OpenAPI 3.1 files (v1.19), found outside this
repository (they are the contract, not ours to copy):

1. `$SPINDLE_MATRIX_SPEC` if set (a directory holding `data/api`),
2. `shared/matrix-spec/v1.19` in any parent directory of the repository,
3. `/work/shared/matrix-spec/v1.19`.

An `Operation` is one (method, full path template) of an API the homeserver serves:
the Client-Server API and the Server-Server API. The Application Service, Identity and
Push Gateway APIs are served by other parties (an application service, an identity
server, a push gateway), so they are not counted against the homeserver.
"""

from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from jsonschema import Draft202012Validator
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

SPEC_VERSION = "v1.19"
METHODS = ("get", "put", "post", "delete")

# The APIs a homeserver itself serves, with the spec's directory name.
APIS = {
    "client-server": "Client-Server API",
    "server-server": "Server-Server API",
}


def find_spec_dir(repo_root: Path) -> Path:
    """The directory holding `data/api` of the spec version we target.

    Raises FileNotFoundError naming every place looked at: the harness must not pass
    silently because it could not find what to check against.
    """
    tried: list[Path] = []
    env = os.environ.get("SPINDLE_MATRIX_SPEC")
    if env:
        tried.append(Path(env))
    for parent in [repo_root, *repo_root.parents]:
        tried.append(parent / "shared" / "matrix-spec" / SPEC_VERSION)
    tried.append(Path("/work/shared/matrix-spec") / SPEC_VERSION)
    for candidate in tried:
        if (candidate / "data" / "api" / "client-server").is_dir():
            return candidate
    raise FileNotFoundError(
        "the Matrix spec's OpenAPI files were not found; set SPINDLE_MATRIX_SPEC to a "
        f"checkout of matrix-org/matrix-spec at {SPEC_VERSION} (it must hold data/api). "
        "Looked in: " + ", ".join(str(p) for p in tried)
    )


@dataclass
class Operation:
    """One endpoint of the spec: a method on a full path template."""

    api: str  # "client-server" | "server-server"
    file: str  # e.g. "room_state.yaml"
    method: str  # upper case: GET, PUT, POST, DELETE
    template: str  # full path, e.g. /_matrix/client/v3/rooms/{roomId}/state
    operation_id: str
    deprecated: bool
    responses: dict[str, Any]  # status (str) -> OpenAPI response object (refs resolved)
    response_pointers: dict[str, str]  # status (str) -> JSON pointer of that response in its file
    path_examples: dict[str, str]  # path parameter -> the spec's example value
    regex: re.Pattern = field(repr=False)
    literal_segments: int = 0

    @property
    def key(self) -> str:
        return f"{self.method} {self.template}"

    def json_schema(self, status: int) -> dict | None:
        """The JSON schema the spec gives for this status, or None if it gives none."""
        resp = self.responses.get(str(status))
        if resp is None:
            return None
        content = resp.get("content") or {}
        media = content.get("application/json")
        if media is None:
            return None
        return media.get("schema")

    def schema_pointer(self, status: int) -> str | None:
        """JSON pointer (within `file`) of the JSON schema for this status."""
        if self.json_schema(status) is None:
            return None
        return self.response_pointers[str(status)] + "/content/application~1json/schema"

    def documents_status(self, status: int) -> bool:
        return str(status) in self.responses

    def probe_path(self) -> str:
        """The template with every path parameter replaced by the spec's own example."""

        def sub(m: re.Match) -> str:
            name = m.group(1)
            value = self.path_examples.get(name) or f"probe-{name}"
            return _quote_segment(str(value))

        return re.sub(r"\{([^}]+)\}", sub, self.template)


def _quote_segment(value: str) -> str:
    from urllib.parse import quote

    return quote(value, safe="")


def _template_regex(template: str) -> re.Pattern:
    parts = re.split(r"(\{[^}]+\})", template)
    out = []
    for part in parts:
        if part.startswith("{") and part.endswith("}"):
            out.append("[^/]*")
        else:
            out.append(re.escape(part))
    return re.compile("^" + "".join(out) + "$")


def _esc(token: str) -> str:
    """One JSON-pointer reference token (RFC 6901)."""
    return token.replace("~", "~0").replace("/", "~1")


def _local(doc: dict, obj: Any) -> tuple[Any, str | None]:
    """Follow same-file `$ref`s (`#/components/...`); returns (object, pointer or None)."""
    pointer = None
    seen = 0
    while isinstance(obj, dict) and isinstance(obj.get("$ref"), str) and obj["$ref"].startswith("#/"):
        pointer = obj["$ref"][1:]
        node: Any = doc
        for token in pointer[1:].split("/"):
            node = node[token.replace("~1", "/").replace("~0", "~")]
        obj = node
        seen += 1
        if seen > 16:
            raise ValueError(f"reference loop at {pointer}")
    return obj, pointer


def _base_path(doc: dict) -> str:
    for server in doc.get("servers") or []:
        var = (server.get("variables") or {}).get("basePath")
        if var is not None:
            return var.get("default", "")
    return ""


class Spec:
    """Every operation of the homeserver-served APIs, and response validators."""

    def __init__(self, spec_dir: Path):
        self.spec_dir = spec_dir
        self.api_dir = spec_dir / "data" / "api"
        self.operations: list[Operation] = []
        for api in APIS:
            for path in sorted((self.api_dir / api).glob("*.yaml")):
                self._load_file(api, path)
        self._registry = Registry(retrieve=self._retrieve)

    def _load_file(self, api: str, path: Path) -> None:
        doc = yaml.safe_load(path.read_text())
        base = _base_path(doc)
        for rel, ops in (doc.get("paths") or {}).items():
            shared_params = ops.get("parameters") or []
            for method in METHODS:
                op = ops.get(method)
                if op is None:
                    continue
                template = (base + rel).strip()  # inviting.yaml has a stray trailing space
                examples = {}
                for param in [*shared_params, *(op.get("parameters") or [])]:
                    param = _local(doc, param)[0]
                    if param.get("in") == "path":
                        example = param.get("example")
                        if example is None:
                            example = (param.get("schema") or {}).get("example")
                        if example is not None:
                            examples[param["name"]] = example
                responses: dict[str, Any] = {}
                pointers: dict[str, str] = {}
                for status, resp in (op.get("responses") or {}).items():
                    pointer = f"/paths/{_esc(rel)}/{method}/responses/{status}"
                    resolved, ref_pointer = _local(doc, resp)
                    responses[str(status)] = resolved
                    pointers[str(status)] = ref_pointer or pointer
                literal = len([s for s in template.split("/") if s and "{" not in s])
                self.operations.append(
                    Operation(
                        api=api,
                        file=path.name,
                        method=method.upper(),
                        template=template,
                        operation_id=op.get("operationId", ""),
                        deprecated=bool(op.get("deprecated", False)),
                        responses=responses,
                        response_pointers=pointers,
                        path_examples=examples,
                        regex=_template_regex(template),
                        literal_segments=literal,
                    )
                )

    # -- lookup ------------------------------------------------------------------
    def match(self, method: str, path: str) -> Operation | None:
        """The spec operation a concrete request path is an instance of.

        `path` is the raw (percent-encoded) path without the query string. When several
        templates match (`/rooms/{roomId}/state/{eventType}` and
        `/rooms/{roomId}/state/{eventType}/{stateKey}` with an empty key), the one with
        the most literal segments, then the longest template, wins.
        """
        found = [
            op for op in self.operations if op.method == method.upper() and op.regex.match(path)
        ]
        if not found:
            return None
        found.sort(key=lambda op: (op.literal_segments, len(op.template)), reverse=True)
        return found[0]

    # -- validation ----------------------------------------------------------------
    def _retrieve(self, uri: str) -> Resource:
        if not uri.startswith("file://"):
            raise LookupError(f"only file references are followed, not {uri}")
        path = Path(uri[len("file://") :])
        return Resource.from_contents(_load_yaml(str(path)), default_specification=DRAFT202012)

    def validator(self, op: Operation, status: int) -> Draft202012Validator | None:
        schema = op.json_schema(status)
        if schema is None:
            return None
        # A reference into the whole file, so that the file's own `#/components/...`
        # references and its relative file references resolve as the spec means them.
        base = (self.api_dir / op.api / op.file).resolve().as_uri()
        pointer = op.schema_pointer(status)
        return Draft202012Validator({"$ref": f"{base}#{pointer}"}, registry=self._registry)

    def validation_errors(self, op: Operation, status: int, body: Any) -> list[str]:
        """Every way `body` breaks the spec's schema for (op, status), as readable lines."""
        v = self.validator(op, status)
        if v is None:
            return []
        out = []
        for err in sorted(v.iter_errors(body), key=lambda e: list(e.absolute_path)):
            where = "/".join(str(p) for p in err.absolute_path) or "(root)"
            out.append(f"{where}: {err.message[:300]}")
        return out


@functools.lru_cache(maxsize=None)
def _load_yaml(path: str) -> Any:
    return yaml.safe_load(Path(path).read_text())
