// The page as an app: a hidden tab is a backgrounded app (Page Visibility API), and a toggle says the
// same by hand. Either one POSTs /v1/lifecycle, and the governor decides what "background" means
// (pause, or low priority).
//
// "background" is a lease: the server lets it lapse after its TTL (SIMMER_LIFECYCLE_TTL_S, told in the
// answer) unless it is renewed, so a tab that crashed or froze cannot keep the server paused. While the
// page stays in the background it renews the lease every third of the TTL; "foreground" ends it at once.
// Each tab is its own client ("page-" and a random name kept for the tab's session), so one tab coming
// back does not end another tab's lease.

import { apiFetch } from "./api.js";

const CLIENT_STORAGE = "simmer.lifecycleClient";
const RENEW_FRACTION = 1 / 3; // three tries before the lease lapses
const MIN_RENEW_MS = 200;
const FALLBACK_TTL_S = 30; // until the server has said its own

function tabClientName() {
  const bytes = crypto.getRandomValues(new Uint8Array(6));
  const fresh = "page-" + Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("");
  try {
    const kept = sessionStorage.getItem(CLIENT_STORAGE);
    if (kept) return kept;
    sessionStorage.setItem(CLIENT_STORAGE, fresh);
  } catch {
    /* storage disabled: a name for as long as this page lives */
  }
  return fresh;
}

export class Lifecycle {
  /** toggle: a checkbox; hooks: {onState(state), onUnsupported()} */
  constructor(toggle, hooks = {}) {
    this.toggle = toggle;
    this.hooks = hooks;
    this.client = tabClientName();
    this.sent = null;
    this.ttlS = FALLBACK_TTL_S;
    this.renewTimer = null;
    this.renewals = 0; // for the browser tests and curious people
  }

  desired() {
    return document.hidden || this.toggle.checked ? "background" : "foreground";
  }

  start() {
    document.addEventListener("visibilitychange", () => this.report());
    this.toggle.addEventListener("change", () => this.report());
    // Leaving the page must not leave the server paused for every other client (until the lease lapses).
    window.addEventListener("pagehide", () => {
      clearTimeout(this.renewTimer);
      if (this.sent === "background") this.post("foreground");
    });
    window.addEventListener("pageshow", (e) => {
      if (e.persisted) this.report(true); // back from the back/forward cache
    });
    this.report(true);
  }

  async report(force = false) {
    const state = this.desired();
    if (!force && state === this.sent) return;
    this.sent = state;
    clearTimeout(this.renewTimer);
    await this.send(state);
  }

  async send(state) {
    let ok = false;
    try {
      const response = await this.post(state);
      if (response.status === 404) {
        this.hooks.onUnsupported?.();
        return; // no governor: nothing to renew
      }
      if (response.ok) {
        ok = true;
        const body = await response.json().catch(() => null);
        if (body && body.lease && body.lease.ttl_s > 0) this.ttlS = body.lease.ttl_s;
        if (body && body.level) this.hooks.onState?.(body);
      }
    } catch {
      /* the network: the next renewal (or change) tries again */
    }
    if (this.sent !== state) return; // the page changed its mind meanwhile
    if (state === "background") this.scheduleRenewal();
    else if (!ok) this.sent = null; // try again at the next change
  }

  scheduleRenewal() {
    clearTimeout(this.renewTimer);
    // Set here, after the answer came (a network task), never from inside a timer callback: Chrome throttles
    // chains of timers in a page hidden for minutes to one wake-up a minute, and a lease would lapse.
    const ms = Math.max(MIN_RENEW_MS, this.ttlS * 1000 * RENEW_FRACTION);
    this.renewTimer = setTimeout(() => {
      if (this.sent !== "background") return;
      this.renewals += 1;
      this.send("background");
    }, ms);
  }

  post(state) {
    // keepalive: the request outlives a page that is being hidden or closed.
    const body = JSON.stringify({ state, client: this.client });
    return apiFetch("/v1/lifecycle", { method: "POST", body, keepalive: true });
  }
}
