// Talking to the simmer server: the API key, fetch with it, and errors turned into words a person reads.

const KEY_STORAGE = "simmer.apiKey";

export function getKey() {
  try {
    return sessionStorage.getItem(KEY_STORAGE) || "";
  } catch {
    return ""; // storage disabled: the key lives only as long as this page
  }
}

export function setKey(key) {
  try {
    if (key) sessionStorage.setItem(KEY_STORAGE, key);
    else sessionStorage.removeItem(KEY_STORAGE);
  } catch {
    /* storage disabled */
  }
  window.dispatchEvent(new CustomEvent("simmer:key-changed"));
}

/** An error from the server (HTTP status or a stream error chunk), or the network. */
export class ApiError extends Error {
  constructor({ status = 0, code = "", message = "", param = null, network = false, midStream = false }) {
    super(message || code || "request failed");
    this.status = status;
    this.code = code;
    this.param = param;
    this.network = network;
    this.midStream = midStream;
  }

  static fromBody(body, status) {
    const e = (body && body.error) || {};
    return new ApiError({ status, code: e.code || "", message: e.message || "", param: e.param || null });
  }

  static async fromResponse(response) {
    let body = null;
    try {
      body = await response.json();
    } catch {
      /* not JSON (a proxy's page?): the status alone must do */
    }
    return ApiError.fromBody(body, response.status);
  }
}

/** fetch() with the Bearer key; a network failure becomes ApiError({network: true}). */
export async function apiFetch(path, options = {}) {
  const headers = new Headers(options.headers || {});
  const key = getKey();
  if (key) headers.set("Authorization", `Bearer ${key}`);
  if (options.body && !headers.has("Content-Type")) headers.set("Content-Type", "application/json");
  try {
    return await fetch(path, { ...options, headers });
  } catch (err) {
    if (err && err.name === "AbortError") throw err;
    throw new ApiError({ network: true, message: String(err && err.message) });
  }
}

/** GET a JSON body, or throw ApiError. */
export async function getJSON(path, options = {}) {
  const response = await apiFetch(path, options);
  if (!response.ok) throw await ApiError.fromResponse(response);
  return response.json();
}

const BY_CODE = {
  invalid_api_key:
    "This server needs an API key, and this page has none or a wrong one. Enter the key (SIMMER_API_KEY) and send again.",
  server_busy: "The server is busy with other requests. Wait a moment and send again.",
  model_loading: "The model is still loading. Try again in a few seconds.",
  server_shutting_down: "The server is shutting down, so the reply stopped.",
  context_length_exceeded:
    'This conversation is longer than the model can read at once (its context window). Start a new chat, shorten your message, or tick "Drop oldest turns".',
  request_too_large: "That message is too large for the server to accept. Shorten it and send again.",
  device_overheated:
    "The device is too hot, so simmer paused replies to let it cool down. Try again in a minute.",
  device_paused: "simmer paused replies for a while (see the device panel) and this one waited too long. Try again later.",
  insufficient_memory:
    "The device is short of memory, so simmer could not run this reply. Close other apps or start a shorter chat.",
  host_not_allowed: "The server refused this page's address (Host header). Open the page at 127.0.0.1 or localhost.",
  model_not_found: "The server serves a different model than this page asked for. Reload the page.",
  invalid_parameter: "The server refused one of the settings.",
  invalid_json: "The page sent a request the server could not read. Reload the page.",
  internal_error: "Something went wrong inside the server. Its log has the details.",
};

/** One or two sentences for a person, plus the server's own words as detail. */
export function describeError(err) {
  if (!(err instanceof ApiError)) {
    return { text: "Something went wrong in this page.", detail: String(err && err.message ? err.message : err) };
  }
  if (err.network) {
    const text = err.midStream
      ? "The connection to the server was lost in the middle of the reply. Check that simmer is still running."
      : "Cannot reach the simmer server. Check that it is still running, then send again.";
    return { text, detail: "" };
  }
  let text = BY_CODE[err.code];
  if (!text) {
    if (err.status === 401) text = BY_CODE.invalid_api_key;
    else if (err.status === 413) text = BY_CODE.context_length_exceeded;
    else if (err.status === 503) text = "The server cannot take this request right now. Try again in a moment.";
    else if (err.status >= 500) text = BY_CODE.internal_error;
    else text = "The server refused the request.";
  }
  const detail = err.message && err.message !== err.code ? err.message : "";
  return { text, detail: detail ? `${detail}${err.status ? ` (HTTP ${err.status})` : ""}` : "" };
}
