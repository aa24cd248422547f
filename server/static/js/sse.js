// Server-Sent Events over fetch (EventSource cannot send an Authorization header or a POST body).
// SSEParser is pure: feed it decoded text in any chunking, it returns the complete events so far.
// Spec: https://html.spec.whatwg.org/multipage/server-sent-events.html#event-stream-interpretation

export class SSEParser {
  constructor() {
    this.buffer = "";
    this.reset();
  }

  reset() {
    this.eventType = "";
    this.dataLines = [];
  }

  /** Add text; return the events completed by it as [{event, data}]. */
  push(text) {
    this.buffer += text;
    const events = [];
    // A line ends at \r\n, \n or \r. A lone \r at the very end may be the first half of \r\n: keep it.
    const lineEnd = /\r\n|\n|\r(?!$)/g;
    let start = 0;
    let match;
    while ((match = lineEnd.exec(this.buffer)) !== null) {
      const line = this.buffer.slice(start, match.index);
      start = match.index + match[0].length;
      const event = this.line(line);
      if (event) events.push(event);
    }
    this.buffer = this.buffer.slice(start);
    return events;
  }

  /** The stream ended: an event without its closing blank line is dropped, as the spec says. */
  end() {
    this.buffer = "";
    this.reset();
  }

  line(line) {
    if (line === "") {
      if (this.dataLines.length === 0) {
        this.reset();
        return null;
      }
      const event = { event: this.eventType || "message", data: this.dataLines.join("\n") };
      this.reset();
      return event;
    }
    if (line.startsWith(":")) return null; // a comment (keep-alive ping)
    const colon = line.indexOf(":");
    const field = colon === -1 ? line : line.slice(0, colon);
    let value = colon === -1 ? "" : line.slice(colon + 1);
    if (value.startsWith(" ")) value = value.slice(1);
    if (field === "data") this.dataLines.push(value);
    else if (field === "event") this.eventType = value;
    return null; // id and retry do not matter to us
  }
}

/** Yield {event, data} from a fetch Response body until the stream ends. */
export async function* readSSE(body) {
  const reader = body.getReader();
  const decoder = new TextDecoder("utf-8"); // stream mode keeps a character split across chunks whole
  const parser = new SSEParser();
  let finished = false;
  try {
    while (true) {
      const { value, done } = await reader.read();
      if (done) {
        finished = true;
        break;
      }
      yield* parser.push(decoder.decode(value, { stream: true }));
    }
    yield* parser.push(decoder.decode());
    parser.end();
  } finally {
    // The consumer stopped early: close the connection rather than leave it half read.
    if (!finished) await reader.cancel().catch(() => {});
  }
}
