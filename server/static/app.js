// simmer's browser UI: wires the chat, the device panel and the lifecycle reporting to the page.
// Plain ES modules, no build step, nothing fetched from anywhere but this server.

import { ApiError, getJSON, getKey, setKey } from "./js/api.js";
import { Chat } from "./js/chat.js";
import { DevicePanel, formatBytes } from "./js/device.js";
import { Lifecycle } from "./js/lifecycle.js";

const $ = (id) => document.getElementById(id);

// ---- the API key: asked for once, when the server answers 401, kept for this tab's session ------------
const keyDialog = $("key-dialog");
let keyDismissedAt = 0;

/** Background pollers ask quietly (not again soon after Cancel); a person's own action always asks. */
function askForKey(force = false) {
  if (keyDialog.open || (!force && Date.now() - keyDismissedAt < 60000)) return;
  $("key-input").value = getKey();
  keyDialog.returnValue = ""; // Escape keeps the last value; a stale "save" must not count
  keyDialog.showModal();
}

$("key-cancel").addEventListener("click", () => keyDialog.close("cancel"));

// Store the key when the form is submitted, not on "close": that event comes a task later, and a send
// made in between would still go out without the key.
keyDialog.querySelector("form").addEventListener("submit", () => setKey($("key-input").value.trim()));
keyDialog.addEventListener("close", () => {
  if (keyDialog.returnValue === "save") refreshModel();
  else keyDismissedAt = Date.now();
});
$("key-button").addEventListener("click", () => askForKey(true));

// ---- model and variant ----------------------------------------------------------------------------
let modelTimer = null;

async function refreshModel() {
  clearTimeout(modelTimer);
  let next = 5000; // cheap: /health reads counters
  try {
    const response = await fetch("/health"); // open: no key needed
    const health = await response.json().catch(() => ({}));
    if (health.status === "ok") {
      $("model-name").textContent = health.model;
      $("model-variant").textContent = health.variant || "–";
      $("queue").textContent = health.busy ? `busy, ${health.queue_depth} waiting` : "idle";
    } else if (health.status === "loading") {
      $("model-name").textContent = "loading…";
      next = 2000;
    } else {
      $("model-name").textContent = health.error ? "failed to load" : health.status || "unavailable";
    }
    const models = await getJSON("/v1/models");
    fillPicker(models.data || []);
    const chosen = $("model-picker").value;
    const entry = (models.data || []).find((m) => (chosen ? m.id === chosen : m.default)) || (models.data || [])[0];
    if (entry && entry.context_length) $("model-context").textContent = `${entry.context_length} tokens`;
  } catch (err) {
    if (err instanceof ApiError && err.status === 401) askForKey();
    else if (err instanceof ApiError && err.network) $("model-name").textContent = "server unreachable";
    next = 10000;
  }
  modelTimer = setTimeout(refreshModel, next);
}

// ---- the model picker: every model /v1/models lists ------------------------------------------------
export function modelLabel(m) {
  const parts = [m.id];
  if (m.remote) parts.push("upstream");
  else {
    if (m.disk_bytes) parts.push(formatBytes(m.disk_bytes));
    if (m.loaded) parts.push("loaded");
    if (m.can_chat === false) parts.push("no chat");
  }
  return parts.join(" · ");
}

function fillPicker(models) {
  const picker = $("model-picker");
  const chosen = picker.value;
  const options = models.map((m) => {
    const option = document.createElement("option");
    option.value = m.default ? "" : m.id; // the default: sent without a model, as the server expects
    option.textContent = modelLabel(m) + (m.default ? " (default)" : "");
    option.dataset.model = m.id;
    option.disabled = m.can_chat === false; // this page chats; a base model serves /v1/completions
    return option;
  });
  if (!options.length) return;
  picker.replaceChildren(...options);
  picker.value = options.some((o) => o.value === chosen && !o.disabled) ? chosen : "";
}

// ---- the three parts ------------------------------------------------------------------------------
const panel = new DevicePanel(
  {
    panel: $("device"),
    badge: $("level-badge"),
    topBadge: $("top-level-badge"),
    reason: $("level-reason"),
    simNote: $("sim-note"),
    notes: $("device-notes"),
    chart: $("chart"),
    temperature: $("d-temperature"),
    headroom: $("d-headroom"),
    memory: $("d-memory"),
    memoryMeter: $("d-memory-meter"),
    battery: $("d-battery"),
    lifecycle: $("d-lifecycle"),
    model: $("d-model"),
    ladder: $("d-ladder"),
    threads: $("d-threads"),
    variant: $("d-variant"),
    contextCap: $("d-context"),
    maxTokens: $("d-max-tokens"),
    pace: $("d-pace"),
    paused: $("d-paused"),
    pausedRow: $("d-paused-row"),
    transitions: $("transitions"),
    connection: $("device-connection"),
  },
  { onState: (state) => chat.applyGovernor(state), onAuthNeeded: askForKey },
);

const chat = new Chat(
  {
    list: $("messages"),
    form: $("composer"),
    prompt: $("prompt"),
    send: $("send"),
    stop: $("stop"),
    temperature: $("temperature"),
    maxTokens: $("max-tokens"),
    truncate: $("truncate"),
    model: $("model-picker"),
    newChat: $("new-chat"),
    error: $("chat-error"),
  },
  {
    onVariant: (variant) => ($("model-variant").textContent = variant),
    onGovernor: (state) => panel.update(state),
    onAuthNeeded: () => askForKey(true),
    onReplyStart: refreshModel,
    onReplyEnd: refreshModel,
  },
);

const lifecycle = new Lifecycle($("background-toggle"), {
  onState: (state) => panel.update(state),
  onUnsupported: () => ($("background-toggle").disabled = true),
});

const temperature = $("temperature");
temperature.addEventListener("input", () => ($("temperature-value").value = temperature.value));

refreshModel();
panel.start();
lifecycle.start();
$("prompt").focus();
window.simmer = { chat, panel, lifecycle }; // for the browser tests and curious people
