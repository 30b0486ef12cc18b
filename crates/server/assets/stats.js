"use strict";
// Polls /stats.json and renders it. No framework, no build step.
(function () {
  const POLL_MS = 500;
  const SPARK_POINTS = 120; // 60 s at 2 Hz
  const KEY_STORE = "scoria_api_key";
  const $ = (id) => document.getElementById(id);

  // The API key: from ?key=..., else this tab's sessionStorage.
  let apiKey = null;
  try {
    const url = new URL(window.location.href);
    const fromUrl = url.searchParams.get("key");
    if (fromUrl) {
      sessionStorage.setItem(KEY_STORE, fromUrl);
      url.searchParams.delete("key");
      history.replaceState(null, "", url.pathname + url.search + url.hash);
    }
    apiKey = sessionStorage.getItem(KEY_STORE);
  } catch (e) { /* storage disabled: the form still works for this page view */ }

  $("keyform").addEventListener("submit", (ev) => {
    ev.preventDefault();
    apiKey = $("keyinput").value.trim() || null;
    try { if (apiKey) sessionStorage.setItem(KEY_STORE, apiKey); } catch (e) { /* ignore */ }
    $("keyform").hidden = true;
    poll();
  });

  const fmtInt = (n) => (n == null ? "–" : Math.round(n).toLocaleString("en-US"));
  const fmtRate = (x) => (x == null ? "–" : x >= 100 ? x.toFixed(0) : x.toFixed(1));
  const fmtMs = (ms) => {
    if (ms == null) return "–";
    if (ms < 1000) return ms.toFixed(0) + " ms";
    if (ms < 60000) return (ms / 1000).toFixed(1) + " s";
    return (ms / 60000).toFixed(1) + " min";
  };
  const fmtDur = (s) => {
    s = Math.floor(s || 0);
    const h = Math.floor(s / 3600), m = Math.floor((s % 3600) / 60), sec = s % 60;
    return (h ? h + "h " : "") + (h || m ? m + "m " : "") + sec + "s";
  };
  const fmtBytes = (b) => {
    if (!b) return "";
    const u = ["B", "KiB", "MiB", "GiB", "TiB"];
    let i = 0;
    while (b >= 1024 && i < u.length - 1) { b /= 1024; i++; }
    return b.toFixed(i ? 1 : 0) + " " + u[i];
  };
  const el = (tag, attrs, text) => {
    const e = document.createElement(tag);
    if (attrs) for (const k in attrs) e.setAttribute(k, attrs[k]);
    if (text != null) e.textContent = text;
    return e;
  };
  const setText = (id, text) => { const e = $(id); if (e.textContent !== text) e.textContent = text; };

  const spark = [];
  function drawSpark() {
    const c = $("spark");
    const dpr = window.devicePixelRatio || 1;
    const w = c.clientWidth, h = c.clientHeight;
    if (c.width !== w * dpr) { c.width = w * dpr; c.height = h * dpr; }
    const g = c.getContext("2d");
    g.setTransform(dpr, 0, 0, dpr, 0, 0);
    g.clearRect(0, 0, w, h);
    g.strokeStyle = "#262a33"; g.lineWidth = 1;
    g.beginPath(); g.moveTo(0, h - 1.5); g.lineTo(w, h - 1.5); g.stroke();
    if (spark.length < 2) return;
    const max = Math.max(1, ...spark);
    const step = w / (SPARK_POINTS - 1);
    const x0 = w - (spark.length - 1) * step;
    g.beginPath();
    spark.forEach((v, i) => {
      const x = x0 + i * step, y = h - 2 - (v / max) * (h - 6);
      i ? g.lineTo(x, y) : g.moveTo(x, y);
    });
    g.strokeStyle = "#f08a3c"; g.lineWidth = 1.5; g.stroke();
    g.lineTo(w, h); g.lineTo(x0, h); g.closePath();
    g.fillStyle = "rgba(240,138,60,0.12)"; g.fill();
  }

  // The slot pool: one cell per slot, filled by the context it holds
  // (green decoding, amber reading its prompt, grey kept for reuse).
  let lastSlotsKey = "";
  function renderSlots(slots) {
    const key = JSON.stringify(slots.map((s) => [s.is_processing, s.state, s.n_ctx_used, s.n_ctx, s.id_task]));
    if (key === lastSlotsKey) return;
    lastSlotsKey = key;
    const box = $("slots");
    box.replaceChildren();
    if (slots.length < 2) return; // one slot: the Now panel says it all
    for (const s of slots) {
      const cell = el("div", { class: "slot" + (s.is_processing ? " busy " + s.state : "") });
      const fill = el("div");
      fill.style.height = s.n_ctx ? Math.min(100, (100 * s.n_ctx_used) / s.n_ctx).toFixed(1) + "%" : "0";
      cell.append(fill);
      cell.title = "slot " + s.id + " · " + (s.is_processing ? "#" + s.id_task + " " + s.state : "idle") +
        " · " + fmtInt(s.n_ctx_used) + " / " + fmtInt(s.n_ctx) + " positions";
      box.append(cell);
    }
  }

  // Several live requests: one row each.
  function renderLive(live) {
    const box = $("current");
    box.replaceChildren();
    box.className = "current table-wrap";
    const t = el("table", { class: "live-table", id: "live" });
    const head = el("tr");
    for (const [h, cls] of [["slot"], ["#"], ["state"], ["prompt", "n"], ["generated", "n"], ["tok/s", "n"], ["elapsed", "n"]]) {
      head.append(el("th", cls ? { class: cls } : null, h));
    }
    t.append(el("thead")); t.tHead.append(head);
    const tb = el("tbody");
    for (const r of live) {
      const tr = el("tr");
      tr.title = r.route + (r.queue_ms > 1 ? " · queued " + fmtMs(r.queue_ms) : "");
      const cells = [
        [r.slot == null ? "–" : r.slot], [r.id], [r.state],
        [fmtInt(r.prompt_done) + " / " + fmtInt(r.prompt_tokens), "n"], [fmtInt(r.predicted_n), "n"],
        [fmtRate(r.state === "prompt" ? r.prompt_per_second : r.predicted_per_second), "n"],
        [fmtMs(r.elapsed_ms), "n"],
      ];
      for (const [v, cls] of cells) tr.append(el("td", cls ? { class: cls } : null, String(v)));
      tb.append(tr);
    }
    t.append(tb);
    box.append(t);
  }

  function renderCurrent(cur, live) {
    if (live && live.length > 1) { renderLive(live); return; }
    const box = $("current");
    box.replaceChildren();
    if (!cur) { box.className = "current idle-text"; box.textContent = "idle"; return; }
    box.className = "current";
    const rows = [
      ["request", "#" + cur.id + " · " + cur.route + (cur.slot != null ? " · slot " + cur.slot : "")],
      ["state", cur.state],
      ["prompt", fmtInt(cur.prompt_done) + " / " + fmtInt(cur.prompt_tokens) + " tokens · " + fmtRate(cur.prompt_per_second) + " tok/s"],
      ["generated", fmtInt(cur.predicted_n) + " tokens · " + fmtRate(cur.predicted_per_second) + " tok/s"],
      ["elapsed", fmtMs(cur.elapsed_ms) + (cur.queue_ms > 1 ? " (queued " + fmtMs(cur.queue_ms) + ")" : "")],
    ];
    for (const [k, v] of rows) {
      const r = el("div", { class: "row" });
      r.append(el("span", { class: "k" }, k), el("span", { id: "cur-" + k }, v));
      box.append(r);
    }
  }

  function renderGpu(gpu) {
    const box = $("gpu");
    box.replaceChildren();
    if (!gpu || !gpu.present) {
      box.append(el("div", { class: "none" }, "no GPU"));
      if (gpu && gpu.reason) box.append(el("div", { class: "nums" }, gpu.reason));
      return;
    }
    if (gpu.error) box.append(el("div", { class: "nums" }, gpu.error));
    for (const d of gpu.devices || []) {
      const dev = el("div", { class: "dev" });
      dev.append(el("div", { class: "name" }, (d.index != null ? d.index + " · " : "") + d.name));
      const used = d.memory_used_mib, total = d.memory_total_mib;
      const memTxt = used != null && total ? (used / 1024).toFixed(1) + " / " + (total / 1024).toFixed(1) + " GiB" : "memory –";
      const parts = [memTxt, "load " + (d.utilization_pct != null ? d.utilization_pct + "%" : "–")];
      if (d.temperature_c != null) parts.push(d.temperature_c + " °C");
      if (d.power_w != null) parts.push(d.power_w.toFixed(0) + " W");
      dev.append(el("div", { class: "nums" }, parts.join(" · ")));
      const bar = el("div", { class: "bar" });
      const fill = el("div");
      fill.style.width = used != null && total ? Math.min(100, (100 * used) / total).toFixed(1) + "%" : "0";
      bar.append(fill);
      dev.append(bar);
      box.append(dev);
    }
  }

  // Where the engine runs, and the device memory it holds by its own account
  // (the GPU panel beside it shows nvidia-smi's view of the whole device).
  function renderDevice(d) {
    const box = $("device");
    box.replaceChildren();
    if (!d) { box.append(el("div", { class: "none" }, "not reported")); return; }
    const dev = el("div", { class: "dev" });
    dev.append(el("div", { class: "name" }, d.name + " · " + d.device));
    const used = d.vram_used_bytes, total = d.vram_total_bytes;
    let memTxt;
    if (used != null && total) memTxt = "engine holds " + (fmtBytes(used) || "0 B") + " of " + fmtBytes(total);
    else if (used != null) memTxt = "engine holds " + (fmtBytes(used) || "0 B");
    else if (d.kind === "cpu") memTxt = "weights memory-mapped in host RAM";
    else memTxt = "device memory –";
    dev.append(el("div", { class: "nums", id: "device-mem" }, memTxt));
    if (used != null && total) {
      const bar = el("div", { class: "bar" });
      const fill = el("div");
      fill.style.width = Math.min(100, (100 * used) / total).toFixed(1) + "%";
      bar.append(fill);
      dev.append(bar);
    }
    box.append(dev);
  }

  // Later releases report speculation and expert-tier numbers; show them when present.
  function renderExtra(s) {
    const parts = [];
    if (s.draft && s.draft.accept_rate != null) parts.push(["draft accept rate", (100 * s.draft.accept_rate).toFixed(1) + "%"]);
    if (s.experts && s.experts.tiers) {
      for (const [tier, v] of Object.entries(s.experts.tiers)) {
        if (v && v.hit_rate != null) parts.push([tier + " hit rate", (100 * v.hit_rate).toFixed(1) + "%"]);
      }
    }
    $("extra-panel").hidden = parts.length === 0;
    const box = $("extra");
    box.replaceChildren();
    for (const [k, v] of parts) {
      const r = el("div", { class: "row" });
      r.append(el("span", { class: "k" }, k), el("span", null, v));
      box.append(r);
    }
  }

  let lastLogKey = "";
  function renderLog(reqs) {
    const key = reqs.length ? reqs[0].id + ":" + reqs.length : "";
    if (key === lastLogKey) return;
    lastLogKey = key;
    const tb = $("log").tBodies[0];
    tb.replaceChildren();
    if (!reqs.length) {
      const tr = el("tr", { class: "empty" });
      tr.append(el("td", { colspan: "11" }, "no requests yet"));
      tb.append(tr);
      return;
    }
    for (const r of reqs) {
      const t = r.timings || {};
      const tr = el("tr");
      if (r.error) tr.title = r.error;
      const cells = [
        [r.id], [r.route], [r.finish, "finish-" + r.finish],
        [fmtInt(t.prompt_n), "n"], [fmtInt(t.cache_n), "n"], [fmtInt(t.predicted_n), "n"],
        [fmtRate(t.prompt_per_second), "n"], [fmtRate(t.predicted_per_second), "n"],
        [fmtMs(r.queue_ms), "n"], [fmtMs((t.prompt_ms || 0) + (t.predicted_ms || 0)), "n"],
        [r.queued_at_ms ? new Date(r.queued_at_ms).toLocaleTimeString() : "–"],
      ];
      for (const [v, cls] of cells) tr.append(el("td", cls ? { class: cls } : null, String(v)));
      tb.append(tr);
    }
  }

  function render(s) {
    const m = s.model || {};
    setText("model", [m.id || m.name, m.arch, m.synthetic ? "synthetic" : null,
      m.file_bytes ? fmtBytes(m.file_bytes) : null].filter(Boolean).join(" · "));
    const st = $("state");
    st.textContent = s.state; st.className = "pill " + s.state;
    setText("uptime", "up " + fmtDur(s.uptime_s));

    const sp = s.speed || {};
    setText("decode-tps", fmtRate(sp.predicted_per_second));
    setText("prompt-tps", fmtRate(sp.prompt_per_second));
    setText("speed-note", sp.live ? "live" : "last request");

    const ctx = s.context || {};
    setText("ctx-used", fmtInt(ctx.used));
    setText("ctx-total", fmtInt(ctx.total));
    $("ctx-bar").style.width = ctx.total ? Math.min(100, (100 * ctx.used) / ctx.total).toFixed(1) + "%" : "0";

    const q = s.queue || {};
    setText("queue-depth", fmtInt(q.depth));
    setText("queue-max", fmtInt(q.max));

    const t = s.totals || {};
    setText("tokens-total", fmtInt(t.tokens_predicted));
    setText("prompt-total", fmtInt(t.prompt_tokens));
    setText("cached-total", fmtInt(t.cache_tokens));
    setText("requests-total", fmtInt(t.requests));
    setText("errors-total", fmtInt(t.errors));
    const live = s.live || (s.current ? [s.current] : []);
    setText("running", String(live.length));
    const slots = s.slots || [];
    setText("slots-total", fmtInt(ctx.slots || slots.length || 1));
    setText("slots-busy", fmtInt(ctx.busy_slots != null ? ctx.busy_slots : live.length));
    setText("live-note", live.length > 1 ? live.length + " requests decoding" : "");

    spark.push(sp.live ? sp.predicted_per_second || 0 : 0);
    while (spark.length > SPARK_POINTS) spark.shift();
    drawSpark();

    renderSlots(slots);
    renderCurrent(s.current, live);
    renderDevice(s.device);
    renderGpu(s.gpu);
    renderExtra(s);
    renderLog(s.requests || []);
    document.body.dataset.updates = String((+document.body.dataset.updates || 0) + 1);
    setText("status-line", "updated " + new Date().toLocaleTimeString() + " · polling every " + POLL_MS + " ms");
  }

  let timer = null;
  async function poll() {
    clearTimeout(timer);
    let next = POLL_MS;
    try {
      const headers = { Accept: "application/json" };
      if (apiKey) headers.Authorization = "Bearer " + apiKey;
      const res = await fetch("/stats.json", { headers, cache: "no-store" });
      if (res.status === 401) {
        $("keyform").hidden = false;
        setText("status-line", apiKey ? "the API key was refused" : "this server needs its API key");
        const st = $("state"); st.textContent = "locked"; st.className = "pill down";
        return; // wait for the form
      }
      if (!res.ok) throw new Error("HTTP " + res.status);
      render(await res.json());
    } catch (e) {
      const st = $("state"); st.textContent = "offline"; st.className = "pill down";
      setText("status-line", "cannot reach the server (" + e.message + "); retrying");
      next = 2000;
    }
    timer = setTimeout(poll, next);
  }
  poll();
})();
