// pagedserve's built-in page: the KV block map (GET /debug/kv/blocks, format in
// control_plane/kv_blocks.py), charts of the last minutes, and a chat playground.
// Plain JavaScript, no build step. Text from the server or the user is always inserted as text
// (textContent), never as HTML.
"use strict";

(() => {
  const POLL_MS = 500;              // at most 2 snapshots a second
  const HISTORY_MS = 5 * 60 * 1000; // the charts' window
  const KEY_STORE = "pagedserve-api-key";
  const $ = (id) => document.getElementById(id);

  // --- the API, with the key when the server wants one ------------------------------------------
  const auth = { needed: document.body.dataset.auth === "key", key: sessionStorage.getItem(KEY_STORE) || "" };
  class AuthError extends Error {}
  let keyWaiters = [];

  function headers(extra) {
    const h = Object.assign({}, extra || {});
    if (auth.key) h.Authorization = "Bearer " + auth.key;
    return h;
  }
  function askKey(message) {
    $("key-error").textContent = message || "";
    $("key-input").value = "";
    if (!$("key-dialog").open) $("key-dialog").showModal();
  }
  function keyReady() {
    if (!auth.needed || auth.key) return Promise.resolve();
    askKey();
    return new Promise((resolve) => keyWaiters.push(resolve));
  }
  $("key-form").addEventListener("submit", () => {
    auth.key = $("key-input").value.trim();
    sessionStorage.setItem(KEY_STORE, auth.key);
    auth.needed = true;
    const waiters = keyWaiters;
    keyWaiters = [];
    waiters.forEach((resolve) => resolve());
    setStatus("connecting", "");
    if (!paused) schedulePoll(0);
  });
  $("key-button").addEventListener("click", () => askKey(""));

  async function call(path, options) {
    await keyReady();
    const opts = Object.assign({}, options || {});
    opts.headers = headers(opts.headers);
    const resp = await fetch(path, opts);
    if (resp.status === 401) {
      auth.key = "";
      sessionStorage.removeItem(KEY_STORE);
      auth.needed = true;
      askKey("The server refused that key: enter it again.");
      throw new AuthError("API key needed");
    }
    return resp;
  }
  async function errorText(resp) {
    try {
      const body = await resp.json();
      return (body.error && body.error.message) || resp.statusText;
    } catch (e) {
      return resp.status + " " + resp.statusText;
    }
  }
  function setStatus(text, kind) {
    const el = $("status");
    el.textContent = text;
    el.className = kind || "";
  }

  // --- decoding a snapshot ----------------------------------------------------------------------
  function int32s(b64) {
    const bin = atob(b64);
    const bytes = new Uint8Array(bin.length);
    for (let i = 0; i < bin.length; i++) bytes[i] = bin.charCodeAt(i);
    return new Int32Array(bytes.buffer);   // little-endian, as the server sends it
  }
  const REF_DIGITS = "0123456789abcdefghijklmnopqrstuvwxyz";

  /** One replica's snapshot as lists the page uses: per pool its blocks, per sequence its table. */
  function decode(snap) {
    const s = snap.seqs;
    const flat = int32s(s.tables);
    const seqs = [];
    let at = 0;
    for (let i = 0; i < s.id.length; i++) {
      const len = s.table_len[i];
      seqs.push({
        id: s.id[i], request: s.request[i], sample: s.sample[i],
        state: { r: "running", w: "waiting", s: "swapped" }[s.state[i]],
        prompt: s.prompt[i], output: s.output[i], table: Array.from(flat.subarray(at, at + len)),
      });
      at += len;
    }
    const pool = (p) => p && {
      blocks: p.blocks, used: p.used, state: p.state, holder: int32s(p.holder), shared: p.shared,
    };
    return { blockSize: snap.block_size, device: pool(snap.device), cpu: pool(snap.cpu), seqs, stats: snap.stats };
  }
  function refCount(pool, i) {
    const c = pool.state[i];
    if (c === "+") return pool.shared[i].length;
    const r = REF_DIGITS.indexOf(c);
    return r > 0 ? r : 0;
  }

  // --- the block map ----------------------------------------------------------------------------
  const colourCache = new Map();
  function colour(seqId) {
    let c = colourCache.get(seqId);
    if (!c) {
      const hue = Math.round((seqId * 137.508) % 360);          // the golden angle: neighbours differ
      const light = 48 + ((seqId * 7) % 3) * 8;
      c = `hsl(${hue} 62% ${light}%)`;
      colourCache.set(seqId, c);
      if (colourCache.size > 4096) colourCache.clear();
    }
    return c;
  }

  class Grid {
    constructor(parent, title, kind) {
      this.box = document.createElement("div");
      this.box.className = "pool";
      this.title = document.createElement("h3");
      this.title.textContent = title;
      this.grid = document.createElement("div");
      this.grid.className = "grid " + kind;
      this.box.append(this.title, this.grid);
      parent.append(this.box);
      this.cells = [];
      this.keys = [];
      this.name = title;
    }
    resize(n) {
      while (this.cells.length < n) {
        const cell = document.createElement("i");
        cell.className = "cell";
        cell.dataset.block = String(this.cells.length);
        this.grid.append(cell);
        this.cells.push(cell);
        this.keys.push("");
      }
      while (this.cells.length > n) {
        this.cells.pop().remove();
        this.keys.pop();
      }
    }
    /** Draws `pool`; `order` maps the highlighted sequence's block ids to their logical indices. */
    draw(pool, order) {
      this.resize(pool.blocks);
      this.title.textContent = `${this.name}: ${pool.used} of ${pool.blocks} blocks in use`;
      this.grid.classList.toggle("dim", order !== null);
      for (let i = 0; i < pool.blocks; i++) {
        const c = pool.state[i];
        const held = c !== "." && c !== "C" && c !== "W";
        let holder = -1, ref = 0;
        if (held) {
          ref = refCount(pool, i);
          const all = pool.shared[i];
          holder = all ? Math.min.apply(null, all) : pool.holder[i];
        }
        const logical = order && order.has(i) ? order.get(i) : null;
        const key = c + "|" + holder + "|" + ref + "|" + (logical === null ? "" : logical.join(","));
        if (this.keys[i] === key) continue;
        this.keys[i] = key;
        const cell = this.cells[i];
        let cls = "cell";
        if (held) cls += ref > 1 ? " held shared" : " held";
        else if (c === "C") cls += " cached";
        else if (c === "W") cls += " window";
        if (logical !== null) cls += " hl";
        cell.className = cls;
        if (held) cell.style.setProperty("--c", colour(holder));
        else cell.style.removeProperty("--c");
        cell.textContent = logical !== null ? logical.join(",") : (ref > 1 ? String(ref) : "");
        let tip = `block ${i}: `;
        if (held) tip += ref > 1 ? `shared by ${ref} sequences (${pool.shared[i].join(", ")})` : `held by sequence ${holder}`;
        else tip += { ".": "free", "C": "free, holds a cached prefix", "W": "free, left the sliding window" }[c];
        if (logical !== null) tip += `; logical block ${logical.join(", ")} of the sequence`;
        cell.title = tip;
      }
    }
  }

  const map = { replicas: [], hovered: null, last: null, snapshots: 0 };

  function ensureGrids(n) {
    while (map.replicas.length < n) {
      const box = document.createElement("div");
      const label = n > 1 ? `Replica ${map.replicas.length}: ` : "";
      $("pools").append(box);
      map.replicas.push({ box, device: new Grid(box, label + "Device pool", "device"), cpu: null });
    }
  }

  function tableOrder(seq) {
    const order = new Map();
    seq.table.forEach((block, logical) => {
      if (block < 0) return;                      // left the sliding window
      if (!order.has(block)) order.set(block, []);
      order.get(block).push(logical);
    });
    return order;
  }

  function render() {
    const snap = map.last;
    if (!snap) return;
    ensureGrids(snap.length);
    let used = 0, total = 0;
    const hovered = map.hovered;
    snap.forEach((rep, r) => {
      const grids = map.replicas[r];
      const seq = hovered && hovered.replica === r ? rep.seqs.find((s) => s.id === hovered.id) : null;
      const onCpu = seq && seq.state === "swapped";
      grids.device.draw(rep.device, seq && !onCpu ? tableOrder(seq) : null);
      if (rep.cpu) {
        if (!grids.cpu) grids.cpu = new Grid(grids.box, (snap.length > 1 ? `Replica ${r}: ` : "") + "CPU swap pool", "cpu");
        grids.cpu.draw(rep.cpu, seq && onCpu ? tableOrder(seq) : null);
      }
      used += rep.device.used;
      total += rep.device.blocks;
    });
    $("map-summary").textContent = `${used} of ${total} device blocks in use, block size ${snap[0].blockSize} tokens`;
    renderSeqs(snap);
    renderDetail(snap);
  }

  // --- the side list of sequences ---------------------------------------------------------------
  const rows = new Map();   // "replica:seq id" -> <li>
  function shortId(request) {
    const dash = request.lastIndexOf("-");
    const head = dash > 0 ? request.slice(0, dash) : request;
    return (head.length > 8 ? head.slice(0, 8) + "…" : head) + (dash > 0 ? request.slice(dash) : "");
  }
  function renderSeqs(snap) {
    const list = $("seq-list");
    const seen = new Set();
    let count = 0;
    const ordered = [];
    snap.forEach((rep, r) => {
      const byRequest = rep.seqs.slice().sort((a, b) =>
        a.request < b.request ? -1 : a.request > b.request ? 1 : a.sample - b.sample);
      byRequest.forEach((s) => ordered.push([r, s]));
    });
    for (const [r, s] of ordered) {
      const key = r + ":" + s.id;
      seen.add(key);
      count++;
      let li = rows.get(key);
      if (!li) {
        li = document.createElement("li");
        li.dataset.seq = String(s.id);
        li.dataset.replica = String(r);
        const swatch = document.createElement("span");
        swatch.className = "swatch";
        swatch.style.setProperty("--c", colour(s.id));
        const req = document.createElement("span");
        req.className = "req";
        const state = document.createElement("span");
        const counts = document.createElement("span");
        counts.className = "counts";
        li.append(swatch, req, state, counts);
        li.addEventListener("mouseenter", () => { map.hovered = { replica: r, id: s.id }; render(); });
        li.addEventListener("mouseleave", () => {
          if (map.hovered && map.hovered.replica === r && map.hovered.id === s.id) map.hovered = null;
          render();
        });
        rows.set(key, li);
      }
      const [, req, state, counts] = li.children;
      req.textContent = shortId(s.request) + (s.sample ? ` #${s.sample}` : "");
      req.title = s.request;
      state.textContent = s.state;
      state.className = "state state-" + s.state;
      counts.textContent = `${s.prompt}+${s.output} tok, ${s.table.filter((b) => b >= 0).length} blk`;
      li.dataset.state = s.state;
      // the row marked is the one whose blocks the grids light up, drawn from the same snapshot: a row's own
      // enter and leave events can come out of turn when rows move under a still pointer
      li.classList.toggle("active", !!map.hovered && map.hovered.replica === r && map.hovered.id === s.id);
      list.append(li);   // moves it into order
    }
    for (const [key, li] of rows) {
      if (!seen.has(key)) {
        li.remove();
        rows.delete(key);
      }
    }
    $("seq-count").textContent = `(${count})`;
  }
  function renderDetail(snap) {
    const box = $("seq-detail");
    const h = map.hovered;
    const seq = h && snap[h.replica] && snap[h.replica].seqs.find((s) => s.id === h.id);
    if (!seq) {
      box.textContent = h ? "That sequence has ended." : "Hover a sequence to see its block table.";
      box.className = "muted";
      return;
    }
    box.className = "";
    const where = seq.state === "swapped" ? "CPU pool" : "device";
    const pool = seq.state === "swapped" ? snap[h.replica].cpu : snap[h.replica].device;
    const parts = seq.table.map((b, i) => {
      if (b < 0) return `${i}→(window)`;
      const ref = pool ? refCount(pool, b) : 1;
      return `${i}→${b}` + (ref > 1 ? `×${ref}` : "");
    });
    box.textContent = `sequence ${seq.id} of request ${seq.request} (sample ${seq.sample}): ${seq.state}, ` +
      `${seq.prompt} prompt + ${seq.output} output tokens; table (${where}, logical→block): ` +
      (parts.length ? parts.join(" ") : "no blocks");
  }

  // --- charts -----------------------------------------------------------------------------------
  const history = [];
  const CHARTS = [
    { canvas: "chart-queues", series: [["running", "#2f9e44"], ["waiting", "#e8a317"], ["swapped", "#7c4dcc"]] },
    { canvas: "chart-kv", series: [["device", "#2f6fdf"], ["cpu", "#7c4dcc"]], max: 100 },
    { canvas: "chart-tps", series: [["tokens/s", "#d9480f"]] },
    { canvas: "chart-preempt", series: [["recompute", "#c92a2a"], ["swap", "#7c4dcc"]] },
  ];
  function record(snap) {
    const now = Date.now();
    const sum = (f) => snap.reduce((acc, rep) => acc + f(rep.stats), 0);
    const devBlocks = snap.reduce((a, r) => a + r.device.blocks, 0);
    const cpuBlocks = snap.reduce((a, r) => a + (r.cpu ? r.cpu.blocks : 0), 0);
    const point = {
      t: now, running: sum((s) => s.running), waiting: sum((s) => s.waiting), swapped: sum((s) => s.swapped),
      device: 100 * snap.reduce((a, r) => a + r.device.used, 0) / Math.max(1, devBlocks),
      cpu: cpuBlocks ? 100 * snap.reduce((a, r) => a + (r.cpu ? r.cpu.used : 0), 0) / cpuBlocks : 0,
      generated: sum((s) => s.generated_tokens),
      recompute: sum((s) => s.preemptions.recompute), swap: sum((s) => s.preemptions.swap),
    };
    const prev = history[history.length - 1];
    point["tokens/s"] = prev && point.generated >= prev.generated
      ? (point.generated - prev.generated) / Math.max(0.001, (now - prev.t) / 1000) : 0;
    history.push(point);
    while (history.length && history[0].t < now - HISTORY_MS) history.shift();
  }
  function niceMax(v) {
    if (v <= 0) return 1;
    const p = Math.pow(10, Math.floor(Math.log10(v)));
    for (const m of [1, 2, 2.5, 5, 10]) if (m * p >= v) return m * p;
    return 10 * p;
  }
  function drawChart(spec) {
    const canvas = $(spec.canvas);
    const dpr = window.devicePixelRatio || 1;
    const w = canvas.clientWidth || 420, h = canvas.clientHeight || 150;
    if (canvas.width !== Math.round(w * dpr)) { canvas.width = Math.round(w * dpr); canvas.height = Math.round(h * dpr); }
    const ctx = canvas.getContext("2d");
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.clearRect(0, 0, w, h);
    const left = 40, right = 8, top = 16, bottom = 18;
    const now = history.length ? history[history.length - 1].t : Date.now();
    let top_ = spec.max || niceMax(Math.max(0, ...history.flatMap((p) => spec.series.map(([k]) => p[k]))));
    ctx.font = "10px system-ui, sans-serif";
    ctx.strokeStyle = "#e3e3e8";
    ctx.fillStyle = "#6b6b70";
    ctx.lineWidth = 1;
    for (let i = 0; i <= 4; i++) {
      const y = top + (h - top - bottom) * i / 4;
      ctx.beginPath(); ctx.moveTo(left, y); ctx.lineTo(w - right, y); ctx.stroke();
      const v = top_ * (1 - i / 4);
      ctx.fillText(v >= 100 ? v.toFixed(0) : +v.toFixed(2) + "", 2, y + 3);
    }
    ["-5m", "-4m", "-3m", "-2m", "-1m", "now"].forEach((label, i) => {
      ctx.fillText(label, left + (w - left - right) * i / 5 - (i === 5 ? 18 : 6), h - 4);
    });
    const x = (t) => left + (w - left - right) * (1 - (now - t) / HISTORY_MS);
    const y = (v) => top + (h - top - bottom) * (1 - Math.min(v, top_) / top_);
    let legendX = left;
    for (const [key, col] of spec.series) {
      ctx.strokeStyle = col;
      ctx.lineWidth = 1.5;
      ctx.beginPath();
      history.forEach((p, i) => (i ? ctx.lineTo(x(p.t), y(p[key])) : ctx.moveTo(x(p.t), y(p[key]))));
      ctx.stroke();
      const last = history.length ? history[history.length - 1][key] : 0;
      const text = `${key} ${Number.isInteger(last) ? last : last.toFixed(1)}`;
      ctx.fillStyle = col;
      ctx.fillText(text, legendX, 10);
      legendX += ctx.measureText(text).width + 12;
    }
  }
  function drawCharts() { CHARTS.forEach(drawChart); }

  // --- polling ----------------------------------------------------------------------------------
  let paused = false, pollTimer = null, lastPoll = 0, inFlight = false;
  async function refresh() {
    if (inFlight) return;
    inFlight = true;
    lastPoll = Date.now();
    try {
      const resp = await call("/debug/kv/blocks");
      if (!resp.ok) throw new Error(await errorText(resp));
      const body = await resp.json();
      map.last = (body.replicas || [body]).map(decode);
      record(map.last);
      render();
      drawCharts();
      map.snapshots++;
      $("map-panel").dataset.snapshots = String(map.snapshots);
      setStatus(paused ? "paused" : "live", paused ? "" : "ok");
    } catch (e) {
      if (!(e instanceof AuthError)) setStatus("no answer: " + e.message, "bad");
    } finally {
      inFlight = false;
    }
  }
  function schedulePoll(delay) {
    clearTimeout(pollTimer);
    pollTimer = setTimeout(async () => {
      if (paused || (auth.needed && !auth.key)) return;
      await refresh();
      if (!paused && !(auth.needed && !auth.key)) {
        schedulePoll(Math.max(0, POLL_MS - (Date.now() - lastPoll)));   // starts at least POLL_MS apart
      }
    }, delay);
  }
  $("pause").addEventListener("click", () => {
    paused = !paused;
    $("pause").setAttribute("aria-pressed", String(paused));
    $("pause").textContent = paused ? "Resume" : "Pause";
    $("step").disabled = !paused;
    setStatus(paused ? "paused" : "live", paused ? "" : "ok");
    if (!paused) schedulePoll(Math.max(0, POLL_MS - (Date.now() - lastPoll)));
  });
  $("step").addEventListener("click", () => {
    if (Date.now() - lastPoll >= POLL_MS) refresh();   // stepping obeys the same 2 Hz
    else setTimeout(refresh, POLL_MS - (Date.now() - lastPoll));
  });
  window.addEventListener("resize", drawCharts);

  async function loadVersion() {
    try {
      const resp = await call("/version");
      if (!resp.ok) return;
      const v = await resp.json();
      $("model").textContent = `${v.model} on ${v.device} (${v.dtype})`;
    } catch (e) { /* shown by the status line */ }
  }

  // --- the playground ---------------------------------------------------------------------------
  let conversation = [];
  let controller = null;
  function el(tag, cls, text) {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined) e.textContent = text;
    return e;
  }
  function scrollLog() { const log = $("chat-log"); log.scrollTop = log.scrollHeight; }
  function numberField(id, min, max, integer) {
    const v = Number($(id).value);
    if (!Number.isFinite(v) || v < min || v > max || (integer && !Number.isInteger(v))) {
      throw new Error(`${id.replace("-", "_")} must be ${integer ? "an integer" : "a number"} from ${min} to ${max}`);
    }
    return v;
  }
  function requestBody() {
    const body = {
      messages: conversation.slice(), stream: true, return_token_ids: true,
      temperature: numberField("temperature", 0, 2, false), top_p: numberField("top-p", 0.01, 1, false),
      max_tokens: numberField("max-tokens", 1, 1e9, true), n: numberField("n", 1, 16, true),
    };
    const schemaText = $("schema").value.trim();
    if (schemaText) {
      let schema;
      try { schema = JSON.parse(schemaText); } catch (e) { throw new Error("the JSON schema is not JSON: " + e.message); }
      body.response_format = { type: "json_schema", json_schema: { name: "playground", schema, strict: true } };
    }
    return body;
  }
  function answerBox(parent, index, n) {
    const box = el("div", "answer");
    if (n > 1) box.append(el("div", "who", `choice ${index}`));
    const text = el("div", "text", "");
    const stats = el("div", "stats", "waiting for the first token…");
    box.append(text, stats);
    parent.append(box);
    return { text, stats, tokens: 0, first: null, last: null, finish: null };
  }
  function showStats(a, sent) {
    if (a.first === null) { a.stats.textContent = a.finish ? `no tokens (${a.finish})` : "waiting for the first token…"; return; }
    const ttft = a.first - sent;
    const span = (a.last - a.first) / 1000;
    const rate = a.tokens > 1 && span > 0 ? ((a.tokens - 1) / span).toFixed(1) + " tokens/s" : "– tokens/s";
    a.stats.textContent = `TTFT ${ttft.toFixed(0)} ms · ${a.tokens} tokens · ${rate}` + (a.finish ? ` · ${a.finish}` : "");
    a.stats.title = "tokens/s: tokens after the first, over the time since the first";
  }

  async function send(event) {
    event.preventDefault();
    $("chat-error").textContent = "";
    const content = $("chat-input").value;
    if (!content.trim() || controller) return;
    let body;
    conversation.push({ role: "user", content });
    try {
      body = requestBody();
    } catch (e) {
      conversation.pop();
      $("chat-error").textContent = e.message;
      return;
    }
    const log = $("chat-log");
    const user = el("div", "msg user");
    user.append(el("div", "who", "you"), el("div", "text", content));
    const turn = el("div", "msg assistant");
    const answersEl = el("div", "answers");
    turn.append(el("div", "who", "model"), answersEl);
    log.append(user, turn);
    $("chat-input").value = "";
    const answers = [];
    for (let i = 0; i < body.n; i++) answers.push(answerBox(answersEl, i, body.n));
    scrollLog();
    controller = new AbortController();
    $("send").disabled = true;
    $("stop").disabled = false;
    const sent = performance.now();
    turn.dataset.done = "false";
    try {
      const resp = await call("/v1/chat/completions", {
        method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body),
        signal: controller.signal,
      });
      if (!resp.ok) throw new Error(await errorText(resp));
      const reader = resp.body.getReader();
      const decoder = new TextDecoder();
      let buffer = "", done = false;
      while (!done) {
        const chunk = await reader.read();
        if (chunk.done) break;
        buffer += decoder.decode(chunk.value, { stream: true });
        let cut;
        while ((cut = buffer.indexOf("\n\n")) >= 0) {
          const event = buffer.slice(0, cut);
          buffer = buffer.slice(cut + 2);
          for (const line of event.split("\n")) {
            if (!line.startsWith("data: ")) continue;
            const data = line.slice(6);
            if (data === "[DONE]") { done = true; break; }
            const payload = JSON.parse(data);
            if (payload.error) throw new Error(payload.error.message || "the server failed");
            for (const choice of payload.choices || []) {
              const a = answers[choice.index];
              if (!a) continue;
              const now = performance.now();
              const delta = choice.delta || {};
              const ids = choice.token_ids || [];
              if (ids.length || delta.content) {
                if (a.first === null) a.first = now;
                a.last = now;
                a.tokens += ids.length;
              }
              if (delta.content) a.text.append(document.createTextNode(delta.content));
              if (choice.error) a.stats.classList.add("error");
              if (choice.finish_reason) a.finish = choice.finish_reason;
              showStats(a, sent);
            }
          }
          scrollLog();
        }
      }
      conversation.push({ role: "assistant", content: answers[0].text.textContent });
    } catch (e) {
      conversation.pop();   // the question stays on screen; it is not part of the context
      if (e.name === "AbortError") $("chat-error").textContent = "stopped";
      else $("chat-error").textContent = e instanceof AuthError ? "enter the API key, then send again" : e.message;
    } finally {
      answers.forEach((a) => showStats(a, sent));
      turn.dataset.done = "true";
      controller = null;
      $("send").disabled = false;
      $("stop").disabled = true;
    }
  }
  $("chat-form").addEventListener("submit", send);
  $("chat-input").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); $("chat-form").requestSubmit(); }
  });
  $("stop").addEventListener("click", () => controller && controller.abort());
  $("clear").addEventListener("click", () => { conversation = []; $("chat-log").replaceChildren(); });

  // --- start ------------------------------------------------------------------------------------
  drawCharts();
  keyReady().then(loadVersion);
  schedulePoll(0);
})();
