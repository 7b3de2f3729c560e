// minisgl's live page: draws the scheduler's snapshots (GET /dashboard/state, then the stream
// /dashboard/events). Plain JavaScript and SVG; the fields are documented in
// docs/ch30_dashboard.md. Everything is redrawn from each snapshot: the page keeps no state
// of its own, so what it shows is what the last snapshot said.
"use strict";

const query = window.location.search; // passed on, whatever the server asks of its clients
const SVG = "http://www.w3.org/2000/svg";
const KINDS = ["prefill", "decode", "verify"];
const STATES = { f: "free", r: "running", c: "cached", l: "locked" };
const STEPS_SHOWN = 200;
let latest = null;

const $ = (id) => document.getElementById(id);
const esc = (s) => String(s).replace(/[&<>"']/g, (c) => `&#${c.charCodeAt(0)};`);
const num = (x, digits = 0) => (x === null || x === undefined ? "–" : Number(x).toFixed(digits));

function draw(state) {
  if (latest && latest.seq === state.seq) return; // the stream's first event repeats the state
  latest = state;
  window.dashboardSeq = state.seq; // for tests: which snapshot is on the screen
  drawHeader(state);
  drawCounters(state);
  drawSteps(state.steps);
  drawRequests(state);
  drawPool(state.pool);
  drawTree(state.tree);
  drawGraphs(state);
  tick();
}

function drawHeader(s) {
  const e = s.engine;
  $("model").textContent = e.model;
  const graphs = e.decode_graphs.length ? `decode graphs [${e.decode_graphs.join(", ")}]` : "no graphs";
  $("engine").textContent =
    `${e.device} · ${e.dtype} · ${e.attention} attention · ${e.num_pages} KV pages of ` +
    `${e.page_size} tokens · up to ${e.max_running_requests} requests · prefill budget ` +
    `${e.max_prefill_length} tokens · ${graphs}${e.overlap ? " · overlap" : ""}` +
    `${e.speculative ? " · speculative" : ""}`;
}

function drawCounters(s) {
  const c = s.counters;
  const cards = [
    ["tokens-per-s", num(c.tokens_per_s, 1), "tokens/s out"],
    ["prefill-per-s", num(c.prefill_tokens_per_s, 0), "prompt tokens/s computed"],
    ["ttft", `${num(c.ttft_ms_p50)} / ${num(c.ttft_ms_p90)}`, "TTFT ms p50 / p90"],
    ["running", c.running, "running"],
    ["waiting", c.waiting, "waiting"],
    ["preemptions", c.preemptions_total, "preemptions"],
    ["cached-tokens", c.cached_tokens_total, "prompt tokens from the cache"],
    ["steps-total", c.steps_total, "steps recorded"],
  ];
  if (c.window_pages !== undefined) {
    // sliding layers with pages of their own (chapter 29): absent where they keep none
    cards.push(["window-pages", `${c.window_pages_in_use} + ${c.window_pages_idle} / ${c.window_pages}`,
                "windowed pages held + idle"]);
  }
  if (c.state_slots !== undefined) {
    // a hybrid model's recurrent states (chapter 31): absent for a model without linear layers
    cards.push(
      ["state-slots", `${c.state_slots_in_use} / ${c.state_slots}`, "state slots in use"],
      ["state-snapshots", `${c.state_snapshots_held} / ${c.state_snapshots}`, "state snapshots held"],
    );
  }
  $("counters").innerHTML = cards
    .map(([id, v, label]) => `<div class="counter"><b id="c-${id}">${esc(v)}</b><span>${label}</span></div>`)
    .join("");
}

function drawSteps(steps) {
  const n = Math.min(steps.step.length, STEPS_SHOWN);
  const from = steps.step.length - n;
  const W = 1000, top = 14, msH = 100, bsTop = 128, bsH = 44, w = W / STEPS_SHOWN;
  const ms = steps.ms.slice(from).filter((x) => x !== null);
  const maxMs = Math.max(1e-3, ...ms);
  const maxBs = Math.max(1, ...steps.padded.slice(from));
  const counts = Object.fromEntries(KINDS.map((k) => [k, 0]));
  let out = `<text class="axis" x="2" y="10">${num(maxMs, 1)} ms</text>` +
    `<text class="axis" x="2" y="${bsTop - 3}">batch ${maxBs}</text>`;
  for (let i = 0; i < n; i++) {
    const j = from + i, kind = steps.kind[j], x = (STEPS_SHOWN - n + i) * w;
    counts[kind] = (counts[kind] || 0) + 1;
    const t = steps.ms[j], h = t === null ? 0 : Math.max(1, (t / maxMs) * msH);
    const real = (steps.size[j] / maxBs) * bsH, padded = (steps.padded[j] / maxBs) * bsH;
    const tip = `step ${steps.step[j]} · ${kind} · ${steps.size[j]} requests` +
      (steps.graph[j] ? ` · graph of ${steps.padded[j]}` : " · eager") +
      ` · ${steps.tokens[j]} tokens` + (steps.chunks[j] ? ` · ${steps.chunks[j]} prompt chunk(s)` : "") +
      ` · ${t === null ? "…" : num(t, 2) + " ms"}`;
    out += `<g class="step" data-kind="${kind}" data-step="${steps.step[j]}"><title>${esc(tip)}</title>` +
      `<rect class="k-${kind}" x="${x}" y="${top + msH - h}" width="${w * 0.85}" height="${h}"/>` +
      `<rect class="k-${kind} pad" x="${x}" y="${bsTop + bsH - padded}" width="${w * 0.85}" height="${padded}"/>` +
      `<rect class="k-${kind}" x="${x}" y="${bsTop + bsH - real}" width="${w * 0.85}" height="${real}"/>` +
      (steps.graph[j] ? `<rect class="gmark" x="${x}" y="${bsTop + bsH + 4}" width="${w * 0.85}" height="5"/>` : "") +
      `</g>`;
  }
  $("steps").innerHTML = out;
  $("kinds").innerHTML = KINDS.map(
    (k) => `<span><i class="k-${k}" style="background:var(--${k})"></i>${k} <b id="kind-${k}">${counts[k]}</b></span>`
  ).join("") + `<span>of the last ${n} steps</span>`;
}

function bar(part, whole) {
  const pct = whole ? Math.min(100, (100 * part) / whole) : 0;
  return `<span class="bar"><i style="width:${pct}%"></i></span>`;
}

function drawRequests(s) {
  const spec = s.engine.speculative, text = s.engine.text;
  $("spec-col").style.display = spec ? "" : "none";
  $("text-col").style.display = text ? "" : "none";
  const rows = [...s.running, ...s.waiting, ...s.finished].map((r) => {
    const computed = r.computed_tokens === undefined ? "" :
      `${r.computed_tokens}${r.state === "prefilling" ? bar(r.computed_tokens, r.prompt_tokens) : ""}`;
    const out = `${r.output_tokens}${r.max_tokens ? " / " + r.max_tokens + bar(r.output_tokens, r.max_tokens) : ""}`;
    const pages = r.pages === undefined ? "" : `${r.pages}${r.shared_pages ? ` (${r.shared_pages} shared)` : ""}`;
    const words = text ? `<td class="text">${esc(r.prompt_text || "")}<b> → </b>${esc(r.output_text || "")}</td>` : "";
    const reason = r.reason ? ` (${r.reason})` : "";
    return `<tr class="${r.state}" data-id="${r.id}" data-state="${r.state}">` +
      `<td>${r.id}</td><td><span class="state state-${r.state}">${r.state}${reason}</span></td>` +
      `<td class="prompt">${r.prompt_tokens}</td><td class="cached">${r.cached_tokens ?? ""}</td>` +
      `<td class="computed">${computed}</td><td class="output">${out}</td>` +
      `<td class="pages">${pages}</td><td>${num(r.ttft_ms)}</td>` +
      `<td>${r.age_s ?? (r.latency_s !== undefined ? num(r.latency_s, 2) : "")}</td>` +
      (spec ? `<td>${r.spec_acceptance === undefined ? "" : num(r.spec_acceptance, 2)}</td>` : "") +
      words + `</tr>`;
  });
  document.querySelector("#requests tbody").innerHTML = rows.join("");
  const hidden = s.counters.waiting - s.waiting.length;
  $("more-waiting").textContent = hidden > 0 ? `and ${hidden} more waiting` : "";
}

function drawPool(pool) {
  const cells = pool.grid.length;
  const cols = Math.min(64, Math.max(16, Math.ceil(Math.sqrt(cells * 3))));
  const size = 12, gap = 2, rows = Math.ceil(cells / cols);
  const svg = $("pool");
  svg.setAttribute("viewBox", `0 0 ${cols * size} ${rows * size}`);
  svg.style.maxWidth = `${cols * (cells > 512 ? 14 : 24)}px`;
  let out = "";
  for (let i = 0; i < cells; i++) {
    const x = (i % cols) * size, y = Math.floor(i / cols) * size;
    out += `<rect class="pg pg-${pool.grid[i]}" x="${x}" y="${y}" width="${size - gap}" height="${size - gap}"/>`;
  }
  svg.innerHTML = out;
  $("pool-legend").innerHTML = Object.entries(STATES).map(
    ([, name]) => `<span><i style="background:var(--${name})"></i>${name} <b id="pool-${name}">${pool[name]}</b></span>`
  ).join("");
  $("pool-note").textContent = `${pool.pages} pages of ${pool.page_size} tokens` +
    (pool.cell_pages > 1 ? `; a cell is ${pool.cell_pages} pages, shown in the state most of them are in` : "; a cell is a page");
}

function drawTree(tree) {
  const nodes = tree.nodes, svg = $("tree");
  if (!nodes.length) {
    svg.innerHTML = "";
    $("tree-legend").textContent = "no radix cache (--cache naive)";
    return;
  }
  const kids = nodes.map(() => []);
  nodes.forEach((n) => n.parent !== null && kids[n.parent].push(n.id));
  const start = new Array(nodes.length).fill(0), rowOf = new Array(nodes.length);
  let rows = 0;
  const place = (id) => { // leaves get rows in order; a node spans the rows of its leaves
    if (!kids[id].length) { rowOf[id] = [rows, rows]; rows++; return; }
    kids[id].forEach((k) => { start[k] = start[id] + nodes[id].tokens; place(k); });
    rowOf[id] = [rowOf[kids[id][0]][0], rowOf[kids[id].at(-1)][1]];
  };
  place(0);
  const W = 1000, rowH = Math.max(6, Math.min(20, 380 / rows));
  const deepest = Math.max(1, ...nodes.map((n) => start[n.id] + n.tokens));
  const scale = (W - 40) / deepest;
  let out = "";
  for (const n of nodes.slice(1)) {
    const [r0, r1] = rowOf[n.id];
    const x = start[n.id] * scale, w = Math.max(2, n.tokens * scale), y = r0 * rowH, h = (r1 - r0 + 1) * rowH - 1;
    const kind = n.refs > 0 ? "locked" : "evictable";
    const used = n.last_used_s === null ? `over ${tree.clock_span_s} s ago (or before the page looked)` : `${n.last_used_s} s ago`;
    const tip = `${n.tokens} tokens (subtree ${n.subtree_tokens}) · ${n.refs} running request(s) hold it · ` +
      `${n.children} children${n.hidden_children ? `, ${n.hidden_children} not drawn` : ""} · last used ${used}` +
      (n.text !== undefined ? `\n${n.text}` : "");
    const label = w > 60 && h >= 10 ? `<text x="${x + 3}" y="${y + Math.min(h, rowH) / 2 + 3.5}">${n.tokens} tok${n.refs ? " · ref " + n.refs : ""}${n.text !== undefined && w > 160 ? " · " + esc(n.text.slice(0, Math.floor(w / 7) - 14)) : ""}</text>` : "";
    const more = n.hidden_children ? `<text x="${x + w + 2}" y="${y + Math.min(h, rowH) / 2 + 3.5}">+${n.hidden_children}</text>` : "";
    out += `<g class="node ${kind}" data-id="${n.id}" data-tokens="${n.tokens}" data-refs="${n.refs}" ` +
      `data-children="${n.children}" data-start="${start[n.id]}"><title>${esc(tip)}</title>` +
      `<rect x="${x}" y="${y}" width="${w}" height="${h}" rx="2"/>${label}${more}</g>`;
  }
  svg.setAttribute("viewBox", `0 0 ${W} ${rows * rowH}`);
  svg.innerHTML = out;
  $("tree-legend").innerHTML =
    `<span><i style="background:var(--locked)"></i>locked by running requests</span>` +
    `<span><i style="background:var(--cached)"></i>evictable</span>` +
    `<span><b id="tree-nodes">${tree.total_nodes}</b> nodes, <b id="tree-tokens">${tree.total_tokens}</b> tokens` +
    `${nodes.length - 1 < tree.total_nodes ? `, the largest ${nodes.length - 1} drawn` : ""}</span>`;
}

function drawGraphs(s) {
  const rows = s.graphs.filter((g) => g[0] !== "prefill" || g[3] > 0);
  document.querySelector("#graphs tbody").innerHTML = rows.map(([kind, bs, padded, hits, steps]) =>
    `<tr data-kind="${kind}" data-size="${bs}"><td>${kind}</td><td>${bs}</td><td>${hits ? padded : "eager"}</td>` +
    `<td class="hits">${hits}</td><td class="steps">${steps}</td><td>${num((100 * hits) / steps)}%</td></tr>`
  ).join("");
  $("graph-note").textContent = s.engine.decode_graphs.length ?
    "steps since the page looked, by batch size" : "none captured: every step runs eagerly";
}

function tick() {
  if (!latest) return;
  const age = Math.max(0, Date.now() / 1000 - latest.time);
  $("footer").textContent = `snapshot #${latest.seq}, ${num(age, 1)} s old` +
    (latest.engine.text ? " · showing text (--dashboard-text)" : "");
}

function status(text, cls) {
  const el = $("status");
  el.textContent = text;
  el.className = `status ${cls}`;
}

// With --api-key every data route wants `Authorization: Bearer KEY`. The page itself is
// served without one (it holds no data); it asks for the key when a route refuses, keeps it
// in this tab's sessionStorage only, and reads the event stream with fetch, which can send
// the header (EventSource cannot).
let key = sessionStorage.getItem("minisgl-key") || "";
const sleep = (ms) => new Promise((done) => setTimeout(done, ms));

function askKey(why) {
  const form = $("key-form");
  form.hidden = false;
  $("key-note").textContent = why;
  status("needs an API key", "down");
  return new Promise((done) => {
    form.onsubmit = (e) => {
      e.preventDefault();
      key = $("key").value.trim();
      sessionStorage.setItem("minisgl-key", key);
      form.hidden = true;
      done();
    };
  });
}

async function get(url) {
  for (;;) {
    const r = await fetch(url, { headers: key ? { Authorization: `Bearer ${key}` } : {} });
    if (r.status !== 401) return r;
    const body = await r.json().catch(() => ({}));
    await askKey(key ? "that key was refused" : (body.error || {}).message || "");
  }
}

function event(block) {
  // One server-sent event: its `event:` and its `data:` lines joined.
  const ev = { type: "message", data: [] };
  for (const line of block.split(/\r?\n/)) {
    const [field, ...rest] = line.split(":");
    const value = rest.join(":").replace(/^ /, "");
    if (field === "event") ev.type = value;
    else if (field === "data") ev.data.push(value);
  }
  return { type: ev.type, data: ev.data.join("\n") };
}

async function follow() {
  for (;;) {
    try {
      const r = await get(`/dashboard/events${query}`);
      if (!r.ok) throw new Error(`HTTP ${r.status}`);
      status("live", "live");
      const reader = r.body.pipeThrough(new TextDecoderStream()).getReader();
      let buf = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buf += value;
        let cut;
        while ((cut = buf.search(/\r?\n\r?\n/)) >= 0) {
          const ev = event(buf.slice(0, cut));
          buf = buf.slice(cut).replace(/^\r?\n\r?\n/, "");
          if (ev.type === "end") {
            status(`server stopped: ${JSON.parse(ev.data).error.message}`, "down");
            return;
          }
          if (ev.data) draw(JSON.parse(ev.data));
        }
      }
    } catch (e) {
      // the server went away or the stream broke: try again below
    }
    status("reconnecting…", "down");
    await sleep(2000);
  }
}

async function start() {
  setInterval(tick, 1000);
  try {
    const r = await get(`/dashboard/state${query}`);
    if (r.ok) draw(await r.json());
    else status(`state: HTTP ${r.status}`, "down");
  } catch (e) {
    status("server unreachable", "down");
  }
  follow();
}

start();
