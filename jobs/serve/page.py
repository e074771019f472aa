"""The live page of jobs and batches: `/` on `tokenmill serve`, and `tokenmill ui --db URL` for
jobs run from the CLI, cron or Airflow.  Server-rendered HTML (Jinja2, autoescaped) that
refreshes itself with a small script of its own (no CDN, no build step), paged, the database
doing the counting (schemas/storage/watch.py).

Each job's row: status, a progress bar, rows/s, time left (its measured rate, beside the
estimate's held wall where one was made), tokens, cost so far, dead letters by reason, and the
engine with whether it is loaded; above them the service's batches that are no job yet
(validating, queued).  A job's page: the figures `tokenmill status --json` shows (the same
catalog), the estimate beside what happened, the report's own plots (jobs/metrics/plots.py,
made on the server as plotly JSON from the database's counts, drawn by plotly.js served here),
and a batch's webhook attempts.

Access: a key, given once in the login form, which opens a session (schemas/storage/sessions.py:
the HttpOnly, SameSite=Strict cookie carries the session's random id, never the key; logout,
the key's revocation or its expiry ends it), or `Authorization: Bearer`.  Login and logout
posted from another site are refused (403); no redirect names a host (`RelativeRedirects`).  A key sees the jobs that are its own batches, an admin key every
job; the page shows figures, never a prompt or an output."""

from __future__ import annotations

import functools
import hashlib
import hmac
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable
from urllib.parse import urlsplit, urlunsplit

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response

from tokenmill.jobs.metrics.catalog import VIEWS, fmt
from tokenmill.jobs.serve.auth import Caller, SessionPolicy, same_site
from tokenmill.jobs.serve.objects import batch_status
from tokenmill.jobs.serve.requests import JobId, JobStatus, Offset
from tokenmill.schemas import storage as S

#: The session cookie: a session's random id (the key is never a cookie).
COOKIE = "tokenmill_session"
PAGE_SIZE = 50
#: How often the page asks for itself again (ms).
REFRESH_MS = 2000
#: How long a running job's report (its metrics and figures) is shown before it is made again.
PLOTS_TTL_S = 10.0
#: plotly.js, from the `plotly` package (the report extra) and served by the page itself: no CDN.
PLOTLY_JS = "/plotly.js"
#: What every page answer carries: no framing by other sites, scripts and styles only its own.
HEADERS = {"content-security-policy": "default-src 'self'; frame-ancestors 'none'; form-action 'self'",
           "x-content-type-options": "nosniff", "referrer-policy": "no-referrer", "cache-control": "no-store"}
#: A job's page, with the report's plots: plotly.js styles what it draws with inline styles
#: (its own <style> rules and style attributes), so styles may be inline there; scripts stay
#: the page's own files only (no inline script, no eval), and every value is autoescaped.
PLOT_HEADERS = {**HEADERS, "content-security-policy": "default-src 'self'; style-src 'self' 'unsafe-inline'; "
                                                      "frame-ancestors 'none'; form-action 'self'"}
_HERE = Path(__file__).resolve().parent / "templates"


@dataclass
class PageContext:
    """What the page needs of the process serving it."""

    eng: Any
    resolve: Callable[[str], Caller | None]
    """A presented key or token → who it is (None: refused)."""
    engines: Callable[[], dict[str, str]] = dict
    """The served models → their engine's state: not started, running a batch, loaded, not
    loaded (`tokenmill serve`; none for `ui`)."""
    held: Callable[[dict[str, Any]], str | None] = lambda b: None
    """Why a validating batch waits, or None (`tokenmill serve`: its key over a quota)."""
    policy: SessionPolicy = SessionPolicy()
    """How long a login lasts and when its cookie is `Secure`."""
    ui_id: str | None = None
    """`tokenmill ui`'s token as a session's key id (`ui_key_id`; none on `tokenmill serve`)."""

    def session_caller(self, session_id: str) -> Caller | None:
        """Who a session cookie is: its key while the session and the key live, else None."""
        row = S.SessionStore(self.eng).lookup(session_id)
        if row is None:
            return None
        if row["admin"] is None:  # no API key: only this process's own ui token
            return Caller(row["key_id"], True) if row["key_id"] == self.ui_id else None
        return Caller(row["key_id"], row["admin"])


def ui_key_id(token: str) -> str:
    """The id `tokenmill ui`'s token is known by (its sessions' key): a later ui's token is
    another, so its sessions end with the process that printed it."""
    return "ui:" + hashlib.sha256(token.encode()).hexdigest()[:24]


def key_resolver(eng, token: str | None = None) -> Callable[[str], Caller | None]:
    """API keys of the database (admin or not), and `token` (`tokenmill ui`'s, printed at its
    start) as an admin."""
    keys = S.KeyStore(eng)

    def resolve(secret: str) -> Caller | None:
        if token is not None and hmac.compare_digest(secret.encode(), token.encode()):
            return Caller(ui_key_id(token), True)
        row = keys.by_secret(secret)
        return Caller(row["id"], bool(row["admin"])) if row else None

    return resolve


def _templates():
    from jinja2 import Environment, FileSystemLoader, select_autoescape

    env = Environment(loader=FileSystemLoader(str(_HERE)), autoescape=select_autoescape(["html"]))
    env.filters["fmt"] = fmt
    env.filters["when"] = _when
    env.filters["dur"] = _duration
    return env


def _when(t: Any) -> str:
    if t is None:
        return "-"
    if hasattr(t, "strftime"):
        return t.strftime("%Y-%m-%d %H:%M:%S")
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(t))


def _duration(s: float | None) -> str:
    if s is None:
        return "-"
    s = max(0.0, float(s))
    if s < 60:
        return f"{s:.0f} s"
    if s < 3600:
        return f"{s // 60:.0f} min {s % 60:.0f} s"
    return f"{s // 3600:.0f} h {s % 3600 // 60:.0f} min"


def _epoch(t: Any) -> float | None:
    return None if t is None else (t.timestamp() if hasattr(t, "timestamp") else float(t))


def job_row(job: dict[str, Any], live: dict[str, int] | None, dead: dict[str, int], lines: int | None,
            estimate: dict[str, Any] | None, engines: dict[str, str], now: float) -> dict[str, Any]:
    """One job's figures on the list: finished jobs from their stored metrics, running ones from
    their rows so far."""
    m = job.get("metrics") or {}
    running = job["status"] == "running"
    failed = sum(dead.values())
    tokens: int | None
    if live is not None:
        done, tokens = live["answered"] + failed, live["prompt"] + live["output"]
    else:
        done = (job.get("succeeded") or 0) + (job.get("failed") or 0)
        tokens = (m.get("tokens") or {}).get("total")
    total = job.get("total") or lines
    started = _epoch(job.get("started_at"))
    elapsed = (now - started) if started is not None and running else None
    rate = (done / elapsed) if elapsed and done else (m.get("throughput") or {}).get("requests_per_s")
    left = ((total - done) / rate) if running and rate and total is not None and total >= done else None
    est_held = ((estimate or {}).get("held_wall_s") or {}).get("value") if estimate else None
    price = (job.get("spec") or {}).get("price_per_hour")
    if running:
        cost = (elapsed or 0) / 3600 * price if price is not None else None
    else:
        cost = (m.get("cost") or {}).get("total")
    engine = job.get("engine_config") or {}
    model = job.get("model")
    state = engines[model] if model in engines else ("running" if running else "-")
    return {"id": job["id"], "name": job.get("name"), "status": job["status"], "done": done, "total": total,
            "rows_per_s": rate, "time_left_s": left, "estimate_left_s": (est_held - elapsed) if est_held is not None
            and elapsed is not None else None, "tokens": tokens, "cost": cost, "cost_live": running,
            "dead": dead, "model": model, "engine": engine.get("kind") or "vllm", "engine_state": state}


def page_router() -> APIRouter:
    router = APIRouter()
    env = _templates()
    reports = JobReports()

    def ctx(request: Request) -> PageContext:
        return request.app.state.page

    def viewer(request: Request) -> Caller | None:
        auth = request.headers.get("authorization", "")
        scheme, _, secret = auth.partition(" ")
        if scheme.lower() == "bearer":
            return ctx(request).resolve(secret.strip()) if secret.strip() else None
        session = request.cookies.get(COOKIE, "")
        return ctx(request).session_caller(session) if session else None

    def html(name: str, code: int = 200, headers: dict[str, str] = HEADERS, **values: Any) -> HTMLResponse:
        return HTMLResponse(env.get_template(name).render(refresh_ms=REFRESH_MS, **values), status_code=code,
                            headers=headers)

    @router.get("/login", response_class=HTMLResponse, include_in_schema=False)
    def login_form(request: Request) -> HTMLResponse:
        return html("login.html", problem=None)

    @router.post("/login", include_in_schema=False)
    async def login(request: Request) -> Response:
        if not same_site(request):
            return html("login.html", code=403, problem="A login from another site is refused.")
        form = await request.form(max_files=0, max_fields=2)
        secret = str(form.get("key") or "").strip()
        c = ctx(request)
        who = c.resolve(secret) if secret else None
        if who is None:
            return html("login.html", code=401, problem="That key is unknown or revoked.")
        session = S.SessionStore(c.eng).open(who.key_id, c.policy.ttl_s)
        resp = RedirectResponse("/", status_code=303, headers=HEADERS)
        resp.set_cookie(COOKIE, session, max_age=int(c.policy.ttl_s), httponly=True, samesite="strict",
                        secure=c.policy.secure(request), path="/")
        return resp

    @router.post("/logout", include_in_schema=False)
    def logout(request: Request) -> Response:
        if not same_site(request):
            return Response("A logout from another site is refused.", status_code=403, media_type="text/plain",
                            headers=HEADERS)
        session = request.cookies.get(COOKIE)
        if session:
            S.SessionStore(ctx(request).eng).close(session)
        resp = RedirectResponse("/login", status_code=303, headers=HEADERS)
        resp.delete_cookie(COOKIE, path="/", httponly=True, samesite="strict", secure=ctx(request).policy.secure(request))
        return resp

    @router.get("/page.js", include_in_schema=False)
    def script() -> Response:
        return Response((_HERE / "page.js").read_text(), media_type="text/javascript", headers=HEADERS)

    @router.get("/page.css", include_in_schema=False)
    def style() -> Response:
        return Response((_HERE / "page.css").read_text(), media_type="text/css", headers=HEADERS)

    @router.get("/", response_class=HTMLResponse)
    def jobs(request: Request, offset: Offset = 0, status: JobStatus = None) -> Response:
        who = viewer(request)
        if who is None:
            return RedirectResponse("/login", status_code=303, headers=HEADERS)
        c = ctx(request)
        reader = S.WatchReader(c.eng)
        now = time.time()
        page = reader.page(who.scope, limit=PAGE_SIZE + 1, offset=offset, status=status or None)
        more, page = len(page) > PAGE_SIZE, page[:PAGE_SIZE]
        ids = [j["id"] for j in page]
        running = [j["id"] for j in page if j["status"] == "running"]
        live, dead = reader.live(running), reader.dead_by_reason(ids)
        lines = {b["id"]: b.get("lines") for b in (S.BatchStore(c.eng).get(i) for i in running) if b}
        estimates = {i: (S.EstimateStore(c.eng).latest(i) or {}).get("estimate") for i in running}
        engines = c.engines()
        n_waiting, waiting = reader.waiting(who.scope, limit=PAGE_SIZE) if offset == 0 and not status else (0, [])
        waits = [{**b, "status": batch_status(b), "waiting_s": now - b["created_at"], "held": c.held(b)}
                 for b in waiting]
        rows = [job_row(j, live.get(j["id"], {"answered": 0, "prompt": 0, "output": 0}) if j["id"] in running else None,
                        dead.get(j["id"], {}), lines.get(j["id"]), estimates.get(j["id"]), engines, now) for j in page]
        return html("jobs.html", rows=rows, counts=reader.status_counts(who.scope), who=who, offset=offset,
                    more=more, page_size=PAGE_SIZE, status=status, engines=engines, now=now, waiting=waits,
                    n_waiting=n_waiting)

    @router.get("/jobs/{job_id}", response_class=HTMLResponse)
    def job_page(job_id: JobId, request: Request) -> Response:
        who = viewer(request)
        if who is None:
            return RedirectResponse("/login", status_code=303, headers=HEADERS)
        c = ctx(request)
        reader = S.WatchReader(c.eng)
        job = reader.job(job_id, who.scope)
        if job is None:
            return html("missing.html", code=404, job_id=job_id[:100], who=who)
        if job["status"] == "running":
            job.update(S.MetricsReader(c.eng).counts(job_id))
        from tokenmill.jobs.estimate.beside import lines  # the estimate package loads the job runner: a job's page only

        rep = reports.get(c.eng, job)
        m = rep["metrics"]
        figures = [{"key": "total", "label": "rows", "value": job.get("total"), "text": fmt(job.get("total"))},
                   {"key": "succeeded", "label": "answered", "value": job.get("succeeded"),
                    "text": fmt(job.get("succeeded"))},
                   {"key": "failed", "label": "dead letters", "value": job.get("failed"), "text": fmt(job.get("failed"))}]
        for view in ("jobs", "status"):
            figures += [{"key": key, "label": f.label, "value": f.value(m), "text": f.text(m)} for key, f in VIEWS[view]
                        if f.value(m) is not None]
        beside = rep["estimate"]
        dead = reader.dead_by_reason([job_id]).get(job_id, {})
        hooks = S.WebhookStore(c.eng).events(job_id) if reader.batch_owners([job_id]) else []
        return html("job.html", job=job, figures=figures, estimate=lines(beside) if beside else [], dead=dead,
                    hooks=hooks, who=who, plots=rep["plots"], metrics_source=rep["source"], headers=PLOT_HEADERS,
                    plots_age_s=time.monotonic() - rep["at"], plotly_js=PLOTLY_JS)

    @router.get(PLOTLY_JS, include_in_schema=False)
    def plotly_js() -> Response:
        js = _plotly_js()
        if js is None:
            return Response("plotly is not installed (pip install 'tokenmill[report]')", status_code=404,
                            media_type="text/plain", headers=HEADERS)
        return Response(js, media_type="text/javascript",
                        headers={**HEADERS, "cache-control": "public, max-age=86400"})

    return router


@functools.lru_cache(maxsize=1)
def _plotly_js() -> str | None:
    try:
        from plotly.offline import get_plotlyjs
    except ImportError:
        return None
    return get_plotlyjs()


class JobReports:
    """A job's report (jobs/metrics/report.py: its metrics, the estimate beside them, and the
    report's own figures) for its page, made at most once per `ttl_s` while the job runs and
    once after it ended: the page asks every `REFRESH_MS`, each ask costing the database only
    the job's counts.  The figures' per-request counts are the database's (`RequestSummary`)."""

    def __init__(self, ttl_s: float = PLOTS_TTL_S, size: int = 64):
        self.ttl_s, self.size = ttl_s, size
        self._held: dict[str, tuple[tuple[Any, ...], dict[str, Any]]] = {}
        self._lock = threading.Lock()

    def get(self, eng, job: dict[str, Any]) -> dict[str, Any]:
        version = (job["status"], job.get("finished_at"))
        with self._lock:
            held = self._held.get(job["id"])
        now = time.monotonic()
        if held is not None and held[0] == version and (job["status"] != "running" or now - held[1]["at"] < self.ttl_s):
            return held[1]
        rep = job_report(eng, job["id"])
        with self._lock:
            if len(self._held) >= self.size:
                self._held.pop(next(iter(self._held)))
            self._held[job["id"]] = (version, rep)
        return rep


def job_report(eng, job_id: str) -> dict[str, Any]:
    """What a job's page shows of its report: its metrics (stored, or computed now from the
    committed rows while it runs), the estimate beside them and the report's figures as plotly
    JSON (None: plotly, the `report` extra, is not installed)."""
    from tokenmill.jobs.metrics.report import load_report  # the report's libraries (tabulate, numpy): a job's page only

    data = load_report(eng, job_id)
    try:
        from tokenmill.jobs.metrics.plots import job_figures

        plots: list[dict[str, str]] | None = [{"name": name, "json": fig.to_json()} for name, fig in job_figures(data)]
    except ImportError:
        plots = None
    return {"metrics": data["metrics"], "estimate": data["estimate"], "source": data["metrics_source"],
            "plots": plots, "at": time.monotonic()}


class RelativeRedirects:
    """ASGI middleware: every redirect's `Location` is a path (with its query), never a host:
    the framework's own trailing-slash redirect builds an absolute URL from the request's
    `Host` header, which a client chooses."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def relative(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start" and 300 <= message["status"] < 400:
                message = {**message, "headers": [(k, _path_only(v) if k.lower() == b"location" else v)
                                                  for k, v in message.get("headers", [])]}
            await send(message)

        await self.app(scope, receive, relative)


def _path_only(location: bytes) -> bytes:
    parts = urlsplit(location.decode("latin-1"))
    path = "/" + parts.path.lstrip("/")  # `//host` would be a host again
    return urlunsplit(("", "", path, parts.query, parts.fragment)).encode("latin-1")


def ui_app(db_url: str, token: str) -> Any:
    """`tokenmill ui`: the page alone over a database (jobs run from the CLI, cron or Airflow),
    entered with `token` (printed at its start) or an API key of that database."""
    app = FastAPI(title="tokenmill ui", docs_url=None, redoc_url=None, openapi_url=None)
    eng = S.connect(db_url)
    app.state.page = PageContext(eng, key_resolver(eng, token), ui_id=ui_key_id(token))
    app.include_router(page_router())
    app.add_middleware(RelativeRedirects)
    return app
