"""A strict stdlib MCP stdio client for tests.

It spawns a server command and speaks JSON-RPC over its stdin/stdout, one message per line. It
is strict on purpose: every stdout line must be exactly one compact JSON-RPC message (a response
or a notification, or an array of responses), every response must echo the id of a request this
client sent (same JSON type: "7" is not 7), and no request may be answered twice. Anything else
is recorded in `violations`; tests assert that list stays empty.

It also carries a small JSON Schema validator (the subset tool schemas use) so
`structuredContent` can be checked against each tool's `outputSchema`.

Nothing here knows memshelf: the bundle tests reuse it against the unpacked extension.
"""

import json
import os
import re
import subprocess
import threading
import time

__all__ = ["McpClient", "McpError", "validate", "schema_problems", "clean_env"]

DEFAULT_TIMEOUT = 20.0


class McpError(AssertionError):
    """A protocol expectation failed (timeout, error answer where a result was expected)."""


def clean_env(base=None, drop_prefixes=("MEMSHELF_",), **extra):
    """A copy of the environment without variables that start with the given prefixes."""
    env = {k: v for k, v in (os.environ if base is None else base).items()
           if not any(k.startswith(p) for p in drop_prefixes)}
    env.update({k: str(v) for k, v in extra.items()})
    return env


class McpClient:
    """One server process and the conversation with it."""

    def __init__(self, argv, env=None, cwd=None, timeout=DEFAULT_TIMEOUT):
        self.argv = list(argv)
        self.timeout = timeout
        self.proc = subprocess.Popen(self.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, env=env, cwd=cwd)
        self.cond = threading.Condition()
        self.responses = {}        # (is_str, id) -> list of response messages
        self.batches = []          # arrays of responses
        self.notifications = []
        self.lines = []            # every raw stdout line, for inspection
        self.violations = []
        self.sent_ids = set()
        self.next_id = 0
        self.stdout_closed = False
        self.stderr_bytes = bytearray()
        self.tools = {}            # name -> tool definition from the last tools/list
        self.protocol_version = None
        threading.Thread(target=self._read_stdout, daemon=True).start()
        threading.Thread(target=self._read_stderr, daemon=True).start()

    # --- context manager ---------------------------------------------------------------------

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def reset(self):
        """Forget the conversation so far (answers, notifications, lines), keep the process.

        Lets several tests share one server: each starts with a clean record. Call it only
        when no request is in flight.
        """
        with self.cond:
            self.responses.clear()
            self.batches.clear()
            self.notifications.clear()
            self.lines.clear()
            self.sent_ids.clear()

    # --- reading -------------------------------------------------------------------------------

    def _read_stderr(self):
        for chunk in iter(lambda: self.proc.stderr.read1(65536), b""):
            self.stderr_bytes += chunk

    @property
    def stderr(self):
        return self.stderr_bytes.decode("utf-8", "replace")

    def _violation(self, text):
        with self.cond:
            self.violations.append(text)
            self.cond.notify_all()

    def _read_stdout(self):
        for line in iter(self.proc.stdout.readline, b""):
            self.lines.append(line)
            self._on_line(line)
        with self.cond:
            self.stdout_closed = True
            self.cond.notify_all()

    def _on_line(self, line):
        shown = line[:200]
        if not line.endswith(b"\n"):
            return self._violation(f"stdout line without a newline at the end: {shown!r}")
        body = line[:-1]
        if b"\r" in body:
            return self._violation(f"carriage return inside a stdout line: {shown!r}")
        try:
            text = body.decode("utf-8")
        except UnicodeDecodeError:
            return self._violation(f"stdout line is not UTF-8: {shown!r}")

        def no_constants(name):
            raise ValueError(name)
        try:
            msg = json.loads(text, parse_constant=no_constants)
        except ValueError:
            return self._violation(f"stdout line is not one JSON value: {shown!r}")
        if isinstance(msg, list):
            if not msg:
                return self._violation("empty array on stdout")
            for item in msg:
                if not self._is_response(item):
                    return self._violation(f"batch answer holds a non-response: {shown!r}")
            with self.cond:
                self.batches.append(msg)
                self.cond.notify_all()
            return None
        if not isinstance(msg, dict) or msg.get("jsonrpc") != "2.0":
            return self._violation(f"not a JSON-RPC 2.0 object: {shown!r}")
        if "method" in msg:
            if "id" in msg:
                return self._violation(f"the server sent a request: {shown!r}")
            if not isinstance(msg["method"], str):
                return self._violation(f"notification method is not a string: {shown!r}")
            with self.cond:
                self.notifications.append(msg)
                self.cond.notify_all()
            return None
        if not self._is_response(msg):
            return self._violation(f"neither a response nor a notification: {shown!r}")
        self._store_response(msg)
        return None

    @staticmethod
    def _is_response(msg):
        return (isinstance(msg, dict) and msg.get("jsonrpc") == "2.0" and "id" in msg and
                ("result" in msg) != ("error" in msg) and
                (isinstance(msg.get("result"), dict) or "error" in msg) and
                (("error" not in msg) or (isinstance(msg["error"], dict) and
                                          isinstance(msg["error"].get("code"), int) and
                                          isinstance(msg["error"].get("message"), str))))

    def _store_response(self, msg):
        rid = msg["id"]
        key = self._key(rid)
        with self.cond:
            if rid is not None and key not in self.sent_ids:
                self.violations.append(f"response to an id this client never sent: {rid!r}")
            bucket = self.responses.setdefault(key, [])
            bucket.append(msg)
            if rid is not None and len(bucket) > 1:
                self.violations.append(f"request {rid!r} was answered {len(bucket)} times")
            self.cond.notify_all()

    @staticmethod
    def _key(rid):
        return (type(rid).__name__, rid)

    # --- writing -------------------------------------------------------------------------------

    def send_raw(self, data):
        """Write raw bytes to the server's stdin (no newline added)."""
        self.proc.stdin.write(data)
        self.proc.stdin.flush()

    def send(self, message):
        """Send one message object (or array) as one line; record its id(s) as sent."""
        for item in message if isinstance(message, list) else [message]:
            if isinstance(item, dict) and "id" in item and "method" in item:
                self.sent_ids.add(self._key(item["id"]))
        self.send_raw(json.dumps(message, separators=(",", ":")).encode("utf-8") + b"\n")

    def new_id(self):
        self.next_id += 1
        return self.next_id

    def notify(self, method, params=None):
        message = {"jsonrpc": "2.0", "method": method}
        if params is not None:
            message["params"] = params
        self.send(message)

    def expect_id(self, rid):
        """Mark an id as sent by raw bytes, so its answer is not a violation."""
        self.sent_ids.add(self._key(rid))

    def start_request(self, method, params=None, rid=None):
        rid = self.new_id() if rid is None else rid
        message = {"jsonrpc": "2.0", "id": rid, "method": method}
        if params is not None:
            message["params"] = params
        self.send(message)
        return rid

    def wait_response(self, rid, timeout=None):
        key = self._key(rid)
        deadline = time.monotonic() + (timeout or self.timeout)
        with self.cond:
            while not self.responses.get(key):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise McpError(f"no response to id {rid!r} within the timeout; "
                                   f"stderr:\n{self.stderr[-2000:]}")
                if self.stdout_closed:
                    raise McpError(f"stdout closed before the response to id {rid!r}; "
                                   f"stderr:\n{self.stderr[-2000:]}")
                self.cond.wait(left)
            return self.responses[key][0]

    def wait_error(self, rid=None, timeout=None):
        """Wait for an error answer with this id (None: the next new id-null error)."""
        return self.wait_response(rid, timeout)["error"]

    def request_raw(self, method, params=None, rid=None, timeout=None):
        """Send a request and return the whole response message."""
        return self.wait_response(self.start_request(method, params, rid), timeout)

    def request(self, method, params=None, rid=None, timeout=None):
        """Send a request and return its result; an error answer raises McpError."""
        response = self.request_raw(method, params, rid, timeout)
        if "error" in response:
            raise McpError(f"{method} failed: {response['error']}")
        return response["result"]

    def null_id_errors(self):
        with self.cond:
            return list(self.responses.get(self._key(None), []))

    def wait_null_id_errors(self, count, timeout=None):
        deadline = time.monotonic() + (timeout or self.timeout)
        with self.cond:
            while len(self.responses.get(self._key(None), [])) < count:
                left = deadline - time.monotonic()
                if left <= 0 or self.stdout_closed:
                    raise McpError(f"expected {count} id-null answers, got "
                                   f"{len(self.responses.get(self._key(None), []))}")
                self.cond.wait(left)
            return list(self.responses[self._key(None)])

    def wait_batch(self, count=1, timeout=None):
        deadline = time.monotonic() + (timeout or self.timeout)
        with self.cond:
            while len(self.batches) < count:
                left = deadline - time.monotonic()
                if left <= 0 or self.stdout_closed:
                    raise McpError("no batch answer within the timeout")
                self.cond.wait(left)
            return self.batches[count - 1]

    def wait_notification(self, method, predicate=None, timeout=None):
        deadline = time.monotonic() + (timeout or self.timeout)
        with self.cond:
            while True:
                for n in self.notifications:
                    if n["method"] == method and (predicate is None or predicate(n)):
                        return n
                left = deadline - time.monotonic()
                if left <= 0 or self.stdout_closed:
                    raise McpError(f"no {method} notification within the timeout")
                self.cond.wait(left)

    def answered(self, rid):
        with self.cond:
            return bool(self.responses.get(self._key(rid)))

    # --- MCP conveniences ------------------------------------------------------------------------

    def initialize(self, version="2025-11-25", client_name="mcp-client-test", capabilities=None,
                   initialized=True):
        result = self.request("initialize", {
            "protocolVersion": version, "capabilities": capabilities or {},
            "clientInfo": {"name": client_name, "version": "1.0"}})
        self.protocol_version = result.get("protocolVersion")
        if initialized:
            self.notify("notifications/initialized")
        return result

    def list_tools(self):
        result = self.request("tools/list")
        self.tools = {t["name"]: t for t in result.get("tools", [])}
        return result["tools"]

    def call_tool(self, name, arguments=None, meta=None, timeout=None, validate_output=True):
        """tools/call; checks the result's shape and its structuredContent against the schema."""
        params = {"name": name, "arguments": arguments if arguments is not None else {}}
        if meta is not None:
            params["_meta"] = meta
        result = self.request("tools/call", params, timeout=timeout)
        problems = call_result_problems(result)
        if problems:
            raise McpError(f"{name}: malformed tool result: {problems}")
        schema = (self.tools.get(name) or {}).get("outputSchema")
        if validate_output and schema and not result.get("isError"):
            if "structuredContent" not in result:
                raise McpError(f"{name}: outputSchema declared but no structuredContent")
            errors = validate(result["structuredContent"], schema)
            if errors:
                raise McpError(f"{name}: structuredContent does not match outputSchema: "
                               f"{errors[:5]}")
        return result

    def close(self, timeout=10.0):
        """Close stdin (EOF), wait for the exit, kill on timeout; returns the exit status."""
        try:
            if not self.proc.stdin.closed:
                self.proc.stdin.close()
        except OSError:
            pass
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise McpError(f"the server did not exit within {timeout} s after EOF")

    def assert_clean(self):
        """No protocol violation so far."""
        with self.cond:
            if self.violations:
                raise McpError("protocol violations: " + "; ".join(self.violations[:10]))


def call_result_problems(result):
    """Shape problems of a CallToolResult (content blocks, isError, structuredContent)."""
    problems = []
    content = result.get("content")
    if not isinstance(content, list):
        problems.append("content is not an array")
    else:
        for block in content:
            if not isinstance(block, dict) or not isinstance(block.get("type"), str):
                problems.append("a content block has no type")
            elif block["type"] == "text" and not isinstance(block.get("text"), str):
                problems.append("a text block has no text")
    if "isError" in result and not isinstance(result["isError"], bool):
        problems.append("isError is not a boolean")
    if "structuredContent" in result and not isinstance(result["structuredContent"], dict):
        problems.append("structuredContent is not an object")
    return problems


# ==========================================================================================
# A small JSON Schema (2020-12 subset) validator
# ==========================================================================================

_TYPES = {
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "string": lambda v: isinstance(v, str),
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "integer": lambda v: (isinstance(v, int) and not isinstance(v, bool)) or
    (isinstance(v, float) and v.is_integer()),
}


def _equal(a, b):
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def validate(instance, schema, path="$", root=None):
    """Errors (strings) of instance against schema; an empty list means valid."""
    root = schema if root is None else root
    if schema is True or schema == {}:
        return []
    if schema is False:
        return [f"{path}: no value is allowed here"]
    if not isinstance(schema, dict):
        return [f"{path}: the schema is not an object"]
    errors = []
    if "$ref" in schema:
        ref = schema["$ref"]
        if not ref.startswith("#"):
            return [f"{path}: cannot follow remote $ref {ref}"]
        target = root
        for part in [p for p in ref[1:].split("/") if p]:
            target = target[part.replace("~1", "/").replace("~0", "~")]
        errors += validate(instance, target, path, root)
    kinds = schema.get("type")
    if kinds is not None:
        kinds = [kinds] if isinstance(kinds, str) else kinds
        if not any(_TYPES[k](instance) for k in kinds):
            return errors + [f"{path}: expected {'/'.join(kinds)}, got {type(instance).__name__}"]
    if "enum" in schema and not any(_equal(instance, e) for e in schema["enum"]):
        errors.append(f"{path}: {instance!r} is not one of {schema['enum']!r}")
    if "const" in schema and not _equal(instance, schema["const"]):
        errors.append(f"{path}: must equal {schema['const']!r}")
    if isinstance(instance, str):
        if len(instance) < schema.get("minLength", 0):
            errors.append(f"{path}: shorter than {schema['minLength']}")
        if "maxLength" in schema and len(instance) > schema["maxLength"]:
            errors.append(f"{path}: longer than {schema['maxLength']}")
        if "pattern" in schema and not re.search(schema["pattern"], instance):
            errors.append(f"{path}: does not match {schema['pattern']!r}")
    if _TYPES["number"](instance):
        for key, bad in (("minimum", lambda v, b: v < b), ("maximum", lambda v, b: v > b),
                         ("exclusiveMinimum", lambda v, b: v <= b),
                         ("exclusiveMaximum", lambda v, b: v >= b)):
            if key in schema and bad(instance, schema[key]):
                errors.append(f"{path}: {instance} violates {key} {schema[key]}")
    if isinstance(instance, list):
        if len(instance) < schema.get("minItems", 0):
            errors.append(f"{path}: fewer than {schema['minItems']} items")
        if "maxItems" in schema and len(instance) > schema["maxItems"]:
            errors.append(f"{path}: more than {schema['maxItems']} items")
        prefix = schema.get("prefixItems", [])
        for i, item in enumerate(instance):
            sub = prefix[i] if i < len(prefix) else schema.get("items")
            if sub is not None:
                errors += validate(item, sub, f"{path}[{i}]", root)
        if schema.get("uniqueItems") and len({json.dumps(x, sort_keys=True)
                                              for x in instance}) != len(instance):
            errors.append(f"{path}: items are not unique")
    if isinstance(instance, dict):
        for key in schema.get("required", []):
            if key not in instance:
                errors.append(f"{path}: missing required key {key!r}")
        props = schema.get("properties", {})
        patterns = schema.get("patternProperties", {})
        for key, value in instance.items():
            matched = False
            if key in props:
                matched = True
                errors += validate(value, props[key], f"{path}.{key}", root)
            for pattern, sub in patterns.items():
                if re.search(pattern, key):
                    matched = True
                    errors += validate(value, sub, f"{path}.{key}", root)
            if not matched and "additionalProperties" in schema:
                errors += validate(value, schema["additionalProperties"], f"{path}.{key}", root)
        if len(instance) < schema.get("minProperties", 0):
            errors.append(f"{path}: fewer than {schema['minProperties']} properties")
    for sub in schema.get("allOf", []):
        errors += validate(instance, sub, path, root)
    if "anyOf" in schema and not any(not validate(instance, s, path, root)
                                     for s in schema["anyOf"]):
        errors.append(f"{path}: matches none of anyOf")
    if "oneOf" in schema and sum(not validate(instance, s, path, root)
                                 for s in schema["oneOf"]) != 1:
        errors.append(f"{path}: does not match exactly one of oneOf")
    if "not" in schema and not validate(instance, schema["not"], path, root):
        errors.append(f"{path}: matches a forbidden schema")
    return errors


_SCHEMA_KEYWORD_TYPES = {
    "type": (str, list), "properties": dict, "required": list, "items": (dict, bool),
    "additionalProperties": (dict, bool), "enum": list, "minimum": (int, float),
    "maximum": (int, float), "exclusiveMinimum": (int, float), "exclusiveMaximum": (int, float),
    "minLength": int, "maxLength": int, "minItems": int, "maxItems": int, "pattern": str,
    "description": str, "title": str, "anyOf": list, "oneOf": list, "allOf": list,
    "patternProperties": dict, "prefixItems": list, "$defs": dict,
}


def schema_problems(schema, path="$"):
    """Structural problems of a JSON Schema (keyword value types, known type names)."""
    if isinstance(schema, bool):
        return []
    if not isinstance(schema, dict):
        return [f"{path}: a schema must be an object or a boolean"]
    problems = []
    for key, kinds in _SCHEMA_KEYWORD_TYPES.items():
        if key in schema and (not isinstance(schema[key], kinds) or
                              isinstance(schema[key], bool) and bool not in
                              (kinds if isinstance(kinds, tuple) else (kinds,))):
            problems.append(f"{path}.{key}: wrong value type {type(schema[key]).__name__}")
    kinds = schema.get("type")
    for k in [kinds] if isinstance(kinds, str) else (kinds or []):
        if k not in _TYPES:
            problems.append(f"{path}.type: unknown type {k!r}")
    if isinstance(schema.get("required"), list):
        if not all(isinstance(r, str) for r in schema["required"]):
            problems.append(f"{path}.required: not all strings")
    for key, sub in (schema.get("properties") or {}).items():
        problems += schema_problems(sub, f"{path}.properties.{key}")
    for key in ("items", "additionalProperties"):
        if isinstance(schema.get(key), dict):
            problems += schema_problems(schema[key], f"{path}.{key}")
    for key in ("anyOf", "oneOf", "allOf"):
        for i, sub in enumerate(schema.get(key) or []):
            problems += schema_problems(sub, f"{path}.{key}[{i}]")
    return problems
