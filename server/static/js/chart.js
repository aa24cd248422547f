// The device chart, drawn on a <canvas> (no library): temperature and headroom over the last minutes.
// Both share one vertical scale in headroom units (1.0 = the throttling threshold; 0.0 = `span` degrees
// below it), so the temperature line and the threshold line meet exactly where the device throttles.
// The right axis labels the same heights in degrees Celsius.

const DEFAULT_SPAN_C = 30; // Android's getThermalHeadroom: 0.0 is 30 C below the threshold

function css(name, fallback) {
  const value = getComputedStyle(document.documentElement).getPropertyValue(name).trim();
  return value || fallback;
}

/** samples: [{t (ms), celsius, headroom, forecast, throttle}] oldest first. */
export function drawChart(canvas, samples, { windowMs = 5 * 60 * 1000, now = Date.now(), empty = "waiting for readings…" } = {}) {
  const dpr = window.devicePixelRatio || 1;
  const width = canvas.clientWidth || 300;
  const height = canvas.clientHeight || 160;
  if (canvas.width !== Math.round(width * dpr) || canvas.height !== Math.round(height * dpr)) {
    canvas.width = Math.round(width * dpr);
    canvas.height = Math.round(height * dpr);
  }
  const ctx = canvas.getContext("2d");
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  ctx.clearRect(0, 0, width, height);

  const fg = css("--muted", "#666");
  const grid = css("--grid", "#ddd");
  const tempColour = css("--temp", "#d9480f");
  const forecastColour = css("--forecast", "#1c7ed6");
  const limitColour = css("--critical", "#c92a2a");
  ctx.font = "11px system-ui, sans-serif";

  const left = 34;
  const right = 40;
  const top = 8;
  const bottom = 18;
  const plotW = Math.max(10, width - left - right);
  const plotH = Math.max(10, height - top - bottom);

  // Zoom to what we have (at least a minute): a fresh page, or a simulated device at a high time scale,
  // would otherwise squeeze everything against the right edge.
  const oldest = samples.length ? now - samples[0].t : 0;
  windowMs = Math.min(windowMs, Math.max(60000, Math.ceil(oldest / 60000) * 60000));
  const visible = samples.filter((s) => now - s.t <= windowMs);
  const last = visible.length ? visible[visible.length - 1] : null;
  const throttle = last ? last.throttle : null;
  const span = DEFAULT_SPAN_C;
  // Temperature in headroom units when the threshold is known; else its own scale (see `toUnits`).
  const temps = visible.map((s) => s.celsius).filter((c) => c != null);
  let toUnits;
  if (throttle != null) {
    toUnits = (c) => 1 - (throttle - c) / span;
  } else if (temps.length) {
    const lo = Math.min(...temps) - 1;
    const hi = Math.max(...temps) + 1;
    toUnits = (c) => (c - lo) / (hi - lo);
  } else {
    toUnits = () => null;
  }
  const values = [];
  for (const s of visible) {
    if (s.celsius != null) values.push(toUnits(s.celsius));
    if (s.headroom != null) values.push(s.headroom);
    if (s.forecast != null) values.push(s.forecast);
  }
  let yMin = Math.min(0.4, ...values);
  let yMax = Math.max(1.2, ...values);
  const pad = (yMax - yMin) * 0.05;
  yMin -= pad;
  yMax += pad;
  const x = (t) => left + plotW * (1 - (now - t) / windowMs);
  const y = (v) => top + plotH * (1 - (v - yMin) / (yMax - yMin));

  // Grid and axes.
  ctx.strokeStyle = grid;
  ctx.fillStyle = fg;
  ctx.lineWidth = 1;
  ctx.textBaseline = "middle";
  const step = yMax - yMin > 1.5 ? 0.5 : 0.2;
  for (let v = Math.ceil(yMin / step) * step; v <= yMax; v += step) {
    const yy = Math.round(y(v)) + 0.5;
    ctx.beginPath();
    ctx.moveTo(left, yy);
    ctx.lineTo(left + plotW, yy);
    ctx.stroke();
    ctx.textAlign = "right";
    ctx.fillText(v.toFixed(1), left - 4, yy);
    if (throttle != null) {
      ctx.textAlign = "left";
      ctx.fillText(`${Math.round(throttle - span * (1 - v))}°`, left + plotW + 4, yy);
    }
  }
  ctx.textAlign = "center";
  ctx.textBaseline = "top";
  const tick = windowMs <= 60000 ? 15000 : 60000;
  for (let ago = windowMs; ago >= 0; ago -= tick) {
    const label = ago === 0 ? "now" : tick < 60000 ? `-${ago / 1000} s` : `-${ago / 60000} min`;
    ctx.fillText(label, Math.min(Math.max(x(now - ago), left + 14), left + plotW - 10), top + plotH + 4);
  }

  // The throttling threshold: headroom 1.0.
  ctx.strokeStyle = limitColour;
  ctx.setLineDash([6, 4]);
  ctx.beginPath();
  ctx.moveTo(left, y(1));
  ctx.lineTo(left + plotW, y(1));
  ctx.stroke();
  ctx.setLineDash([]);
  ctx.fillStyle = limitColour;
  ctx.textAlign = "left";
  ctx.textBaseline = "bottom";
  ctx.fillText(throttle != null ? `throttling ${throttle}°C` : "throttling (headroom 1.0)", left + 4, y(1) - 2);

  // Lines break across gaps (a hidden tab is polled rarely): no straight line through missing minutes.
  function line(pick, colour, dash) {
    ctx.strokeStyle = colour;
    ctx.lineWidth = 2;
    ctx.setLineDash(dash);
    ctx.beginPath();
    let prev = null;
    for (const s of visible) {
      const v = pick(s);
      if (v == null) {
        prev = null;
        continue;
      }
      if (prev && s.t - prev.t < 15000) ctx.lineTo(x(s.t), y(v));
      else ctx.moveTo(x(s.t), y(v));
      prev = s;
    }
    ctx.stroke();
    ctx.setLineDash([]);
  }
  line((s) => s.headroom, forecastColour, []);
  line((s) => s.forecast, forecastColour, [3, 3]);
  line((s) => (s.celsius == null ? null : toUnits(s.celsius)), tempColour, []);

  if (!visible.length) {
    ctx.fillStyle = fg;
    ctx.textAlign = "center";
    ctx.textBaseline = "middle";
    ctx.fillText(empty, left + plotW / 2, top + plotH / 2);
  }
}
