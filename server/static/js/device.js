// The device panel: level, reason, a live chart, memory, battery, lifecycle, the limits in force and the
// recent transitions. Fed by GET /v1/thermal/events (SSE) for changes the moment they happen, and by
// polling GET /v1/thermal for the temperature curve (events only come on a change of level or limits)
// and as the fallback when the event stream is unavailable.

import { ApiError, apiFetch, getJSON } from "./api.js";
import { drawChart } from "./chart.js";
import { readSSE } from "./sse.js";

const WINDOW_MS = 5 * 60 * 1000;
const POLL_LIVE_MS = 2000; // events cover changes; polling only draws the curve
const POLL_FALLBACK_MS = 1000;
const RECONNECT_MS = 5000;
const LEVELS = ["nominal", "fair", "serious", "critical"];

export function formatBytes(n) {
  if (n == null) return "?";
  const units = ["B", "KB", "MB", "GB", "TB"];
  let i = 0;
  let v = n;
  while (v >= 1024 && i < units.length - 1) {
    v /= 1024;
    i += 1;
  }
  return `${v >= 10 || i === 0 ? Math.round(v) : v.toFixed(1)} ${units[i]}`;
}

/** "17.7 tok/s": a rate for people (not 17.68033946251768). */
export function formatRate(value, unit) {
  if (value == null || !Number.isFinite(value)) return "";
  const digits = Math.abs(value) >= 100 ? 0 : Math.abs(value) >= 10 ? 1 : 2;
  return `${Number(value.toFixed(digits))} ${unit}`;
}

function text(el, value) {
  if (el) el.textContent = value;
}

export function setBadge(el, level) {
  if (!el) return;
  const known = LEVELS.includes(level) ? level : "unknown";
  el.textContent = level || "unknown";
  el.className = `badge level-${known}`;
  el.dataset.level = known;
}

export class DevicePanel {
  /** els: see index.html ids; hooks: {onState(state), onAuthNeeded()} */
  constructor(els, hooks = {}) {
    this.els = els;
    this.hooks = hooks;
    this.samples = [];
    this.state = null;
    this.live = false;
    this.unavailable = false;
    this.controller = null;
    this.pollTimer = null;
    this.stopped = false;
  }

  start() {
    this.redraw();
    this.connect();
    this.poll();
    window.addEventListener("resize", () => this.redraw());
    window.addEventListener("simmer:key-changed", () => {
      this.controller?.abort();
      this.unavailable = false;
    });
  }

  setConnection(kind) {
    const words = {
      live: "Live: updates arrive as the governor changes level.",
      polling: "Polling every second (the live event stream is not available).",
      unavailable: "This server publishes no device state (no governor).",
      auth: "Waiting for the API key.",
      offline: "Cannot reach the server; retrying.",
    };
    text(this.els.connection, words[kind] || "");
    this.els.connection.dataset.kind = kind;
  }

  async connect() {
    while (!this.stopped) {
      this.controller = new AbortController();
      let wait = RECONNECT_MS;
      try {
        const response = await apiFetch("/v1/thermal/events", {
          headers: { Accept: "text/event-stream" },
          signal: this.controller.signal,
        });
        if (!response.ok) throw await ApiError.fromResponse(response);
        this.live = true;
        this.setConnection("live");
        for await (const event of readSSE(response.body)) {
          if (!event.data) continue;
          try {
            this.update(JSON.parse(event.data));
          } catch (err) {
            if (!(err instanceof SyntaxError)) throw err;
          }
        }
      } catch (err) {
        if (err instanceof ApiError && err.status === 404) wait = 30000; // an older server: poll instead
        if (err instanceof ApiError && err.status === 401) this.hooks.onAuthNeeded?.();
      }
      this.live = false;
      if (!this.unavailable) this.setConnection("polling");
      await new Promise((resolve) => setTimeout(resolve, wait));
    }
  }

  async poll() {
    clearTimeout(this.pollTimer);
    try {
      this.update(await getJSON("/v1/thermal"));
      this.unavailable = false;
    } catch (err) {
      if (err instanceof ApiError && err.status === 404) {
        this.unavailable = true;
        this.setConnection("unavailable");
        setBadge(this.els.badge, "");
        setBadge(this.els.topBadge, "");
        this.els.badge.textContent = this.els.topBadge.textContent = "n/a";
        this.redraw();
      } else if (err instanceof ApiError && err.status === 401) {
        this.setConnection("auth");
        this.hooks.onAuthNeeded?.();
      } else if (err instanceof ApiError && err.network) {
        this.setConnection("offline");
      }
    }
    const every = this.unavailable ? 10000 : this.live ? POLL_LIVE_MS : POLL_FALLBACK_MS;
    this.pollTimer = setTimeout(() => this.poll(), every);
  }

  /** A state (GET /v1/thermal shape), from the events, the poll or a chat stream's governor event. */
  update(state) {
    if (!state || typeof state !== "object" || !state.level) return;
    this.state = state;
    const temperature = state.temperature || {};
    const now = Date.now();
    const sample = {
      t: now,
      celsius: temperature.celsius ?? null,
      headroom: state.headroom ?? null,
      forecast: state.forecast ?? null,
      throttle: temperature.throttle_c ?? null,
    };
    const last = this.samples[this.samples.length - 1];
    if (last && now - last.t < 250) this.samples[this.samples.length - 1] = sample;
    else this.samples.push(sample);
    while (this.samples.length && now - this.samples[0].t > WINDOW_MS + 60000) this.samples.shift();
    this.render(state);
    this.redraw();
    this.hooks.onState?.(state);
  }

  redraw() {
    const empty = this.unavailable ? "no device data on this server" : "waiting for readings…";
    drawChart(this.els.chart, this.samples, { windowMs: WINDOW_MS, empty });
  }

  render(state) {
    const els = this.els;
    setBadge(els.badge, state.level);
    setBadge(els.topBadge, state.level);
    text(els.reason, state.reason || "");
    const t = state.temperature || {};

    const simulated = t.source === "simulated";
    els.simNote.hidden = !simulated;
    if (simulated) {
      text(
        els.simNote,
        `Simulated device${t.sensor ? ` (${t.sensor})` : ""}: these temperatures come from a software model of a device, not from a sensor.`,
      );
    }
    els.panel.dataset.source = t.source || "";

    if (t.celsius != null) {
      const limit = t.throttle_c != null ? `, throttles at ${t.throttle_c} °C` : "";
      text(els.temperature, `${t.celsius.toFixed(1)} °C${limit}`);
    } else {
      text(els.temperature, t.source === "none" ? "no sensor" : "unknown");
    }
    const headroom = state.headroom != null ? state.headroom.toFixed(2) : "–";
    const forecast = state.forecast != null ? ` (in 10 s: ${state.forecast.toFixed(2)})` : "";
    text(els.headroom, `${headroom}${forecast}`);
    els.chart.setAttribute(
      "aria-label",
      `Chart of the last minutes. Now: ${els.temperature.textContent}; headroom ${headroom}${forecast}; ` +
        "1.0 is the throttling threshold.",
    );

    const m = state.memory;
    if (m && m.limit) {
      els.memoryMeter.max = m.limit;
      els.memoryMeter.value = m.used ?? 0;
      els.memoryMeter.hidden = false;
      const psi = m.psi && m.psi.some_avg10 ? `, pressure ${m.psi.some_avg10}%` : "";
      text(els.memory, `${formatBytes(m.used)} used of ${formatBytes(m.limit)} (${m.source})${psi}`);
    } else {
      els.memoryMeter.hidden = true;
      text(els.memory, "unknown");
    }

    const b = state.battery;
    if (!b) text(els.battery, "none (mains power)");
    else {
      const plug = b.plugged === true ? ", plugged in" : b.plugged === false ? ", on battery" : "";
      text(els.battery, `${Math.round(b.percent)} %${plug}`);
    }
    const work = state.background_work;
    if (work && !work.runs) {
      // conversions and summaries wait for a charger, a cool device or the foreground
      text(els.battery, `${els.battery.textContent}; background work waits (${work.why})`);
    }
    if (state.lifecycle === "background") {
      // Background while any client's lease holds: say whose, so a stray one is easy to spot.
      const holders = (state.leases || []).map((lease) => lease.client).join(", ");
      text(els.lifecycle, `background (replies may pause${holders ? `; reported by ${holders}` : ""})`);
    } else text(els.lifecycle, state.lifecycle || "?");

    const l = state.limits || {};
    if (state.model !== undefined) {
      text(els.model, state.model ? `${state.model}${state.variant ? ` (${state.variant})` : ""}` : "none loaded");
    }
    if (state.ladder) this.renderLadder(state.ladder); // GET /v1/thermal has it; a stream's events do not
    text(els.threads, l.threads != null ? String(l.threads) : "all usable");
    text(els.variant, l.variant || "as started");
    text(els.contextCap, l.context_cap != null ? `${l.context_cap} tokens` : "full");
    text(els.maxTokens, l.max_tokens != null ? `${l.max_tokens} per reply` : "no cap");
    const pace =
      l.tokens_per_second != null
        ? formatRate(l.tokens_per_second, "tok/s")
        : l.cpu_budget_cores != null
          ? formatRate(l.cpu_budget_cores, "busy cores")
          : "full speed";
    text(els.pace, pace);
    const paused = l.pause_running ? "all replies paused" : l.pause_new ? "new replies held" : "no";
    text(els.paused, paused);
    els.paused.dataset.paused = l.pause_running || l.pause_new ? "true" : "false";
    els.pausedRow.classList.toggle("alert", Boolean(l.pause_running || l.pause_new));

    const notes = [];
    if (state.enforced === false) notes.push("Observe only: the governor reports but does not limit (SIMMER_GOVERNOR=false).");
    if (state.device_killed) notes.push("The simulated device overheated and killed the app; it recovers once cool.");
    text(els.notes, notes.join(" "));
    els.notes.hidden = notes.length === 0;

    this.renderTransitions(state);
  }

  renderLadder(ladder) {
    const list = this.els.ladder;
    if (!list) return;
    list.replaceChildren();
    if (!ladder.length) {
      const li = document.createElement("li");
      li.className = "empty";
      li.textContent = "one model, its variants";
      list.append(li);
      return;
    }
    for (const rung of ladder) {
      const li = document.createElement("li");
      li.textContent = `${rung.model} (${rung.variant})`;
      li.dataset.current = rung.current ? "true" : "false";
      list.append(li);
    }
  }

  renderTransitions(state) {
    const list = this.els.transitions;
    const items = (state.transitions || []).slice(-8).reverse();
    list.replaceChildren();
    if (!items.length) {
      const li = document.createElement("li");
      li.className = "empty";
      li.textContent = "No changes yet.";
      list.append(li);
      return;
    }
    for (const tr of items) {
      const li = document.createElement("li");
      const from = document.createElement("span");
      setBadge(from, tr.old);
      const to = document.createElement("span");
      setBadge(to, tr.new);
      const when = document.createElement("span");
      when.className = "when";
      // Transition times are on the governor's clock (simulated seconds on a simulated device).
      when.textContent = typeof state.time === "number" ? `${Math.max(0, Math.round(state.time - tr.time))} s ago` : `t=${Math.round(tr.time)} s`;
      const reason = document.createElement("span");
      reason.className = "reason";
      reason.textContent = tr.reason;
      li.append(from, " → ", to, " ", when, reason);
      list.append(li);
    }
  }
}
