// latentserve viewer: streams one prompt from the public API and draws the thinking.
// Data: GET /v1/models (each card's `latent`: family and controls), then a streamed
// /v1/chat/completions or /v1/completions with return_latent_trace and stream_latent_steps;
// the chunk shapes are those of docs/server.md ("Latent reasoning", "Streamed latent steps").
"use strict";

const $ = (id) => document.getElementById(id);
const models = {};  // id -> /v1/models card

// name -> [input type, label, choices]; only the controls a card lists are shown. A select's
// choices default to the card's exit_criteria.
const CONTROLS = {
  latent_budget: ["number", "budget"],
  thinking: ["bool", "thinking"],
  max_latent: ["number", "max_latent"],
  min_latent: ["number", "min_latent"],
  use_stop: ["bool", "use_stop"],
  stop_threshold: ["number", "stop_threshold"],
  min_output_tokens: ["number", "min_output_tokens"],
  compression_factor: ["number", "compression factor"],
  latent_temperature: ["number", "latent temperature"],
  exit_criterion: ["select", "exit criterion"],
  exit_threshold: ["number", "exit threshold"],
  exit_min_steps: ["number", "exit_min_steps"],
  exit_check_every: ["number", "exit_check_every"],
  exit_semantics: ["select", "exit semantics", ["engine", "upstream"]],
  upstream_stop_rules: ["bool", "upstream stop rules"],
};

const CUT = "the stream ended before the request finished (the server stopped or the " +
  "connection broke)";

function el(tag, attrs = {}, ...kids) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") e.className = v;
    else if (k === "text") e.textContent = v;
    else if (k === "style") e.style.cssText = v;
    else e.setAttribute(k, v);
  }
  for (const kid of kids) if (kid != null) e.append(kid);
  return e;
}

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("key").value.trim();
  if (key) h.Authorization = "Bearer " + key;
  return h;
}

// What a 401 means: a key was sent and refused, or none was sent.
function keyMessage() {
  return $("key").value.trim() ? "API key rejected (401): check the key" : "API key needed (401)";
}

async function apiError(r) {
  if (r.status === 401) return keyMessage();
  try {
    const body = await r.json();
    return `${r.status}: ${body.error ? body.error.message : JSON.stringify(body)}`;
  } catch (e) {
    return `${r.status} ${r.statusText}`;
  }
}

// ----- models and controls -------------------------------------------------------------

// Connect: list the served models. The selected model, the side-by-side choice and the
// latent controls' values are kept when the model is still served.
async function loadModels() {
  sessionStorage.setItem("latentserve-key", $("key").value);
  $("status").textContent = "loading models...";
  const r = await fetch("/v1/models", { headers: headers() });
  if (!r.ok) {
    $("status").textContent = await apiError(r);
    return;
  }
  const cards = (await r.json()).data;
  const select = $("model");
  const kept = { model: select.value, other: $("compare_with").value, values: {} };
  $("controls").querySelectorAll("input, select").forEach((i) => { kept.values[i.id] = i.value; });
  select.innerHTML = "";
  for (const id of Object.keys(models)) delete models[id];
  for (const c of cards) {
    models[c.id] = c;
    select.append(el("option", { value: c.id, text: c.id }));
  }
  $("status").textContent = `${cards.length} model${cards.length === 1 ? "" : "s"}`;
  const same = kept.model in models;
  if (same) select.value = kept.model;
  showControls();
  if (same) {
    for (const [id, v] of Object.entries(kept.values)) if ($(id)) $(id).value = v;
    if ([...$("compare_with").options].some((o) => o.value === kept.other)) {
      $("compare_with").value = kept.other;
    }
  }
  setReady();
}

// Run needs a model: until the models are listed it is disabled, with a hint saying why.
function setReady() {
  const ready = $("model").options.length > 0;
  $("run").disabled = !ready;
  $("run_hint").hidden = ready;
}

function latentOf(id) {
  return (models[id] && models[id].latent) || null;
}

function showControls() {
  const lat = latentOf($("model").value);
  $("family").textContent = lat ? `${lat.family} (${lat.kind})` : "no latent reasoning";
  const box = $("controls");
  box.querySelectorAll("label").forEach((n) => n.remove());
  box.classList.toggle("none", !lat);
  for (const name of lat ? lat.controls : []) {
    const spec = CONTROLS[name];
    // a head's latent_budget is its max_latent again: one input is enough
    if (!spec || (name === "latent_budget" && lat.controls.includes("max_latent"))) continue;
    let input;
    if (spec[0] === "bool") {
      input = el("select", { id: "c_" + name },
        el("option", { value: "", text: "default" }), el("option", { value: "true", text: "on" }),
        el("option", { value: "false", text: "off" }));
    } else if (spec[0] === "select") {
      input = el("select", { id: "c_" + name }, el("option", { value: "", text: "default" }),
        ...(spec[2] || lat.exit_criteria || []).map((c) => el("option", { value: c, text: c })));
    } else {
      input = el("input", { id: "c_" + name, type: "number", step: "any", placeholder: "default" });
      if (name === "latent_budget" && lat.budget) {
        input.min = lat.budget.min; input.max = lat.budget.max;
        input.placeholder = String(lat.budget.default);
      }
      if (name === "compression_factor" && lat.max_compression_factor) {
        input.min = 1; input.max = lat.max_compression_factor;
      }
    }
    box.append(el("label", {}, spec[1] + " ", input));
  }
  const cmp = $("compare_with");
  cmp.innerHTML = "";
  const off = lat && offSwitch(lat);
  if (off) cmp.append(el("option", { value: "", text: off.label }));
  for (const id of Object.keys(models)) {
    if (id !== $("model").value) cmp.append(el("option", { value: id, text: id }));
  }
  // Nothing to compare with (a recurrent-depth model alone): no side-by-side.
  $("compare_row").hidden = cmp.options.length === 0;
  if (cmp.options.length === 0) $("compare").checked = false;
}

// The same model with less thinking: {label, body} (the body fields), or null when there is
// no such mode. Recurrent depth has none: every token recurs. Looped blocks at budget 0 still
// run pass 0 over the block (the latent-token placeholders, no feedback; docs/models.md).
function offSwitch(lat) {
  if (lat.kind === "head") return { label: "thinking off", body: { thinking: false } };
  if (lat.kind === "recurrent" || !lat.budget || lat.budget.min !== 0) return null;
  if (lat.kind === "loop") {
    return { label: "latent_budget 0: pass 0 only", body: { latent_budget: 0 } };
  }
  return { label: "thinking off", body: { latent_budget: 0 } };
}

function controlValues(lat) {
  const out = {};
  for (const name of lat ? lat.controls : []) {
    const input = $("c_" + name);
    if (!input || input.value === "") continue;
    const kind = CONTROLS[name][0];
    out[name] = kind === "bool" ? input.value === "true"
      : kind === "select" ? input.value : Number(input.value);
  }
  return out;
}

// ----- one run --------------------------------------------------------------------------

function requestBody(model, route, extra) {
  const lat = latentOf(model);
  const body = {
    model, stream: true, stream_options: { include_usage: true },
    max_tokens: Number($("max_tokens").value) || 64,
    temperature: Number($("temperature").value),
  };
  if (lat && lat.return_latent_trace) body.return_latent_trace = true;
  if (lat && lat.stream_latent_steps) body.stream_latent_steps = true;
  if (route === "chat") {
    body.messages = [{ role: "user", content: $("prompt").value }];
    body.logprobs = true;  // token texts: the heat map's cells, text CoT's thinking tokens
  } else {
    body.prompt = $("prompt").value;
    body.logprobs = 0;
  }
  return Object.assign(body, extra);
}

class RunView {
  constructor(title, lat) {
    this.lat = lat;
    this.cols = [];  // step entries, in order
    this.tokens = [];  // generated token texts (from logprobs)
    this.answer = "";
    this.reasoning = "";
    this.root = el("div", { class: "run" }, el("h2", { text: title }));
    this.thinking = el("div", { class: "thinking" });
    this.answerEl = el("div", { class: "answer" });
    this.summaryEl = el("table", { class: "summary" });
    this.root.append(el("h3", { text: "Thinking" }), this.thinking, el("h3", { text: "Answer" }),
      this.answerEl, this.summaryEl);
    if (lat && (lat.kind === "feedback" || lat.kind === "head")) {
      this.strip = el("div", { class: "steps" });
      this.thinking.append(this.strip);
    } else if (lat && lat.kind === "loop") {
      this.grid = el("div", { class: "grid" });
      this.thinking.append(this.grid);
    }
  }

  onTick(info) {
    const entry = info.trace && info.trace.length ? info.trace[0] : null;
    this.addStep(info.steps, entry);
  }

  addStep(k, entry) {
    this.cols[k - 1] = entry;
    if (this.strip) {
      this.strip.append(this.stepColumn(k, entry));
      // Entry k's stop_prob was read from step k-1's output (the prompt's, for k = 1): the
      // decision that ran step k. It is drawn on the step it was read from.
      if (entry && entry.stop_prob != null && k > 1) this.setStop(k - 1, entry.stop_prob);
    } else if (this.grid) this.drawGrid(k);
  }

  stepColumn(k, e) {
    const col = el("div", { class: "step-col", "data-step": String(k) });
    col.append(el("div", { class: "k" }, `step ${k}`,
      e ? el("span", { text: `‖z‖ ${e.norm.toFixed(1)}` }) : null));
    if (!e) return col;
    const texts = e.top_texts || e.top_tokens.map((t) => `#${t[0]}`);
    texts.forEach((t, i) => {
      const p = e.top_probs ? e.top_probs[i] : null;
      col.append(el("div", { class: "tok", title: `id ${e.top_tokens[i][0]}, logit ` +
          e.top_tokens[i][1].toFixed(2) },
        el("div", { class: "bar", style: `width:${p == null ? 0 : Math.max(2, p * 100)}%` }),
        el("code", { text: JSON.stringify(t), title: JSON.stringify(t) }),
        el("span", { class: "p", text: p == null ? "" : pct(p) })));
    });
    return col;
  }

  // The stop probability read from step k's output: the decision whether to run step k+1
  // (the next entry's stop_prob) or, after the last step, the one that ended the phase
  // (stats.end_stop_prob).
  setStop(k, p) {
    const col = this.strip.querySelector(`.step-col[data-step="${k}"]`);
    if (!col || col.querySelector(".stopbar")) return;
    col.append(el("div", { class: "stopbar" },
      el("div", { class: "fill", style: `width:${p * 100}%` })));
    col.append(el("div", { class: "stoptext", text: `${this.stopName()} ${fmtP(p)}`,
      title: `${this.stopName()} read from step ${k}'s output: the chance the phase stops ` +
        "after this step" }));
  }

  stopName() {
    return this.lat && this.lat.family === "colar" ? "p(###)" : "p(stop)";
  }

  // Looped blocks: one row per pass, one cell per block position; with a trace entry the
  // cell shows the position's logit-lens top token in that pass (tooltip: the top 5).
  drawGrid(k) {
    const size = this.lat.block_size || 1;
    const passes = Math.ceil(k / size);
    this.grid.style.gridTemplateColumns = `auto repeat(${size}, minmax(22px, auto))`;
    this.grid.innerHTML = "";
    for (let p = 0; p < passes; p++) {
      this.grid.append(el("div", { class: "lab", text: `pass ${p + 1}` }));
      for (let j = 0; j < size; j++) {
        const i = p * size + j;
        const e = this.cols[i];
        let title = `pass ${p + 1}, block position ${j + 1}`;
        const cell = el("div", { class: "cell" + (i < k ? " on" : "") + (e ? " lens" : ""),
          "data-pass": String(p + 1), "data-position": String(j + 1) });
        if (e) {
          const texts = e.top_texts || e.top_tokens.map((t) => `#${t[0]}`);
          cell.append(el("code", { text: JSON.stringify(texts[0]) }));
          if (e.top_probs) cell.append(el("span", { class: "p", text: pct(e.top_probs[0]) }));
          title += ": " + texts.map((t, n) => `${JSON.stringify(t)} ` +
            (e.top_probs ? pct(e.top_probs[n]) : "")).join(", ") + `; ‖h‖ ${e.norm.toFixed(1)}`;
        }
        cell.title = title;
        this.grid.append(cell);
      }
    }
  }

  onText(text) {
    this.answer += text;
    this.answerEl.textContent = this.answer;
  }

  onReasoning(text) {
    if (this.strip || this.grid) return;  // latent steps are drawn, not written
    if (!this.reasoningEl) {
      this.reasoningEl = el("div", { class: "thinking-text" });
      this.thinking.append(this.reasoningEl);
    }
    this.reasoning += text;
    this.reasoningEl.textContent = this.reasoning;
  }

  onFinish(latent) {
    this.latent = latent;
    if (!latent) return;
    const trace = latent.trace || [];
    if (this.strip) {
      for (let k = this.cols.length + 1; k <= latent.steps; k++) this.addStep(k, trace[k - 1] || null);
      this.markEnd(latent);
    } else if (this.grid) {
      trace.forEach((e, i) => { this.cols[i] = e; });
      if (latent.steps) this.drawGrid(latent.steps);
      this.thinking.append(el("div", { class: "stop-marker",
        text: loopSummary(this.lat, latent.steps) }));
    } else if (this.lat && this.lat.kind === "recurrent") {
      this.heatMap(trace, latent.recurrence);
    }
  }

  markEnd(latent) {
    const s = latent.stats;
    let head = `ended after ${latent.steps} step${latent.steps === 1 ? "" : "s"}`;
    let why = "";
    if (s && !s.thinking) {
      head = "thinking off"; why = "no latent phase";
    } else if (s) {
      head = s.end === "stop" ? `stop at step ${s.stop_step}` : `${s.end} at step ${s.steps}`;
      const p = s.end_stop_prob;
      if (p != null && s.end !== "length") this.setStop(s.steps, p);
      if (this.lat.family === "colar") {
        why = s.end === "stop" ? `### sampled (p ${p == null ? "?" : fmtP(p)})`
          : s.end === "cap" ? `max_latent ${s.max_latent} reached` : "max_tokens or context spent";
      } else {
        const thr = s.stop_threshold;
        why = s.end === "stop" ? `p(stop) ${p == null ? "?" : fmtP(p)} > ${thr}`
          : s.end === "cap" ? `max_latent ${s.max_latent} reached` : "max_tokens or context spent";
        this.strip.querySelectorAll(".stopbar").forEach((bar) =>
          bar.append(el("div", { class: "thr", style: `left:${thr * 100}%`, title: `threshold ${thr}` })));
      }
    } else if (latent.steps === 0) {
      head = "thinking off"; why = "latent_budget 0: no latent steps";
    } else {
      why = "the budget's fixed number of steps";
    }
    const last = this.strip.querySelector(`.step-col[data-step="${latent.steps}"]`);
    if (last && s && s.end === "stop") last.classList.add("fired");
    this.strip.append(el("div", { class: "stop-marker" }, el("b", { text: head }),
      el("span", { text: why })));
  }

  // Recurrent depth: one cell per generated token, trace entry i paired with the i-th token
  // the stream's logprobs named (the API's contract: one entry per generated token, a stop
  // or EOS token included). Ouro cells also draw the token's exit distribution, one bar per
  // loop step.
  heatMap(trace, recurrence) {
    const depths = trace.map((e) => e.depth);
    const max = Math.max(1, ...depths);
    const map = el("div", { class: "heat" });
    trace.forEach((e, i) => {
      const t = i < this.tokens.length ? this.tokens[i] : "⟂";
      const a = (e.depth / max).toFixed(2);
      let title = `token ${i + 1} ${JSON.stringify(t)}: depth ${e.depth}`;
      if (e.readout_step != null) title += `, read out at step ${e.readout_step + 1} of ${e.depth}`;
      let bars = null;
      if (e.exit_probs) {
        title += "\nexit probability per step: " +
          e.exit_probs.map((p, n) => `${n + 1}: ${p.toFixed(3)}`).join(", ");
        bars = el("span", { class: "exitbars" }, ...e.exit_probs.map((p, n) =>
          el("i", { style: `height:${Math.max(1, p * 100)}%`,
            class: n === e.readout_step ? "read" : "" })));
      }
      // white text on the darkest cells, where the page's ink would not read
      map.append(el("span", { class: e.depth / max > 0.9 ? "cell deep" : "cell",
        "data-depth": String(e.depth), "data-token": t,
        style: `background: rgba(47,111,219,${a})`, title },
        visible(t), e.readout_step != null ? el("sub", { text: `@${e.readout_step + 1}` }) : null,
        bars));
    });
    this.thinking.append(map, el("div", { class: "legend", text:
      `recurrences per token, darker = deeper (max ${max}); ␣ a space, ↵ a newline` +
      (trace.some((e) => e.readout_step != null) ? "; @n: the loop step read out (Ouro)" : "") +
      (trace.some((e) => e.exit_probs) ? "; bars: the exit probability of each step (Ouro)" : "") }));
    if (trace.length !== this.tokens.length) {
      this.thinking.append(el("div", { class: "align-warn", text:
        `${trace.length} trace entries for ${this.tokens.length} streamed tokens: ` +
        "cells pair them by position" }));
    }
    if (recurrence && recurrence.histogram) {
      const hist = el("div", { class: "hist", title: "tokens per recurrence count" });
      const counts = Object.entries(recurrence.histogram);
      const top = Math.max(...counts.map((c) => c[1]));
      for (const [depth, n] of counts) {
        hist.append(el("div", { style: `height:${(n / top) * 100}%`, title: `${n} tokens at depth ${depth}` },
          el("span", { text: depth })));
      }
      this.thinking.append(el("h3", { text: `Depth distribution (mean ${recurrence.mean_iterations.toFixed(2)})` }), hist);
    }
  }

  summary(rows) {
    this.summaryEl.innerHTML = "";
    for (const [k, v, cls] of rows) {
      this.summaryEl.append(el("tr", {}, el("td", { text: k }), el("td", { class: cls || "", text: v })));
    }
  }
}

// A probability with three decimals, or in scientific notation below 0.001.
function fmtP(p) {
  return p === 0 || p >= 0.001 ? p.toFixed(3) : p.toExponential(1);
}

// A token's text with its whitespace made visible (a heat-map cell's text).
function visible(t) {
  return t.replace(/ /g, "␣").replace(/\n/g, "↵").replace(/\t/g, "⇥");
}

function pct(p) {
  return p >= 0.995 ? "100%" : p < 0.001 ? "<0.1%" : (p * 100).toFixed(p < 0.1 ? 1 : 0) + "%";
}

// Looped blocks: what `steps` block positions ran means. latent_budget counts the passes after
// pass 0, so budget 0 still runs pass 0: the block of latent-token placeholders, no feedback.
function loopSummary(lat, steps) {
  const passes = Math.ceil(steps / (lat.block_size || 1));
  return `${steps} latent position${steps === 1 ? "" : "s"}: ` +
    `${passes} pass${passes === 1 ? "" : "es"} over the block` +
    (passes === 1 ? " (latent_budget 0: pass 0 only, the latent-token placeholders with no " +
      "feedback)" : "");
}

// The summary's "thinking" value: latent steps, recurrences per token, a looped block's
// passes, or the tokens of a text chain of thought (before "###" / "Answer:"), also a head
// model's with thinking off (CoLaR then writes its reasoning as text before "###").
function thinkingSummary(lat, latent, tokens) {
  if (lat && lat.kind === "recurrent") {
    return latent && latent.recurrence
      ? `${latent.recurrence.mean_iterations.toFixed(2)} recurrences per token` : "n/a";
  }
  if (lat && lat.kind === "loop" && latent && latent.steps) return loopSummary(lat, latent.steps);
  const steps = latent ? latent.steps : 0;
  if (lat && !(lat.kind === "head" && latent && latent.stats && !latent.stats.thinking)) {
    return `${steps} latent step${steps === 1 ? "" : "s"}`;
  }
  const n = thinkingTokens(tokens);
  const off = lat ? "thinking off, " : "";
  return n === null ? `none (${off}no ### or Answer: mark in the output)`
    : `${n} thinking token${n === 1 ? "" : "s"} (${off}text before ### / Answer:)`;
}

// The answer part of an output: after "Answer:" or "####" when present.
function finalAnswer(text) {
  for (const mark of ["Answer:", "####"]) {
    const i = text.lastIndexOf(mark);
    if (i >= 0) return text.slice(i + mark.length).trim();
  }
  return text.trim();
}

const norm = (s) => s.replace(/\s+/g, " ").trim();

// Tokens of a text chain of thought: those before the answer mark ("###", "Answer:"); null
// when the output has no mark (then nothing in it is told apart as thinking).
function thinkingTokens(tokens) {
  let text = "";
  for (let i = 0; i < tokens.length; i++) {
    text += tokens[i];
    if (text.includes("###") || text.includes("Answer:")) return i;
  }
  return null;
}

async function* sse(response) {
  const reader = response.body.getReader();
  const dec = new TextDecoder();
  let buf = "";
  for (;;) {
    let read;
    try {
      read = await reader.read();
    } catch (err) {  // the connection broke mid-stream (a reset, the server killed)
      throw new Error(`${CUT}: ${err.message || err}`);
    }
    const { value, done } = read;
    if (done) break;
    buf += dec.decode(value, { stream: true });
    let cut;
    while ((cut = buf.indexOf("\n\n")) >= 0) {
      const event = buf.slice(0, cut);
      buf = buf.slice(cut + 2);
      for (const line of event.split("\n")) {
        if (line.startsWith("data: ") && line.slice(6) !== "[DONE]") yield JSON.parse(line.slice(6));
      }
    }
  }
}

// One streamed request drawn in its own pane; `signal` (the Stop button's) aborts it. The
// summary is drawn only when the stream finished (a finish_reason came); otherwise the pane
// says why it ended (an error, Stop, or a stream cut short, e.g. the server stopping).
async function run(model, route, extra, title, signal) {
  const lat = latentOf(model);
  const view = new RunView(title, lat);
  $("runs").append(view.root);
  const t0 = performance.now();
  let first = null, usage = null, finish = null;
  const path = route === "chat" ? "/v1/chat/completions" : "/v1/completions";
  try {
    const r = await fetch(path, { method: "POST", headers: headers(), signal,
                                  body: JSON.stringify(requestBody(model, route, extra)) });
    if (!r.ok) throw new Error(await apiError(r));
    for await (const chunk of sse(r)) {
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) usage = chunk.usage;
      for (const c of chunk.choices || []) {
        const d = c.delta || {};
        const text = route === "chat" ? d.content : c.text;
        if (c.logprobs) {
          const toks = route === "chat" ? (c.logprobs.content || []).map((x) => x.token)
            : c.logprobs.tokens || [];
          view.tokens.push(...toks);
        }
        if (c.latent && c.finish_reason == null) view.onTick(c.latent);
        else if (d.reasoning_content) view.onReasoning(d.reasoning_content);
        if (text) {
          if (first === null) first = performance.now();
          view.onText(text);
        }
        if (c.finish_reason != null) {
          finish = c.finish_reason;
          view.onFinish(c.latent || null);
        }
      }
    }
    if (finish === null) throw new Error(CUT);
  } catch (err) {
    const stopped = signal && signal.aborted;
    view.root.append(el("div", { class: "error", text: stopped ? "stopped (Stop pressed)"
      : String(err.message || err) }));
    return;
  }
  const secs = (performance.now() - t0) / 1000;
  const rows = [["answer", finalAnswer(view.answer) || "(none)"]];
  const expected = $("expected").value.trim();
  if (expected) {
    const ok = norm(finalAnswer(view.answer)) === norm(expected);
    rows.push(["correct", ok ? "yes" : `no (expected ${expected})`, ok ? "ok" : "bad"]);
  }
  rows.push(["thinking", thinkingSummary(lat, view.latent, view.tokens)]);
  if (usage) rows.push(["tokens", `${usage.completion_tokens} generated`]);
  rows.push(["time", `${secs.toFixed(2)} s` + (first ? `, first answer text at ${((first - t0) / 1000).toFixed(2)} s` : "")]);
  rows.push(["finish", finish]);
  view.summary(rows);
}

// The form's first invalid field (a value out of its min/max, say) as "name: why", or null.
// The form is novalidate so that this shows in the page too: a headless browser draws no
// validation bubble.
function invalidField() {
  const form = $("ask");
  if (form.checkValidity()) return null;
  form.reportValidity();
  const bad = form.querySelector("input:invalid, select:invalid, textarea:invalid");
  return `${bad.id.replace(/^c_/, "")}: ${bad.validationMessage}`;
}

async function submit(ev) {
  ev.preventDefault();
  const model = $("model").value;
  const route = $("route").value;
  if (!model) return;
  const runs = $("runs");
  runs.innerHTML = "";
  const bad = invalidField();
  if (bad) {
    runs.classList.remove("pair");
    runs.append(el("div", { class: "run" }, el("div", { class: "error", text: bad })));
    return;
  }
  const compare = $("compare").checked;
  runs.classList.toggle("pair", compare);
  const lat = latentOf(model);
  const abort = new AbortController();
  const signal = abort.signal;
  $("run").disabled = true;
  $("stop").hidden = false;
  $("stop").onclick = () => abort.abort();
  try {
    await run(model, route, controlValues(lat), model, signal);
    if (compare && !signal.aborted) {
      const other = $("compare_with").value;
      if (other) await run(other, route, {}, other, signal);
      else {
        const off = lat && offSwitch(lat);
        if (off) await run(model, route, off.body, `${model} (${off.label})`, signal);
      }
    }
  } finally {
    setReady();
    $("stop").hidden = true;
  }
}

$("auth").addEventListener("submit", (ev) => { ev.preventDefault(); loadModels(); });
$("ask").addEventListener("submit", submit);
$("model").addEventListener("change", showControls);
$("key").value = sessionStorage.getItem("latentserve-key") || "";
loadModels();
