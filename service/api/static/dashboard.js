// The /dashboard page: polls /dashboard/data (the whole history first, then `?since=<t of the newest point>`),
// keeps the last `window` seconds in columns, and draws them with uPlot. A failed or slow poll (3 s), or a
// status other than "up", shows a banner and retries every 2 s; a 401 asks for the metrics token (kept in
// sessionStorage, sent as a Bearer token). Hooks for tests: window.dashboard, [data-chart], [data-total],
// [data-latest] (with data-value), #status[data-state].
"use strict";
(() => {
  const TIMEOUT_MS = 3000, RETRY_MS = 2000, CHART_HEIGHT = 190, TOKEN_KEY = "dashboard-token";
  const dashboard = window.dashboard = {charts: {}, lastOk: null, polls: 0};
  const $ = (sel) => document.querySelector(sel);
  const hist = {t: [], cols: {}};  // the points kept: hist.t and one array per series, all the same length
  let last = null;                  // the newest payload (for thresholds, lists, trace_url)
  const signatures = {};            // chart name -> what its series were built from (rebuilt when it changes)

  // ---- formatting: a unit per series, chosen by its name ----
  const trim = (x, digits) => String(+x.toFixed(digits));
  const FMT = {
    sec: (v) => Math.abs(v) < 1 ? `${+(v * 1000).toPrecision(3)} ms` : `${+v.toPrecision(3)} s`,
    ratio: (v) => `${trim(v * 100, 1)}%`,
    rate: (v) => trim(v, v < 10 ? 2 : 1),
    count: (v) => trim(v, v < 10 ? 2 : 0),
    watts: (v) => `${trim(v, 0)} W`,
  };
  const unitOf = (key) =>
    /^(ttft|itl|e2e)_|^step_seconds|^engine_host|^loop_lag/.test(key) ? "sec"
      : /^kv_usage|^gpu_util|^gpu_memory/.test(key) ? "ratio"
        : /_per_s$/.test(key) ? "rate" : /^gpu_power/.test(key) ? "watts" : "count";
  const fmt = (v, unit) => v == null || !Number.isFinite(v) ? "–" : FMT[unit](v);
  const clock = (unixSeconds) => new Date(unixSeconds * 1000).toLocaleTimeString("en-GB", {hour12: false});  // 13:04:05

  // ---- the charts: name -> y unit, optional second axis unit, series (built from the newest payload) ----
  const S = (key, label, more = {}) => ({key, label, ...more});
  const pcts = (m) => ["p50", "p90", "p99"].map((p) => S(`${m}_${p}`, p));
  const perProcess = (metric) => {  // the processes with this series, in the payload's order, then by name
    const order = last.processes || [], rank = (p) => order.includes(p) ? order.indexOf(p) : order.length;
    return Object.keys(hist.cols).filter((k) => k.startsWith(`${metric}:`)).map((k) => k.slice(metric.length + 1))
      .sort((a, b) => rank(a) - rank(b) || a.localeCompare(b)).map((p) => S(`${metric}:${p}`, p));
  };
  const CHARTS = {
    requests: {y: "rate", series: () => [S("arrivals_per_s", "arrivals"), S("finished_per_s", "finished"),
      S("rejected_503_per_s", "503 rejected"), S("errors_per_s", "errors")]},
    queue: {y: "count", threshold: ["waiting_requests", "alert: waiting above"],
      series: () => [S("running", "running"), S("waiting", "waiting")]},
    throughput: {y: "rate", series: () => [S("output_tokens_per_s", "output"), S("prompt_tokens_per_s", "prompt")]},
    ttft: {y: "sec", threshold: ["ttft_p95_seconds", "alert: p95 above"], series: () => pcts("ttft")},
    itl: {y: "sec", threshold: ["itl_p95_seconds", "alert: p95 above"], series: () => pcts("itl")},
    e2e: {y: "sec", series: () => pcts("e2e")},
    steps: {y: "sec", series: () => [S("step_seconds_prefill", "prefill"), S("step_seconds_decode", "decode"),
      S("step_seconds_mixed", "mixed"), S("engine_host_seconds_per_step", "engine host / step")]},
    batch: {y: "count", y2: "rate", series: () => [S("batch_tokens", "tokens / step"),
      S("preemptions_per_s", "preemptions /s", {scale: "y2"})]},
    kv: {y: "ratio", threshold: ["kv_cache_usage_ratio", "alert: above"],
      series: () => [S("kv_usage", "KV cache used")]},
    cpu: {y: "count", series: () => perProcess("cpu")},
    loop_lag: {y: "sec", series: () => perProcess("loop_lag")},  // front ends only: the series that exist
    ipc_backlog: {y: "count", series: () => perProcess("ipc_backlog")},
    gpu: {y: "ratio", gpu: true, series: () => (last.gpus || []).flatMap((g, i) => [  // one colour per GPU
      S(`gpu_util:${g}`, `util ${g}`, {color: PALETTE[i % PALETTE.length]}),
      S(`gpu_memory_used_bytes:${g}`, `memory ${g}`, {color: PALETTE[i % PALETTE.length], dash: [4, 3],
        col: () => memoryShare(g)})])},
    gpu_power: {y: "watts", gpu: true,
      series: () => (last.gpus || []).map((g) => S(`gpu_power_watts:${g}`, `GPU ${g}`))},
  };
  const PALETTE = ["#3b82f6", "#f59e0b", "#8b5cf6", "#10b981", "#ec4899", "#14b8a6", "#84cc16", "#f97316"];
  const THRESHOLD_COLOR = "#e11d48";

  const column = (key) => hist.cols[key] || hist.t.map(() => null);
  function memoryShare(g) {
    const used = column(`gpu_memory_used_bytes:${g}`), total = column(`gpu_memory_total_bytes:${g}`);
    return used.map((u, i) => u == null || !total[i] ? null : u / total[i]);
  }

  // The series of a chart now: its data series, then its threshold (a dashed constant) when the payload has one.
  function seriesOf(name) {
    const def = CHARTS[name], list = def.series().map((s) => ({scale: "y", ...s}));
    const value = def.threshold && last.thresholds ? last.thresholds[def.threshold[0]] : null;
    if (typeof value === "number") list.push(S(null, def.threshold[1], {threshold: value, scale: "y"}));
    return list;
  }
  const dataOf = (list) => [hist.t, ...list.map((s) =>
    s.threshold != null ? hist.t.map(() => s.threshold) : s.col ? s.col() : column(s.key))];

  // y from 0 to the data's top; a threshold widens it only when within 5x of the data (or no data), so that a
  // far-off one does not flatten the lines (the legend always gives its value).
  function yRange(list, scale, unit) {
    return (u) => {
      if (unit === "ratio") return [0, 1];
      let top = 0, threshold = null;
      list.forEach((s, i) => {
        if (s.scale !== scale) return;
        if (s.threshold != null) { threshold = s.threshold; return; }
        for (const v of u.data[i + 1]) if (v != null && v > top) top = v;
      });
      if (threshold != null && (top === 0 || threshold <= 5 * top)) top = Math.max(top, threshold);
      return [0, top > 0 ? top * 1.1 : 1];
    };
  }

  // x: the last `window` seconds, or all the points while there are fewer (at least a minute).
  function xRange(u, lo, hi) {
    if (hi == null) { hi = last.now || Date.now() / 1000; lo = hi; }
    return [Math.max(hi - (last.window || 900), Math.min(lo, hi - 60)), hi];
  }

  function makeChart(name, list, el) {
    const def = CHARTS[name], css = getComputedStyle(document.body);
    const ink = css.getPropertyValue("--muted").trim(), grid = css.getPropertyValue("--grid").trim();
    const axis = (scale, unit, side) => ({scale, side, stroke: ink, grid: {stroke: grid, width: 1, show: side !== 1},
      ticks: {stroke: grid, width: 1}, size: 58, values: (u, splits) => splits.map((v) => fmt(v, unit))});
    const scales = {x: {time: true, range: xRange}, y: {range: yRange(list, "y", def.y)}};
    const axes = [{stroke: ink, grid: {stroke: grid, width: 1}, ticks: {stroke: grid, width: 1}, space: 80,
      values: (u, splits) => splits.map((v) => splits[1] - splits[0] < 60 ? clock(v) : clock(v).slice(0, 5))},
    axis("y", def.y, 3)];
    if (def.y2) { scales.y2 = {range: yRange(list, "y2", def.y2)}; axes.push(axis("y2", def.y2, 1)); }
    let color = 0;
    const series = [{value: (u, v) => v == null ? "–" : clock(v)}, ...list.map((s) => ({
      label: s.label, scale: s.scale, width: s.threshold != null ? 1.5 : 1.75,
      stroke: s.threshold != null ? THRESHOLD_COLOR : s.color || PALETTE[color++ % PALETTE.length],
      dash: s.threshold != null ? [6, 4] : s.dash, points: {show: false},
      value: (u, v) => fmt(s.threshold != null ? s.threshold : v, s.scale === "y2" ? def.y2 : def.y),
    }))];
    const opts = {width: el.clientWidth, height: CHART_HEIGHT, scales, axes, series,
      cursor: {sync: {key: "dashboard"}}, legend: {live: true}};
    return new uPlot(opts, dataOf(list), el);
  }

  // Build, rebuild (when its series change) or update every chart; one without series (no GPU, no front-end
  // series) is left out and its figure hidden.
  function drawCharts() {
    const gpus = (last.gpus || []).length > 0;
    $("#gpu-section").hidden = !gpus;
    for (const name of Object.keys(CHARTS)) {
      const el = document.querySelector(`[data-chart="${name}"]`);
      let chart = dashboard.charts[name];
      const list = CHARTS[name].gpu && !gpus ? [] : seriesOf(name);
      el.closest("figure").hidden = !list.some((s) => s.threshold == null);
      if (el.closest("figure").hidden) {
        if (chart) { chart.destroy(); delete dashboard.charts[name]; delete signatures[name]; }
        continue;
      }
      const signature = JSON.stringify(list.map((s) => [s.key, s.label, s.threshold]));
      if (chart && signatures[name] !== signature) { chart.destroy(); chart = null; }
      if (chart) { chart.setData(dataOf(list)); continue; }
      dashboard.charts[name] = makeChart(name, list, el);
      signatures[name] = signature;
    }
  }
  function dropCharts() {
    for (const [name, chart] of Object.entries(dashboard.charts)) { chart.destroy(); delete dashboard.charts[name]; }
    for (const name of Object.keys(signatures)) delete signatures[name];
    if (last) drawCharts();
  }

  // ---- data: append the new points, drop those older than the window ----
  function append(points, span) {
    const t = Array.isArray(points.t) ? points.t : [];
    const newest = () => hist.t.length ? hist.t[hist.t.length - 1] : -Infinity;
    for (const key of Object.keys(points)) {
      if (key !== "t" && !hist.cols[key]) hist.cols[key] = new Array(hist.t.length).fill(null);
    }
    for (let i = 0; i < t.length; i++) {
      if (!(t[i] > newest())) continue;  // only newer points, in order
      hist.t.push(t[i]);
      for (const [key, col] of Object.entries(hist.cols)) {
        const v = points[key] ? points[key][i] : null;
        col.push(typeof v === "number" ? v : null);
      }
    }
    const cutoff = hist.t.length ? hist.t[hist.t.length - 1] - span : 0;
    let drop = 0;
    while (drop < hist.t.length && hist.t[drop] <= cutoff) drop++;
    if (drop) { hist.t.splice(0, drop); for (const col of Object.values(hist.cols)) col.splice(0, drop); }
  }

  function showNumbers(data) {
    for (const el of document.querySelectorAll("[data-total]")) {
      const v = (data.totals || {})[el.dataset.total];
      el.textContent = typeof v === "number" ? String(Math.round(v)) : "–";
    }
    const i = hist.t.length - 1;
    for (const el of document.querySelectorAll("[data-latest]")) {
      const key = el.dataset.latest, v = i >= 0 && hist.cols[key] ? hist.cols[key][i] : null;
      if (v == null) el.removeAttribute("data-value"); else el.dataset.value = String(v);
      el.textContent = fmt(v, unitOf(key));
    }
  }

  function showSlowest(data) {
    const body = $("#slowest tbody"), rows = Array.isArray(data.slowest) ? data.slowest : [];
    const cell = (text, className = "") => Object.assign(document.createElement("td"), {textContent: text, className});
    const linkFor = (id) => {
      if (!data.trace_url || !id) return null;
      try {
        const url = new URL(data.trace_url.replaceAll("{trace_id}", encodeURIComponent(id)), location.href);
        return /^https?:$/.test(url.protocol) ? url.href : null;
      } catch { return null; }
    };
    body.replaceChildren(...rows.map((r) => {
      const tr = document.createElement("tr");
      tr.dataset.requestId = r.request_id ?? "";
      const trace = cell("", "id"), href = linkFor(r.trace_id);
      if (href) {
        const a = Object.assign(document.createElement("a"),
          {href, target: "_blank", rel: "noopener", textContent: r.trace_id});
        a.dataset.traceId = r.trace_id;
        trace.append(a);
      } else trace.textContent = r.trace_id || "–";
      tr.append(cell(r.request_id ?? "–", "id"), cell(r.finished ? clock(r.finished) : "–"),
        cell(r.finish_reason ?? "–"), cell(r.prompt_tokens ?? "–", "num"), cell(r.output_tokens ?? "–", "num"),
        cell(fmt(r.queue, "sec"), "num"), cell(fmt(r.ttft, "sec"), "num"), cell(fmt(r.e2e, "sec"), "num"), trace);
      return tr;
    }));
    if (!rows.length) body.append(Object.assign(document.createElement("tr"), {innerHTML:
      '<td colspan="9" class="empty">No finished requests in the last 15 minutes.</td>'}));
  }

  // ---- status banner and token form ----
  function setStatus(state, text) {
    const el = $("#status");
    el.dataset.state = state;
    el.textContent = text;
  }
  const lastGood = () => dashboard.lastOk ? `last good update ${clock(dashboard.lastOk / 1000)}`
    : "no good update yet";
  function down(text) { setStatus("down", `${text} — ${lastGood()}; retrying every ${RETRY_MS / 1000} s`); }

  function askToken(message) {
    setStatus("auth", "Token needed");
    $("#auth-msg").textContent = message;
    $("#auth").hidden = false;
    $("#token").focus();
  }
  $("#auth").addEventListener("submit", (ev) => {
    ev.preventDefault();
    sessionStorage.setItem(TOKEN_KEY, $("#token").value.trim());
    $("#token").value = "";
    $("#auth").hidden = true;
    setStatus("down", "Connecting…");
    poll();
  });

  // ---- polling: one request at a time; the next one is scheduled when this one ends ----
  // One request: the payload, or null when a token is needed (the form is shown); throws "Service down…" otherwise.
  async function fetchData() {
    const abort = new AbortController(), watchdog = setTimeout(() => abort.abort(), TIMEOUT_MS);
    try {
      const token = sessionStorage.getItem(TOKEN_KEY);
      const url = hist.t.length ? `/dashboard/data?since=${hist.t[hist.t.length - 1]}` : "/dashboard/data";
      const res = await fetch(url, {signal: abort.signal, cache: "no-store",
        headers: token ? {Authorization: `Bearer ${token}`} : {}});
      if (res.status === 401 || res.status === 403) {
        await res.text();
        sessionStorage.removeItem(TOKEN_KEY);
        askToken(token ? "That token was refused; try again." : "This service needs a token to show its metrics.");
        return null;
      }
      if (!res.ok) throw new Error(`Service down (HTTP ${res.status})`);
      const data = await res.json();
      if (!data || typeof data !== "object" || !data.points) throw new Error("Service down (unreadable answer)");
      return data;
    } catch (err) {
      throw new Error(String(err && err.message).startsWith("Service down") ? err.message : "Service down");
    } finally {
      clearTimeout(watchdog);
    }
  }

  let timer = null;
  async function poll() {
    clearTimeout(timer);
    let data, next = RETRY_MS;
    try {
      data = await fetchData();
    } catch (err) {
      down(err.message);
      timer = setTimeout(poll, RETRY_MS);
      return;
    }
    if (data === null) return;  // no retry until a token is given
    try {
      last = data;
      append(data.points, data.window || 900);
      $("#model").textContent = data.model || "…";
      document.title = `${data.model || "LLM service"} · dashboard`;
      showNumbers(data);
      showSlowest(data);
      drawCharts();
      if (data.status === "up") {
        dashboard.lastOk = Date.now();
        dashboard.polls += 1;
        setStatus("up", "Live");
        $("#updated").textContent = `updated ${clock(dashboard.lastOk / 1000)}`;
        next = Math.max(250, (data.interval || 1) * 1000);
      } else {
        down(String(data.status || "unknown status"));
      }
    } catch (err) {  // a payload this page cannot draw: say so, keep polling
      console.error("dashboard: cannot show the data", err);
      down(`Cannot show the data (${err && err.message})`);
    }
    timer = setTimeout(poll, next);
  }

  let resizing = false;
  window.addEventListener("resize", () => {
    if (resizing) return;
    resizing = true;
    requestAnimationFrame(() => {
      resizing = false;
      for (const [name, chart] of Object.entries(dashboard.charts)) {
        const el = document.querySelector(`[data-chart="${name}"]`);
        chart.setSize({width: el.clientWidth, height: CHART_HEIGHT});
      }
    });
  });
  matchMedia("(prefers-color-scheme: dark)").addEventListener("change", dropCharts);  // axis colours follow
  poll();
})();
