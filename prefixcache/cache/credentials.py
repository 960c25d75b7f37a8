"""Credentials: the secret that authenticates KV records below host memory (record.py), the Redis password, and
the router's admin key for the replicas' health details. Each comes from a file named on the command line or from an
environment variable, never from a flag's value: any user of the machine can read a command line (ps,
/proc/PID/cmdline).

Without a tier secret, a server with a disk tier keeps a random one in a file of the disk cache's folder (mode 0600),
so its L2 blocks outlive a restart; one without uses a random secret that dies with the process. Either way its L3
blocks can be read by no other replica (so it warns): give every replica that shares a Redis the same secret.
"""
import logging
import os
import secrets

from prefixcache.files import private_dir

TIER_SECRET_ENV = "PREFIXCACHE_TIER_SECRET"
REDIS_PASSWORD_ENV = "PREFIXCACHE_REDIS_PASSWORD"
ROUTER_ADMIN_KEY_ENV = "PREFIXCACHE_ROUTER_ADMIN_KEY"
SECRET_FILE = "tier-secret"  # in the disk cache's folder, when no secret is given
MIN_SECRET = 16  # characters

log = logging.getLogger("prefixcache.tiers")


def given(path: str, env: str) -> str | None:
    """The file's contents if a path is given (trailing newlines dropped, as a shell's $(cat FILE) does), else the
    environment variable's value; None if neither is set."""
    if path:
        with open(path) as f:
            return f.read().rstrip("\r\n") or None
    return os.environ.get(env) or None


def redis_password(path: str = "") -> str | None:
    return given(path, REDIS_PASSWORD_ENV)


def router_admin_key(path: str = "") -> str | None:
    return given(path, ROUTER_ADMIN_KEY_ENV)


def tier_secret(path: str, disk_cache: str, l3: bool) -> bytes:
    """The secret given (the file at `path`, else the environment), else one of this replica's own."""
    secret = given(path, TIER_SECRET_ENV)
    if secret is not None:
        if len(secret) < MIN_SECRET:
            raise ValueError(f"the tier secret ({path or TIER_SECRET_ENV}) has under {MIN_SECRET} characters: "
                             "make one with `openssl rand -hex 32`")
        return secret.encode()
    if l3:
        log.warning("no tier secret (%s or --tier-secret-file): this replica's L3 blocks cannot be read by other "
                    "replicas%s", TIER_SECRET_ENV, "" if disk_cache else ", nor after a restart")
    return _kept(os.path.join(private_dir(disk_cache), SECRET_FILE)) if disk_cache else secrets.token_hex(32).encode()


def _kept(path: str) -> bytes:
    """The secret in this file, made on first use (random, readable by this user only)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        with open(os.open(path, os.O_RDONLY | os.O_NOFOLLOW), "rb") as f:
            return f.read()
    secret = secrets.token_hex(32).encode()
    with os.fdopen(fd, "wb") as f:
        f.write(secret)
    return secret
