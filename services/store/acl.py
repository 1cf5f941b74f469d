"""Redis users, one per service, each with the keys and commands it needs and no more.

Every service reaches Redis as its own user (`redis_url` with `<service>:<password>@`), so a
process that is taken over can do only what its service does: a drafter reaches the registry
alone (it cannot mint an API key or read a prompt), a scheduler or a verifier never the API
keys, quotas or the audit trail, and no service runs what only an operator runs (CONFIG,
FLUSHALL, ACL, DEBUG, KEYS...). The operator's user (`default`, with its own password) keeps
every right: `specserve keys`, `specserve rollout` and migrations use it.

The key patterns are those of store.Layout on one Redis and on Redis Cluster (hash-tagged).
"""

from __future__ import annotations

import secrets
from pathlib import Path

from .schema import PREFIX

SERVICES = ("gateway", "scheduler", "verifier", "drafter")


def _tagged(*names: str) -> list[str]:
    """A request-shard key family, as on one Redis and as on Redis Cluster (`{shard}:`)."""
    return [f"{PREFIX}{name}*" for name in names] + [f"{PREFIX}{{*}}:{name}*" for name in names]


REQUESTS = _tagged("req:", "out:", "queue:", "queued:", "requeued:", "owned:", "owners", "wake:")
REGISTRY = [f"{PREFIX}verifier*", f"{PREFIX}drafter*", f"{PREFIX}{{registry}}:*"]
SHARED = [f"{PREFIX}result:*", f"{PREFIX}session:*", f"{PREFIX}rollout"]
STORED = [f"{PREFIX}stored:*"]  # tenants' stored bytes (the scheduler's)
TENANTS = [f"{PREFIX}apikey*", f"{PREFIX}quota:*", f"{PREFIX}streams:*", f"{PREFIX}audit"]
KEYS = {
    "gateway": REQUESTS + REGISTRY + SHARED + TENANTS,
    "scheduler": REQUESTS + REGISTRY + SHARED + STORED,
    "verifier": REQUESTS + REGISTRY + SHARED,
    "drafter": REGISTRY + [f"{PREFIX}rollout"],
}
# Every command but the operator's (@dangerous), and of those what the services use: INFO
# (how full Redis is: the scheduler refuses new work before it is), and the commands a Redis
# Cluster client asks the topology with.
COMMANDS = "+@all -@dangerous +info +cluster|slots +cluster|shards +cluster|nodes"


def user_line(service: str, password: str) -> str:
    """The redis.conf (or ACL file) line of a service's user."""
    keys = " ".join(f"~{pattern}" for pattern in KEYS[service])
    return f"user {service} on >{password} resetkeys {keys} resetchannels {COMMANDS}"


def url(service: str, password: str, host_port: str, db: int = 0, scheme: str = "redis") -> str:
    return f"{scheme}://{service}:{password}@{host_port}/{db}"


def make_users(out: Path, host_port: str, admin_password: str | None = None) -> dict[str, str]:
    """Passwords for every service's user and the operator's, in `out`: `redis.conf` (the
    `user` lines; the operator's is `default`), and `url-<service>` and `url` (the operator's)
    with the URL each connects with. Files 0600. Returns the URLs by user ('default' too)."""
    out.mkdir(parents=True, exist_ok=True)
    admin = admin_password or secrets.token_hex(24)
    passwords = {service: secrets.token_hex(24) for service in SERVICES}
    lines = [f"user default on >{admin} ~* &* +@all"]
    lines += [user_line(service, pw) for service, pw in passwords.items()]
    urls = {service: url(service, pw, host_port) for service, pw in passwords.items()}
    urls["default"] = f"redis://:{admin}@{host_port}/0"
    files = {"redis.conf": "\n".join(lines) + "\n", "url": urls["default"]}
    files |= {f"url-{service}": urls[service] for service in SERVICES}
    for name, text in files.items():
        path = out / name
        path.touch(mode=0o600)
        path.write_text(text)
    return urls
