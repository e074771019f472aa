"""Batch events sent to webhooks: when a batch ends (`completed`, `failed`, `expired`,
`cancelled`) and its key, or its `metadata.webhook_url`, names a URL, the server POSTs OpenAI's
`batch.*` event (`{"id": "evt_…", "object": "event", "created_at", "type", "data": {"id"}}`)
signed as Standard Webhooks specifies (`webhook-id`, `webhook-timestamp`, `webhook-signature`:
HMAC-SHA256 with the key's `whsec_` secret, by the `standardwebhooks` package), so the `openai`
SDK's `client.webhooks.unwrap` verifies it.  The secrets are sealed in the database
(`SecretBox`: AES-256-GCM under a key file of the server's data folder, 0600).

One event per batch ending (its id derives from the batch and the type), kept in the database
with every attempt; a background thread sends what is due and retries a failure (no answer, or
not 2xx) after `first_retry_s`, doubling up to `max_retry_s`, until `retry_for_s` after the
event was made.  Every replica of the service runs that thread; each event is claimed for
its attempt (`WebhookStore.claim`), so two replicas never send it at once, and one killed
mid-attempt leaves it to be tried again.

A URL that is not http(s), or whose host resolves to an address that is not public
(loopback, link-local and the cloud metadata address, private and shared ranges; an IPv6
address is checked with every IPv4 address it embeds: IPv4-mapped and -compatible, NAT64,
6to4, Teredo), is refused with a message that does not name the address, unless
`webhooks.allow_networks` names its range: when a batch names it (400), when a key is given
it (`tokenmill keys webhook`), and again at each attempt (a name may resolve elsewhere
later): the name is resolved once, every address checked, and the connection made to
a checked address with the name in the Host header and TLS's SNI (`pinned`), so a name that
answers a public address to the check and a private one to the connection reaches no private
address.  A refused attempt is recorded and the event given up, the URL never called."""

from __future__ import annotations

import base64
import hashlib
import ipaddress
import json
import logging
import os
import secrets
import socket
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable
from urllib.parse import urlsplit, urlunsplit

from sqlalchemy.engine import Connection

from tokenmill.jobs.serve.config import Webhooks
from tokenmill.jobs.serve.objects import ENDED
from tokenmill.schemas import storage as S
from tokenmill.schemas.errors import first_line

log = logging.getLogger(__name__)

#: Where a batch's URL may be given in its metadata.
METADATA_KEY = "webhook_url"
#: The longest wait between two looks at the events table when nothing is due.
IDLE_S = 5.0
USER_AGENT = "tokenmill-webhooks/1"

Resolver = Callable[[str, int], list[str]]


def new_secret() -> str:
    """A webhook signing secret in Standard Webhooks' form: `whsec_` + 32 random bytes, base64."""
    return "whsec_" + base64.b64encode(secrets.token_bytes(32)).decode()


def event_type(status: str) -> str:
    return f"batch.{status}"


def event_id(batch_id: str, kind: str) -> str:
    """The event of a batch's ending: the same id however often the batch is finalized."""
    return "evt_" + hashlib.sha256(f"{batch_id}/{kind}".encode()).hexdigest()[:24]


def event_body(evt_id: str, kind: str, batch_id: str, created_at: float) -> str:
    """OpenAI's `batch.*` webhook event, as the bytes that are signed and sent."""
    return json.dumps({"id": evt_id, "object": "event", "created_at": int(created_at), "type": kind,
                       "data": {"id": batch_id}}, separators=(",", ":"))


def signed_headers(secret: str, msg_id: str, body: str, now: float) -> dict[str, str]:
    """The Standard Webhooks headers of one attempt (the timestamp is the attempt's)."""
    from standardwebhooks.webhooks import Webhook

    when = datetime.fromtimestamp(int(now), tz=timezone.utc)
    return {"webhook-id": msg_id, "webhook-timestamp": str(int(now)),
            "webhook-signature": Webhook(secret).sign(msg_id, when, body)}


def _resolve(host: str, port: int) -> list[str]:
    return sorted({str(info[4][0]) for info in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)})


IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
#: IPv6 ranges that carry an IPv4 address in their last 32 bits: IPv4-compatible (::a.b.c.d) and
#: NAT64's well-known and local-use prefixes (RFC 6052, RFC 8215).
_LOW32 = tuple(ipaddress.ip_network(n) for n in ("::/96", "64:ff9b::/96", "64:ff9b:1::/48"))
#: Ranges Python's `is_global` still calls global that no public host answers from: NAT64's
#: local-use prefix (RFC 8215) and the deprecated IPv4-compatible form.
_NOT_PUBLIC = tuple(ipaddress.ip_network(n) for n in ("64:ff9b:1::/48", "::/96"))


def _kind(ip: IPAddress) -> str:
    if ip.is_loopback:
        return "a loopback address"
    if ip.is_link_local:
        return "a link-local address (the cloud metadata range)"
    if ip.is_private:
        return "a private address"
    return "not a public address"


def address_forms(ip: IPAddress) -> list[IPAddress]:
    """`ip` and every IPv4 address it embeds (IPv4-mapped, IPv4-compatible, NAT64, 6to4,
    Teredo's server and client): a connection to any of these forms may reach the IPv4 one."""
    forms: list[IPAddress] = [ip]
    if isinstance(ip, ipaddress.IPv6Address):
        for v4 in (ip.ipv4_mapped, ip.sixtofour, *(ip.teredo or ())):
            if v4 is not None:
                forms.append(v4)
        if any(ip in n for n in _LOW32):
            forms.append(ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF))
    return forms


def is_public(ip: IPAddress) -> bool:
    """Whether `ip` and every IPv4 address it embeds are globally reachable."""
    return all(f.is_global and not any(f.version == n.version and f in n for n in _NOT_PUBLIC)
               for f in address_forms(ip))


#: How a sealed secret starts in `api_keys.webhook_secret`; a value without it is a secret stored
#: before secrets were sealed, used as it is.
SEALED = "tmenc1:"


class SecretError(RuntimeError):
    """A key file or a sealed secret that cannot be used (one line: which and why)."""


def key_path(cfg: Webhooks) -> Path:
    """Where the key that seals the webhook signing secrets is kept."""
    from tokenmill.schemas.models import tokenmill_home

    return Path(cfg.secret_key_file) if cfg.secret_key_file else tokenmill_home() / "serve" / "webhook-secrets.key"


class SecretBox:
    """The keys' webhook signing secrets sealed at rest: AES-256-GCM (the `cryptography`
    package) under a key kept in a file of the server's data folder, mode 0600, made at first
    use.  A sealed secret fits the column a plain one had (no migration); a plain one, stored
    before, is opened as it is.  The database alone no longer signs an event."""

    def __init__(self, path: Path):
        self.path = path
        self._aead: Any = None

    def _key(self) -> Any:
        if self._aead is None:
            from cryptography.hazmat.primitives.ciphers.aead import AESGCM

            if not self.path.exists():
                self._make(AESGCM.generate_key(bit_length=256))
            mode = self.path.stat().st_mode & 0o777
            if mode & 0o077:
                raise SecretError(f"the webhook secrets' key file {self.path} has mode {mode:o}: others may read it; "
                                  f"chmod 600 {self.path}")
            try:
                key = base64.urlsafe_b64decode(self.path.read_bytes().strip())
            except ValueError:
                key = b""
            if len(key) != 32:
                raise SecretError(f"the webhook secrets' key file {self.path} does not hold a 256-bit key in base64")
            self._aead = AESGCM(key)
        return self._aead

    def _make(self, key: bytes) -> None:
        """Write the key file whole, mode 0600, unless another process made it first."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.{secrets.token_hex(4)}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as fh:
            fh.write(base64.urlsafe_b64encode(key) + b"\n")
        try:
            os.link(tmp, self.path)  # never a half-written key file under its name
        except FileExistsError:
            pass
        finally:
            os.unlink(tmp)

    def seal(self, secret: str) -> str:
        nonce = os.urandom(12)
        return SEALED + base64.urlsafe_b64encode(nonce + self._key().encrypt(nonce, secret.encode(), None)).decode()

    def open(self, stored: str) -> str:
        """The secret a stored value holds (a value stored unsealed, as it is)."""
        if not stored.startswith(SEALED):
            return stored
        from cryptography.exceptions import InvalidTag

        raw = base64.urlsafe_b64decode(stored[len(SEALED):])
        try:
            return self._key().decrypt(raw[:12], raw[12:], None).decode()
        except (InvalidTag, ValueError):
            raise SecretError(f"the key's webhook secret was sealed with another key file than {self.path}") from None


class Refused(ValueError):
    """A webhook URL the server will not call: its message (one line: what and why) is what a
    key is told (in a 400 and in the attempt log `GET /v1/batches/{id}/webhooks` shows);
    `detail` adds, for the server's log and the operator's CLI only, the address refused."""

    def __init__(self, message: str, detail: str | None = None):
        super().__init__(message)
        self.detail = detail or message


def check_url(url: str, allow_networks: list[str], resolve: Resolver = _resolve) -> list[str]:
    """The addresses `url`'s host resolves to now, each one checked; Refused when `url` is not
    http(s) or any of them is not public and not in `allow_networks`; OSError when its host does
    not resolve now."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as err:
        raise Refused(f"webhook URL {url[:200]!r} is not a URL: {err}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise Refused(f"webhook URL {url[:200]!r} must be http:// or https:// with a host")
    if parts.username is not None or parts.password is not None:
        raise Refused("a webhook URL may not carry a user name or password (the events are signed instead)")
    host = parts.hostname
    nets = [ipaddress.ip_network(n, strict=False) for n in allow_networks]
    addrs = resolve(host, port or (443 if parts.scheme == "https" else 80))
    if not addrs:
        raise OSError(f"{host!r} resolves to no address")
    for addr in addrs:
        ip = ipaddress.ip_address(addr.split("%")[0])
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped  # the same host: ::ffff:127.0.0.1 is 127.0.0.1, allowed or not alike
        if any(ip.version == n.version and ip in n for n in nets):
            continue
        if not is_public(ip):
            # the resolved address is not named: a refusal must not tell a key what an internal name is
            why = "webhooks go to public addresses unless the server's webhooks.allow_networks names the range"
            raise Refused(f"webhook host is not a public address; {why}",
                          f"webhook host {host!r} is {ip}, {_kind(ip)}; {why}")
    return addrs


def pinned(url: str, addr: str) -> tuple[str, dict[str, str], dict[str, Any]]:
    """`url` sent to the checked address `addr` instead of its host name (which could resolve
    elsewhere by the time a connection resolved it again: DNS rebinding): (the URL with the
    address as its host, the Host header naming the host as the URL did, httpx's request
    extensions giving TLS the name for SNI and the certificate check)."""
    parts = urlsplit(url)
    ip = ipaddress.ip_address(addr.split("%")[0])
    host = f"[{ip}]" if ip.version == 6 else str(ip)
    netloc = host if parts.port is None else f"{host}:{parts.port}"
    return (urlunsplit(parts._replace(netloc=netloc)), {"host": parts.netloc},
            {"sni_hostname": parts.hostname})


def batch_url(key: dict[str, Any] | None, metadata: dict[str, Any] | None) -> str | None:
    """Where a batch's events go: its `metadata.webhook_url`, else its key's URL."""
    return (metadata or {}).get(METADATA_KEY) or (key or {}).get("webhook_url") or None


class WebhookSender:
    """Makes a batch's event when it ends and sends the due events from one thread."""

    def __init__(self, eng, cfg: Webhooks, *, resolve: Resolver = _resolve, clock: Callable[[], float] = time.time):
        self.cfg, self.resolve, self.clock = cfg, resolve, clock
        self.store, self.keys, self.batches = S.WebhookStore(eng), S.KeyStore(eng), S.BatchStore(eng)
        self.box = SecretBox(key_path(cfg))
        self._wake, self._stop = threading.Event(), threading.Event()
        self._thread: threading.Thread | None = None
        self._http: Any = None

    def check_batch_url(self, url: str) -> str | None:
        """Why a batch's `metadata.webhook_url` is refused (one line), or None."""
        try:
            check_url(url, self.cfg.allow_networks, self.resolve)
        except Refused as err:
            return str(err)
        except (OSError, UnicodeError) as err:  # UnicodeError: a host name the IDNA codec refuses
            return f"webhook host of {url[:200]!r} does not resolve: {first_line(err)}"
        return None

    def end_batch(self, b: dict[str, Any], status: str, *, conn: Connection | None = None, **values: Any) -> bool:
        """End batch `b` as `status` (`values`: its `<status>_at` and the rest of its row) and,
        when it names a URL, make its event in the same transaction (WebhookStore.end_batch; in
        `conn`'s where the batch is held while it ends): a server killed between the two cannot
        lose the event, and a batch finalized again after a restart makes no second one.
        Returns whether this call ended the batch."""
        at = values[f"{status}_at"]
        url = batch_url(self.keys.get(b["owner"]), b.get("metadata"))
        event = None
        if status in ENDED and url:
            kind = event_type(status)
            evt = event_id(b["id"], kind)
            now = self.clock()
            event = {"id": evt, "batch_id": b["id"], "owner": b["owner"], "type": kind, "url": url,
                     "body": event_body(evt, kind, b["id"], at), "created_at": now, "next_at": now, "attempts": 0}
        done = self.store.end_batch(b["id"], ended=f"{status}_at", values=values, event=event, conn=conn)
        if done and event is not None:
            self._wake.set()
        return done

    # ------------------------------------------------------------------ sending

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, daemon=True, name="tokenmill-serve-webhooks")
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(self.cfg.timeout_s + 5)

    def _loop(self) -> None:
        while not self._stop.is_set():
            wait = IDLE_S
            try:
                self.send_due()
                nxt = self.store.next_due()
                if nxt is not None:
                    wait = min(IDLE_S, max(0.0, nxt - self.clock()))
            except Exception:  # a database hiccup must not stop the sending
                log.exception("webhook sending failed")
            self._wake.wait(wait)
            self._wake.clear()

    def send_due(self, limit: int = 50) -> int:
        """Attempt each due event once (at most `limit`), each claimed first (WebhookStore.claim),
        so the replicas' senders never send one event at the same time; returns how many were
        attempted."""
        n = 0
        while n < limit and not self._stop.is_set():
            ev = self.store.claim(self.clock(), self.claim_s)
            if ev is None:
                break
            self.attempt(ev)
            n += 1
        return n

    @property
    def claim_s(self) -> float:
        """How long an event claimed for an attempt is not due to anyone else: longer than an
        attempt can take (a timeout per address the name resolves to, a few of them)."""
        return 4 * self.cfg.timeout_s + 30.0

    def attempt(self, ev: dict[str, Any]) -> str:
        """One delivery attempt of an event, recorded with its outcome: delivered, failed (to be
        tried again, or given up past `retry_for_s`) or refused (given up, the URL not called)."""
        import httpx

        n = int(ev["attempts"]) + 1
        t0 = self.clock()
        key = self.keys.get(ev["owner"])
        problem: str | None = None
        detail: str | None = None  # for the server's log alone: the attempt log is the key's to read
        addrs: list[str] = []
        secret = ""
        if key is None or key.get("revoked_at") is not None:
            problem = "the batch's key was revoked"
        elif not key.get("webhook_secret"):
            problem = "the batch's key has no webhook secret (tokenmill keys webhook)"
        else:
            try:
                secret = self.box.open(key["webhook_secret"])
                addrs = check_url(ev["url"], self.cfg.allow_networks, self.resolve)
            except Refused as err:
                problem, detail = str(err), err.detail
            except SecretError as err:
                problem = str(err)
            except OSError as err:
                return self._failed(ev, n, t0, None, f"the host does not resolve: {first_line(err)}")
        if problem is not None:
            self.store.record(ev, {"attempt": n, "at": t0, "outcome": "refused", "error": problem[:2000]},
                              next_at=None, gave_up_at=t0)
            log.warning("webhook %s of batch %s refused: %s", ev["id"], ev["batch_id"], detail or problem)
            return "refused"
        headers = {"content-type": "application/json", "user-agent": USER_AGENT,
                   **signed_headers(secret, ev["id"], ev["body"], t0)}
        if self._http is None:  # no proxies from the environment: the refusal above must hold for the connection
            self._http = httpx.Client(trust_env=False, follow_redirects=False, timeout=self.cfg.timeout_s)
        # resolved once: the connection goes to an address just checked, never to a second
        # resolution of the name (the next address where one refuses the connection)
        for i, addr in enumerate(addrs):
            url, host, ext = pinned(ev["url"], addr)
            try:
                r = self._http.post(url, content=ev["body"].encode(), headers={**headers, **host}, extensions=ext)
                break
            except httpx.ConnectError as err:
                if i + 1 == len(addrs):
                    return self._failed(ev, n, t0, None, first_line(err) or type(err).__name__)
            except httpx.HTTPError as err:
                return self._failed(ev, n, t0, None, first_line(err) or type(err).__name__)
        if 200 <= r.status_code < 300:
            done = self.clock()
            self.store.record(ev, {"attempt": n, "at": t0, "outcome": "delivered", "status_code": r.status_code,
                                   "duration_s": done - t0}, next_at=None, delivered_at=done)
            return "delivered"
        return self._failed(ev, n, t0, r.status_code, f"the receiver answered HTTP {r.status_code}")

    def _failed(self, ev: dict[str, Any], n: int, t0: float, code: int | None, error: str) -> str:
        now = self.clock()
        wait = min(self.cfg.first_retry_s * 2 ** (n - 1), self.cfg.max_retry_s)
        give_up = now + wait > ev["created_at"] + self.cfg.retry_for_s
        self.store.record(ev, {"attempt": n, "at": t0, "outcome": "failed", "status_code": code,
                               "error": error[:2000], "duration_s": now - t0},
                          next_at=None if give_up else now + wait, gave_up_at=now if give_up else None)
        return "gave_up" if give_up else "failed"
