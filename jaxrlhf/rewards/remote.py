"""Score responses with a remote HTTP service (standard library only, no JAX).

The service gets one POST per row with the JSON body `{"prompt": ..., "response": ..., "answer":
...}` and answers with a JSON object holding a number under "score" (`{"score": 0.75}`), or a
bare JSON number. Every failure has a name (`RemoteScore.status`):

- "timeout": no answer within `timeout` seconds;
- "unreachable": the connection failed (refused, reset, no such host);
- "http": an HTTP error status;
- "garbage": the body is not JSON, or holds no finite number under "score".

A timeout, a failed connection, a 5xx status or 429 is retried `retries` times, waiting `backoff`,
then twice that, ... seconds in between (an HTTP 4xx and a garbage body are not: asking again gets
the same answer). At most `concurrency` requests to one URL are in flight at once in this process
(a semaphore shared by every batch and every thread scoring for that URL); `score_batch` sends a
batch's rows concurrently on a thread pool of that size. The longest a row can take is
`(retries + 1) * timeout + backoff * (2**retries - 1)` seconds plus the wait for the semaphore.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import http.client
import json
import math
import socket
import threading
import time
import urllib.error
import urllib.request
from typing import Sequence

_SEMAPHORES: dict[tuple[str, int], threading.BoundedSemaphore] = {}
_SEMAPHORES_LOCK = threading.Lock()
FAILURES = ("timeout", "unreachable", "http", "garbage")


@dataclasses.dataclass(frozen=True)
class RemoteScore:
    score: float | None  # None when the service gave no usable score
    status: str  # "ok" or one of FAILURES
    attempts: int
    detail: str = ""


def semaphore(url: str, concurrency: int) -> threading.BoundedSemaphore:
    """The semaphore shared by every request to `url` made with this concurrency limit."""
    if concurrency < 1:
        raise ValueError(f"remote reward concurrency must be >= 1, got {concurrency}")
    with _SEMAPHORES_LOCK:
        return _SEMAPHORES.setdefault((url, concurrency), threading.BoundedSemaphore(concurrency))


def _parse(body: bytes) -> float | None:
    try:
        data = json.loads(body)
    except ValueError:
        return None
    if isinstance(data, dict):
        data = data.get("score")
    if isinstance(data, bool) or not isinstance(data, (int, float)) or not math.isfinite(data):
        return None
    return float(data)


def _post_once(url: str, payload: bytes, timeout: float) -> RemoteScore:
    request = urllib.request.Request(url, data=payload, method="POST",
                                     headers={"Content-Type": "application/json", "Accept": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            body = reply.read(1 << 20)
    except urllib.error.HTTPError as exc:
        return RemoteScore(None, "http", 1, f"HTTP {exc.code}")
    except urllib.error.URLError as exc:
        if isinstance(exc.reason, (socket.timeout, TimeoutError)):
            return RemoteScore(None, "timeout", 1, str(exc.reason))
        return RemoteScore(None, "unreachable", 1, str(exc.reason))
    except (socket.timeout, TimeoutError) as exc:
        return RemoteScore(None, "timeout", 1, str(exc) or "timed out")
    except (ConnectionError, http.client.HTTPException, OSError) as exc:
        return RemoteScore(None, "unreachable", 1, repr(exc))
    score = _parse(body)
    if score is None:
        return RemoteScore(None, "garbage", 1, body[:200].decode("utf-8", "replace"))
    return RemoteScore(score, "ok", 1)


def _retryable(result: RemoteScore) -> bool:
    if result.status in ("timeout", "unreachable"):
        return True
    return result.status == "http" and (result.detail.startswith("HTTP 5") or result.detail == "HTTP 429")


def score_one(url: str, prompt: str, response: str, answer: str | None, *, timeout: float = 10.0,
              retries: int = 2, backoff: float = 0.5, concurrency: int = 8) -> RemoteScore:
    """POST one row to `url` (see the module docstring): its score, or the failure that ended it."""
    if not url or not url.startswith(("http://", "https://")):
        raise ValueError(f"remote reward url must be an http:// or https:// URL, got {url!r}")
    if timeout <= 0 or retries < 0 or backoff < 0:
        raise ValueError(f"remote reward needs timeout > 0, retries >= 0, backoff >= 0; got {timeout}, "
                         f"{retries}, {backoff}")
    payload = json.dumps({"prompt": prompt, "response": response, "answer": answer}).encode()
    gate = semaphore(url, concurrency)
    result = RemoteScore(None, "unreachable", 0)
    for attempt in range(retries + 1):
        if attempt:
            time.sleep(backoff * 2 ** (attempt - 1))
        with gate:
            result = dataclasses.replace(_post_once(url, payload, timeout), attempts=attempt + 1)
        if not _retryable(result):
            break
    return result


def score_batch(url: str, prompts: Sequence[str], responses: Sequence[str], answers: Sequence[str | None], *,
                timeout: float = 10.0, retries: int = 2, backoff: float = 0.5,
                concurrency: int = 8) -> list[RemoteScore]:
    """`score_one` for every row, `concurrency` rows at a time, in the rows' order."""
    if not len(prompts) == len(responses) == len(answers):
        raise ValueError(f"batch lengths differ: {len(prompts)}, {len(responses)}, {len(answers)}")
    if not prompts:
        return []
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(concurrency, len(prompts)),
                                               thread_name_prefix="remote-reward") as pool:
        return list(pool.map(lambda row: score_one(url, *row, timeout=timeout, retries=retries, backoff=backoff,
                                                   concurrency=concurrency),
                             zip(prompts, responses, answers)))
