"""The replica's shared secret: who may use it, and where a launch gets one.

`RequireSecret` wraps the API process's ASGI app: every HTTP request and WebSocket
except the open paths (`/healthz`, for load balancers and launchers) must carry
`Authorization: Bearer <secret>`; others get 401 (HTTP) or a close with code 4401
before the handshake completes (the proxy's pool reads that as "refused").
Prefix-cache salts travel only inside authenticated requests, so nobody without
the secret can probe a tenant's cached prompts through `cached_tokens`.

An optional metrics token (`EDGECHAT_METRICS_TOKEN`, `--metrics-token-file`) is a second,
read-only credential for scrapers: accepted for `GET /metrics` and nothing else (403 on
any other path, a close with 4403 on a WebSocket), so Prometheus never holds the secret
that generates text. It must differ from the secret.

`launch_secret` is where a replica's secret comes from: the environment variable
(the launcher and deployments set it), else a `--secret-file` that exists, else a
fresh random one for this launch, written (mode 600) to that file or to a per-port
file under the user's cache folder, so a proxy on the same machine can read it.
"""

from __future__ import annotations

import hmac
import os
import secrets
from pathlib import Path

import msgspec


class RequireSecret:
    """ASGI middleware: the bearer secret on every path but `open_paths`; the metrics token,
    where one is given, on `GET metrics_path` only."""

    def __init__(self, app, secret: str, open_paths: tuple[str, ...] = ("/healthz",), *, metrics_token: str = "",
                 metrics_path: str = "/metrics"):
        if not secret:
            raise ValueError("RequireSecret needs a non-empty secret")
        if metrics_token == secret:
            raise ValueError("the metrics token must differ from the replica secret (it is handed to scrapers)")
        self.app, self.open_paths, self.metrics_path = app, frozenset(open_paths), metrics_path
        self._expected = f"Bearer {secret}".encode()
        self._metrics = f"Bearer {metrics_token}".encode() if metrics_token else None
        self._body = _error("missing or wrong replica secret (Authorization: Bearer <EDGECHAT_REPLICA_SECRET>)",
                            "unauthorized")
        self._forbidden = _error(f"the metrics token reads GET {metrics_path} only; this needs the replica secret",
                                 "forbidden")

    def _credential(self, scope) -> str:
        """"secret", "metrics" or "" for the request's Authorization header (compared in constant time)."""
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                if hmac.compare_digest(value, self._expected):
                    return "secret"
                if self._metrics is not None and hmac.compare_digest(value, self._metrics):
                    return "metrics"
                return ""
        return ""

    async def __call__(self, scope, receive, send) -> None:
        kind = scope["type"]
        if kind not in ("http", "websocket") or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        who = self._credential(scope)
        if who == "secret" or (who == "metrics" and kind == "http" and scope["method"] == "GET"
                               and scope["path"] == self.metrics_path):
            await self.app(scope, receive, send)
        elif kind == "websocket":
            code, reason = (4403, "forbidden") if who else (4401, "unauthorized")
            await send({"type": "websocket.close", "code": code, "reason": reason})
        elif who:  # the metrics token, elsewhere: known, and not allowed this
            await send({"type": "http.response.start", "status": 403,
                        "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": self._forbidden})
        else:
            await send({"type": "http.response.start", "status": 401,
                        "headers": [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer")]})
            await send({"type": "http.response.body", "body": self._body})


def _error(message: str, code: str) -> bytes:
    return msgspec.json.encode({"error": {"message": message, "type": code, "code": code}})


def metrics_token(env_value: str | None, token_file: str) -> tuple[str, str]:
    """(the metrics token or "" for none, where it came from: a line for the start-up log). The
    environment variable, else `token_file` (which must exist and hold one); never generated: a
    scraper is given it by whoever deploys the replica."""
    if env_value:
        return env_value, "metrics token from the environment"
    if not token_file:
        return "", "no metrics token (/metrics needs the secret)"
    value = Path(token_file).read_text().strip()
    if not value:
        raise ValueError(f"metrics token file {token_file} is empty")
    return value, f"metrics token from {token_file}"


def default_secret_file(host: str, port: int) -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "edgechat" / "replica-secrets" / f"{host}-{port}"


def launch_secret(env_value: str | None, secret_file: str, host: str, port: int) -> tuple[str, str]:
    """(secret, where it came from: a line for the start-up log)."""
    if env_value:
        return env_value, "secret from the environment"
    path = Path(secret_file) if secret_file else None
    if path is not None and path.exists():
        value = path.read_text().strip()
        if not value:
            raise ValueError(f"secret file {path} is empty")
        return value, f"secret from {path}"
    path = path or default_secret_file(host, port)
    value = secrets.token_urlsafe(32)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(value + "\n")
    os.replace(tmp, path)
    return value, (f"generated a secret for this launch in {path} (mode 600); proxies present it: "
                   f"EDGECHAT_REPLICA_SECRET=$(cat {path}) "
                   f"python -m edge_proxy --replica ws://{host}:{port}/v1/replica")
