"""A fake SGLang HTTP server: SGLang needs a GPU, so this stands in for it and records what
it is sent (the weight endpoints answer success, ``/generate`` one token)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class FakeSGLangHTTP:
    """Answers SGLang's weight endpoints with success, ``/generate`` with one token, and
    records every POST body."""

    def __init__(self) -> None:
        self.posts: list[tuple[str, Any]] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                self._answer({})

            def do_POST(self) -> None:
                n = int(self.headers.get("Content-Length", "0"))
                fake.posts.append((self.path, json.loads(self.rfile.read(n) or b"null")))
                if self.path == "/generate":
                    # One token, then the length limit: enough for a request to complete.
                    triples = [[-0.5, 7, None]]
                    finish = {"type": "length", "message": ""}
                    meta = {"output_token_logprobs": triples, "finish_reason": finish}
                    return self._answer({"text": "", "meta_info": meta})
                self._answer({"success": True, "message": "ok"})

            def _answer(self, body: object) -> None:
                data = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
