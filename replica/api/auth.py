"""The replica's shared secret: who may use it, and where a launch gets one.

`RequireSecret` wraps the API process's ASGI app: every HTTP request and WebSocket
except the open paths (`/healthz`, for load balancers and launchers) must carry
`Authorization: Bearer <secret>`; others get 401 (HTTP) or a close with code 4401
before the handshake completes (the proxy's pool reads that as "refused").
Prefix-cache salts travel only inside authenticated requests, so nobody without
the secret can probe a tenant's cached prompts through `cached_tokens`.

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
    """ASGI middleware: the bearer secret on every path but `open_paths`."""

    def __init__(self, app, secret: str, open_paths: tuple[str, ...] = ("/healthz",)):
        if not secret:
            raise ValueError("RequireSecret needs a non-empty secret")
        self.app, self.open_paths = app, frozenset(open_paths)
        self._expected = f"Bearer {secret}".encode()
        self._body = msgspec.json.encode({"error": {"message": "missing or wrong replica secret (Authorization: "
                                                               "Bearer <EDGECHAT_REPLICA_SECRET>)",
                                                    "type": "unauthorized", "code": "unauthorized"}})

    def _authorized(self, scope) -> bool:
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                return hmac.compare_digest(value, self._expected)
        return False

    async def __call__(self, scope, receive, send) -> None:
        kind = scope["type"]
        if kind not in ("http", "websocket") or scope["path"] in self.open_paths or self._authorized(scope):
            await self.app(scope, receive, send)
        elif kind == "websocket":
            await send({"type": "websocket.close", "code": 4401, "reason": "unauthorized"})
        else:
            await send({"type": "http.response.start", "status": 401,
                        "headers": [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer")]})
            await send({"type": "http.response.body", "body": self._body})


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
