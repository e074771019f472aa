// The page asks for itself again every few seconds and swaps in its <main>: no build step, no CDN.
// A job's page draws the report's figures with plotly.js (served by the page itself) from the
// JSON the server rendered into each div[data-plot]; a figure whose JSON did not change keeps
// the chart already drawn.
(function () {
  const every = Number(document.body.dataset.refreshMs) || 2000;
  function draw(root) {
    if (!window.Plotly) return;
    for (const el of root.querySelectorAll("div[data-plot]:not([data-drawn])")) {
      const fig = JSON.parse(el.dataset.plot);
      el.dataset.drawn = "1";
      window.Plotly.newPlot(el, fig.data, fig.layout, {displaylogo: false, responsive: true});
    }
  }
  async function refresh() {
    try {
      const r = await fetch(location.href, {credentials: "same-origin", cache: "no-store"});
      if (r.ok && r.headers.get("content-type").startsWith("text/html")) {
        const parsed = new DOMParser().parseFromString(await r.text(), "text/html").getElementById("live");
        const now = document.getElementById("live");
        if (parsed && now) {
          const fresh = document.adoptNode(parsed);
          for (const el of fresh.querySelectorAll("div[data-plot]")) {
            const old = document.getElementById(el.id);
            if (old && old.dataset.drawn && old.dataset.plot === el.dataset.plot) el.replaceWith(old);
          }
          now.replaceWith(fresh);
          draw(fresh);
        }
      }
    } catch (e) { /* the server restarting: try again at the next tick */ }
    setTimeout(refresh, every);
  }
  document.addEventListener("DOMContentLoaded", () => draw(document));
  if (document.getElementById("live") && !document.querySelector("form.login")) setTimeout(refresh, every);
})();
