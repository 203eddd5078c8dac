"""A recording Matrix client for the conformance harness.

Every request goes through `Client.request`, which records the answer and checks it
against the spec (`Recorder.check`):

- a JSON answer with a status the spec documents for that endpoint must validate
  against the spec's schema for that status;
- a 2xx status the spec does not document for that endpoint is a finding;
- any other error status must still be a Matrix error (`errcode` string).

An endpoint counts as *exercised* once one of its 2xx answers has been validated.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote, urlencode

from .spec import Operation, Spec

_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))
TIMEOUT_S = 30.0


def seg(value: str) -> str:
    """One path segment, percent-encoded (room ids, event ids, user ids, aliases)."""
    return quote(value, safe="")


@dataclass
class Answer:
    status: int
    body: Any  # parsed JSON, or raw bytes for non-JSON answers
    content_type: str

    def __getitem__(self, key: str) -> Any:
        return self.body[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self.body.get(key, default) if isinstance(self.body, dict) else default


@dataclass
class Recorder:
    """What the flows did, and what broke the spec, across one pytest module."""

    spec: Spec
    exercised: dict[str, int] = field(default_factory=dict)  # op key -> validated 2xx count
    seen: dict[str, set[int]] = field(default_factory=dict)  # op key -> statuses seen
    not_in_spec: set[str] = field(default_factory=set)  # "METHOD path" of extensions
    problems: list[str] = field(default_factory=list)

    def check(self, method: str, path: str, answer: Answer) -> Operation | None:
        op = self.spec.match(method, path)
        if op is None:
            self.not_in_spec.add(f"{method} {path}")
            return None
        self.seen.setdefault(op.key, set()).add(answer.status)
        where = f"{op.key} -> {answer.status}"
        is_json = answer.content_type.startswith("application/json")
        documented = op.documents_status(answer.status)
        if 200 <= answer.status < 300 and not documented:
            self.problems.append(f"{where}: the spec documents no {answer.status} for this endpoint")
            return op
        if documented and op.json_schema(answer.status) is not None:
            if not is_json:
                self.problems.append(f"{where}: spec says JSON, got {answer.content_type!r}")
                return op
            errors = self.spec.validation_errors(op, answer.status, answer.body)
            for e in errors[:20]:
                self.problems.append(f"{where}: {e}")
            if not errors and 200 <= answer.status < 300:
                self.exercised[op.key] = self.exercised.get(op.key, 0) + 1
        elif documented and 200 <= answer.status < 300:
            # A documented non-JSON answer (media bytes, redirects): nothing to validate.
            self.exercised[op.key] = self.exercised.get(op.key, 0) + 1
        elif answer.status >= 400:
            body = answer.body if isinstance(answer.body, dict) else {}
            if not isinstance(body.get("errcode"), str):
                self.problems.append(f"{where}: error answer is not a Matrix error: {answer.body!r:.200}")
        return op


class Client:
    """A client of one server, optionally logged in (`token`)."""

    def __init__(self, base_url: str, recorder: Recorder, token: str | None = None):
        self.base_url = base_url
        self.recorder = recorder
        self.token = token
        self.user_id: str | None = None
        self.device_id: str | None = None

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        query: dict[str, Any] | None = None,
        expect: int | tuple[int, ...] | None = 200,
        auth: bool = True,
        raw_body: bytes | None = None,
        content_type: str = "application/json",
    ) -> Answer:
        url = self.base_url + path
        if query:
            url += "?" + urlencode({k: v if isinstance(v, str) else json.dumps(v) if isinstance(v, (dict, list)) else str(v) for k, v in query.items()})
        data = raw_body
        if data is None and body is not None:
            data = json.dumps(body).encode()
        if data is None and method in ("POST", "PUT"):
            data = b"{}"
        req = urllib.request.Request(url, data=data, method=method)
        req.add_header("Content-Type", content_type)
        if auth and self.token:
            req.add_header("Authorization", f"Bearer {self.token}")
        try:
            with _OPENER.open(req, timeout=TIMEOUT_S) as resp:
                status, raw, ctype = resp.status, resp.read(), resp.headers.get("Content-Type", "")
        except urllib.error.HTTPError as e:
            status, raw, ctype = e.code, e.read(), e.headers.get("Content-Type", "")
        parsed: Any = raw
        if ctype.startswith("application/json"):
            try:
                parsed = json.loads(raw)
            except ValueError:
                parsed = raw
        answer = Answer(status, parsed, ctype)
        self.recorder.check(method, path, answer)
        if expect is not None:
            wanted = expect if isinstance(expect, tuple) else (expect,)
            assert status in wanted, f"{method} {path}: expected {wanted}, got {status}: {parsed!r:.400}"
        return answer

    def get(self, path: str, **kw) -> Answer:
        return self.request("GET", path, **kw)

    def post(self, path: str, body: Any = None, **kw) -> Answer:
        return self.request("POST", path, body, **kw)

    def put(self, path: str, body: Any = None, **kw) -> Answer:
        return self.request("PUT", path, body, **kw)

    def delete(self, path: str, body: Any = None, **kw) -> Answer:
        return self.request("DELETE", path, body, **kw)
