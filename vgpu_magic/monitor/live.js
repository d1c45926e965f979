// The live memory view, drawn by the browser (an anywidget: see live.py).
//
// The kernel sends only new rows of the trace as custom messages
// ({rows: [[t, cur0, peak0, cur1, peak1, ...], ...], reset: bool}); the
// series, their groups, units, epoch marks and the title are synced traits.
// Rows are kept per model (not per view), so every view of the widget shows
// the whole run: anywidget hands initialize() and render() different proxies
// of one model, so they meet in a store under the model's own `key` trait.
// Rows are bounded: past MAX_ROWS, neighbouring rows merge into their maxima.
//
// Colours: text, axes and grid come from the front end's theme variables, so
// the view follows JupyterLab's and Notebook 7's light and dark themes; each
// series has a colour for light themes and one for dark ones (the body's
// data-jp-theme-light says which), each 4.5:1 or more against its background.
// Series that read the same so far are one line, labelled "A…C, same": the
// kernel groups them (the `groups` trait: [label, [series...]] per line, as
// the final image groups them), each panel's lines in turn.

const MAX_ROWS = 6000;
const STORES = new Map();
const TRAITS = ["series", "groups", "units", "marks", "title", "note"];
const PANELS = [
  ["device", "device memory"],
  ["process", "process RSS"],
];
const W = 720, LEFT = 62, RIGHT = 14, TOP = 20, BOTTOM = 26, PANEL_H = 150;
const TEXT = "var(--jp-ui-font-color1, #6b6b6b)";
const MUTED = "var(--jp-ui-font-color2, #777777)";
const GRID = "var(--jp-border-color2, rgba(127, 127, 127, 0.35))";
const AXIS = "var(--jp-border-color1, #8a8a8a)";
const FONT = "var(--jp-ui-font-family, system-ui, sans-serif)";
// The lines of one panel, in turn: series that differ somewhere but overlap elsewhere stay apart by
// their dashes, never by moving them (as the final image).
const DASHES = ["", "7,3", "2,2", "7,3,2,3"];

function store(model) {
  const key = model.get("key");
  let s = STORES.get(key);
  if (!s) {
    s = { t: [], values: [], redraw: new Set() };
    STORES.set(key, s);
  }
  return s;
}

function thin(s) {
  // Halve the rows: each pair becomes its later time and the maxima.
  const t = [], values = s.values.map(() => []);
  for (let i = 0; i + 1 < s.t.length; i += 2) {
    t.push(s.t[i + 1]);
    s.values.forEach((v, k) => values[k].push(Math.max(v[i], v[i + 1])));
  }
  if (s.t.length % 2) {
    t.push(s.t[s.t.length - 1]);
    s.values.forEach((v, k) => values[k].push(v[v.length - 1]));
  }
  s.t = t;
  s.values = values;
}

function receive(model, msg) {
  if (!msg || !msg.rows) return;
  const s = store(model);
  if (msg.reset) {
    s.t = [];
    s.values = [];
  }
  for (const row of msg.rows) {
    while (s.values.length < row.length - 1) s.values.push(new Array(s.t.length).fill(0));
    s.t.push(row[0]);
    for (let k = 1; k < row.length; k++) s.values[k - 1].push(row[k]);
  }
  if (s.t.length > MAX_ROWS) thin(s);
  for (const redraw of s.redraw) redraw();
}

function niceCeil(x) {
  if (!(x > 0)) return 1;
  const p = Math.pow(10, Math.floor(Math.log10(x)));
  for (const m of [1, 2, 2.5, 5, 10]) if (m * p >= x * 0.9999) return m * p;
  return 10 * p;
}

function tickStep(x) {
  // 1, 2 or 5 times a power of ten: tick labels stay exact with few digits.
  const p = Math.pow(10, Math.floor(Math.log10(x)));
  for (const m of [1, 2, 5]) if (m * p >= x * 0.9999) return m * p;
  return 10 * p;
}

// The y-axis, in the panel's unit: [bottom, top, tick step], both ends on a tick. A process's memory starts far
// from 0 (the interpreter, its imports), so from 0 its growth would look flat: its axis fits its readings, from the
// lowest non-zero one (a rank that ended reads 0), as the final image's; device memory is drawn from 0. The top
// only grows during a run, so the scale does not jitter (the lowest reading only falls).
function yRange(top, low, fromZero, state) {
  const fitted = !fromZero && low <= top;
  const span = fitted ? Math.max(top - low, 0.05 * top) : top;
  const lo = fitted ? Math.max(0, low - 0.15 * span) : 0;
  const hi = Math.max(top + 0.08 * span, state.ymax || 0);
  const step = tickStep((hi - lo) / 4);
  state.ymax = Math.ceil(hi / step - 1e-9) * step;
  return [Math.floor(lo / step + 1e-9) * step, state.ymax, step];
}

function ticks(lo, top, step) {
  const out = [];
  for (let i = 0; lo + i * step <= top * 1.0001; i++) out.push(lo + i * step);
  return out;
}

function fmt(v) {
  if (v === 0) return "0";
  if (Math.abs(v) >= 100) return v.toFixed(0);
  if (Math.abs(v) >= 10) return v.toFixed(1).replace(/\.0$/, "");
  return v.toFixed(2).replace(/0+$/, "").replace(/\.$/, "");
}

function esc(text) {
  return String(text).replace(/[&<>"]/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;" })[c]);
}

function stepPath(t, v, x, y) {
  if (!t.length) return "";
  let d = `M${x(t[0]).toFixed(1)},${y(v[0]).toFixed(1)}`;
  for (let i = 1; i < t.length; i++) d += `H${x(t[i]).toFixed(1)}V${y(v[i]).toFixed(1)}`;
  return d;
}

function drawPanel(s, series, indices, unit, title, marks, xmax, state, last, fromZero) {
  const [unitName, scale] = unit;
  if (state.unit !== unitName) {
    state.unit = unitName;
    state.ymax = 0;
  }
  let top = 0, low = Infinity;
  for (const k of indices) {
    const cur = s.values[2 * k] || [], peak = s.values[2 * k + 1] || [];
    for (const v of cur) {
      if (v > top) top = v;
      if (v > 0 && v < low) low = v;
    }
    for (const v of peak) if (v > top) top = v;
    if (series[k].cap) top = Math.max(top, series[k].cap);
  }
  // Never below 1 KiB: an allocator reporting nothing is drawn at zero on a sane scale.
  const [ymin, ymax, step] = yRange(Math.max(top, 1024) / scale, low / scale, fromZero, state);
  const h = PANEL_H + (last ? 14 : 0);
  const plotH = PANEL_H - TOP - BOTTOM;
  const x = (t) => LEFT + (t / xmax) * (W - LEFT - RIGHT);
  // A reading below the axis (a rank that ended) lies on its bottom.
  const y = (v) => TOP + plotH - Math.max(0, (v / scale - ymin) / (ymax - ymin)) * plotH;
  const out = [`<svg class="vgpu-live-panel" data-panel="${esc(title)}" data-ymin="${ymin}" data-ymax="${ymax}" `
    + `viewBox="0 0 ${W} ${h}" width="100%" style="max-width:${W}px;display:block;font-family:${FONT}" role="img" `
    + `aria-label="${esc(title)}">`];
  out.push(`<text x="${LEFT}" y="13" font-size="12" fill="${TEXT}">${esc(title)} (${unitName})</text>`);
  for (const v of ticks(ymin, ymax, step)) {
    const yy = y(v * scale).toFixed(1);
    out.push(`<line x1="${LEFT}" x2="${W - RIGHT}" y1="${yy}" y2="${yy}" stroke="${GRID}" stroke-width="1"/>`);
    out.push(`<text x="${LEFT - 6}" y="${yy}" font-size="11" fill="${MUTED}" text-anchor="end" dominant-baseline="middle">${fmt(v)}</text>`);
  }
  for (const v of ticks(0, xmax, tickStep(xmax / 4))) {
    const xx = x(v).toFixed(1);
    out.push(`<line x1="${xx}" x2="${xx}" y1="${TOP + plotH}" y2="${TOP + plotH + 4}" stroke="${AXIS}"/>`);
    out.push(`<text x="${xx}" y="${TOP + plotH + 16}" font-size="11" fill="${MUTED}" text-anchor="middle">${fmt(v)}</text>`);
  }
  if (last) {
    out.push(`<text x="${W - RIGHT}" y="${TOP + plotH + 30}" font-size="11" fill="${MUTED}" text-anchor="end">time (s)</text>`);
  }
  out.push(`<line x1="${LEFT}" x2="${W - RIGHT}" y1="${TOP + plotH}" y2="${TOP + plotH}" stroke="${AXIS}"/>`);
  out.push(`<line x1="${LEFT}" x2="${LEFT}" y1="${TOP}" y2="${TOP + plotH}" stroke="${AXIS}"/>`);
  // Epoch marks: a dotted line each; a label above the data, only where it runs neither into the
  // panel's title nor into the label before.
  let lastLabel = LEFT + 7 * (title.length + unitName.length + 3);
  for (const [t, epoch] of marks) {
    const xx = x(t);
    out.push(`<line class="vgpu-mark" x1="${xx.toFixed(1)}" x2="${xx.toFixed(1)}" y1="${TOP}" y2="${TOP + plotH}" stroke="${TEXT}" stroke-dasharray="2,3"/>`);
    if (xx - lastLabel >= 30) {
      out.push(`<text x="${(xx + 2).toFixed(1)}" y="${TOP - 3}" font-size="10" fill="${TEXT}">e${epoch + 1}</text>`);
      lastLabel = xx;
    }
  }
  for (const [j, k] of indices.entries()) {
    const colour = series[k].colour;
    const dash = DASHES[j % DASHES.length];
    if (series[k].cap) {
      const yy = y(series[k].cap).toFixed(1);
      out.push(`<line class="vgpu-cap" x1="${LEFT}" x2="${W - RIGHT}" y1="${yy}" y2="${yy}" stroke="${colour}" stroke-dasharray="6,4" stroke-width="1.2"/>`);
    }
    const peak = stepPath(s.t, s.values[2 * k + 1] || [], x, y);
    const cur = stepPath(s.t, s.values[2 * k] || [], x, y);
    out.push(`<path class="vgpu-peak" d="${peak}" fill="none" stroke="${colour}" stroke-dasharray="1,2" stroke-width="1.2"/>`);
    out.push(`<path class="vgpu-line" d="${cur}" fill="none" stroke="${colour}" stroke-width="1.8"`
      + `${dash ? ` stroke-dasharray="${dash}"` : ""}/>`);
  }
  out.push("</svg>");
  return out.join("");
}

function swatch(colour, dash) {
  return `<svg width="18" height="6"><line x1="0" x2="18" y1="3" y2="3" stroke="${colour}" stroke-width="2"`
    + `${dash ? ` stroke-dasharray="${dash}"` : ""}/></svg>`;
}

function legend(series, panels) {
  const item = (body) => `<span class="vgpu-legend-item" style="display:inline-flex;align-items:center;gap:4px;margin-right:14px;white-space:nowrap">${body}</span>`;
  const items = [];
  for (const [, , lines] of panels) {
    for (const [j, [label, [k]]] of lines.entries()) {
      const cap = series[k].cap_text ? ` · cap ${esc(series[k].cap_text)}` : "";
      items.push(item(swatch(series[k].colour, DASHES[j % DASHES.length]) + esc(label) + cap));
    }
  }
  items.push(item(swatch(TEXT, "1,2") + "running peak"));
  return items.join("");
}

function render({ model, el }) {
  const s = store(model);
  const root = document.createElement("div");
  root.className = "vgpu-live";
  root.style.cssText = `font-family:${FONT};font-size:12px;color:${TEXT};padding:4px 0;max-width:${W}px`;
  el.appendChild(root);
  const states = { device: {}, process: {} };
  let pending = false;
  let xmax = 10;

  function draw() {
    pending = false;
    const dark = document.body.dataset.jpThemeLight === "false";
    const series = (model.get("series") || []).map((x) => ({ ...x, colour: dark ? x.dark : x.color }));
    const units = model.get("units") || {};
    const marks = model.get("marks") || [];
    const tLast = s.t.length ? s.t[s.t.length - 1] : 0;
    while (tLast > xmax * 0.95) xmax = niceCeil(xmax * 2);
    // Each panel's lines; a group naming a series gone (the series just changed) waits for the new groups.
    const lines = (model.get("groups") || []).filter(([, [k]]) => series[k]);
    const panels = PANELS.map(([key, title]) => [key, title, lines.filter(([, [k]]) => series[k].panel === key)])
      .filter(([, , found]) => found.length);
    const parts = [`<div class="vgpu-live-title" style="font-weight:600;margin-bottom:2px">${esc(model.get("title") || "")}</div>`];
    parts.push(`<div class="vgpu-live-legend" style="font-size:11px;line-height:18px;margin-bottom:2px">${legend(series, panels)}</div>`);
    panels.forEach(([key, title, found], i) => {
      parts.push(drawPanel(s, series, found.map(([, [k]]) => k), units[key] || ["MiB", 1048576], title, marks, xmax, states[key], i === panels.length - 1,
        key === "device"));
    });
    const note = model.get("note");
    if (note) parts.push(`<div class="vgpu-live-note" style="font-size:11px;color:${MUTED};white-space:pre-line">${esc(note)}</div>`);
    root.innerHTML = parts.join("");
    root.dataset.rows = String(s.t.length);
  }

  function schedule() {
    if (!pending) {
      pending = true;
      requestAnimationFrame(draw);
    }
  }
  s.redraw.add(schedule);
  for (const name of TRAITS) model.on(`change:${name}`, schedule);
  // A theme switch redraws in the other theme's colours.
  const theme = new MutationObserver(schedule);
  theme.observe(document.body, { attributes: true, attributeFilter: ["data-jp-theme-light"] });
  draw();
  return () => {
    theme.disconnect();
    s.redraw.delete(schedule);
    for (const name of TRAITS) model.off(`change:${name}`, schedule);
  };
}

function initialize({ model }) {
  store(model);
  model.on("msg:custom", (msg) => receive(model, msg));
  return () => STORES.delete(model.get("key"));
}

export default { initialize, render };
