"""What a monitor scrape reads: vLLM's spec-decode counters as Prometheus text (`exposition`),
served by a loopback HTTP server (`Exposition`) that can also serve any bytes, or drip them."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def exposition(drafts: int, draft_tokens: int, accepted: int, per_pos: list[int]) -> str:
    """vLLM's spec-decode counters as its /metrics writes them (one engine, one model)."""
    labels = 'engine="0",model_name="tiny"'
    lines = ["# HELP vllm:num_requests_running Number of requests running.",
             "# TYPE vllm:num_requests_running gauge", f"vllm:num_requests_running{{{labels}}} 0.0"]
    for name, value in (("num_drafts", drafts), ("num_draft_tokens", draft_tokens),
                        ("num_accepted_tokens", accepted)):
        lines += [f"# HELP vllm:spec_decode_{name}_total Spec decode {name}.",
                  f"# TYPE vllm:spec_decode_{name}_total counter",
                  f"vllm:spec_decode_{name}_total{{{labels}}} {float(value)}",
                  f"vllm:spec_decode_{name}_created{{{labels}}} 1.7e9"]
    lines += ["# HELP vllm:spec_decode_num_accepted_tokens_per_pos_total Accepted per position.",
              "# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter"]
    lines += [f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{labels},position="{i}"}} {float(v)}'
              for i, v in enumerate(per_pos)]
    return "\n".join(lines) + "\n"


class Exposition:
    """A loopback server whose GET /metrics answers `text` (what a test sets: text, or bytes
    written as they are); with `drip_s` set, one byte every drip_s seconds, then the rest never."""

    def __init__(self):
        owner = self
        self.text: str | bytes = exposition(0, 0, 0, [0, 0, 0])
        self.drip_s: float | None = None
        self.closed = threading.Event()

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                body = owner.text if isinstance(owner.text, bytes) else owner.text.encode()
                self.send_response(200 if self.path == "/metrics" else 404)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.end_headers()
                if owner.drip_s is None:
                    try:
                        self.wfile.write(body)
                    except OSError:                 # a client that stopped reading (a size cap)
                        pass
                    return
                for index in range(len(body)):      # a byte at a time, until the client goes
                    if owner.closed.wait(owner.drip_s):
                        return
                    try:
                        self.wfile.write(body[index:index + 1])
                    except OSError:
                        return

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self):
        self.closed.set()
        self.server.shutdown()
        self.server.server_close()
