// The page as an app: a hidden tab is a backgrounded app (Page Visibility API), and a toggle says the
// same by hand. Either one POSTs /v1/lifecycle, and the governor decides what "background" means
// (pause, or low priority).

import { apiFetch } from "./api.js";

export class Lifecycle {
  /** toggle: a checkbox; hooks: {onState(state), onUnsupported()} */
  constructor(toggle, hooks = {}) {
    this.toggle = toggle;
    this.hooks = hooks;
    this.sent = null;
  }

  desired() {
    return document.hidden || this.toggle.checked ? "background" : "foreground";
  }

  start() {
    document.addEventListener("visibilitychange", () => this.report());
    this.toggle.addEventListener("change", () => this.report());
    // Leaving the page must not leave the server paused for every other client.
    window.addEventListener("pagehide", () => {
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
    try {
      const response = await this.post(state);
      if (response.status === 404) this.hooks.onUnsupported?.();
      else if (response.ok) {
        const body = await response.json().catch(() => null);
        if (body && body.level) this.hooks.onState?.(body);
      } else this.sent = null; // try again at the next change
    } catch {
      this.sent = null;
    }
  }

  post(state) {
    // keepalive: the request outlives a page that is being hidden or closed.
    return apiFetch("/v1/lifecycle", { method: "POST", body: JSON.stringify({ state }), keepalive: true });
  }
}
