"""A Hub on 127.0.0.1 for the upload tests: the part of the Hugging Face Hub's HTTP API that huggingface_hub's
create_repo, model_info and upload_folder call (repository creation, the preupload and LFS batch endpoints, the
LFS PUTs, the ndjson commit), with every request recorded."""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclasses.dataclass
class Request:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes

    def json(self):
        return json.loads(self.body)


@dataclasses.dataclass
class Commit:
    """One commit as the Hub received it: each path's bytes (a regular file's from the ndjson, an LFS file's
    from its PUT, looked up by the oid the commit names), and the LFS oids and sizes the commit named."""

    repo: str
    summary: str
    files: dict[str, bytes]
    lfs: dict[str, tuple[str, int]]


class FakeHub:
    """Answers as the Hub does; `refuse` maps a request kind ('create', 'info', 'preupload', 'batch', 'put',
    'commit') to an HTTP status to answer instead, `stall` holds a kind's answer until `release` is set."""

    def __init__(self, existing: dict[str, bool] | None = None):
        self.requests: list[Request] = []
        self.repos: dict[str, bool] = dict(existing or {})  # repo id -> private
        self.blobs: dict[str, bytes] = {}
        self.commits: list[Commit] = []
        self.refuse: dict[str, int] = {}
        self.stall: set[str] = set()
        self.release = threading.Event()
        self.arrived: dict[str, threading.Event] = {}
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _serve(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                hub.requests.append(Request(self.command, self.path, dict(self.headers), body))
                status, answer = hub.answer(self.command, self.path.split("?")[0], body)
                payload = json.dumps(answer).encode()
                self.send_response(status)
                if status >= 400:
                    self.send_header("X-Error-Message", answer["error"])
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(payload)

            do_GET = do_POST = do_PUT = do_HEAD = _serve

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()

    def kind_of(self, method: str, path: str) -> str:
        for kind, pattern in (("create", r"POST /api/repos/create"), ("info", r"GET /api/models/[^/]+/[^/]+"),
                              ("yaml", r"POST /api/validate-yaml"), ("preupload", r"POST /api/models/.+/preupload/"),
                              ("batch", r"POST /.+\.git/info/lfs/objects/batch"), ("put", r"PUT /lfs/"),
                              ("commit", r"POST /api/models/.+/commit/")):
            if re.fullmatch(pattern + ".*", f"{method} {path}"):
                return kind
        return "other"

    def answer(self, method: str, path: str, body: bytes) -> tuple[int, dict]:
        kind = self.kind_of(method, path)
        self.arrived.setdefault(kind, threading.Event()).set()
        if kind in self.stall:
            self.release.wait(120)
        if kind in self.refuse:
            return self.refuse[kind], {"error": f"refused by the test Hub ({kind})"}
        if kind == "create":
            request = json.loads(body)
            repo = f"{request['organization']}/{request['name']}"
            if repo in self.repos:
                return 409, {"error": "You already created this model repo", "url": f"{self.url}/{repo}"}
            self.repos[repo] = request.get("visibility") == "private" or request.get("private") is True
            return 200, {"url": f"{self.url}/{repo}", "name": repo}
        if kind == "info":
            repo = path.removeprefix("/api/models/")
            if repo not in self.repos:
                return 404, {"error": "Repository not found"}
            return 200, {"id": repo, "private": self.repos[repo]}
        if kind == "yaml":
            return 200, {"errors": [], "warnings": []}
        if kind == "preupload":
            # The Hub's rule for model repositories: safetensors go through LFS, small text files in the commit.
            return 200, {"files": [{"path": f["path"], "shouldIgnore": False,
                                    "uploadMode": "lfs" if f["path"].endswith(".safetensors") else "regular"}
                                   for f in json.loads(body)["files"]]}
        if kind == "batch":
            return 200, {"transfer": "basic", "objects": [
                {"oid": o["oid"], "size": o["size"], "authenticated": True,
                 "actions": {"upload": {"href": f"{self.url}/lfs/{o['oid']}"}}} for o in json.loads(body)["objects"]]}
        if kind == "put":
            self.blobs[path.removeprefix("/lfs/")] = body
            return 200, {}
        if kind == "commit":
            return 200, self._commit(path, body)
        if method == "HEAD":
            return 200, {}
        return 404, {"error": f"no such endpoint: {method} {path}"}

    def _commit(self, path: str, body: bytes) -> dict:
        repo = re.fullmatch(r"/api/models/(.+)/commit/.+", path).group(1)
        lines = [json.loads(line) for line in body.decode().splitlines()]
        files, lfs = {}, {}
        for line in lines[1:]:
            value = line["value"]
            if line["key"] == "file":
                files[value["path"]] = base64.b64decode(value["content"])
            elif line["key"] == "lfsFile":
                lfs[value["path"]] = (value["oid"], value["size"])
                files[value["path"]] = self.blobs.get(value["oid"], b"")
        self.commits.append(Commit(repo, lines[0]["value"]["summary"], files, lfs))
        oid = hashlib.sha1(body).hexdigest()
        return {"commitUrl": f"{self.url}/{repo}/commit/{oid}", "commitOid": oid}


class SilentHub:
    """A listener on 127.0.0.1 that accepts every connection and never answers; with `answer_probe`, it answers
    qconvert's reachability probe (`HEAD /`) and nothing after it. Records each request's first line."""

    def __init__(self, answer_probe: bool = False):
        import socket

        self._server = socket.create_server(("127.0.0.1", 0))
        self.port = self._server.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.requests: list[bytes] = []
        self._answer_probe = answer_probe
        self._held: list = []
        self._stop = threading.Event()

    def __enter__(self) -> "SilentHub":
        threading.Thread(target=self._serve, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for conn in self._held:
            conn.close()
        self._server.close()

    def _serve(self) -> None:
        self._server.settimeout(0.2)
        while not self._stop.is_set():
            try:
                conn = self._server.accept()[0]
            except OSError:
                continue
            self._held.append(conn)
            if self._answer_probe:
                self._read_request(conn)

    def _read_request(self, conn) -> None:
        conn.settimeout(5)
        data = b""
        try:
            while b"\r\n\r\n" not in data and (chunk := conn.recv(4096)):
                data += chunk
        except OSError:
            pass
        self.requests.append(data.split(b"\r\n")[0])
        if data.startswith(b"HEAD / "):
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
            conn.close()
