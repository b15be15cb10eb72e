// tbp view: wires the page's controls to the numbers embedded in #tbp-data (view.py).
"use strict";
const D = JSON.parse(document.getElementById("tbp-data").textContent);
const P = D.prompt;
const more = document.getElementById("more");

function draw(id, fig) {
  Plotly.newPlot(id, fig.data, fig.layout, {responsive: true, displaylogo: false});
}

function section(title, note) {
  const s = document.createElement("section");
  s.innerHTML = "<h2></h2><p class='note'></p>";
  s.querySelector("h2").textContent = title;
  s.querySelector("p").textContent = note || "";
  more.appendChild(s);
  return s;
}

function figureIn(parent, key) {
  const div = document.createElement("div");
  div.id = "fig-" + key;
  parent.appendChild(div);
  draw(div.id, D.figures[key]);
}

// "what to look for", under each chart that has a note (view.py's NOTES)
function noteAfter(element, key) {
  const p = document.createElement("p");
  p.className = "note look";
  p.textContent = D.notes[key];
  element.after(p);
}

const config = document.getElementById("config");
for (const [what, value] of D.about.config) {
  const tr = config.insertRow();
  tr.insertCell().textContent = what; tr.insertCell().textContent = value;
}
document.getElementById("about").textContent =
  `runs: ${D.about.runs.join(", ")} · ${D.about.model} · ${D.about.prompt_tokens} prompt tokens`;
for (const key of ["curves", "grad_norm", "update_ratio", "stream_rms"]) {
  if (D.figures[key]) { draw("fig-" + key, D.figures[key]); noteAfter(document.getElementById("fig-" + key), key); }
  else document.getElementById("fig-" + key).textContent = key === "curves" ? "" :
    "(no per-layer statistics in this run's metrics: it was trained before they were recorded)";
}

// --- attention: a map per layer and head; the cross-attention of an encoder-decoder -------------
const cross = P.cross !== undefined;
const maps = cross ? P.cross.maps : P.attention;           // L x H x rows x keys
const keys = cross ? P.cross.source : P.tokens;            // the tokens a row reads
const rows = cross ? P.cross.target : P.tokens;            // the tokens whose rows they are
const layerSel = document.getElementById("layer"), headSel = document.getElementById("head");
maps.forEach((_, l) => layerSel.add(new Option(String(l), String(l))));
layerSel.value = String(maps.length - 1);
maps[0].forEach((_, h) => headSel.add(new Option(String(h), String(h))));
headSel.add(new Option("mean of heads", "mean"));

function current() {
  const L = maps[Number(layerSel.value)];
  if (headSel.value !== "mean") return L[Number(headSel.value)];
  return L[0].map((row, r) => row.map((_, c) => L.reduce((s, m) => s + m[r][c], 0) / L.length));
}

const strip = document.getElementById("tokens");
function label(t) { return t.replace(/\n/g, "⏎").replace(/\t/g, "⇥") || "∅"; }
// Plotly renders a subset of HTML in tick labels: a token is shown as text, its <, > and & as entities
function plotText(t) { return label(t).replace(/ /g, "␣").replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;"); }
function makeStrip() {
  strip.innerHTML = "";
  const add = (tok, i, kind) => {
    const span = document.createElement("span");
    span.textContent = label(tok);
    span.dataset.index = String(i);
    span.dataset.kind = kind;
    span.dataset.weight = "";
    strip.appendChild(span);
    span.addEventListener("mouseenter", () => focus(kind, i));
  };
  if (cross) {
    keys.forEach((t, i) => add(t, i, "key"));
    strip.appendChild(document.createElement("br"));
    rows.forEach((t, i) => add(t, i, "row"));
  } else {
    keys.forEach((t, i) => add(t, i, "both"));
  }
}

function shade(span, w, rgb) {
  span.dataset.weight = w.toFixed(6);
  span.style.background = w > 0 ? `rgba(${rgb},${Math.sqrt(w).toFixed(4)})` : "";
}

function focus(kind, i) {
  const M = current();
  for (const span of strip.children) {
    if (span.tagName !== "SPAN") continue;
    const j = Number(span.dataset.index), k = span.dataset.kind;
    span.classList.toggle("focus", k === kind && j === i);
    span.dataset.role = "";
    if (kind !== "key" && k !== "row" && (cross || j <= i)) {       // what row i reads: M[i][j]
      shade(span, M[i][j], "31,119,180"); span.dataset.role = "read";
    } else if (kind !== "row" && k !== "key" && (cross || j > i)) {  // what reads key i: M[j][i]
      shade(span, M[j][i], "255,127,14"); span.dataset.role = "reader";
    } else {
      shade(span, 0, "0,0,0");
    }
  }
  // the hovered token's row of the map (a key's: its column), outlined
  const rect = kind === "key" ? {x0: i - 0.5, x1: i + 0.5, y0: -0.5, y1: rows.length - 0.5}
                              : {x0: -0.5, x1: keys.length - 0.5, y0: i - 0.5, y1: i + 0.5};
  Plotly.relayout("fig-map", {shapes: [{type: "rect", xref: "x", yref: "y", ...rect,
                                        line: {color: "#d62728", width: 2}}]});
  const who = kind === "key" ? keys[i] : rows[i];
  document.getElementById("reading").textContent =
    `layer ${layerSel.value}, head ${headSel.value}: token ${i} ${JSON.stringify(who)}`;
}

function drawMap() {
  const M = current();
  markCurrent();
  draw("fig-map", {data: [{type: "heatmap", z: M, colorscale: "Blues", reversescale: true, x: keys.map((_, i) => i),
                           y: rows.map((_, i) => i),
                           hovertemplate: "row %{y} → key %{x}: %{z}<extra></extra>"}],
                   layout: {title: {text: `${cross ? "cross-attention" : "attention"} · layer ${layerSel.value} · head ${headSel.value}`},
                            height: Math.max(360, 18 * rows.length + 160),
                            xaxis: {tickvals: keys.map((_, i) => i), ticktext: keys.map(plotText), title: {text: "key"}},
                            yaxis: {tickvals: rows.map((_, i) => i), ticktext: rows.map(plotText), autorange: "reversed",
                                    title: {text: "query"}}}});
}

// --- the overview: every layer x head map in small, drawn on canvases; a click opens it above ---
const overview = document.getElementById("overview");
document.getElementById("note-overview").textContent = D.notes.overview;
overview.style.gridTemplateColumns = `repeat(${Math.min(maps[0].length, 8)}, minmax(60px, 120px))`;
function paint(canvas, M) {
  canvas.width = M[0].length; canvas.height = M.length;           // one pixel per weight, scaled by CSS
  const ctx = canvas.getContext("2d"), img = ctx.createImageData(canvas.width, canvas.height);
  M.forEach((row, r) => row.forEach((w, c) => {
    const i = 4 * (r * canvas.width + c), a = Math.sqrt(Math.max(w, 0));   // the strip's square-root shade
    img.data[i] = 255 - a * 224; img.data[i + 1] = 255 - a * 136; img.data[i + 2] = 255 - a * 75; img.data[i + 3] = 255;
  }));
  ctx.putImageData(img, 0, 0);
}
maps.forEach((L, l) => L.forEach((M, h) => {
  const fig = document.createElement("figure");
  fig.dataset.layer = String(l); fig.dataset.head = String(h);
  const canvas = document.createElement("canvas"), cap = document.createElement("figcaption");
  cap.textContent = `layer ${l} · head ${h}`;
  fig.append(canvas, cap);
  overview.appendChild(fig);
  paint(canvas, M);
  fig.addEventListener("click", () => {
    layerSel.value = String(l); headSel.value = String(h);
    drawMap();
    document.getElementById("fig-map").scrollIntoView({block: "center"});
  });
}));
function markCurrent() {
  for (const f of overview.children)
    f.classList.toggle("current", f.dataset.layer === layerSel.value && f.dataset.head === headSel.value);
}

layerSel.addEventListener("change", drawMap);
headSel.addEventListener("change", drawMap);
makeStrip();
drawMap();

if (D.figures.kept) {
  const s = section("Sparse decoding: kept positions",
    "Row t: the cached positions the layers after the selection layer attend to when decoding token t.");
  figureIn(s, "kept"); noteAfter(s.lastChild, "kept");
}
// what each design draws of itself (view.py's sections, from its declaration's draw)
for (const d of D.sections) {
  const s = section(d.title, d.caption);
  d.charts.forEach(k => figureIn(s, k));
  const p = document.createElement("p");
  p.className = "note look";
  p.textContent = d.look_for;
  s.lastChild.after(p);
}
