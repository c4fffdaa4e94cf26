#!/usr/bin/env python3
"""memshelf-mcp: the MCP stdio server of memshelf (stdlib only, Python 3.9+).

It translates JSON-RPC into calls of the verb functions in memshelf.py and back; it holds no
shelf logic (docs/tools.md lists the tools; docs/architecture.md maps them to their
functions).

Data flow:
  stdin bytes -> reader thread: split lines (32 MiB cap) -> decode UTF-8 -> parse JSON
     -> classify (request, notification, response, batch) -> era (classic session or a
        stateless 2026-07-28 request carrying its own _meta envelope)
     -> lifecycle, ping, list requests and cancellations: answered on the reader thread
     -> tools/call, resources/read, prompts/get: queued for up to 4 worker threads
  worker -> memshelf.call_tool / recall / index under memshelf.run_context (progress, cancel)
  every message -> one writer lock -> the saved real stdout descriptor, one line each

Sections: protocol constants . JSON in and out . requests and batches . the server
(lifecycle, dispatch, tools, resources, prompts, logging, workers, shutdown) . main.
"""

import json
import os
import sys
import threading
import time

__all__ = ["main"]

# ==========================================================================================
# Protocol constants
# ==========================================================================================

_HANDSHAKE_VERSIONS = ("2024-11-05", "2025-03-26", "2025-06-18", "2025-11-25")
_LATEST = "2025-11-25"
_MODERN_VERSIONS = ("2026-07-28",)
_STRUCTURED = ("2025-06-18", "2025-11-25") + _MODERN_VERSIONS   # outputSchema era
_TITLED = _STRUCTURED                                            # `title` fields exist

_PV_KEY = "io.modelcontextprotocol/protocolVersion"
_CAPS_KEY = "io.modelcontextprotocol/clientCapabilities"
_CLIENT_KEY = "io.modelcontextprotocol/clientInfo"
_LOG_LEVEL_KEY = "io.modelcontextprotocol/logLevel"
_SERVER_INFO_KEY = "io.modelcontextprotocol/serverInfo"

PARSE_ERROR = -32700
INVALID_REQUEST = -32600
METHOD_NOT_FOUND = -32601
INVALID_PARAMS = -32602
INTERNAL_ERROR = -32603
RESOURCE_NOT_FOUND = -32002
UNSUPPORTED_VERSION = -32022

_CAPABILITIES = {"tools": {"listChanged": False},
                 "resources": {"subscribe": False, "listChanged": False},
                 "prompts": {"listChanged": False},
                 "logging": {}}

_LINE_CAP = 32 * 1024 * 1024
_MAX_DEPTH = 512
_MAX_INT_DIGITS = 4300
_WORKERS = 4
_DRAIN_SECONDS = 1.5
_PROGRESS_INTERVAL = 0.25
_RESOURCE_PAGE = 100
_RESOURCE_TEXT_CAP = 1024 * 1024
_STATIC_TTL_MS = 3600 * 1000      # tool, prompt and template lists do not change in a process
_LEVELS = ("debug", "info", "notice", "warning", "error", "critical", "alert", "emergency")

# Classic-era methods: served ones, and who answers them.
_INLINE = frozenset({"initialize", "ping", "tools/list", "resources/list",
                     "resources/templates/list", "prompts/list", "logging/setLevel"})
_QUEUED = frozenset({"tools/call", "resources/read", "prompts/get"})
# The stateless era has no lifecycle, ping or setLevel (the log level rides in _meta).
_MODERN_INLINE = frozenset({"server/discover", "tools/list", "resources/list",
                            "resources/templates/list", "prompts/list"})

_ABSENT = object()
_DEFERRED = object()


class _RpcError(Exception):
    """A JSON-RPC error answer: code, one-line message, optional data."""

    def __init__(self, code, message, data=None):
        super().__init__(message)
        self.code = code
        self.message = message
        # a value from the request echoed in data is bounded like the messages that quote one
        self.data = {k: _core()._excerpt(v, 300, False) if isinstance(v, str) else v
                     for k, v in data.items()} if isinstance(data, dict) else data


def _short(value):
    """A value quoted for an error message: memshelf's one rule (a long one becomes an excerpt)."""
    return _core()._excerpt(value)


def _one_line(text, limit=300):
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit - 1] + "…"


def _is_id(value):
    return isinstance(value, (str, int)) and not isinstance(value, bool)


def _id_key(value):
    # "7" and 7 are different requests; the key keeps the type.
    return (isinstance(value, str), value)


# ==========================================================================================
# JSON in and out
# ==========================================================================================

class _ParseError(Exception):
    pass


def _reject_constant(name):
    raise ValueError(f"{name} is not a JSON value")


def _parse_int(text):
    if len(text) - text.startswith("-") > _MAX_INT_DIGITS:
        raise ValueError(f"an integer has more than {_MAX_INT_DIGITS} digits")
    return int(text)


def _parse_float(text):
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise ValueError("a number is out of the double range")
    return value


def _depth(obj):
    """Deepest container nesting of a parsed value, walked without recursion."""
    deepest, stack = 0, [(obj, 1)]
    while stack:
        node, level = stack.pop()
        children = node.values() if isinstance(node, dict) else node
        deepest = max(deepest, level)
        if deepest > _MAX_DEPTH:
            break
        stack.extend((c, level + 1) for c in children if isinstance(c, (dict, list)))
    return deepest


def _parse_json(text):
    try:
        obj = json.loads(text, parse_constant=_reject_constant, parse_int=_parse_int,
                         parse_float=_parse_float)
    except RecursionError:
        raise _ParseError(f"nesting deeper than {_MAX_DEPTH}") from None
    except ValueError as exc:
        raise _ParseError(_one_line(exc, 160)) from None
    # Counting openers is cheap; only a line that could nest too deep is walked.
    if text.count("[") + text.count("{") > _MAX_DEPTH and isinstance(obj, (dict, list)) and \
            _depth(obj) > _MAX_DEPTH:
        raise _ParseError(f"nesting deeper than {_MAX_DEPTH}")
    return obj


def _jsonable(obj):
    if isinstance(obj, (set, frozenset, tuple)):
        return list(obj)
    return str(obj)


def _finite(obj):
    """Replace NaN and infinities (not JSON) by null, for the rare result that holds one."""
    if isinstance(obj, float) and obj != obj or obj in (float("inf"), float("-inf")):
        return None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def _encode(message):
    """One compact line of UTF-8; ASCII escapes when hostile input left a lone surrogate."""
    try:
        text = json.dumps(message, ensure_ascii=False, separators=(",", ":"), default=_jsonable,
                          allow_nan=False)
    except ValueError:
        text = json.dumps(_finite(message), ensure_ascii=False, separators=(",", ":"),
                          default=_jsonable, allow_nan=False)
    try:
        return text.encode("utf-8") + b"\n"
    except UnicodeEncodeError:
        return json.dumps(json.loads(text), ensure_ascii=True, separators=(",", ":")).encode(
            "ascii") + b"\n"


_UNRESERVED = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~")


def _percent_encode(text):
    return "".join(c if c in _UNRESERVED else "".join(
        "%%%02X" % b for b in c.encode("utf-8", "surrogateescape")) for c in text)


def _percent_decode(text):
    if "%" not in text:
        return text
    out, i = bytearray(), 0
    while i < len(text):
        if text[i] == "%":
            pair = text[i + 1:i + 3]
            if len(pair) != 2 or any(c not in "0123456789abcdefABCDEF" for c in pair):
                raise ValueError("bad percent escape")
            out.append(int(pair, 16))
            i += 3
        else:
            out += text[i].encode("utf-8")
            i += 1
    return out.decode("utf-8")


# ==========================================================================================
# Requests and batches
# ==========================================================================================

class _Request:
    """One request (or a message that gets an error answer) and how to answer it."""

    __slots__ = ("id", "method", "params", "batch", "index", "modern", "version", "client_name",
                 "log_level", "progress_token", "state", "cancelled", "answered")

    def __init__(self, rid=None, method=None, params=_ABSENT, batch=None):
        self.id = rid
        self.method = method
        self.params = params
        self.batch = batch
        self.index = 0
        self.modern = False
        self.version = _LATEST
        self.client_name = None
        self.log_level = None
        self.progress_token = None
        self.state = "new"
        self.cancelled = False
        self.answered = False

    def is_cancelled(self):
        return self.cancelled


class _Batch:
    """Collects the answers of a 2025-03-26 batch; written as one array when all are in."""

    def __init__(self, server):
        self.server = server
        self.lock = threading.Lock()
        self.pending = 1          # the reader holds one slot until every element is read
        self.count = 0
        self.answers = []

    def expect(self):
        with self.lock:
            self.pending += 1
            self.count += 1
            return self.count

    def deliver(self, index, message):
        with self.lock:
            if message is not None:
                self.answers.append((index, message))
            self.pending -= 1
            done = self.pending == 0
        if done and self.answers:
            self.server._write([m for _, m in sorted(self.answers, key=lambda t: t[0])])


# ==========================================================================================
# The server
# ==========================================================================================

class _Server:
    def __init__(self, core, proto_in, proto_out):
        self.core = core
        self.proto_in = proto_in
        self.proto_out = proto_out
        self.write_lock = threading.Lock()
        self.stderr_lock = threading.Lock()
        self.broken = False
        # classic session state (the last initialize wins)
        self.version = None
        self.initialized = False
        self.client_name = None
        self.log_level = "warning"
        self.handshaken = False
        self.shelf_warning_sent = False
        # worker pool
        self.cv = threading.Condition()
        self.queue = []
        self.inflight = {}
        self.threads = []
        self.idle = 0
        self.running = 0
        self.closing = False
        self.verbs_warm = False
        # shutdown
        self.stop = threading.Event()
        self.signalled = None
        self.exit_code = 0
        self.tools_by_version = {}
        self.stderr_threshold = _LEVELS.index(_env_level("MEMSHELF_LOG_LEVEL", "info"))

    # --- diagnostics on stderr -------------------------------------------------------------

    def diag(self, level, message):
        if _LEVELS.index(level) < self.stderr_threshold:
            return
        with self.stderr_lock:
            try:
                sys.stderr.write(f"memshelf-mcp: {level}: {message}\n")
                sys.stderr.flush()
            except (OSError, ValueError):
                pass

    def debug_traceback(self):
        if os.environ.get("MEMSHELF_DEBUG") == "1":
            import traceback
            with self.stderr_lock:
                traceback.print_exc(file=sys.stderr)

    # --- output ----------------------------------------------------------------------------

    def _write(self, message, req=None):
        data = _encode(message)
        with self.write_lock:
            if req is not None:
                req.answered = True
            self._write_bytes(data)

    def _write_bytes(self, data):
        if self.broken:
            return
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(self.proto_out, view):]
        except OSError:
            # EPIPE or a closed descriptor: the client is gone; leave quietly with 0.
            self.broken = True
            self.stop.set()

    def _notify(self, method, params, req=None):
        data = _encode({"jsonrpc": "2.0", "method": method, "params": params})
        with self.write_lock:
            if req is not None and (req.answered or req.cancelled):
                return   # nothing about a request after its answer
            self._write_bytes(data)

    def _finish(self, req, message):
        """Answer a request exactly once: on stdout, into its batch, or not at all (None)."""
        if req.batch is not None:
            req.answered = True
            req.batch.deliver(req.index, message)
        elif message is not None:
            self._write(message, req)
        else:
            req.answered = True

    @staticmethod
    def _result(req, result):
        return {"jsonrpc": "2.0", "id": req.id, "result": result}

    @staticmethod
    def _error(rid, code, message, data=None):
        error = {"code": code, "message": message}
        if data is not None:
            error["data"] = data
        return {"jsonrpc": "2.0", "id": rid, "error": error}

    # --- logging to the client ---------------------------------------------------------------

    def log(self, level, message, req=None, **data):
        self.diag(level, message)
        if req is not None and req.modern:
            threshold = req.log_level       # the stateless era logs only on request
        else:
            threshold = self.log_level if self.initialized else None
        if threshold is None or _LEVELS.index(level) < _LEVELS.index(threshold):
            return
        self._notify("notifications/message",
                     {"level": level, "logger": "memshelf", "data": {"message": message, **data}},
                     req)

    # --- input -------------------------------------------------------------------------------

    def _lines(self):
        """Yield (line bytes, oversized flag) from the protocol descriptor until EOF."""
        buf = bytearray()
        scan_from = 0
        discarding = False
        while True:
            try:
                chunk = os.read(self.proto_in, 65536)
            except InterruptedError:
                continue
            except OSError:
                chunk = b""
            if not chunk:
                if buf and not discarding:
                    yield bytes(buf), False     # a last line without its newline
                return
            buf += chunk
            while True:
                nl = buf.find(b"\n", scan_from)
                if nl < 0:
                    if discarding:
                        buf.clear()
                        scan_from = 0
                    elif len(buf) > _LINE_CAP:
                        discarding = True
                        buf.clear()
                        scan_from = 0
                        yield b"", True
                    else:
                        scan_from = len(buf)
                    break
                line = bytes(buf[:nl])
                del buf[:nl + 1]
                scan_from = 0
                if discarding:
                    discarding = False
                    continue
                if len(line) > _LINE_CAP:
                    yield b"", True
                    continue
                yield line, False

    def _read_loop(self):
        try:
            for line, oversized in self._lines():
                if self.stop.is_set():
                    break
                if oversized:
                    self.diag("warning", "discarded a line over 32 MiB")
                    self._write(self._error(None, INVALID_REQUEST,
                                            "invalid request: a line over 32 MiB was discarded"))
                    continue
                try:
                    self._on_line(line)
                except Exception as exc:   # the reader never dies of input
                    self.diag("error", f"reader: {type(exc).__name__}: {_one_line(exc)}")
                    self.debug_traceback()
        finally:
            self.stop.set()

    def _on_line(self, raw):
        if raw.endswith(b"\r"):
            raw = raw[:-1]
        if not raw.strip():
            return
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            self._write(self._error(None, PARSE_ERROR,
                                    f"parse error: the line is not valid UTF-8 (byte {exc.start})"))
            return
        if text.startswith("\ufeff"):
            text = text[1:]
        try:
            msg = _parse_json(text)
        except _ParseError as exc:
            self._write(self._error(None, PARSE_ERROR, f"parse error: {exc}"))
            return
        if isinstance(msg, list):
            if self.version != "2025-03-26":
                self._write(self._error(None, INVALID_REQUEST,
                                        "invalid request: batches are only accepted on protocol "
                                        "version 2025-03-26"))
            elif not msg:
                self._write(self._error(None, INVALID_REQUEST, "invalid request: empty batch"))
            else:
                batch = _Batch(self)
                for item in msg:
                    self._on_message(item, batch)
                batch.deliver(-1, None)
            return
        self._on_message(msg, None)

    def _on_message(self, msg, batch):
        req = _Request(batch=batch)
        if batch is not None:
            req.index = batch.expect()
        try:
            answer = self._classify(msg, req)
        except _RpcError as exc:
            rid = req.id if _is_id(req.id) else None
            answer = self._error(rid, exc.code, exc.message, exc.data)
        except Exception as exc:
            answer = self._internal(req, exc)
        if answer is not _DEFERRED:
            self._finish(req, answer)

    def _classify(self, msg, req):
        """Return the answer (a message, or None for no answer) or _DEFERRED (a worker answers)."""
        if not isinstance(msg, dict):
            raise _RpcError(INVALID_REQUEST, "invalid request: a message must be a JSON object")
        rid = msg.get("id")
        response_like = "method" not in msg and ("result" in msg or "error" in msg)
        if _is_id(rid) and not response_like:
            req.id = rid     # a broken response's id is the client's own; never echo it
        if msg.get("jsonrpc") != "2.0":
            raise _RpcError(INVALID_REQUEST, 'invalid request: "jsonrpc" must be "2.0"')
        if "method" not in msg:
            if "id" in msg and response_like:
                return None      # a response from the client; the server never asked anything
            raise _RpcError(INVALID_REQUEST, "invalid request: no method")
        method = msg["method"]
        if not isinstance(method, str):
            raise _RpcError(INVALID_REQUEST, "invalid request: method must be a string")
        if "id" in msg and not _is_id(rid):
            raise _RpcError(INVALID_REQUEST,
                            "invalid request: id must be a string or an integer")
        req.method = method
        req.params = _ABSENT if msg.get("params") is None else msg["params"]   # null = absent
        if "id" not in msg:
            self._on_notification(method, req.params)
            return None
        envelope = self._modern_envelope(req)
        if envelope is not None:
            return self._dispatch_modern(req, envelope)
        return self._dispatch_classic(req)

    # --- notifications -------------------------------------------------------------------------

    def _on_notification(self, method, params):
        if method == "notifications/cancelled" and isinstance(params, dict):
            self._cancel(params.get("requestId"))
        # notifications/initialized and everything else: accepted silently

    def _cancel(self, rid):
        if not _is_id(rid):
            return
        with self.cv:
            req = self.inflight.get(_id_key(rid))
            if req is None:
                return
            req.cancelled = True
            if req.state != "queued":
                return       # running: the verb sees the flag; its answer is suppressed
            self.queue = [item for item in self.queue if item[0] is not req]
            self.inflight.pop(_id_key(rid), None)
            req.state = "dropped"
        self._finish(req, None)

    # --- eras ----------------------------------------------------------------------------------

    def _modern_envelope(self, req):
        """The request's 2026-07-28 envelope, None for a classic request; -32602/-32022 if bad."""
        params = req.params
        if req.method == "initialize" or not isinstance(params, dict):
            return None
        meta = params.get("_meta")
        if not isinstance(meta, dict) or _PV_KEY not in meta:
            return None
        version = meta[_PV_KEY]
        if _CAPS_KEY not in meta:
            raise _RpcError(INVALID_PARAMS,
                            f"params._meta is missing the required key {_CAPS_KEY}")
        if not isinstance(version, str):
            raise _RpcError(INVALID_PARAMS, f"params._meta {_PV_KEY} must be a string")
        if version not in _MODERN_VERSIONS:
            # Handshake versions are listed too: a client that knows no modern version we
            # serve can still fall back to initialize.
            raise _RpcError(UNSUPPORTED_VERSION, f"unsupported protocol version {_short(version)}",
                            {"supported": list(_HANDSHAKE_VERSIONS + _MODERN_VERSIONS),
                             "requested": version})
        if not isinstance(meta[_CAPS_KEY], dict):
            raise _RpcError(INVALID_PARAMS, f"params._meta {_CAPS_KEY} must be an object")
        level = meta.get(_LOG_LEVEL_KEY)
        if level is not None and level not in _LEVELS:
            raise _RpcError(INVALID_PARAMS, f"unknown log level {_short(level)}",
                            {"levels": list(_LEVELS)})
        info = meta.get(_CLIENT_KEY)
        return {"version": version, "level": level,
                "client": info.get("name") if isinstance(info, dict) and
                isinstance(info.get("name"), str) else None}

    def _dispatch_modern(self, req, envelope):
        req.modern = True
        req.version = envelope["version"]
        req.client_name = envelope["client"]
        req.log_level = envelope["level"]
        self.handshaken = True
        method = req.method
        if method not in _MODERN_INLINE and method not in _QUEUED:
            raise _RpcError(METHOD_NOT_FOUND, f"method not found: {_short(method)}")
        params = req.params
        if method == "server/discover":
            result = {"supportedVersions": list(_MODERN_VERSIONS),
                      "capabilities": _CAPABILITIES,
                      "instructions": self._instructions(),
                      "ttlMs": _STATIC_TTL_MS, "cacheScope": "private"}
        elif method in _QUEUED:
            return self._queue_call(req, params)
        else:
            result = self._inline(req, method, params)
            result["ttlMs"] = 0 if method == "resources/list" else _STATIC_TTL_MS
            result["cacheScope"] = "private"
        return self._result(req, self._modern_result(result))

    def _modern_result(self, result):
        result["resultType"] = "complete"
        meta = result.get("_meta")
        result["_meta"] = dict(meta or {}, **{_SERVER_INFO_KEY: self._server_info()})
        return result

    def _dispatch_classic(self, req):
        method = req.method
        if method not in _INLINE and method not in _QUEUED:
            raise _RpcError(METHOD_NOT_FOUND, f"method not found: {_short(method)}")
        if not self.initialized and method not in ("initialize", "ping"):
            raise _RpcError(INVALID_PARAMS, "received a request before initialization")
        params = req.params
        if params is not _ABSENT and not isinstance(params, dict):
            raise _RpcError(INVALID_PARAMS, "params must be an object")
        params = {} if params is _ABSENT else params
        req.version = self.version or _LATEST
        req.client_name = self.client_name
        if method == "initialize":
            return self._initialize(req, params)
        if method in _QUEUED:
            return self._queue_call(req, params)
        return self._result(req, self._inline(req, method, params))

    # --- lifecycle -----------------------------------------------------------------------------

    def _server_info(self):
        return {"name": "memshelf", "title": "memshelf", "version": self.core.__version__}

    def _instructions(self):
        return self.core.server_instructions(
            self.core.default_shelf_state()["state"] == "configured")

    def _initialize(self, req, params):
        version = params.get("protocolVersion")
        if not isinstance(version, str):
            raise _RpcError(INVALID_PARAMS, "initialize needs params.protocolVersion (a string)")
        for key in ("capabilities", "clientInfo"):
            if key in params and not isinstance(params[key], dict):
                raise _RpcError(INVALID_PARAMS, f"initialize params.{key} must be an object")
        info = params.get("clientInfo") or {}
        negotiated = version if version in _HANDSHAKE_VERSIONS else _LATEST
        self.version = negotiated
        self.client_name = info.get("name") if isinstance(info.get("name"), str) else None
        self.initialized = True
        self.handshaken = True
        state = self.core.default_shelf_state()
        answer = self._result(req, {
            "protocolVersion": negotiated, "capabilities": _CAPABILITIES,
            "serverInfo": self._server_info(),
            "instructions": self.core.server_instructions(state["state"] == "configured")})
        if req.batch is None:
            self._write(answer, req)     # written here so the log line below follows it
        self.diag("info", f"initialize: protocol {negotiated} (client asked {_short(version)}), "
                          f"client {_short(self.client_name or '?')}")
        if state["state"] != "configured" and not self.shelf_warning_sent:
            self.shelf_warning_sent = True
            why = ("holds an unexpanded ${...} placeholder" if state["state"] == "unexpanded"
                   else "is not set")
            self.log("warning", f"the default shelf {why}; calls need shelf_path, or set "
                                "MEMSHELF_SHELF in the extension settings",
                     state=state["state"])
        return _DEFERRED if req.batch is None else answer

    # --- answers given on the reader thread ----------------------------------------------------

    def _inline(self, req, method, params):
        if method == "ping":
            return {}
        if method == "logging/setLevel":
            level = params.get("level")
            if level not in _LEVELS:
                raise _RpcError(INVALID_PARAMS, f"unknown log level {_short(level)}",
                                {"levels": list(_LEVELS)})
            self.log_level = level
            return {}
        if params.get("cursor") is not None and method != "resources/list":
            raise _RpcError(INVALID_PARAMS, "bad cursor: this list has a single page")
        if method == "tools/list":
            return {"tools": self._tools(req.version)}
        if method == "prompts/list":
            return {"prompts": [self._prompt_entry(p, req.version) for p in self.core.PROMPTS]}
        if method == "resources/templates/list":
            return {"resourceTemplates": self._templates(req.version)}
        if method == "resources/list":
            return self._resources_list(req, params)
        raise _RpcError(METHOD_NOT_FOUND, f"method not found: {_short(method)}")

    def _tools(self, version):
        tools = self.tools_by_version.get(version)
        if tools is None:
            tools = self.core.tool_definitions(version)
            self.tools_by_version[version] = tools
            self.verbs_warm = True
        return tools

    def _tool_names(self):
        return {t["name"] for t in self._tools(_LATEST)}

    # --- tools/call, resources/read, prompts/get: queued for the workers ----------------------

    def _queue_call(self, req, params):
        method = req.method
        # Arguments are checked here so protocol faults are answered at once.
        if method == "tools/call":
            name = params.get("name")
            if not isinstance(name, str):
                raise _RpcError(INVALID_PARAMS, "tools/call needs params.name (a string)")
            if name not in self._tool_names():
                raise _RpcError(INVALID_PARAMS, f"unknown tool {_short(name)}",
                                {"tools": sorted(self._tool_names())})
            args = params.get("arguments")
            if args is not None and not isinstance(args, dict):
                raise _RpcError(INVALID_PARAMS, "tools/call params.arguments must be an object")
            meta = params.get("_meta")
            token = meta.get("progressToken") if isinstance(meta, dict) else None
            req.progress_token = token if _is_id(token) else None
            job = self._run_tool
        elif method == "resources/read":
            uri = params.get("uri")
            if not isinstance(uri, str):
                raise _RpcError(INVALID_PARAMS, "resources/read needs params.uri (a string)")
            _parse_resource_uri(uri)
            job = self._run_read
        else:
            name = params.get("name")
            prompt = next((p for p in self.core.PROMPTS if p["name"] == name), None)
            if prompt is None:
                raise _RpcError(INVALID_PARAMS, f"unknown prompt {_short(name)}",
                                {"prompts": [p["name"] for p in self.core.PROMPTS]})
            args = params.get("arguments")
            if args is None:
                args = {}
            if not isinstance(args, dict) or not all(isinstance(v, str) for v in args.values()):
                raise _RpcError(INVALID_PARAMS, "prompts/get params.arguments must map names "
                                                "to strings")
            for arg in prompt["arguments"]:
                if arg.get("required") and not str(args.get(arg["name"], "")).strip():
                    raise _RpcError(INVALID_PARAMS,
                                    f"prompt {name!r} needs the argument {arg['name']!r}")
            job = self._run_prompt
        self._submit(req, job)
        return _DEFERRED

    def _submit(self, req, job):
        if not self.verbs_warm:
            self._tools(_LATEST)     # build memshelf's verb table before any worker touches it
        with self.cv:
            if self.closing:
                req.state = "dropped"
            else:
                req.state = "queued"
                self.queue.append((req, job))
                self.inflight[_id_key(req.id)] = req
                if len(self.queue) > self.idle and len(self.threads) < _WORKERS:
                    worker = threading.Thread(target=self._worker, daemon=True,
                                              name=f"memshelf-mcp-worker-{len(self.threads) + 1}")
                    self.threads.append(worker)
                    worker.start()
                self.cv.notify()
                return
        self._finish(req, None)

    def _worker(self):
        while True:
            with self.cv:
                while not self.queue and not self.closing:
                    self.idle += 1
                    self.cv.wait()
                    self.idle -= 1
                if not self.queue:
                    return
                req, job = self.queue.pop(0)
                req.state = "running"
                self.running += 1
            try:
                try:
                    answer = job(req)
                except _RpcError as exc:
                    answer = self._error(req.id, exc.code, exc.message, exc.data)
                except self.core.Cancelled:
                    answer = None
                except Exception as exc:
                    answer = self._internal(req, exc)
                if req.cancelled:
                    answer = None    # cancelled: no answer, even when the work finished
                self._finish(req, answer)
            except Exception as exc:
                self.diag("error", f"worker: {type(exc).__name__}: {_one_line(exc)}")
            finally:
                with self.cv:
                    req.state = "done"
                    if self.inflight.get(_id_key(req.id)) is req:
                        del self.inflight[_id_key(req.id)]
                    self.running -= 1
                    self.cv.notify_all()

    def _internal(self, req, exc):
        what = req.method or "message"
        self.diag("error", f"{what}: {type(exc).__name__}: {_one_line(exc)}")
        self.debug_traceback()
        return self._error(req.id if _is_id(req.id) else None, INTERNAL_ERROR,
                           _one_line(f"internal error in {what}: {type(exc).__name__}: {exc}"))

    def _context(self, req):
        sink = _ProgressSink(self, req) if req.progress_token is not None else None
        def log(level, message, **data):
            self.log(level if level in _LEVELS else "info", message, req, **data)
        return self.core.run_context(progress=sink, cancelled=req.is_cancelled,
                                     client_name=req.client_name or "mcp", log=log)

    def _run_tool(self, req):
        core = self.core
        params = req.params if isinstance(req.params, dict) else {}
        name = params["name"]
        arguments = params.get("arguments") or {}
        started = time.monotonic()
        try:
            with self._context(req):
                result = core.call_tool(name, arguments, client_name=req.client_name)
        except core.ShelfError as exc:
            self.diag("debug", f"{name}: {exc.code}: {_one_line(exc.message)}")
            return self._answer(req, {"content": [{"type": "text", "text": exc.as_text()}],
                                      "isError": True})
        self.diag("debug", f"{name}: ok in {(time.monotonic() - started) * 1000:.0f} ms")
        if not isinstance(result, dict):
            result = {"status": "ok", "result": result}
        self._result_events(req, name, result)
        if os.environ.get("MEMSHELF_MCP_TEXT", "").strip().lower() == "json":
            text = json.dumps(result, ensure_ascii=False, default=_jsonable)
        else:
            text = core.render_text(name, result)
        answer = {"content": [{"type": "text", "text": text}], "isError": False}
        if req.version in _STRUCTURED:
            answer["structuredContent"] = result
        return self._answer(req, answer)

    def _answer(self, req, result):
        return self._result(req, self._modern_result(result) if req.modern else result)

    def _result_events(self, req, name, result):
        """Log what a result reveals that the user should see even if the agent does not say it:
        a push that failed after the commit, search falling back to the scan."""
        if name == "memshelf_shelve" and result.get("status") == "incomplete":
            self.log("warning", "push failed: " + _one_line(result.get("summary") or
                                                            "the commit was not pushed"), req)
        if name == "memshelf_search" and result.get("engine") == "scan":
            self.log("notice", "search fell back to the scan (no SQLite FTS5)", req)

    def _run_prompt(self, req):
        params = req.params
        prompt = next(p for p in self.core.PROMPTS if p["name"] == params["name"])
        text = self.core.prompt_text(prompt["name"], params.get("arguments") or {})
        return self._answer(req, {"description": prompt["description"],
                                  "messages": [{"role": "user",
                                                "content": {"type": "text", "text": text}}]})

    # --- resources -----------------------------------------------------------------------------

    def _default_root(self):
        state = self.core.default_shelf_state()
        path = state.get("path")
        if state["state"] != "configured" or not path or not os.path.isabs(path):
            return None
        return path

    def _no_default(self):
        state = self.core.default_shelf_state()
        if state["state"] == "configured":
            return (f"resource not found: the default shelf path {state['path']!r} is relative; "
                    f"set {state['variable']} to an absolute path")
        what = ("holds an unexpanded ${...} placeholder" if state["state"] == "unexpanded"
                else "is not set")
        return (f"resource not found: the default shelf {what}; set the default shelf in the "
                "extension settings (MEMSHELF_SHELF)")

    def _not_found(self, req, message, uri):
        # The stateless era retired -32002; it answers a missing resource with -32602.
        return _RpcError(INVALID_PARAMS if req.modern else RESOURCE_NOT_FOUND, message,
                         {"uri": uri})

    def _templates(self, version):
        entries = [("memshelf://episode/{id}", "episode", "Episode",
                    "A whole episode, wrapped in the recalled-data envelope."),
                   ("memshelf://episode/{id}/{section}", "episode-section", "Episode section",
                    "One section of an episode (name or slug), in the recalled-data envelope.")]
        out = []
        for template, name, title, description in entries:
            entry = {"uriTemplate": template, "name": name}
            if version in _TITLED:
                entry["title"] = title
            entry.update(description=description, mimeType="text/markdown")
            out.append(entry)
        return out

    def _resources_list(self, req, params):
        cursor = params.get("cursor")
        offset = 0 if cursor is None else _decode_cursor(cursor)
        root = self._default_root()
        if root is None:
            return {"resources": []}
        titled = req.version in _TITLED
        items = []

        def add(uri, name, title, description, size=None):
            entry = {"uri": uri, "name": name}
            if titled:
                entry["title"] = title
            if description:
                entry["description"] = description
            entry["mimeType"] = "text/markdown"
            if size is not None:
                entry["size"] = size
            items.append(entry)

        if offset == 0:
            add("memshelf://index", "INDEX", "Shelf INDEX",
                "One line per episode on the default shelf; read it first.")
            if os.path.isdir(os.path.join(root, "archive")):
                add("memshelf://archive/index", "archive INDEX", "Archive INDEX",
                    "Episodes folded into rollups.")
        episodes = self._episodes(root)
        for ep in episodes[offset:offset + _RESOURCE_PAGE]:
            ident = str(ep.get("id"))
            add("memshelf://episode/" + _percent_encode(ident), ident,
                ep.get("title") or ident, ep.get("description") or "",
                ep.get("size", ep.get("size_bytes")))
        result = {"resources": items}
        if offset + _RESOURCE_PAGE < len(episodes):
            result["nextCursor"] = _encode_cursor(offset + _RESOURCE_PAGE)
        return result

    def _episodes(self, root):
        """The default shelf's live episodes, newest first (memshelf.list_episodes)."""
        lister = getattr(self.core, "list_episodes", None)
        if lister is None:
            return []
        try:
            with self.core.run_context(client_name="mcp"):
                listed = lister(shelf_path=root)
        except self.core.ShelfError as exc:
            self.diag("warning", f"resources/list: {exc.code}: {_one_line(exc.message)}")
            return []
        episodes = listed.get("episodes") if isinstance(listed, dict) else listed
        return [e for e in episodes or [] if isinstance(e, dict) and e.get("id")]

    def _run_read(self, req):
        core = self.core
        uri = req.params["uri"]
        kind, ident, section = _parse_resource_uri(uri)
        try:
            with core.run_context(client_name=req.client_name or "mcp"):
                if kind == "episode":
                    root = self._default_root()
                    if root is None:
                        raise self._not_found(req, self._no_default(), uri)
                    res = core.recall(shelf_path=root, episode_id=ident, section=section,
                                      log=False, max_bytes=_RESOURCE_TEXT_CAP)
                    text = res["content"]
                    if res.get("truncated"):
                        where = f', section="{section}"' if section else ""
                        text += (f"\n[cut at 1 MiB of {res.get('size_bytes')} bytes: call "
                                 f'memshelf_recall with episode_id="{ident}"{where}, offset='
                                 f"{res.get('next_offset')} for the rest]")
                else:
                    root = self._default_root()
                    if kind == "archive" and (root is None or not os.path.isdir(
                            os.path.join(root, "archive"))):
                        raise self._not_found(req, "resource not found: the default shelf has "
                                                   "no archive", uri)
                    # the served view, within the shelf's budget (hook_index_chars)
                    res = core.call_tool("memshelf_index", {"archive": kind == "archive"})
                    text = _cap_text(res["index"], "call memshelf_index with offset to page")
        except core.ShelfError as exc:
            if exc.code in ("id-invalid", "usage"):
                raise _RpcError(INVALID_PARAMS, _one_line(exc.message), {"uri": uri})
            if exc.code in ("episode-not-found", "section-not-found", "not-a-shelf", "no-shelf",
                            "shelf-path-relative"):
                raise self._not_found(req, _one_line(f"resource not found: {exc.message}; "
                                                     f"{exc.fix}"), uri)
            raise _RpcError(INTERNAL_ERROR, _one_line(f"{exc.code}: {exc.message}"), {"uri": uri})
        result = {"contents": [{"uri": uri, "mimeType": "text/markdown", "text": text}]}
        if req.modern:
            result.update(ttlMs=0, cacheScope="private")
        return self._answer(req, result)

    @staticmethod
    def _prompt_entry(prompt, version):
        entry = {"name": prompt["name"]}
        if version in _TITLED:
            entry["title"] = prompt["title"]
        entry["description"] = prompt["description"]
        entry["arguments"] = [{"name": a["name"], "description": a["description"],
                               "required": bool(a.get("required"))}
                              for a in prompt["arguments"]]
        return entry

    # --- running and stopping ------------------------------------------------------------------

    def run(self):
        self._install_signals()
        reader = threading.Thread(target=self._read_loop, name="memshelf-mcp-reader",
                                  daemon=True)
        reader.start()
        self._startup_line()
        timeout = _handshake_timeout(self)
        deadline = time.monotonic() + timeout if timeout > 0 else None
        try:
            while True:
                wait = 0.2    # signal handlers only set a flag; this loop notices it
                if deadline is not None and not self.handshaken:
                    wait = max(0.0, min(wait, deadline - time.monotonic()))
                if self.stop.wait(wait):
                    break
                if self.signalled:
                    self.diag("info", f"{self.signalled}: stopping")
                    break
                if deadline is not None and not self.handshaken and \
                        time.monotonic() >= deadline:
                    self.diag("error", f"no initialize within {timeout:g} s "
                                       "(MEMSHELF_HANDSHAKE_TIMEOUT); exiting")
                    return 3
        except KeyboardInterrupt:
            self.exit_code = 130
        self._drain()
        return self.exit_code

    def _drain(self):
        """Stop reading, drop queued requests, give running ones up to 1.5 s."""
        self.stop.set()
        with self.cv:
            self.closing = True
            dropped = [req for req, _ in self.queue]
            self.queue = []
            for req in dropped:
                req.state = "dropped"
            self.cv.notify_all()
            deadline = time.monotonic() + _DRAIN_SECONDS
            while self.running and time.monotonic() < deadline:
                self.cv.wait(max(0.0, deadline - time.monotonic()))
            left = self.running
        if left:
            self.diag("warning", f"exiting with {left} request(s) still running")

    def _install_signals(self):
        import signal

        def on_signal(signum, frame):
            self.signalled = "SIGTERM" if signum == getattr(signal, "SIGTERM", None) else \
                f"signal {signum}"
        try:
            signal.signal(signal.SIGTERM, on_signal)
        except (ValueError, OSError, AttributeError):
            pass    # not the main thread, or no SIGTERM on this platform

    def _startup_line(self):
        core = self.core
        state = core.default_shelf_state()
        if state["state"] == "configured":
            shelf = f"{state['path']} (from ${state['variable']})"
        elif state["state"] == "unexpanded":
            shelf = "not configured (an unexpanded ${...} placeholder counts as unset)"
        else:
            shelf = "not configured (set MEMSHELF_SHELF or pass shelf_path)"
        try:
            code = core.code_hash()
        except OSError:
            code = "unknown"
        self.diag("info", f"memshelf-mcp {core.__version__} ({code}) on Python "
                          f"{sys.version.split()[0]}; default shelf: {shelf}")


class _ProgressSink:
    """notifications/progress for one tools/call: strictly increasing, at most 4 a second."""

    def __init__(self, server, req):
        self.server = server
        self.req = req
        self.last_value = None
        self.last_time = None
        self.lock = threading.Lock()

    def __call__(self, progress=None, total=None, message=None):
        req = self.req
        if req.answered or req.cancelled:
            return
        if message == "waiting for the shelf lock":
            self.server.log("notice", "a tool is waiting for the shelf lock", req)
        with self.lock:
            now = time.monotonic()
            if self.last_time is not None and now - self.last_time < _PROGRESS_INTERVAL:
                return
            number = isinstance(progress, (int, float)) and not isinstance(progress, bool) and \
                progress == progress and abs(progress) != float("inf")
            if number and (self.last_value is None or progress > self.last_value):
                value = progress
            else:
                value = 0 if self.last_value is None else self.last_value + 1
            self.last_value, self.last_time = value, now
        params = {"progressToken": req.progress_token, "progress": value}
        if isinstance(total, (int, float)) and not isinstance(total, bool) and total >= value:
            params["total"] = total
        if message and req.version != "2024-11-05":
            params["message"] = _one_line(message, 200)
        self.server._notify("notifications/progress", params, req)


def _parse_resource_uri(uri):
    """(kind, id, section) of a memshelf:// URI; -32602 when it does not parse."""
    if uri == "memshelf://index":
        return "index", None, None
    if uri == "memshelf://archive/index":
        return "archive", None, None
    prefix = "memshelf://episode/"
    bad = _RpcError(INVALID_PARAMS, f"cannot parse the resource URI {_short(uri)}; expected "
                                    "memshelf://index, memshelf://archive/index or "
                                    "memshelf://episode/{id}[/{section}]", {"uri": uri})
    if not uri.startswith(prefix) or "?" in uri or "#" in uri:
        raise bad
    parts = uri[len(prefix):].split("/")
    if len(parts) > 2 or not all(parts):
        raise bad
    try:
        decoded = [_percent_decode(p) for p in parts]
    except ValueError:
        raise bad from None
    if not all(decoded):
        raise bad
    return "episode", decoded[0], decoded[1] if len(decoded) == 2 else None


def _cap_text(text, how):
    data = text.encode("utf-8", "surrogatepass")
    if len(data) <= _RESOURCE_TEXT_CAP:
        return text
    cut = _RESOURCE_TEXT_CAP
    while cut and (data[cut] & 0xC0) == 0x80:
        cut -= 1
    return data[:cut].decode("utf-8", "replace") + f"\n[cut at 1 MiB of {len(data)} bytes; {how}]"


def _encode_cursor(offset):
    import base64
    return base64.urlsafe_b64encode(f"memshelf:{offset}".encode()).decode()


def _decode_cursor(cursor):
    import base64
    import binascii
    try:
        text = base64.urlsafe_b64decode(cursor.encode("ascii")).decode("ascii")
        prefix, offset = text.split(":")
        if prefix != "memshelf" or not offset.isdigit():
            raise ValueError(text)
        return int(offset)
    except (AttributeError, ValueError, UnicodeError, binascii.Error):
        raise _RpcError(INVALID_PARAMS, "bad cursor: pass nextCursor from the previous page "
                                        "unchanged") from None


def _env_level(name, default):
    value = os.environ.get(name, "").strip().lower()
    return value if value in _LEVELS else default


def _handshake_timeout(server):
    raw = os.environ.get("MEMSHELF_HANDSHAKE_TIMEOUT", "").strip()
    if not raw:
        return 60.0
    try:
        value = float(raw)
        if value != value or value < 0:
            raise ValueError(raw)
        return value
    except ValueError:
        server.diag("warning", f"MEMSHELF_HANDSHAKE_TIMEOUT={raw!r} is not a number of "
                               "seconds; using 60")
        return 60.0


# ==========================================================================================
# main
# ==========================================================================================

def _core():
    """memshelf, imported once: the module already loaded, else memshelf.py next to this file."""
    for name in ("memshelf", "__main__"):
        module = sys.modules.get(name)
        if module is not None and hasattr(module, "call_tool") and \
                hasattr(module, "tool_definitions"):
            return module
    here = os.path.dirname(os.path.abspath(__file__))
    source = os.path.join(here, "memshelf.py")
    if os.path.isfile(source):
        _hash_checked_cache(source)
        if here not in sys.path:
            sys.path.insert(0, here)
    import memshelf
    return memshelf


def _hash_checked_cache(source):
    """Make memshelf.py's cached bytecode one Python checks by the source's hash.

    An extension update is unpacked over the old folder with every file dated 1980-01-01 (a
    reproducible bundle), and Python checks an ordinary cache by the source's date and size
    only: a same-size memshelf.py would run the old code. A hash-checked cache cannot be stale,
    and Python keeps it hash-checked when it rewrites it after a change."""
    if sys.dont_write_bytecode:
        return
    import importlib.util
    cache = importlib.util.cache_from_source(source)
    try:
        with open(cache, "rb") as f:
            head = f.read(8)
        if len(head) == 8 and head[:4] == importlib.util.MAGIC_NUMBER and head[4] & 0b11 == 3:
            return   # hash-based and checked (PEP 552 flags)
    except OSError:
        pass
    folder = os.path.dirname(cache)
    if not os.access(folder if os.path.isdir(folder) else os.path.dirname(folder), os.W_OK):
        return   # a read-only install caches nothing: compiling here would be wasted
    import py_compile
    try:
        py_compile.compile(source, cache, doraise=True,
                           invalidation_mode=py_compile.PycInvalidationMode.CHECKED_HASH)
    except (OSError, py_compile.PyCompileError):   # a read-only folder: nothing is cached
        try:
            os.unlink(cache)   # a stale timestamp cache must not outlive a failed rewrite
        except OSError:
            pass


def _protocol_streams():
    """Keep the real stdin/stdout descriptors for the protocol; point 0 at null and 1 at stderr.

    A stray print, or a child process that inherits the descriptors, then cannot corrupt the
    stream or eat its input.
    """
    proto_in = os.dup(0)
    proto_out = os.dup(1)
    try:
        os.dup2(2, 1)
    except OSError:
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 1)
        os.close(null)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    if os.name == "nt":
        import msvcrt
        msvcrt.setmode(proto_in, os.O_BINARY)
        msvcrt.setmode(proto_out, os.O_BINARY)
    sys.stdout = sys.stderr
    return proto_in, proto_out


_USAGE = """usage: memshelf-mcp [--shelf DIR] [--version]

The memshelf MCP server: JSON-RPC over stdin/stdout, one message per line.
Hosts start it as `memshelf-mcp`, `python3 server.py` or `memshelf serve`.
--shelf DIR: the default shelf, as MEMSHELF_SHELF=DIR (the option wins over the variable).
Environment: MEMSHELF_SHELF (default shelf), MEMSHELF_HANDSHAKE_TIMEOUT (60; 0 = never exit),
MEMSHELF_LOCK_TIMEOUT, MEMSHELF_MCP_TEXT (human|json), MEMSHELF_LOG_LEVEL (info),
MEMSHELF_DEBUG=1 (tracebacks on stderr).
"""


def main(argv=None):
    """Run the server (or print the version). Returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["--version"], ["-V"]):
        core = _core()
        sys.stdout.write(f"memshelf-mcp {core.__version__} ({core.code_hash()})\n")
        return 0
    if argv[:1] in (["-h"], ["--help"]):
        sys.stdout.write(_USAGE)
        return 0
    if argv[:1] == ["--shelf"] or argv[:1] and argv[0].startswith("--shelf="):
        shelf = argv[1] if argv[0] == "--shelf" and len(argv) > 1 else argv[0][len("--shelf="):]
        argv = argv[2:] if argv[0] == "--shelf" else argv[1:]
        if not shelf.strip():
            sys.stderr.write(f"memshelf-mcp: error: --shelf needs a folder\n{_USAGE}")
            return 2
        # the tools read the default shelf from the environment: the option is that variable
        os.environ["MEMSHELF_SHELF"] = os.path.abspath(os.path.expanduser(shelf))
    if argv:
        sys.stderr.write(f"memshelf-mcp: error: unknown argument {argv[0]!r}\n{_USAGE}")
        return 2
    try:
        proto_in, proto_out = _protocol_streams()
    except OSError as exc:
        sys.stderr.write(f"memshelf-mcp: error: no usable stdin/stdout: {exc}\n")
        return 1
    server = _Server(_core(), proto_in, proto_out)
    return server.run()


if __name__ == "__main__":
    sys.exit(main())
