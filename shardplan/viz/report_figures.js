/* shardplan plan report, part 2 of 2: the pipeline timeline, memory bars, runner-ups and
   predicted | compiled | measured; then draws every section. Shares report.js's scope
   (html.py wraps both in one function). */

// ------------------------------------------------------------------ timeline

let zoom = 1;
let replicaShown = -1;

function niceStep(raw) {
  const p = Math.pow(10, Math.floor(Math.log10(raw)));
  for (const m of [1, 2, 5, 10]) if (m * p >= raw) return m * p;
  return 10 * p;
}

function timelineRows(T) {
  return T.rows.map((r) => {
    const src = r.length === 3 ? T.rows[r[2]] : r;
    return {replica: r[0], stage: r[1], compute: src[2], transfers: src[3]};
  });
}

function drawLane(items, width, px, y, h, kinds, T, colors, stage) {
  let svg = "";
  let run = null;
  const flush = () => {
    if (!run) return;
    const fillColor = stride === 6 || run.mask !== 3 ? colors[run.first] : "url(#sp-mix)";
    const counts = Object.keys(run.count).map((k) => run.count[k] + " " + kinds[k])
      .join(", ");
    svg += '<rect class="dense" x="' + run.x0.toFixed(2) + '" y="' + y + '" width="' +
      Math.max(run.x1 - run.x0, 1).toFixed(2) + '" height="' + h + '" fill="' + fillColor +
      '"><title>' + esc(counts + "; microbatches " + run.mb0 + "-" + run.mb1 + "; " +
      fmtMs(run.t0 * T.tick_s) + " to " + fmtMs(run.t1 * T.tick_s) +
      " (zoom in to see each task)") + "</title></rect>";
    run = null;
  };
  const stride = items.stride;
  const data = items.data;
  for (let k = 0; k < data.length; k += stride) {
    const kind = data[k];
    const mb = data[k + 1];
    const chunk = data[k + 2];
    const start = data[k + 3];
    const dur = data[k + 4];
    const x = start * px;
    const w = dur * px;
    if (w >= 2) {
      flush();
      const to = stride === 6 ? " to stage " + (stage + data[k + 5]) : "";
      svg += '<rect class="task ' + kinds[kind] + '" x="' + x.toFixed(2) + '" y="' + y +
        '" width="' + w.toFixed(2) + '" height="' + h + '" fill="' + colors[kind] +
        '" stroke="#ffffff" stroke-width="0.5"><title>' + esc(kinds[kind] + " · microbatch " +
        mb + " · chunk " + chunk + to + " · " + fmtMs(start * T.tick_s) + " to " +
        fmtMs((start + dur) * T.tick_s)) + "</title></rect>";
      if (stride === 5 && w >= 18) {
        svg += '<text x="' + (x + w / 2).toFixed(2) + '" y="' + (y + h / 2 + 4) +
          '" font-size="10" text-anchor="middle" fill="#ffffff" pointer-events="none">' + mb +
          "</text>";
      }
      continue;
    }
    if (run && x - run.x1 < 1.5) {
      run.x1 = Math.max(run.x1, x + w);
      run.t1 = start + dur;
      run.mb0 = Math.min(run.mb0, mb);
      run.mb1 = Math.max(run.mb1, mb);
    } else {
      flush();
      run = {x0: x, x1: x + w, t0: start, t1: start + dur, mb0: mb, mb1: mb, mask: 0,
        first: kind, count: {}};
    }
    run.mask |= kind % 2 === 0 ? 1 : 2;
    run.count[kind] = (run.count[kind] || 0) + 1;
  }
  flush();
  return svg;
}

function omitted(row, T, px, y, h) {
  // A windowed timeline leaves out the steady state: mark the row's longest gap between
  // tasks when it is long enough to hold the tasks left out (else it is a real bubble).
  const c = row.compute;
  const left = T.microbatches[row.replica] - 2 * T.window;
  if (c.length < 10 || left <= 0) return "";
  let best = [0, 0];
  let shortest = Infinity;
  for (let k = 0; k < c.length; k += 5) {
    shortest = Math.min(shortest, c[k + 4]);
    if (k + 5 < c.length) {
      const gap = c[k + 8] - (c[k + 3] + c[k + 4]);
      if (gap > best[1] - best[0]) best = [c[k + 3] + c[k + 4], c[k + 8]];
    }
  }
  if (best[1] - best[0] < 0.9 * left * shortest) return "";
  return '<rect class="omitted" x="' + (best[0] * px).toFixed(2) + '" y="' + y +
    '" width="' + ((best[1] - best[0]) * px).toFixed(2) + '" height="' + h +
    '" fill="url(#sp-omit)"><title>' + esc("not stored: the tasks of microbatches " +
    T.window + " to " + (T.microbatches[row.replica] - T.window - 1) + " (the steady state)") +
    "</title></rect>";
}

function drawTimeline() {
  const T = D.timeline;
  const all = timelineRows(T);
  const rows = replicaShown < 0 ? all : all.filter((r) => r.replica === replicaShown);
  const box = $("timeline-plot");
  const labelW = 150;
  const avail = Math.max(600, (box.clientWidth || 1100) - 20);
  const plotW = (avail - labelW) * zoom;
  const px = plotW / Math.max(T.end, 1);
  const rowH = 22;
  const top = 26;
  const height = top + rows.length * rowH + 8;
  const colors = ["#3f7fd6", "#e0863a", "#7a4fb3", "#7a4fb3"];
  let svg = '<svg width="' + (labelW + plotW + 30).toFixed(0) + '" height="' +
    height + '"><defs><pattern id="sp-mix" width="6" height="6" ' +
    'patternUnits="userSpaceOnUse" patternTransform="rotate(45)"><rect width="3" height="6"' +
    ' fill="#3f7fd6"/><rect x="3" width="3" height="6" fill="#e0863a"/></pattern>' +
    '<pattern id="sp-omit" width="8" height="8" patternUnits="userSpaceOnUse" ' +
    'patternTransform="rotate(45)"><rect width="8" height="8" fill="#f7f8fa"/><rect ' +
    'width="2" height="8" fill="#c9ced6"/></pattern></defs>';
  const totalMs = T.end * T.tick_s * 1e3;
  const step = niceStep(totalMs / (10 * zoom));
  for (let ms = 0; ms <= totalMs + 1e-9; ms += step) {
    const x = labelW + (ms / 1e3 / T.tick_s) * px;
    svg += '<line x1="' + x.toFixed(2) + '" y1="' + (top - 4) + '" x2="' + x.toFixed(2) +
      '" y2="' + (height - 6) + '" stroke="#e3e6eb"/><text x="' + x.toFixed(2) +
      '" y="14" font-size="10" text-anchor="middle" fill="#5d6675">' +
      esc(Number(ms.toPrecision(6)) + " ms") + "</text>";
  }
  rows.forEach((row, i) => {
    const y = top + i * rowH;
    const st = stages[row.stage];
    let busy = 0;
    for (let k = 4; k < row.compute.length; k += 5) busy += row.compute[k];
    svg += '<text x="4" y="' + (y + 15) + '" font-size="11" fill="#1d2330"><title>' +
      esc("replica " + row.replica + ", stage " + row.stage + " (" + st.type + ", " +
      plural(st.ids.length, "device") + "): busy " + (100 * busy / Math.max(T.end, 1))
        .toFixed(1) + " % of the pipeline phase") + "</title>" +
      esc("r" + row.replica + " s" + row.stage + " " + st.type) + "</text>";
    svg += '<g transform="translate(' + labelW + ',0)"><rect class="lane" x="0" y="' +
      (y + 2) + '" width="' + plotW.toFixed(2) + '" height="' + (rowH - 4) +
      '" fill="#eef0f3"><title>idle (bubble)</title></rect>';
    if (T.window) svg += omitted(row, T, px, y + 2, rowH - 4);
    svg += drawLane({data: row.compute, stride: 5}, plotW, px, y + 2, rowH - 8, T.kinds, T,
      colors, row.stage);
    svg += drawLane({data: row.transfers, stride: 6}, plotW, px, y + rowH - 6, 3, T.kinds, T,
      colors, row.stage);
    svg += "</g>";
  });
  box.innerHTML = svg + "</svg>";
}

function renderTimeline() {
  const T = D.timeline;
  if (T.reason) {
    section("timeline", "Pipeline timeline", '<p class="note">' + esc(T.reason) + "</p>");
    return;
  }
  const replicas = Array.from(new Set(T.rows.map((r) => r[0])));
  let tools = '<div class="toolbar">zoom<select id="timeline-zoom">' + [1, 2, 4, 8, 16, 32]
    .map((z) => '<option value="' + z + '">' + z + "×</option>").join("") + "</select>";
  if (replicas.length > 1) {
    tools += "replica<select id=\"timeline-replica\"><option value=\"-1\">all</option>" +
      replicas.map((r) => '<option value="' + r + '">' + r + "</option>").join("") +
      "</select>";
  }
  tools += "</div>";
  const key = '<div class="legend"><span><span class="swatch" style="background:#3f7fd6">' +
    '</span>forward</span><span><span class="swatch" style="background:#e0863a"></span>' +
    'backward</span><span><span class="swatch" style="background:repeating-linear-gradient(' +
    '45deg,#3f7fd6 0 3px,#e0863a 3px 6px)"></span>forward and backward too dense to draw ' +
    'apart (zoom in)</span><span><span class="swatch" style="background:#7a4fb3"></span>' +
    'transfer to the next / previous stage (thin mark)</span><span><span class="swatch" ' +
    'style="background:#eef0f3"></span>idle: pipeline bubble</span>' + (T.window ?
    '<span><span class="swatch" style="background:repeating-linear-gradient(45deg,' +
    '#c9ced6 0 2px,#f7f8fa 2px 6px)"></span>tasks not stored</span>' : "") + "</div>";
  section("timeline", "Pipeline timeline", '<p class="note">The simulator\'s pipeline phase ' +
    "of one step (" + fmtMs(T.end * T.tick_s) + "), one row per replica and stage; hover " +
    "a box for its task.</p>" + (T.window ? '<p class="note">The plan file keeps only ' +
    "each replica's first and last " + plural(T.window, "microbatch", "microbatches") +
    " (the pipeline's fill and drain): the steady state between them is left out, so " +
    "gaps in the middle of a row are missing tasks, not idle time.</p>" : "") + tools + key +
    '<div class="scroll" id="timeline-plot"></div>');
  $("timeline-zoom").addEventListener("change", (e) => {
    zoom = Number(e.target.value);
    drawTimeline();
  });
  const pick = $("timeline-replica");
  if (pick) {
    pick.addEventListener("change", (e) => {
      replicaShown = Number(e.target.value);
      drawTimeline();
    });
  }
  drawTimeline();
}

// ------------------------------------------------------------------ memory

function renderMemory() {
  const groups = D.memory.map((m) => ({type: D.types[m[0]], stages: m[1], count: m[2],
    parts: [m[3], m[4], m[5], m[6]], peak: m[7], capacity: m[8], compiled: m[9]}));
  const usage = (g) => Math.max(g.peak || 0, g.parts.reduce((a, b) => a + b, 0),
    g.compiled || 0);
  const fits = groups.some((g) => g.capacity && usage(g) >= 0.1 * g.capacity);
  const scale = Math.max(1, ...groups.map((g) => Math.max(usage(g),
    fits ? g.capacity || 0 : 0)));
  const names = ["parameters", "gradients", "optimizer state", "activations and temporaries"];
  const colors = ["var(--params)", "var(--grads)", "var(--opt)", "var(--other)"];
  let body = '<p class="note">Predicted peak per device, split; devices with equal figures ' +
    "share one bar. Black line: the device's memory" + (fits ? "" : " (off the scale: " +
    "every device uses under 10 % of it, so bars are scaled to the largest peak)") +
    "; dashed red line: XLA's compiled figure, where the plan has run.</p>" +
    '<div class="legend">' + names.map((n, k) => '<span><span class="swatch" ' +
    'style="background:' + colors[k] + '"></span>' + n + "</span>").join("") + "</div>";
  for (const g of groups) {
    const label = (g.stages.length === 1 ? "stage " : "stages ") + compressIds(g.stages) +
      " · " + g.type + " × " + plural(g.count, "device");
    let x = 0;
    let segs = "";
    g.parts.forEach((b, k) => {
      const w = (100 * b) / scale;
      segs += '<div class="seg" style="left:' + x.toFixed(3) + "%;width:" + w.toFixed(3) +
        "%;background:" + colors[k] + '" title="' + esc(names[k] + ": " + fmtBytes(b)) +
        '"></div>';
      x += w;
    });
    if (g.capacity && g.capacity <= scale) {
      segs += '<div class="cap" style="left:' + (100 * g.capacity / scale).toFixed(3) +
        '%" title="' + esc("capacity " + fmtBytes(g.capacity)) + '"></div>';
    }
    if (g.compiled) {
      segs += '<div class="compiled" style="left:' + (100 * g.compiled / scale).toFixed(3) +
        '%" title="' + esc("compiled (XLA) " + fmtBytes(g.compiled)) + '"></div>';
    }
    const pct = g.capacity && g.peak !== null ? 100 * g.peak / g.capacity : null;
    const share = pct === null ? "" : " (" + (pct >= 0.1 ? pct.toFixed(1) : "< 0.1") + " %)";
    body += '<div class="membar"><div>' + esc(label) + '</div><div class="track">' + segs +
      "</div><div>" + esc((g.peak === null ? "not predicted" : fmtBytes(g.peak)) + " of " +
      (g.capacity ? fmtBytes(g.capacity) : "?") + share) + "</div></div>";
  }
  section("memory", "Memory per device", body);
}

// ------------------------------------------------------------------ runner-ups, figures

function renderRunnerUps() {
  const R = D.runner_ups;
  const chosen = R.rows[0];
  let body = '<div class="scroll"><table><thead><tr><th></th><th>configuration</th>' +
    '<th class="num">step time</th><th class="num">Δ step</th><th class="num">peak memory' +
    '</th><th class="num">Δ memory</th><th>why it lost</th></tr></thead><tbody>';
  R.rows.forEach((r, i) => {
    let dStep = "";
    let dMem = "";
    if (i > 0 && r[1] !== null && chosen[1]) {
      const d = r[1] - chosen[1];
      dStep = '<span class="' + (d > 0 ? "worse" : "better") + '">' + (d >= 0 ? "+" : "-") +
        esc(fmtMs(Math.abs(d))) + " (" + (d >= 0 ? "+" : "") + (100 * d / chosen[1])
        .toFixed(1) + " %)</span>";
    }
    if (i > 0 && r[2] !== null && chosen[2] !== null) {
      const d = r[2] - chosen[2];
      dMem = (d >= 0 ? "+" : "-") + esc(fmtBytes(Math.abs(d)));
    }
    body += "<tr" + (i === 0 ? ' class="chosen"' : "") + "><td>" + (i === 0 ? "chosen"
      : "#" + i) + '</td><td class="mono">' + esc(r[0]) + '</td><td class="num">' +
      esc(fmtMs(r[1])) + '</td><td class="num">' + dStep + '</td><td class="num">' +
      esc(fmtBytes(r[2])) + '</td><td class="num">' + dMem + "</td><td>" +
      esc(i === 0 ? "" : r[3]) + "</td></tr>";
  });
  body += "</tbody></table></div>";
  if (R.note) body += '<p class="note">' + esc(R.note) + "</p>";
  section("runner-ups", "Chosen plan and runner-ups", body);
}

function renderFigures() {
  const F = D.figures;
  let body = F.head.map((h) => '<p class="note">' + esc(h) + "</p>").join("") +
    '<div class="scroll"><table><thead><tr><th></th><th class="num">predicted</th>' +
    '<th class="num">compiled</th><th class="num">measured</th><th class="num">ratio</th>' +
    "</tr></thead><tbody>";
  for (const r of F.rows) {
    if (r.length === 1) {
      body += '<tr class="heading"><td colspan="5">' + esc(r[0]) + "</td></tr>";
    } else {
      body += "<tr><td>" + esc(r[0]) + "</td>" + r.slice(1).map((c) => '<td class="num">' +
        esc(c) + "</td>").join("") + "</tr>";
    }
  }
  section("figures", "Predicted | compiled | measured", body + "</tbody></table></div>");
}

renderSummary();
renderCluster();
renderStages();
renderTensors();
renderTimeline();
renderMemory();
renderRunnerUps();
renderFigures();
applyHash();
window.addEventListener("hashchange", applyHash);
