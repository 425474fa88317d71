// The dashboard page: polls /api/state every 2 s and renders it. Every string in the snapshot comes
// from strangers' DHT records, so text is only ever set with textContent (never parsed as HTML), and SVG
// attributes get numbers only.
"use strict";

const SVG_NS = "http://www.w3.org/2000/svg";
const COLORS = ["#0b57d0", "#d93025", "#188038", "#e37400", "#8430ce", "#007b83", "#b80672", "#5f6368"];
const $ = (id) => document.getElementById(id);

function text(id, value) { $(id).textContent = value === null || value === undefined ? "-" : String(value); }
function num(value, digits) {
  return typeof value === "number" && isFinite(value) ? value.toFixed(digits) : "-";
}
function short(peerId) { return typeof peerId === "string" ? "…" + peerId.slice(-12) : "-"; }

function cell(row, value, cls) {
  const td = document.createElement("td");
  td.textContent = value === null || value === undefined ? "-" : String(value);
  if (cls) td.className = cls;
  row.appendChild(td);
  return td;
}

function fillTable(id, rows, render) {
  const body = $(id).querySelector("tbody");
  const fresh = document.createElement("tbody");
  for (const item of rows) {
    const tr = document.createElement("tr");
    render(tr, item);
    fresh.appendChild(tr);
  }
  body.replaceWith(fresh);
}

function renderPeers(peers) {
  fillTable("peers", peers, (tr, p) => {
    tr.className = "peer-row";
    const id = cell(tr, short(p.peer_id), "l");
    id.title = String(p.peer_id);
    const state = cell(tr, p.state + (p.client ? " (client)" : ""), "l");
    state.classList.add("state-" + String(p.state).replace(/[^a-z]/g, ""));
    // for the active job: fit, or why not (its own word, or a plugin the job needs that it lacks)
    const fit = cell(tr, p.unfit === null || p.unfit === undefined ? "-" : p.unfit ? "unfit: " + p.unfit : "fit", "l");
    fit.classList.add(p.unfit ? "unfit" : "fit");
    cell(tr, num(p.gflops, 1)); cell(tr, num(p.mem_gb, 1));
    cell(tr, num(p.up_mbps, 0)); cell(tr, num(p.down_mbps, 0)); cell(tr, num(p.rtt_ms, 1));
    cell(tr, p.epoch); cell(tr, p.cluster === null ? "-" : p.cluster + "/" + p.stage);
    cell(tr, num(p.age_s, 0)); cell(tr, p.device, "l"); cell(tr, p.version, "l");
    cell(tr, plugins(p), "l plugins");
  });
}

function plugins(p) {
  const models = Array.isArray(p.plugin_models) ? p.plugin_models.map(String) : [];
  const datasets = Array.isArray(p.plugin_datasets) ? p.plugin_datasets.map(String) : [];
  const parts = [];
  if (models.length) parts.push("models: " + models.join(", "));
  if (datasets.length) parts.push("data: " + datasets.join(", "));
  return parts.length ? parts.join("; ") : "built-ins only";
}

function renderPlan(plan) {
  text("plan-epoch", plan.epoch); text("clusters-epoch", plan.epoch);
  text("plan-agree", plan.digest
    ? plan.agree + "/" + plan.published + " peers agree on plan " + plan.digest
    : "no plan published");
  fillTable("clusters", plan.clusters, (tr, c) => {
    tr.className = "cluster-row";
    cell(tr, c.cluster);
    cell(tr, c.stages.map((s) => s.stage + ": " + short(s.peer_id)).join("  →  "), "l");
  });
}

function renderJob(job, peers) {
  if (!job) {
    text("job-id", "none"); text("job-desc", "no job published"); text("job-progress", "-");
    text("job-mode", "-"); text("job-unfit", "");
    text("job-max", ""); text("job-state", "-"); fillTable("job-clusters", [], () => {});
    return;
  }
  text("job-id", job.job_id);
  text("job-desc", job.model + " on " + job.dataset + ", batch " + job.batch_size);
  text("job-mode", job.mode);
  const unfit = (peers || []).filter((p) => p.unfit).length;
  text("job-unfit", unfit ? unfit + " peer" + (unfit > 1 ? "s" : "") + " unfit for it (see Peers)" : "");
  const steps = job.micro_batches !== null ? job.micro_batches
    : Math.max(0, ...job.clusters.map((c) => c.step));
  text("job-progress", steps);
  text("job-max", job.max_steps ? "of " + job.max_steps : "");
  text("job-state", job.done ? "done" : job.ended ? "ended: " + (job.reason || "") : "training");
  fillTable("job-clusters", job.clusters, (tr, c) => {
    tr.className = "job-cluster-row";
    cell(tr, c.cluster); cell(tr, c.num_stages); cell(tr, c.step); cell(tr, num(c.samples_per_s, 0));
    cell(tr, num(c.loss, 3));
    cell(tr, typeof c.eval_accuracy === "number" ? (100 * c.eval_accuracy).toFixed(1) + " %" : "-");
    cell(tr, c.averaging_rounds); cell(tr, c.done ? "done" : "training", "l");
  });
}

function renderAveraging(avg, stages) {
  text("averaging-summary", stages.length
    ? "rounds " + avg.min_rounds + "–" + avg.max_rounds + " across stages; slowest last round "
      + num(avg.slowest_round_s, 2) + " s; fewest joined " + (avg.min_participants ?? "-")
      + "; " + num(avg.mb_sent, 1) + " MB sent"
    : "no stage metrics yet");
  fillTable("averaging", stages, (tr, s) => {
    tr.className = "averaging-row";
    cell(tr, s.cluster); cell(tr, s.stage); cell(tr, short(s.peer_id), "l"); cell(tr, s.averaging_rounds);
    cell(tr, s.last_round); cell(tr, num(s.last_round_s, 2)); cell(tr, s.last_round_participants);
    cell(tr, num(s.averaging_mb_sent, 1)); cell(tr, num(s.age_s, 0));
    const state = cell(tr, s.failed ? "failed: " + s.failed : s.done ? "done" : "training", "l");
    if (s.failed) state.classList.add("err");
  });
}

function svgEl(name, attrs) {
  const el = document.createElementNS(SVG_NS, name);
  for (const [key, value] of Object.entries(attrs)) el.setAttribute(key, String(value));
  return el;
}

// series: [{label, points: [[x, y], ...]}]; draws axes, ticks at the ends and one polyline per series
function plot(id, series) {
  const svg = $(id);
  while (svg.firstChild) svg.removeChild(svg.firstChild);
  const w = Number(svg.getAttribute("width")), h = Number(svg.getAttribute("height"));
  const m = { l: 48, r: 10, t: 10, b: 28 };
  const all = series.flatMap((s) => s.points).filter((p) => isFinite(p[0]) && isFinite(p[1]));
  if (!all.length) {
    const t = svgEl("text", { x: w / 2, y: h / 2, "text-anchor": "middle", fill: "#5a6472" });
    t.textContent = "no data yet";
    svg.appendChild(t);
    return;
  }
  let x0 = Math.min(...all.map((p) => p[0])), x1 = Math.max(...all.map((p) => p[0]));
  let y0 = Math.min(0, ...all.map((p) => p[1])), y1 = Math.max(...all.map((p) => p[1]));
  if (x1 === x0) x1 = x0 + 1;
  if (y1 === y0) y1 = y0 + 1;
  const sx = (x) => m.l + ((x - x0) / (x1 - x0)) * (w - m.l - m.r);
  const sy = (y) => h - m.b - ((y - y0) / (y1 - y0)) * (h - m.t - m.b);
  svg.appendChild(svgEl("line", { x1: m.l, y1: h - m.b, x2: w - m.r, y2: h - m.b, stroke: "#9aa0a6" }));
  svg.appendChild(svgEl("line", { x1: m.l, y1: m.t, x2: m.l, y2: h - m.b, stroke: "#9aa0a6" }));
  const label = (x, y, value, anchor, fill) => {
    const t = svgEl("text", { x: x, y: y, "text-anchor": anchor, "font-size": 11, fill: fill || "#5a6472" });
    t.textContent = value;
    svg.appendChild(t);
  };
  label(m.l, h - 8, num(x0, 0), "start"); label(w - m.r, h - 8, num(x1, 0), "end");
  label(m.l - 4, h - m.b, num(y0, 2), "end"); label(m.l - 4, m.t + 10, num(y1, 2), "end");
  series.forEach((s, i) => {
    const pts = s.points.filter((p) => isFinite(p[0]) && isFinite(p[1]));
    if (!pts.length) return;
    const color = COLORS[i % COLORS.length];
    svg.appendChild(svgEl("polyline", {
      points: pts.map((p) => sx(p[0]).toFixed(1) + "," + sy(p[1]).toFixed(1)).join(" "),
      fill: "none", stroke: color, "stroke-width": 1.8, class: "series",
    }));
    label(w - m.r, m.t + 12 + 13 * i, s.label, "end", color);
  });
}

function renderPlots(history) {
  const clusters = Object.keys(history).sort((a, b) => Number(a) - Number(b));
  plot("loss-plot", clusters.map((c) => ({
    label: "cluster " + Number(c),
    points: history[c].filter((p) => p.loss !== null).map((p) => [p.loss_step, p.loss]),
  })));
  plot("rate-plot", clusters.map((c) => ({
    label: "cluster " + Number(c),
    points: history[c].map((p) => [p.t, p.samples_per_s]),
  })));
}

function render(state) {
  text("run-id", state.run_id);
  text("error", state.error || "");
  if (state.loading) { text("updated", "loading…"); return; }
  text("updated", new Date(state.time * 1000).toLocaleTimeString() + " (read " + state.reads + ")");
  text("num-peers", state.num_peers);
  renderPeers(state.peers || []);
  renderPlan(state.plan);
  renderJob(state.job, state.peers);
  renderAveraging(state.averaging, state.stages || []);
  renderPlots(state.history || {});
  document.body.dataset.reads = String(state.reads);
}

async function poll() {
  try {
    const response = await fetch("/api/state", { cache: "no-store" });
    render(await response.json());
  } catch (err) {
    text("error", "dashboard unreachable: " + err);
  }
  setTimeout(poll, 2000);
}
poll();
