"""The agent endpoint's HTTP transport: `POST .../v1/chat/completions` and `GET .../v1/models` on localhost.

Each episode has its own base URL, `http://127.0.0.1:{port}/episodes/{episode_id}/v1`, which the official
client takes unchanged (`openai.OpenAI(base_url=..., api_key=...)`); the path is how a request finds its
episode, so an agent needs no extra headers or fields. Everything a request means (its episode, its record,
the generation behind it) is the `ChatService`'s; this module only routes, reads bodies and writes replies.
Standard library only (`http.server`, threads).
"""

from __future__ import annotations

import ipaddress
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Mapping

from jaxrlhf.environments.backends import GenerateBackend
from jaxrlhf.environments.chat import EndpointError
from jaxrlhf.environments.records import Episode
from jaxrlhf.environments.service import ChatService
from jaxrlhf.models.tokenizer import Tokenizer

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")
MAX_BODY_BYTES = 16 * 2**20  # a request body larger than this is refused before it is read
# a refused body is read and dropped (a client writes its whole body before it reads the reply: closing mid-body
# would leave it a broken pipe instead of the 413), up to this many bytes while it keeps coming
DISCARD_BYTES, DISCARD_WAIT_S = 4 * MAX_BODY_BYTES, 5.0
IDLE_CONNECTION_S = 120  # an open connection's thread waits this long for its next request
EPISODE_PATH = re.compile(r"^/episodes/(?P<episode>[A-Za-z0-9_.-]+)/v1/(?P<route>chat/completions|models)/?$")


class BodyTooLarge(EndpointError):
    """A request whose announced body is over `MAX_BODY_BYTES`: refused (413) before it is read."""

    def __init__(self, length: int):
        super().__init__(413, f"the request body is {length} bytes, over {MAX_BODY_BYTES}: send a shorter "
                              "conversation", code="request_too_large")
        self.length = length


class ChatEndpoint(ChatService):
    """The agent endpoint: a `ChatService` served over HTTP on `host:port` (0 = any free port), on threads of
    its own until `close`. A host other than loopback is reachable from other machines: it says so (`warn`)."""

    def __init__(self, backend: GenerateBackend, tokenizer: Tokenizer, *, host: str = "127.0.0.1", port: int = 0,
                 warn: Callable[[str], None] = print, **service: Any):
        super().__init__(backend, tokenizer, **service)
        if host not in LOCAL_HOSTS and not _is_loopback(host):
            warn(f"warning: the agent endpoint listens on {host}:{port}, reachable from other machines "
                 "(env.server.host); anyone who can reach it can sample from the policy")
        try:
            self.httpd = ThreadingHTTPServer((host, port), _handler(self))
        except OSError as e:
            self.batcher.close()
            raise ValueError(f"the agent endpoint cannot listen on {host}:{port} ({e}): choose another "
                             "env.server.port (0 = any free port) or env.server.host") from None
        self.httpd.daemon_threads = True
        self._thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,), name="endpoint-http",
                                        daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        return self.httpd.server_address[1]

    @property
    def host(self) -> str:
        return self.httpd.server_address[0]

    def base_url(self, episode: Episode | str) -> str:
        """What an agent's client takes as `base_url` for this episode."""
        episode_id = episode if isinstance(episode, str) else episode.episode_id
        host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(self.host, self.host)  # all interfaces: reach it locally
        host = host if ":" not in host else f"[{host}]"
        return f"http://{host}:{self.port}/episodes/{episode_id}/v1"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        super().close()

    def __enter__(self) -> "ChatEndpoint":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _handler(endpoint: ChatEndpoint) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        timeout = IDLE_CONNECTION_S  # a kept-alive connection no request comes on is closed (its thread ends)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
            pass  # one line per request would flood the run's log

        def _send(self, status: int, body: Mapping[str, Any], headers: Mapping[str, str] = {}) -> None:
            data = json.dumps(body).encode("utf-8")
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            for key, value in headers.items():
                self.send_header(key, value)
            self.end_headers()
            self.wfile.write(data)

        def _route(self, method: str) -> None:
            try:
                match = EPISODE_PATH.match(self.path.split("?", 1)[0])
                if match is None:
                    raise EndpointError(404, f"no route {self.path!r}: an episode's routes are "
                                             "/episodes/{episode_id}/v1/chat/completions and .../v1/models",
                                        code="not_found")
                allowed = "POST" if match["route"] == "chat/completions" else "GET"
                if method != allowed:
                    self._read_body()  # keep the connection usable
                    endpoint.count(refused=1)
                    self._send(405, EndpointError(405, f"{method} {self.path}: use {allowed}").body(),
                               {"Allow": allowed})
                    return
                episode = endpoint.episode(match["episode"])
                if method == "GET":
                    self._send(200, endpoint.models())
                    return
                raw = self._read_body()
                try:
                    body = json.loads(raw)
                except (json.JSONDecodeError, UnicodeDecodeError) as e:
                    raise EndpointError(400, f"the request body is not JSON: {e}") from None
                self._send(200, endpoint.chat(episode, body))
            except BodyTooLarge as e:
                endpoint.count(refused=1)
                self.close_connection = True
                self._send(e.status, e.body(), {"Connection": "close"})
                self._discard(e.length)
            except EndpointError as e:
                endpoint.count(refused=1)
                self._send(e.status, e.body())
            except Exception as e:  # noqa: BLE001 - a bug or a failed generate call: the agent gets a 500
                endpoint.count(refused=1)
                self._send(500, EndpointError(500, f"{type(e).__name__}: {e}", kind="server_error").body())

        def _read_body(self) -> bytes:
            length = int(self.headers.get("Content-Length") or 0)
            if length > MAX_BODY_BYTES:
                raise BodyTooLarge(length)
            return self.rfile.read(length)

        def _discard(self, length: int) -> None:
            """Read and drop the refused body the client is still sending, so it gets to read the reply (up to
            `DISCARD_BYTES`, while bytes keep coming within `DISCARD_WAIT_S`); the connection closes after."""
            self.connection.settimeout(DISCARD_WAIT_S)
            left = min(length, DISCARD_BYTES)
            try:
                while left > 0:
                    chunk = self.rfile.read1(min(left, 1 << 16))
                    if not chunk:
                        return
                    left -= len(chunk)
            except OSError:  # the client stopped sending (a timeout) or went away
                return

        def do_POST(self) -> None:
            self._route("POST")

        def do_GET(self) -> None:
            self._route("GET")

        def do_PUT(self) -> None:
            self._route("PUT")

        def do_DELETE(self) -> None:
            self._route("DELETE")

    return Handler
