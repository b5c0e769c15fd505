"""A local stand-in for the Hugging Face Hub, for the calls huggingface_hub makes.

It serves directories as model or dataset repositories, on 127.0.0.1 at a random port, from a
thread.  What it answers is what the Hub answers (read from huggingface_hub's own client code):

* `GET /api/{models,datasets}/{repo}[/revision/{rev}]`: repo info with `sha` and `siblings`;
* `GET /api/{models,datasets}/{repo}/tree/{rev}[/{path}]`: the file listing (one page);
* `HEAD`/`GET /{repo}/resolve/{rev}/{file}` (datasets under `/datasets/`): `ETag`, `X-Repo-Commit`,
  `Content-Length`, `Accept-Ranges`; `Range: bytes=a-b` gives 206 with `Content-Range`;
* errors with the Hub's `X-Error-Code` header: `RepoNotFound`, `RevisionNotFound`,
  `EntryNotFound`, `GatedRepo` (401 without a token, 403 with a token that is not allowed).

File data is read with pread, so a sparse checkpoint of any apparent size costs only what is
asked for.  `bytes_served` counts the body bytes sent; `requests` logs (method, path, range).
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit
from typing import Any

_HASH_LIMIT = 64 << 20  # files above this get an ETag from their name, size and mtime (not their data)


@dataclass
class Repo:
    root: Path
    commit: str
    access: str = "public"  # "public" | "gated" / "private" (need `token`) | "forbidden" (403 for everyone)
    token: str | None = None
    slow_suffix: str | None = None  # delay GETs of files ending with this...
    delay: float = 0.0  # ...by this many seconds before answering
    ignore_range: bool = False  # answer every GET with the whole file (as some mirrors do)
    # a fault on GETs of files ending with `fault_suffix`: "503" / "429" (with Retry-After:
    # `retry_after`), "truncate" (half the range, then the connection closes), "content_range"
    # (a 206 whose Content-Range starts one byte late), "stall" (headers, then `delay` s of silence)
    fault: str | None = None
    fault_suffix: str = ".safetensors"
    retry_after: int = 1
    _etags: dict[str, str] = field(default_factory=dict)

    def files(self) -> list[str]:
        return sorted(p.relative_to(self.root).as_posix() for p in self.root.rglob("*") if p.is_file())

    def etag(self, rel: str) -> str:
        if rel not in self._etags:
            p = self.root / rel
            st = p.stat()
            h = hashlib.sha256()
            if st.st_size <= _HASH_LIMIT:
                h.update(p.read_bytes())
            else:
                h.update(f"{rel}\0{st.st_size}\0{st.st_mtime_ns}".encode())
            self._etags[rel] = h.hexdigest()
        return self._etags[rel]


class FakeHub:
    def __init__(self) -> None:
        self.repos: dict[tuple[str, str], Repo] = {}
        self.bytes_served = 0
        self.requests: list[tuple[str, str, str | None]] = []
        self._lock = threading.Lock()
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:  # quiet
                pass

            def do_HEAD(self) -> None:
                hub._handle(self, head=True)

            def do_GET(self) -> None:
                hub._handle(self, head=False)

        class Server(ThreadingHTTPServer):
            def handle_error(self, request, client_address) -> None:  # a client that hung up
                pass

        self._server = Server(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def add(self, repo_id: str, root: Path, *, repo_type: str = "model", **kw: Any) -> Repo:
        commit = hashlib.sha1(f"{repo_type}/{repo_id}/{root}".encode()).hexdigest()
        repo = self.repos[(repo_type, repo_id)] = Repo(Path(root), commit, **kw)
        return repo

    def reset_counts(self) -> None:
        with self._lock:
            self.bytes_served = 0
            self.requests.clear()

    def range_gets(self, suffix: str = ".safetensors") -> list[tuple[str, str, str | None]]:
        return [r for r in self.requests if r[0] == "GET" and r[1].endswith(suffix)]

    # -- request handling ---------------------------------------------------------------------
    def _handle(self, h: BaseHTTPRequestHandler, *, head: bool) -> None:
        path = unquote(urlsplit(h.path).path)
        rng = h.headers.get("Range")
        with self._lock:
            self.requests.append(("HEAD" if head else "GET", path, rng))
        parts = path.strip("/").split("/")
        try:
            if parts[0] == "api" and len(parts) >= 4 and parts[1] in ("models", "datasets"):
                self._api(h, parts[1][:-1], "/".join(parts[2:4]), parts[4:], head)
            elif len(parts) >= 5 and parts[0] == "datasets" and parts[3] == "resolve":
                self._resolve(h, "dataset", "/".join(parts[1:3]), parts[4], "/".join(parts[5:]), head, rng)
            elif len(parts) >= 4 and parts[2] == "resolve":
                self._resolve(h, "model", "/".join(parts[:2]), parts[3], "/".join(parts[4:]), head, rng)
            else:
                self._send(h, 404, b"", head)
        except (BrokenPipeError, ConnectionResetError):
            pass

    def _send(self, h: BaseHTTPRequestHandler, status: int, body: bytes, head: bool, headers: dict | None = None) -> None:
        h.send_response(status)
        for k, v in (headers or {}).items():
            h.send_header(k, str(v))
        if "Content-Length" not in (headers or {}):
            h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        if not head and body:
            h.wfile.write(body)
            with self._lock:
                self.bytes_served += len(body)

    def _error(self, h: BaseHTTPRequestHandler, status: int, code: str | None, head: bool, extra: dict | None = None) -> None:
        headers = {"Content-Type": "application/json", **(extra or {})}
        if code:
            headers["X-Error-Code"] = code
            headers["X-Error-Message"] = code
        self._send(h, status, json.dumps({"error": code or "error"}).encode(), head, headers)

    def _repo(self, h: BaseHTTPRequestHandler, repo_type: str, repo_id: str, rev: str | None, head: bool) -> Repo | None:
        repo = self.repos.get((repo_type, repo_id))
        if repo is None:
            self._error(h, 404, "RepoNotFound", head)
            return None
        auth = h.headers.get("Authorization", "")
        if repo.access == "forbidden":
            self._error(h, 403, None, head)
            return None
        if repo.access == "gated" and auth != f"Bearer {repo.token}":
            self._error(h, 403 if auth else 401, "GatedRepo", head)
            return None
        if repo.access == "private" and auth != f"Bearer {repo.token}":  # the Hub does not say it exists
            self._error(h, 401, "RepoNotFound", head)
            return None
        if rev is not None and rev not in ("main", repo.commit):
            self._error(h, 404, "RevisionNotFound", head)
            return None
        return repo

    def _api(self, h: BaseHTTPRequestHandler, repo_type: str, repo_id: str, rest: list[str], head: bool) -> None:
        rev = rest[1] if len(rest) >= 2 and rest[0] in ("revision", "tree") else None
        repo = self._repo(h, repo_type, repo_id, rev, head)
        if repo is None:
            return
        if rest[:1] == ["tree"]:
            under = "/".join(rest[2:])
            entries = []
            dirs: set[str] = set()
            for rel in repo.files():
                if under and not rel.startswith(under + "/"):
                    continue
                parent = rel.rsplit("/", 1)[0] if "/" in rel else ""
                while parent and parent != under and parent not in dirs:
                    dirs.add(parent)
                    parent = parent.rsplit("/", 1)[0] if "/" in parent else ""
                entries.append({"type": "file", "oid": repo.etag(rel)[:40], "size": (repo.root / rel).stat().st_size,
                                "path": rel})
            entries += [{"type": "directory", "oid": hashlib.sha1(d.encode()).hexdigest(), "size": 0, "path": d}
                        for d in sorted(dirs)]
            body = json.dumps(entries).encode()
        else:
            body = json.dumps({
                "_id": repo.commit[:24], "id": repo_id, "sha": repo.commit, "private": False,
                "gated": "auto" if repo.access == "gated" else False, "disabled": False, "downloads": 0, "likes": 0,
                "tags": [], "lastModified": "2026-01-01T00:00:00.000Z", "createdAt": "2026-01-01T00:00:00.000Z",
                "siblings": [{"rfilename": rel} for rel in repo.files()],
            }).encode()
        self._send(h, 200, body, head, {"Content-Type": "application/json"})

    def _resolve(self, h: BaseHTTPRequestHandler, repo_type: str, repo_id: str, rev: str, rel: str, head: bool,
                 rng: str | None) -> None:
        repo = self._repo(h, repo_type, repo_id, rev, head)
        if repo is None:
            return
        p = repo.root / rel
        if not rel or ".." in rel.split("/") or not p.is_file():
            self._error(h, 404, "EntryNotFound", head, {"X-Repo-Commit": repo.commit})
            return
        if not head and repo.slow_suffix and rel.endswith(repo.slow_suffix):
            time.sleep(repo.delay)
        fault = repo.fault if not head and rel.endswith(repo.fault_suffix) else None
        if fault in ("503", "429"):
            self._error(h, int(fault), None, head, {"Retry-After": repo.retry_after} if fault == "429" else None)
            return
        size = p.stat().st_size
        headers = {"ETag": f'"{repo.etag(rel)}"', "X-Repo-Commit": repo.commit, "Accept-Ranges": "bytes",
                   "Content-Type": "application/octet-stream"}
        start, end, status = 0, size - 1, 200
        if rng and not repo.ignore_range:
            spec = rng.strip().removeprefix("bytes=")
            a, _, b = spec.partition("-")
            start = int(a) if a else max(0, size - int(b))
            end = min(int(b), size - 1) if (a and b) else size - 1
            if start >= size or start > end:
                self._send(h, 416, b"", head, {**headers, "Content-Range": f"bytes */{size}"})
                return
            status = 206
            headers["Content-Range"] = f"bytes {start + (fault == 'content_range')}-{end}/{size}"
        headers["Content-Length"] = end - start + 1
        if head:
            self._send(h, status, b"", True, headers)
            return
        h.send_response(status)
        for k, v in headers.items():
            h.send_header(k, str(v))
        h.end_headers()
        if fault == "stall":
            h.wfile.flush()
            time.sleep(repo.delay)
            h.close_connection = True
            return
        if fault == "truncate":  # fewer bytes than Content-Length, then the connection ends
            with open(p, "rb") as f:
                h.wfile.write(os.pread(f.fileno(), (end - start + 1) // 2, start))
            h.wfile.flush()
            h.close_connection = True
            return
        with open(p, "rb") as f:  # in chunks: a client that has enough closes the connection
            pos = start
            while pos <= end:
                chunk = os.pread(f.fileno(), min(1 << 20, end + 1 - pos), pos)
                h.wfile.write(chunk)
                with self._lock:
                    self.bytes_served += len(chunk)
                pos += len(chunk)
