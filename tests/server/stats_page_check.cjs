#!/usr/bin/env node
// The stats page in headless Chromium (Debian's /usr/bin/chromium driven by
// playwright-core; no browser download): the page loads, its numbers update
// while a streamed reply runs, and a screenshot is written.
//
//   node stats_page_check.cjs --url http://127.0.0.1:PORT [--key KEY]
//        [--screenshot out.png] [--model ID]
//
// playwright-core is resolved from NODE_PATH (scripts/install-test-deps.sh
// installs it under target/server-tests/node).
"use strict";

const { chromium } = require("playwright-core");

function args() {
  const out = { url: process.env.SCORIA_URL, key: process.env.SCORIA_API_KEY || "", screenshot: "stats-page.png", model: null };
  const a = process.argv.slice(2);
  for (let i = 0; i < a.length; i++) {
    const v = a[i + 1];
    if (a[i] === "--url") { out.url = v; i++; }
    else if (a[i] === "--key") { out.key = v; i++; }
    else if (a[i] === "--screenshot") { out.screenshot = v; i++; }
    else if (a[i] === "--model") { out.model = v; i++; }
    else throw new Error("unknown argument " + a[i]);
  }
  if (!out.url) throw new Error("--url or SCORIA_URL is required");
  out.url = out.url.replace(/\/+$/, "");
  return out;
}

const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

function check(cond, msg) {
  if (!cond) throw new Error("check failed: " + msg);
  console.log("ok   " + msg);
}

async function waitFor(fn, what, ms = 10000) {
  const t0 = Date.now();
  for (;;) {
    const v = await fn();
    if (v) return v;
    if (Date.now() - t0 > ms) throw new Error("timed out waiting for " + what);
    await sleep(100);
  }
}

const num = (s) => Number(String(s).replace(/[^0-9.]/g, ""));

async function main() {
  const o = args();
  const auth = o.key ? { Authorization: "Bearer " + o.key } : {};
  let model = o.model;
  if (!model) {
    const r = await fetch(o.url + "/v1/models", { headers: auth });
    model = (await r.json()).data[0].id;
  }
  const props = await (await fetch(o.url + "/props", { headers: auth })).json();
  const nCtx = props.default_generation_settings.n_ctx;

  const browser = await chromium.launch({
    executablePath: process.env.CHROMIUM || "/usr/bin/chromium",
    headless: true,
    timeout: 30000,
    args: [
      "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
      "--disable-background-networking", "--disable-component-update", "--disable-sync",
      "--disable-dev-shm-usage",
    ],
  });
  const ac = new AbortController();
  try {
    const ctx = await browser.newContext({ viewport: { width: 1400, height: 900 } });
    const page = await ctx.newPage();
    const errors = [];
    page.on("pageerror", (e) => errors.push(String(e)));
    page.on("console", (m) => { if (m.type() === "error") errors.push(m.text()); });

    if (o.key) {
      // Without the key the page asks for it.
      const locked = await ctx.newPage();
      await locked.goto(o.url + "/", { timeout: 15000 });
      await locked.waitForSelector("#keyform:not([hidden])", { timeout: 10000 });
      check(true, "without the key the page shows the key form");
      await locked.close();
    }

    await page.goto(o.url + "/" + (o.key ? "?key=" + encodeURIComponent(o.key) : ""), { timeout: 15000 });
    await waitFor(async () => Number(await page.evaluate(() => document.body.dataset.updates || 0)) >= 1, "first update");
    check(true, "page loaded and rendered /stats.json");
    check(!page.url().includes("key="), "the key is removed from the address bar");
    const tokens0 = num(await page.textContent("#tokens-total"));

    // A long streamed reply; the page must follow it.
    const body = {
      model, stream: true, temperature: 0, max_tokens: Math.max(64, Math.min(4096, nCtx - 256)),
      messages: [{ role: "user", content: "Tell me a very long story about a lighthouse." }],
      chat_template_kwargs: { enable_thinking: false },
    };
    const res = await fetch(o.url + "/v1/chat/completions", {
      method: "POST", headers: { ...auth, "Content-Type": "application/json" },
      body: JSON.stringify(body), signal: ac.signal,
    });
    check(res.status === 200, "streamed request started");
    const reader = res.body.getReader();
    let chunks = 0;
    const pump = (async () => {
      try { for (;;) { const { done } = await reader.read(); if (done) break; chunks++; } } catch (e) { /* aborted */ }
    })();
    await waitFor(async () => chunks >= 3, "first stream chunks");

    const state = await waitFor(async () => {
      const s = await page.textContent("#state");
      return s === "decoding" || s === "prompt" ? s : null;
    }, "the page to show the request running");
    check(true, "state pill shows " + state);
    const a = num(await page.textContent("#tokens-total"));
    await sleep(1200);
    const b = num(await page.textContent("#tokens-total"));
    check(b > a, `token counter increases during the stream (${a} -> ${b})`);
    const tps = num(await page.textContent("#decode-tps"));
    check(tps > 0, "decode speed shown while streaming: " + tps + " tok/s");
    check(num(await page.textContent("#ctx-used")) > 0, "context used shown");
    const gpu = (await page.textContent("#gpu")).trim();
    check(gpu.length > 0, "GPU panel: " + gpu.split("\n")[0]);

    await page.screenshot({ path: o.screenshot, fullPage: true });
    check(true, "screenshot written to " + o.screenshot);

    ac.abort();
    await pump;
    // The cancelled request lands in the log.
    await waitFor(async () => (await page.textContent("#state")) === "idle", "idle after the client went away");
    const rows = await page.$$eval("#log tbody tr:not(.empty)", (t) => t.length);
    check(rows >= 1, "request log has " + rows + " row(s)");
    check(num(await page.textContent("#tokens-total")) > tokens0, "totals grew");
    check(errors.length === 0, "no script errors" + (errors.length ? ": " + errors.join("; ") : ""));
  } finally {
    ac.abort();
    await browser.close();
  }
}

const deadline = setTimeout(() => { console.error("stats page check: overall timeout"); process.exit(2); }, 120000);
main().then(() => { clearTimeout(deadline); console.log("stats page check passed"); process.exit(0); })
  .catch((e) => { clearTimeout(deadline); console.error(e && e.stack ? e.stack : e); process.exit(1); });
