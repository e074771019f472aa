// The page asks for itself again every few seconds and swaps in its <main>: no build step, no CDN.
(function () {
  const every = Number(document.body.dataset.refreshMs) || 2000;
  async function refresh() {
    try {
      const r = await fetch(location.href, {credentials: "same-origin", cache: "no-store"});
      if (r.ok && r.headers.get("content-type").startsWith("text/html")) {
        const fresh = new DOMParser().parseFromString(await r.text(), "text/html").getElementById("live");
        const now = document.getElementById("live");
        if (fresh && now) now.replaceWith(fresh);
      }
    } catch (e) { /* the server restarting: try again at the next tick */ }
    setTimeout(refresh, every);
  }
  if (document.getElementById("live") && !document.querySelector("form.login")) setTimeout(refresh, every);
})();
