// The conversation: history kept in the page (the whole history goes with every turn; the server reuses
// its KV cache for the shared prefix), a streamed reply, Stop, and the reply's timings.

import { ApiError, apiFetch, describeError } from "./api.js";
import { readSSE } from "./sse.js";

/** Is a governor state (GET /v1/thermal shape) holding replies? `running`: a reply already under way. */
export function pausedBy(state, running) {
  if (!state) return false;
  if (typeof state.paused === "boolean") return state.paused;
  const limits = state.limits || {};
  return Boolean(running ? limits.pause_running : limits.pause_new || limits.pause_running);
}

export function pauseReason(state) {
  if (state && state.lifecycle === "background") {
    return "Paused while the app is in the background. The reply continues when this page is visible again.";
  }
  const why = state && state.reason ? ` (${state.reason})` : "";
  return `Paused by the device governor${why}. The reply continues when the device recovers.`;
}

// Why a reply left the device (the `route.reason` of simmer's answers), in words.
const UPSTREAM_WHY = {
  thermal: "the device is too hot",
  background: "the app is in the background",
  memory: "the device is short of memory",
  context: "the conversation is longer than the local model reads",
  model: "this model is not on the device",
  queue: "the device is busy",
  loading: "the local model is still loading",
  local_failed: "the local model could not load",
  request: "it was asked for",
  policy: "the server sends every request upstream",
};

/** The X-Simmer-Route header ("upstream; reason=thermal") as a route object, or null. */
export function parseRouteHeader(value) {
  const m = /^\s*(local|upstream)\s*(?:;\s*reason=([\w-]+))?/.exec(value || "");
  return m ? { served: m[1], reason: m[2] || "" } : null;
}

/** "Answered by the upstream server (the device is too hot)", or "" for a reply made on the device. */
export function routeLabel(route) {
  if (!route || route.served !== "upstream") return "";
  const why = UPSTREAM_WHY[route.reason];
  return `Answered by the upstream server${why ? ` (${why})` : ""}`;
}

function formatTimings(timings, usage, variant) {
  const parts = [];
  if (timings) {
    if (timings.ttft_ms != null) parts.push(`TTFT ${Math.round(timings.ttft_ms)} ms`);
    if (timings.predicted_per_second) parts.push(`${timings.predicted_per_second.toFixed(1)} tok/s`);
    if (timings.prompt_per_second) parts.push(`prompt ${Math.round(timings.prompt_per_second)} tok/s`);
  }
  if (usage) {
    const byModel = Object.entries(usage.models || {});
    if (byModel.length > 1) parts.push(byModel.map(([m, n]) => `${m} ${n}`).join(" + ") + " tokens");
    else parts.push(`${usage.completion_tokens} tokens`);
    const cached = usage.prompt_tokens_details && usage.prompt_tokens_details.cached_tokens;
    if (cached) parts.push(`${cached} of ${usage.prompt_tokens} prompt tokens cached`);
  }
  if (variant) parts.push(variant);
  return parts.join(" · ");
}

class MessageView {
  constructor(list, role, text) {
    this.el = document.createElement("article");
    this.el.className = `msg ${role}`;
    this.el.dataset.role = role;
    const who = document.createElement("h3");
    who.className = "who";
    who.textContent = role === "user" ? "You" : "simmer";
    this.content = document.createElement("div");
    this.content.className = "content";
    this.content.textContent = text;
    this.status = document.createElement("p");
    this.status.className = "status";
    this.status.hidden = true;
    this.meta = document.createElement("p");
    this.meta.className = "meta";
    this.meta.hidden = true;
    this.el.append(who, this.content, this.status, this.meta);
    list.append(this.el);
  }

  append(text) {
    this.content.append(text); // a text node: model output is never parsed as HTML
  }

  setStatus(text, kind = "") {
    this.status.textContent = text;
    this.status.hidden = !text;
    this.status.className = `status ${kind}`.trim();
    this.el.dataset.state = kind || "";
  }

  setMeta(text) {
    this.meta.textContent = text;
    this.meta.hidden = !text;
  }

  /** Where the reply was made: an "upstream" tag next to the name, the reason in words on hover. */
  setRoute(route) {
    if (!route) return;
    this.el.dataset.route = route.served;
    const label = routeLabel(route);
    if (!label) return;
    const tag = document.createElement("span");
    tag.className = "route-tag";
    tag.textContent = "upstream";
    tag.title = label;
    tag.setAttribute("aria-label", label);
    this.el.querySelector(".who").append(" ", tag);
  }
}

export class Chat {
  /** els: {list, form, prompt, send, stop, temperature, maxTokens, truncate, newChat, error}
   *  hooks: {onVariant(variant), onGovernor(state), onAuthNeeded(), onReplyStart(), onReplyEnd()} */
  constructor(els, hooks = {}) {
    this.els = els;
    this.hooks = hooks;
    this.history = [];
    this.controller = null;
    this.reply = null; // the MessageView being streamed
    this.received = false;
    this.paused = false;
    this.lastState = null;

    els.form.addEventListener("submit", (e) => {
      e.preventDefault();
      this.send();
    });
    els.prompt.addEventListener("keydown", (e) => {
      // Enter sends, Shift+Enter is a new line; never while an input method (Chinese, Japanese) composes.
      if (e.key === "Enter" && !e.shiftKey && !e.isComposing && e.keyCode !== 229) {
        e.preventDefault();
        this.send();
      } else if (e.key === "Escape" && this.controller) {
        this.stop();
      }
    });
    els.stop.addEventListener("click", () => this.stop());
    els.newChat.addEventListener("click", () => this.clear());
  }

  get busy() {
    return this.controller !== null;
  }

  setBusy(busy) {
    this.els.send.hidden = busy;
    this.els.stop.hidden = !busy;
    this.els.list.setAttribute("aria-busy", busy ? "true" : "false");
    if (!busy) this.els.prompt.focus();
    else this.els.stop.focus();
  }

  showError(err) {
    const { text, detail } = describeError(err);
    this.els.error.replaceChildren();
    const p = document.createElement("p");
    p.textContent = text;
    this.els.error.append(p);
    if (detail) {
      const d = document.createElement("p");
      d.className = "detail";
      d.textContent = `Server said: ${detail}`;
      this.els.error.append(d);
    }
    this.els.error.dataset.code = err.code || (err.network ? "network" : "");
    this.els.error.hidden = false;
    if (err.status === 401 || err.code === "invalid_api_key") this.hooks.onAuthNeeded?.();
  }

  hideError() {
    this.els.error.hidden = true;
    this.els.error.replaceChildren();
  }

  clear() {
    this.stop();
    this.history = [];
    this.els.list.querySelectorAll(".msg").forEach((el) => el.remove());
    this.hideError();
    this.els.prompt.focus();
  }

  stop() {
    if (this.controller) this.controller.abort(); // the server cancels the generation when we hang up
  }

  /** A governor state from the stream or the device panel: show or clear "paused" on the live reply. */
  applyGovernor(state) {
    this.lastState = state;
    if (!this.reply) return;
    const paused = pausedBy(state, this.received);
    if (paused && !this.paused) {
      this.paused = true;
      this.reply.setStatus(pauseReason(state), "paused");
    } else if (!paused && this.paused) {
      this.paused = false;
      this.reply.setStatus("Resumed.", "resumed");
    }
  }

  scrollToEnd() {
    const list = this.els.list;
    list.scrollTop = list.scrollHeight;
  }

  requestBody() {
    const body = {
      messages: this.history,
      stream: true,
      stream_options: { include_usage: true },
      governor_events: true,
    };
    const temperature = Number.parseFloat(this.els.temperature.value);
    if (Number.isFinite(temperature)) body.temperature = temperature;
    const maxTokens = Number.parseInt(this.els.maxTokens.value, 10);
    if (Number.isFinite(maxTokens) && maxTokens > 0) body.max_tokens = maxTokens;
    if (this.els.truncate.checked) body.truncate = true;
    const model = this.els.model && this.els.model.value;
    if (model) body.model = model;
    return body;
  }

  async send() {
    const text = this.els.prompt.value;
    if (!text.trim() || this.busy) return;
    this.hideError();
    const turn = { role: "user", content: text };
    this.history.push(turn);
    const userView = new MessageView(this.els.list, "user", text);
    this.els.prompt.value = "";
    const reply = new MessageView(this.els.list, "assistant", "");
    reply.el.setAttribute("aria-busy", "true");
    reply.setStatus("Waiting for the model…", "waiting");
    this.reply = reply;
    this.received = false;
    this.paused = false;
    this.controller = new AbortController();
    this.setBusy(true);
    this.scrollToEnd();
    if (this.lastState) this.applyGovernor(this.lastState); // already paused before we started?

    let content = "";
    let timings = null;
    let usage = null;
    let variant = null;
    let finishReason = null;
    let truncated = false;
    let route = null;
    let error = null;
    let stopped = false;
    try {
      const response = await apiFetch("/v1/chat/completions", {
        method: "POST",
        body: JSON.stringify(this.requestBody()),
        headers: { Accept: "text/event-stream" },
        signal: this.controller.signal,
      });
      if (!response.ok) throw await ApiError.fromResponse(response);
      route = parseRouteHeader(response.headers.get("X-Simmer-Route")); // the final chunk confirms it
      this.hooks.onReplyStart?.();
      for await (const event of readSSE(response.body)) {
        if (event.event === "governor") {
          const state = JSON.parse(event.data);
          if (state.switch) {
            // the governor moved this reply to another model; it goes on there
            reply.setStatus(`Continued on ${state.switch.new} (${state.switch.old} before).`, "switched");
            continue;
          }
          this.applyGovernor(state);
          this.hooks.onGovernor?.(state);
          continue;
        }
        if (event.data === "[DONE]") break;
        let chunk;
        try {
          chunk = JSON.parse(event.data);
        } catch {
          continue; // not ours to understand
        }
        if (chunk.error) throw ApiError.fromBody(chunk, 0);
        if (chunk.system_fingerprint) variant = chunk.system_fingerprint.replace(/^simmer-/, "");
        if (chunk.timings) timings = chunk.timings;
        if (chunk.usage) usage = chunk.usage;
        if (chunk.truncated) truncated = true;
        if (chunk.route) route = chunk.route;
        const choice = chunk.choices && chunk.choices[0];
        if (!choice) continue;
        if (choice.finish_reason) finishReason = choice.finish_reason;
        const delta = choice.delta && choice.delta.content;
        if (delta) {
          if (!this.received) {
            this.received = true;
            reply.setStatus("", "");
          } else if (!this.paused && reply.el.dataset.state === "resumed") {
            reply.setStatus("", "");
          }
          content += delta;
          reply.append(delta);
          this.scrollToEnd();
        }
      }
    } catch (err) {
      if (err && err.name === "AbortError") stopped = true;
      else if (err instanceof ApiError) error = err;
      else error = new ApiError({ network: true, midStream: this.received, message: String(err) });
      if (error && this.received) error.midStream = true;
    } finally {
      this.controller = null;
      this.reply = null;
      reply.el.setAttribute("aria-busy", "false");
      this.setBusy(false);
    }

    if (content) this.history.push({ role: "assistant", content });
    // No answer: the turn leaves the history (two user turns in a row confuse chat templates).
    else this.history.splice(this.history.indexOf(turn), 1);
    if (error && !content) {
      // Nothing came back: give the text back so a retry is one key press.
      userView.el.classList.add("not-sent");
      userView.setStatus("Not sent.", "not-sent");
      reply.el.remove();
      if (!this.els.prompt.value) this.els.prompt.value = text;
    }
    if (error) this.showError(error);
    if (stopped) reply.setStatus(content ? "Stopped." : "Stopped before the first word.", "stopped");
    else if (!error && finishReason === "length") reply.setStatus("Cut off at the max-tokens limit.", "length");
    else if (!error) reply.setStatus("", "done");
    if (truncated) reply.setStatus("Older turns were dropped so the conversation fits the context.", "truncated");
    reply.setRoute(route);
    const where = routeLabel(route);
    const meta = formatTimings(timings, usage, route && route.served === "upstream" ? null : variant);
    reply.setMeta([where, meta].filter(Boolean).join(" · "));
    if (variant) this.hooks.onVariant?.(variant);
    this.hooks.onReplyEnd?.();
    this.scrollToEnd();
  }
}
