(function () {
  "use strict";
  // Everything the agent wrote is data: it reaches the page through textContent only, never as markup.
  const data = JSON.parse(document.getElementById("trace-data").textContent);
  const runs = data.runs;
  const span = Math.max(data.duration, 0.001);
  const rowsBox = document.getElementById("rows");
  const details = document.getElementById("details");
  const rows = [];
  const collapsed = new Set();
  let selected = null;

  function el(tag, cls, text) {
    const node = document.createElement(tag);
    if (cls) node.className = cls;
    if (text !== undefined && text !== null) node.textContent = String(text);
    return node;
  }
  // The time window shown (zoomed in on a run, or the whole trace).
  let shownFrom = 0;
  let shownTo = span;
  const at = (t) => ((t - shownFrom) / (shownTo - shownFrom)) * 100;
  function place(node, from, to) {
    node.style.left = at(from) + "%";
    node.style.width = Math.max(0, at(to) - at(from)) + "%";
  }
  const seconds = (t) => (t === null || t === undefined ? "-" : t.toFixed(3) + " s");
  const endOf = (run) => (run.end === null ? data.duration : run.end);
  const stateClass = (run) => "state-" + (
    ["completed", "failed", "stopped", "cancelled"].includes(run.state) ? run.state : "running");

  function ticks() {
    const lane = document.getElementById("ticks");
    lane.replaceChildren();
    const width = shownTo - shownFrom;
    const rough = width / 8;
    const power = Math.pow(10, Math.floor(Math.log10(rough)));
    const step = [1, 2, 5, 10].map((f) => f * power).find((s) => s >= rough) || rough;
    for (let t = Math.ceil(shownFrom / step) * step; t <= shownTo + 1e-9; t += step) {
      const tick = el("div", "tick", t < 1 ? +(t * 1000).toFixed(3) + " ms" : +t.toFixed(3) + " s");
      tick.style.left = at(t) + "%";
      lane.append(tick);
    }
  }

  function layout() {
    ticks();
    runs.forEach((run, index) => {
      const shapes = rows[index].shapes;
      const start = run.start === null ? 0 : run.start;
      place(shapes[0], start, endOf(run));
      run.marks.forEach(([, from, to], mark) => place(shapes[mark + 1], from, to === null ? endOf(run) : to));
    });
    document.getElementById("zoom-out").hidden = shownFrom === 0 && shownTo === span;
  }

  function zoom(from, to) {
    const margin = Math.max((to - from) * 0.15, 0.0005);
    shownFrom = Math.max(0, from - margin);
    shownTo = Math.min(span, to + margin);
    if (shownTo <= shownFrom) [shownFrom, shownTo] = [0, span];
    layout();
  }

  // A run's budget, in a cap's own units: whole counts with separators, a cost and seconds shortened.
  const spentKeys = {max_tokens: "tokens", max_cost: "cost", max_seconds: "seconds",
    max_tool_calls: "toolCalls", max_turns: "turns"};
  function amount(cap, value) {
    if (cap === "max_cost" || cap === "max_seconds" || cap === "timeout") return String(+value.toPrecision(4));
    return Math.round(value).toLocaleString("en-US");
  }
  function limitText(limit) {
    const unit = limit.limit === "max_seconds" || limit.limit === "timeout" ? " s" : "";
    return limit.limit + " " + amount(limit.limit, limit.spent) + " of " + amount(limit.limit, limit.allowed) + unit;
  }
  function spentLines(run) {
    if (!run.budget) return [];
    return Object.entries(run.budget).map(([cap, value]) => {
      const spent = run.spent ? run.spent[spentKeys[cap]] : undefined;
      const unit = cap === "max_cost" && run.spent && run.spent.costCurrency ? " " + run.spent.costCurrency
        : cap === "max_seconds" ? " s" : "";
      return [cap, (spent === undefined ? "?" : amount(cap, spent)) + " of " + amount(cap, value) + unit];
    });
  }

  function hover(run) {
    const parts = [(run.provider || "run") + ": " + run.title, "state: " + run.state];
    if (run.stopReason) parts.push("stop reason: " + run.stopReason);
    parts.push(seconds(run.start) + " to " + (run.end === null ? "(not ended)" : seconds(run.end)));
    const excerpt = (text) => (text.length > 160 ? text.slice(0, 159) + "\u2026" : text);
    if (run.prompt) parts.push("prompt: " + excerpt(run.prompt));
    if (run.output) parts.push("output: " + excerpt(run.output));
    if (run.error) parts.push("error: " + excerpt(run.error));
    if (run.usage) parts.push("usage: " + excerpt(JSON.stringify(run.usage)));
    if (run.limit) parts.push("stopped by its budget: " + limitText(run.limit));
    parts.push("(click for the details)");
    return parts.join("\n");
  }

  function buildRow(run, index) {
    const row = el("div", "row");
    row.dataset.index = String(index);
    row.dataset.depth = String(run.depth);
    const label = el("div", "label");
    label.style.paddingLeft = 4 + 14 * Math.min(run.depth, 16) + "px";
    const hasChildren = index + 1 < runs.length && runs[index + 1].depth > run.depth;
    const toggle = el("button", "toggle", hasChildren ? "\u25be" : "");
    toggle.type = "button";
    if (hasChildren) {
      toggle.title = "fold or unfold the runs below this one";
      toggle.addEventListener("click", (event) => {
        event.stopPropagation();
        if (collapsed.has(index)) collapsed.delete(index); else collapsed.add(index);
        toggle.textContent = collapsed.has(index) ? "\u25b8" : "\u25be";
        applyFolds();
      });
    }
    // "spawn subagent: do this" under provider "spawn" reads "spawn  do this"; the full title is on hover.
    const provider = run.provider || "run";
    const prefix = provider + " subagent: ";
    const shortTitle = run.title.startsWith(prefix) ? run.title.slice(prefix.length) : run.title;
    label.append(toggle, el("span", "provider", provider), el("span", "title", shortTitle));
    label.title = run.title;
    const lane = el("div", "lane");
    const bar = el("div", "bar " + stateClass(run));
    bar.title = hover(run);
    if (run.limit && run.limit.limit !== "timeout") {
      bar.append(el("span", "badge", "budget: " + limitText(run.limit)));
      bar.classList.add("capped");
    }
    lane.append(bar);
    row.shapes = [bar];
    for (const [kind, from, , text, status] of run.marks) {
      const mark = el("div", "mark mark-" + kind);
      mark.title = kind + ": " + text + (status ? " (" + status + ")" : "") + "\n" + seconds(from);
      lane.append(mark);
      row.shapes.push(mark);
    }
    row.append(label, lane);
    row.addEventListener("click", () => select(index));
    row.tabIndex = 0;
    row.addEventListener("keydown", (event) => {
      if (event.key === "Enter" || event.key === " ") {
        event.preventDefault();
        select(index);
      }
    });
    return row;
  }

  function applyFolds() {
    let hideBelow = Infinity;
    rows.forEach((row, index) => {
      const depth = runs[index].depth;
      if (depth <= hideBelow) hideBelow = Infinity;
      row.classList.toggle("hidden", depth > hideBelow);
      if (hideBelow === Infinity && collapsed.has(index)) hideBelow = depth;
    });
  }

  function field(list, name, value) {
    if (value === null || value === undefined || value === "") return;
    list.append(el("dt", null, name), el("dd", null, value));
  }

  function textSection(title, text, total, id) {
    const box = el("section");
    box.id = id;
    box.append(el("h3", null, title));
    box.append(el("pre", null, text || "(none)"));
    if (total > text.length) {
      box.append(el("p", "note", "truncated: the first " + text.length + " of " + total + " characters"));
    }
    details.append(box);
  }

  function select(index) {
    const run = runs[index];
    if (selected !== null) rows[selected].classList.remove("selected");
    selected = index;
    rows[index].classList.add("selected");
    details.replaceChildren();
    details.dataset.runId = run.id;
    details.append(el("h2", null, (run.provider || "run") + ": " + run.title));
    const zoomIn = el("button", null, "zoom in on this run");
    zoomIn.type = "button";
    zoomIn.id = "zoom-in";
    zoomIn.addEventListener("click", () => zoom(run.start === null ? 0 : run.start, endOf(run)));
    details.append(zoomIn);
    const list = el("dl");
    field(list, "run", run.id);
    field(list, "parent", run.parent);
    field(list, "depth", run.depth);
    field(list, "state", run.state);
    field(list, "stop reason", run.stopReason);
    field(list, "started", seconds(run.start));
    field(list, "ended", run.end === null ? "(not ended)" : seconds(run.end));
    if (run.end !== null && run.start !== null) field(list, "duration", seconds(run.end - run.start));
    if (run.elapsed !== null) field(list, "elapsed (reported)", seconds(run.elapsed));
    if (run.limit) {
      const whose = run.limit.owner ? " (the budget of " + run.limit.owner + ")" : "";
      field(list, "limit", limitText(run.limit) + whose);
    }
    details.append(list);
    if (run.budget) {
      details.append(el("h3", null, "budget"));
      const budget = el("dl");
      budget.id = "detail-budget";
      for (const [cap, line] of spentLines(run)) field(budget, cap, line);
      details.append(budget);
    }
    if (run.error) textSection("error", run.error, run.error.length, "detail-error");
    textSection("prompt", run.prompt, run.promptChars, "detail-prompt");
    textSection("output", run.output, run.outputChars, "detail-output");
    details.append(el("h3", null, "usage"));
    if (run.usage && Object.keys(run.usage).length) {
      const usage = el("dl");
      usage.id = "detail-usage";
      for (const [key, value] of Object.entries(run.usage)) field(usage, key, JSON.stringify(value));
      details.append(usage);
    } else {
      details.append(el("p", "hint", "(not reported)"));
    }
    details.append(el("h3", null, "marks (" + run.marks.length + ")"));
    const marks = el("ul");
    for (const [kind, from, to, text, status] of run.marks.slice(0, 200)) {
      const until = to === null ? "" : " to " + seconds(to);
      const said = status ? " (" + status + ")" : "";
      marks.append(el("li", null, seconds(from) + until + "  " + kind + ": " + text + said));
    }
    details.append(marks);
    const hidden = run.marksDropped + Math.max(0, run.marks.length - 200);
    if (hidden) details.append(el("p", "note", hidden + " more not shown"));
  }

  document.getElementById("heading").textContent = document.title;
  let summary = runs.length + " runs, " + seconds(data.duration) + ", " + data.events + " events";
  if (data.runsDropped) summary += " (" + data.runsDropped + " more runs not kept)";
  document.getElementById("summary").textContent = summary;
  document.getElementById("zoom-out").addEventListener("click", () => zoom(0, span));
  const fragment = document.createDocumentFragment();
  runs.forEach((run, index) => {
    const row = buildRow(run, index);
    rows.push(row);
    fragment.append(row);
  });
  rowsBox.append(fragment);
  layout();
  document.documentElement.dataset.ready = "1";
})();
