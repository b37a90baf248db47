/* shardplan plan report, part 1 of 2: data, formatting, summary, cluster, stages, tensors
   and their tiling. html.py inlines report.js then report_figures.js inside one
   '(function () { "use strict"; ... }());', so nothing here is a global. Plain ES2017, no
   frameworks, nothing fetched. */

const D = JSON.parse(document.getElementById("plan-data").textContent);
const $ = (id) => document.getElementById(id);
const TENSOR_ROWS = 300;   // rows the tensor table shows at once ("N more" beyond)

// ------------------------------------------------------------------ formatting

function esc(value) {
  return String(value).replace(/[&<>"']/g, (c) => ({
    "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;"}[c]));
}

function fmtBytes(n) {
  if (n === null || n === undefined) return "-";
  const units = [["GiB", 1073741824], ["MiB", 1048576], ["KiB", 1024]];
  for (const [unit, scale] of units) {
    if (n >= scale) return (n / scale).toFixed(2) + " " + unit;
  }
  return n + " B";
}

function fmtMs(seconds) {
  if (seconds === null || seconds === undefined) return "-";
  const ms = seconds * 1e3;
  return (ms >= 10 ? ms.toFixed(1) : ms.toPrecision(4)) + " ms";
}

function plural(n, word, many) {
  return n + " " + (n === 1 ? word : (many || word + "s"));
}

function compressIds(ids) {
  const sorted = Array.from(new Set(ids)).sort((a, b) => a - b);
  const runs = [];
  for (const d of sorted) {
    if (runs.length && d === runs[runs.length - 1][1] + 1) runs[runs.length - 1][1] = d;
    else runs.push([d, d]);
  }
  return runs.map((r) => (r[0] === r[1] ? String(r[0]) : r[0] + "-" + r[1])).join(", ");
}

function formatSpec(spec) {
  const parts = spec.map((dim) => (dim.length === 0 ? "None"
    : dim.length === 1 ? "'" + dim[0] + "'" : "(" + dim.map((a) => "'" + a + "'").join(", ") + ")"));
  return "(" + parts.join(", ") + (parts.length === 1 ? ",)" : ")");
}

function stageColor(i) {
  return "hsl(" + ((i * 137.508) % 360).toFixed(1) + ", 58%, 64%)";
}

function section(id, title, body) {
  $(id).innerHTML = "<h2>" + esc(title) + "</h2>" + body;
}

// ------------------------------------------------------------------ decoded data

const stages = D.stages.map((s, i) => ({
  index: i, type: D.types[s[0]], axes: s[1], sizes: s[2], ids: s[3], remat: s[4],
  layers: s[5], replica: s[6], layout: s[7]}));

function meshCoords(sizes, flat) {
  const coords = new Array(sizes.length);
  let rest = flat;
  for (let k = sizes.length - 1; k >= 0; k--) {
    coords[k] = rest % sizes[k];
    rest = Math.floor(rest / sizes[k]);
  }
  return coords;
}

function describeCoords(st, coords) {
  return "(" + st.axes.map((a, k) => a + "=" + coords[k]).join(", ") + ")";
}

function fill(pattern, member) {
  if (typeof member !== "string") return member[0];
  const values = member === "" ? [] : member.split(",");
  let next = 0;
  return pattern.split("/").map((comp) => {
    if (comp === "*" || comp.endsWith("_*")) return comp.slice(0, -1) + values[next++];
    return comp;
  }).join("/");
}

const tensors = [];
D.tensors.groups.forEach((g) => {
  for (const member of g[7]) {
    tensors.push({path: fill(g[0], member), pattern: g[0], kind: g[1], stage: g[2],
      spec: D.tensors.specs[g[3]], dtype: g[4], shape: g[5], bytes: g[6]});
  }
});

// ------------------------------------------------------------------ summary

function renderSummary() {
  const s = D.summary;
  const rows = [
    ["plan", '<code title="' + esc(s.hash) + '">' + esc(s.id) + "</code> (shardplan " +
      esc(s.version) + ", solver " + esc(s.status || "-") + ")"],
    ["cluster", esc(s.cluster || "- (not recorded)")],
    ["stages", esc(plural(s.stages, "stage") + " in " + plural(s.replicas, "replica"))],
    ["devices", esc(plural(s.devices, "device") + " used of " + D.devices.length / 3)],
    ["schedule", esc(s.schedule + (s.chunks > 1 ? " (" + s.chunks + " chunks per stage)" : ""))],
    ["microbatches", esc(s.microbatches + (s.microbatch_size ? " of " + s.microbatch_size
      + " samples" : ""))],
    ["accumulation", esc(s.accumulation)],
    ["predicted step time", esc(fmtMs(s.step_time_s) + " (compute " + fmtMs(s.compute_s)
      + ", communication " + fmtMs(s.communication_s) + ")")],
  ];
  let body = '<dl class="kv">' + rows.map((r) => "<dt>" + r[0] + "</dt><dd>" + r[1] +
    "</dd>").join("") + "</dl>";
  if (s.notes.length) {
    body += "<h3>Notes</h3><ul>" + s.notes.map((n) => "<li>" + esc(n) + "</li>").join("") +
      "</ul>";
  }
  section("summary", "Summary", body);
}

// ------------------------------------------------------------------ cluster map

function renderCluster() {
  const where = {};
  for (const st of stages) {
    st.ids.forEach((d, flat) => { where[d] = [st, meshCoords(st.sizes, flat)]; });
  }
  const byType = D.types.map(() => []);
  for (let i = 0; i < D.devices.length; i += 3) {
    byType[D.devices[i + 1]].push([D.devices[i], D.devices[i + 2]]);
  }
  const big = D.devices.length / 3 <= 64;
  let body = '<p class="note">One box per device, coloured by its stage; grey: idle ' +
    "(the plan leaves it unused). Hover a box for its id, type, stage and mesh position.</p>";
  byType.forEach((devs, t) => {
    if (!devs.length) return;
    const idle = devs.filter((d) => d[1] < 0).length;
    const used = new Set(devs.filter((d) => d[1] >= 0).map((d) => d[1]));
    body += '<div class="devtype"><h3>' + esc(D.types[t]) + ": " +
      esc(plural(devs.length, "device")) + " (" + (devs.length - idle) + " in " +
      plural(used.size, "stage") + ", " + idle + " idle)</h3><div class=\"boxes\">";
    for (const [id, stage] of devs) {
      let title = "device " + id + " · " + D.types[t];
      let style = "";
      if (stage >= 0 && where[id]) {
        const [st, coords] = where[id];
        title += " · stage " + stage + " (replica " + st.replica + ") · mesh " +
          describeCoords(st, coords);
        style = ' style="background:' + stageColor(stage) + '"';
      } else {
        title += " · idle";
      }
      body += '<div class="dev' + (stage < 0 ? " idle" : "") + (big ? " big" : "") +
        '" data-device="' + id + '" title="' + esc(title) + '"' + style + ">" +
        (big ? id : "") + "</div>";
    }
    body += "</div></div>";
  });
  section("cluster", "Cluster", body);
}

// ------------------------------------------------------------------ stages

function renderStages() {
  let body = '<div class="scroll"><table><thead><tr><th>stage</th><th>replica</th>' +
    "<th>device type</th><th>mesh</th><th>devices</th><th>remat</th><th>layers</th>" +
    "</tr></thead><tbody>";
  for (const st of stages) {
    body += "<tr><td><span class=\"swatch\" style=\"background:" + stageColor(st.index) +
      '"></span>' + st.index + "</td><td>" + st.replica + "</td><td>" + esc(st.type) +
      "</td><td class=\"mono\">(" + esc(st.axes.map((a, k) => a + "=" + st.sizes[k])
      .join(", ")) + ")</td><td>" + st.ids.length + ": " + esc(compressIds(st.ids)) +
      "</td><td>" + esc(st.remat) + "</td><td class=\"mono\">" + esc(st.layers) +
      "</td></tr>";
  }
  section("stages", "Stages", body + "</tbody></table></div>");
}

// ------------------------------------------------------------------ tensors and tiling

let selected = -1;
let query = "";

function matcher(q) {
  if (!q) return () => true;
  const lower = q.toLowerCase();
  if (lower.indexOf("*") < 0) {
    return (t) => t.path.toLowerCase().includes(lower) || t.pattern.toLowerCase()
      .includes(lower);
  }
  const re = new RegExp(lower.split("*").map((p) => p.replace(/[.+?^${}()|[\]\\]/g,
    "\\$&")).join(".*"));
  return (t) => re.test(t.path.toLowerCase()) || re.test(t.pattern.toLowerCase());
}

function tensorRow(i) {
  const t = tensors[i];
  const shape = t.shape ? "[" + t.shape.join(", ") + "]" : "?";
  return '<tr data-i="' + i + '" aria-selected="' + (i === selected) + '"><td class="mono"' +
    ' title="pattern ' + esc(t.pattern) + '">' + esc(t.path) + "</td><td>" + esc(t.kind) +
    '</td><td class="mono">' + esc(shape) + "</td><td>" + esc(t.dtype || "?") +
    "</td><td>" + t.stage + '</td><td class="mono">' + esc(formatSpec(t.spec)) +
    '</td><td class="num">' + (t.shape ? esc(fmtBytes(t.bytes)) : "?") + "</td></tr>";
}

function renderRows() {
  const test = matcher(query);
  const shown = [];
  let matches = 0;
  for (let i = 0; i < tensors.length; i++) {
    if (!test(tensors[i])) continue;
    matches++;
    if (shown.length < TENSOR_ROWS) shown.push(i);
  }
  if (selected >= 0 && shown.indexOf(selected) < 0) shown.unshift(selected);
  let html = shown.map(tensorRow).join("");
  if (matches > TENSOR_ROWS) {
    html += '<tr class="more"><td colspan="7" class="muted">' + (matches - TENSOR_ROWS) +
      " more: refine the search to see them</td></tr>";
  }
  if (!matches) html += '<tr class="more"><td colspan="7" class="muted">no tensor matches</td></tr>';
  document.querySelector("#tensor-table tbody").innerHTML = html;
  $("tensor-count").textContent = matches + " of " + tensors.length + " tensors";
}

function renderTensors() {
  const body = '<p class="note">Every state and batch leaf as the plan places it. Type to ' +
    "filter by key path or pattern (<code>*</code> matches anything); pick a row to see " +
    "which block of it each device of its stage holds.</p>" +
    '<input id="tensor-search" type="search" placeholder="filter: e.g. mlp, blocks/*/attn"' +
    ' aria-label="filter tensors"> <span class="muted" id="tensor-count"></span>' +
    '<div class="tablewrap"><table id="tensor-table"><thead><tr><th>key path</th>' +
    '<th>kind</th><th>shape</th><th>dtype</th><th>stage</th><th>spec</th>' +
    '<th class="num">bytes / device</th></tr></thead><tbody></tbody></table></div>' +
    '<div id="tiling"><p class="note">Pick a tensor to draw its tiling.</p></div>';
  section("tensors", "Tensors", body);
  $("tensor-search").addEventListener("input", (e) => {
    query = e.target.value;
    renderRows();
  });
  document.querySelector("#tensor-table tbody").addEventListener("click", (e) => {
    const row = e.target.closest("tr[data-i]");
    if (row) select(Number(row.getAttribute("data-i")), true);
  });
  renderRows();
}

function tiles(spec, st, shape) {
  const sizeOf = {};
  st.axes.forEach((a, k) => { sizeOf[a] = st.sizes[k]; });
  const rank = shape ? shape.length : spec.length;
  return st.ids.map((device, flat) => {
    const coords = meshCoords(st.sizes, flat);
    const at = {};
    st.axes.forEach((a, k) => { at[a] = coords[k]; });
    const block = [];
    for (let d = 0; d < rank; d++) {
      let index = 0;
      let count = 1;
      for (const axis of spec[d] || []) {
        const size = sizeOf[axis] || 1;
        index = index * size + (at[axis] || 0);
        count *= size;
      }
      block.push([index, count]);
    }
    const bounds = shape ? shape.map((n, d) => {
      const per = Math.ceil(n / block[d][1]);
      return [Math.min(n, block[d][0] * per), Math.min(n, (block[d][0] + 1) * per)];
    }) : null;
    return {device, coords, block, bounds};
  });
}

function blockLabel(tile) {
  const parts = tile.block.map(([index, count], d) => (count === 1 ? ":"
    : tile.bounds ? tile.bounds[d][0] + ":" + tile.bounds[d][1] : index + "/" + count));
  return "[" + parts.join(", ") + "]";
}

function legend(t, st, list) {
  const sizeOf = {};
  st.axes.forEach((a, k) => { sizeOf[a] = st.sizes[k]; });
  const rank = t.shape ? t.shape.length : t.spec.length;
  const lines = [];
  if (rank === 0) lines.push("A scalar (0-d): every device holds all of it.");
  if (!t.shape) {
    lines.push("(The plan file records no shapes, so blocks read index/count: 1/4 is the " +
      "second of four.)");
  }
  for (let d = 0; d < rank; d++) {
    const axes = t.spec[d] || [];
    const n = t.shape ? t.shape[d] : "?";
    if (!axes.length) {
      lines.push("dim " + d + " (" + n + "): not split");
      continue;
    }
    const ways = axes.reduce((p, a) => p * (sizeOf[a] || 1), 1);
    lines.push("dim " + d + " (" + n + "): split over " + axes.map((a) => "'" + a + "' (" +
      sizeOf[a] + ")").join(" × ") + " into " + ways + " blocks" +
      (t.shape ? " of " + Math.ceil(t.shape[d] / ways) : ""));
  }
  const used = new Set([].concat(...t.spec));
  const free = st.axes.filter((a) => !used.has(a) && sizeOf[a] > 1);
  const distinct = new Set(list.map((x) => x.block.map((b) => b[0]).join(","))).size;
  lines.push(plural(distinct, "distinct block") + ", each held by " +
    plural(list.length / distinct, "device") + (free.length ? " (replicated over " +
    free.map((a) => "'" + a + "'").join(", ") + "): cells of one colour hold the same block"
      : ""));
  return lines;
}

function drawTiling(i) {
  const t = tensors[i];
  const st = stages[t.stage];
  const list = tiles(t.spec, st, t.shape);
  const n = st.sizes.length;
  let cols;
  let rows;
  let note = "";
  if (n === 0) {
    cols = 1;
    rows = 1;
  } else if (n === 1) {
    cols = Math.min(st.sizes[0], 16);
    rows = Math.ceil(st.sizes[0] / cols);
    if (rows > 1) note = "One mesh axis '" + st.axes[0] + "' of " + st.sizes[0] +
      " devices, drawn " + cols + " to a row.";
  } else {
    cols = st.sizes[n - 1];
    rows = list.length / cols;
    if (n > 2) note = "Rows flatten the leading mesh axes (" + st.axes.slice(0, -1).join(", ") +
      "); columns are '" + st.axes[n - 1] + "'.";
  }
  const cw = Math.max(44, Math.min(150, Math.floor(1000 / cols)));
  const ch = cw >= 80 ? 54 : 40;
  const left = n >= 2 ? 110 : 8;
  const top = n >= 2 ? 22 : 6;
  const keys = [];
  const keyOf = list.map((x) => {
    const key = x.block.map((b) => b[0]).join(",");
    if (keys.indexOf(key) < 0) keys.push(key);
    return keys.indexOf(key);
  });
  const color = (k) => (keys.length === 1 ? "hsl(212, 60%, 78%)"
    : "hsl(" + ((k * 360 / keys.length + (k % 2) * 23) % 360).toFixed(1) + ", 62%, 74%)");
  const width = left + cols * cw + 8;
  const height = top + rows * ch + 8;
  let svg = '<svg width="' + width + '" height="' + height + '" role="img"' +
    ' aria-label="tiling of ' + esc(t.path) + '">';
  if (n >= 2) {
    for (let c = 0; c < cols; c++) {
      svg += '<text x="' + (left + c * cw + cw / 2) + '" y="14" font-size="11" ' +
        'text-anchor="middle" fill="#5d6675">' + esc(st.axes[n - 1] + "=" + c) + "</text>";
    }
    for (let r = 0; r < rows; r++) {
      const coords = meshCoords(st.sizes, r * cols).slice(0, -1);
      svg += '<text x="' + (left - 6) + '" y="' + (top + r * ch + ch / 2 + 4) +
        '" font-size="11" text-anchor="end" fill="#5d6675">' +
        esc(st.axes.slice(0, -1).map((a, k) => a + "=" + coords[k]).join(", ")) + "</text>";
    }
  }
  list.forEach((x, flat) => {
    const r = Math.floor(flat / cols);
    const c = flat % cols;
    const x0 = left + c * cw;
    const y0 = top + r * ch;
    const label = blockLabel(x);
    const held = x.bounds ? "[" + x.bounds.map((b) => b[1] - b[0]).join(", ") + "]" : "?";
    svg += '<rect class="tile" data-device="' + x.device + '" data-block="' + esc(label) +
      '" x="' + (x0 + 1) + '" y="' + (y0 + 1) + '" width="' + (cw - 2) + '" height="' +
      (ch - 2) + '" rx="3" fill="' + color(keyOf[flat]) + '" stroke="#ffffff"><title>' +
      esc("device " + x.device + " · mesh " + describeCoords(st, x.coords) + " · block " +
        label + " · holds " + held + " " + (t.dtype || "")) + "</title></rect>";
    const fsDev = Math.min(12, (cw - 6) / (("dev " + x.device).length * 0.62));
    if (fsDev >= 6.5) {
      svg += '<text x="' + (x0 + cw / 2) + '" y="' + (y0 + (ch >= 54 ? 20 : 16)) +
        '" font-size="' + fsDev.toFixed(1) + '" text-anchor="middle" fill="#1d2330">dev ' +
        x.device + "</text>";
    }
    const fs = Math.min(12, (cw - 6) / (label.length * 0.62));
    if (fs >= 6.5) {
      svg += '<text class="bounds" x="' + (x0 + cw / 2) + '" y="' + (y0 + (ch >= 54 ? 40 : 31)) +
        '" font-size="' + fs.toFixed(1) + '" text-anchor="middle" fill="#1d2330">' +
        esc(label) + "</text>";
    }
  });
  svg += "</svg>";
  const lines = legend(t, st, list);
  $("tiling").innerHTML = "<h3>Tiling of <code>" + esc(t.path) + "</code> " +
    (t.shape ? esc("[" + t.shape.join(", ") + "] " + t.dtype) : "") + " on stage " +
    t.stage + " (" + esc(st.type) + ", mesh " + esc("(" + st.axes.map((a, k) => a + "=" +
    st.sizes[k]).join(", ") + ")") + ")</h3>" + (note ? '<p class="note">' + esc(note) +
    "</p>" : "") + '<div class="scroll">' + svg + '</div><div class="legend">' +
    lines.map((l) => "<div>" + esc(l) + "</div>").join("") + "</div>" + alternativesTable(t);
}

function starredValues(path, pattern) {
  // the components of path that its pattern writes as "*" or "Name_*" (layer indices)
  const pat = pattern.split("/");
  const out = [];
  path.split("/").forEach((part, k) => {
    const p = pat[k] || "";
    if (p === "*" || p.endsWith("_*")) out.push(part.slice(p.length - 1));
  });
  return out;
}

function alternativesOf(t) {
  // The leaf's group in the planner's alternatives record (plan.explain(tensor=...)).
  const A = D.alternatives;
  if (!A || t.kind === "batch") return null;
  const rec = A.layouts ? A.layouts[stages[t.stage].layout] : A;
  if (!rec || !rec.leaves) return null;
  let entry = rec.leaves[t.pattern];
  if (entry === undefined) entry = rec.leaves[t.path];
  if (entry === undefined) return null;
  if (typeof entry !== "number") {  // the pattern's leaves lie in several groups
    const want = starredValues(t.path, t.pattern).join(",");
    const hit = entry.find((e) => e[1].indexOf(want) >= 0) || entry[0];
    entry = hit[0];
  }
  return {group: rec.groups[entry], basis: rec.basis || ""};
}

function alternativesTable(t) {
  const alt = alternativesOf(t);
  if (!alt) return "";
  const signed = (x, f) => (x === null ? "-" : (x >= 0 ? "+" : "-") + f(Math.abs(x)));
  const rows = alt.group.options.map((o) => "<tr><td class=\"mono\">" + esc(formatSpec(o[0])) +
    '</td><td class="num">' + esc(signed(o[1], fmtMs)) + '</td><td class="num">' +
    esc(signed(o[2], fmtBytes)) + "</td><td>" + (o[3] ? "" : o[1] === null
      ? "not priced: needs other changes" : "over the memory budget") + "</td></tr>");
  return "<h3>Other shardings of this leaf</h3><p class=\"note\">Chosen: <code>" +
    esc(formatSpec(alt.group.chosen)) + "</code>. " + esc(alt.basis) + "</p>" +
    (rows.length ? '<table><thead><tr><th>spec</th><th class="num">Δ step time</th>' +
      '<th class="num">Δ memory</th><th></th></tr></thead><tbody>' + rows.join("") +
      "</tbody></table>" : '<p class="note">No alternative: the leaf has one possible ' +
      "sharding.</p>");
}

function select(i, fromClick) {
  selected = i;
  renderRows();
  drawTiling(i);
  if (fromClick) {
    try {
      history.replaceState(null, "", "#tensor=" + encodeURIComponent(tensors[i].path));
    } catch (err) {
      /* a page without a URL of its own (a notebook's srcdoc frame): nothing to update */
    }
  }
}

function applyHash() {
  const hash = window.location.hash;
  if (hash.indexOf("#tensor=") !== 0) return;
  let want;
  try {
    want = decodeURIComponent(hash.slice("#tensor=".length));
  } catch (err) {
    want = hash.slice("#tensor=".length);
  }
  let i = tensors.findIndex((t) => t.path === want);
  if (i < 0) i = tensors.findIndex((t) => t.pattern === want);
  if (i < 0) {
    $("tiling").innerHTML = '<p class="note">No tensor ' + esc(want) + " in this plan.</p>";
    return;
  }
  select(i, false);
  const row = document.querySelector('#tensor-table tr[data-i="' + i + '"]');
  if (row) row.scrollIntoView({block: "nearest"});
}
