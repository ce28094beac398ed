// Shared by group_offload.js (live readout) and group_offload_report.js (report table): the message
// the pack sends, node lookup by execution id, callback composition and human-readable figures.
// ComfyUI loads every .js file of the web directory; this one registers nothing.

/** Websocket event of nodes/telemetry.py (EVENT); its payload carries the node's execution id. */
export const TELEMETRY_EVENT = "group_offload.telemetry";
export const TELEMETRY_NODE_TYPES = new Set(["GroupOffload", "GroupOffloadLoader", "GroupOffloadTextEncoder", "GroupOffloadCLIPLoader"]);
export const REPORT_NODE_TYPE = "GroupOffloadReport";

/** Compose `callback` after `object[name]`: both run with the same arguments; returns the callback's
 *  result when it has one, else the earlier result. */
export function chainCallback(object, name, callback) {
  const earlier = object[name];
  object[name] = function (...args) {
    const result = earlier?.apply(this, args);
    const own = callback.apply(this, args);
    return own === undefined ? result : own;
  };
}

/** Compose `transform(result, ...args)` onto the result of `object[name]`. */
export function chainResult(object, name, transform) {
  const earlier = object[name];
  object[name] = function (...args) {
    return transform.call(this, earlier?.apply(this, args), ...args);
  };
}

/** A node by the id the server knows it by: "12" in the root graph, "12:5" (subgraph node 12,
 *  node 5 inside it) and deeper for nodes inside subgraphs. */
export function findNodeByExecutionId(rootGraph, executionId) {
  if (rootGraph == null || executionId == null) return null;
  const path = String(executionId).split(":");
  let graph = rootGraph;
  for (const id of path.slice(0, -1)) {
    graph = graph.getNodeById(id)?.subgraph;
    if (graph == null) return null;
  }
  return graph.getNodeById(path[path.length - 1]) ?? null;
}

const BYTE_UNITS = ["KB", "MB", "GB", "TB"];

function threeDigits(value) {
  return value >= 100 ? value.toFixed(0) : value >= 10 ? value.toFixed(1) : value.toFixed(2);
}

/** 0 → "0 B", 512e6 → "512 MB", 1.234e9 → "1.23 GB" (decimal units, as the Python side logs). */
export function formatBytes(bytes) {
  if (!Number.isFinite(bytes)) return "–";
  let value = Math.abs(bytes);
  if (value < 999.5) return `${Math.round(bytes)} B`;
  let unit = -1;
  while (value >= 999.5 && unit < BYTE_UNITS.length - 1) {
    value /= 1000;
    unit += 1;
  }
  return `${bytes < 0 ? "-" : ""}${threeDigits(value)} ${BYTE_UNITS[unit]}`;
}

/** GB/s, or MB/s below 1 GB/s. */
export function formatRate(gbps) {
  if (!Number.isFinite(gbps)) return "–";
  if (gbps === 0) return "0 GB/s";
  return gbps >= 0.9995 ? `${threeDigits(gbps)} GB/s` : `${threeDigits(gbps * 1000)} MB/s`;
}

export function formatMs(ms) {
  if (!Number.isFinite(ms)) return "–";
  return ms === 0 ? "0 ms" : `${threeDigits(ms)} ms`;
}

/** µs, or ms from 1 ms on. */
export function formatUs(us) {
  if (!Number.isFinite(us)) return "–";
  return us >= 999.5 ? formatMs(us / 1000) : `${threeDigits(us)} µs`;
}

/** The quantized formats the blocks are stored in, [[name, bytes], ...] largest first, as shares:
 *  "GGUF Q4_K 71% · GGUF F32 29%"; past `limit` of them, how many more. */
export function formatShares(formats, limit = Infinity) {
  const total = formats.reduce((sum, [, bytes]) => sum + bytes, 0);
  const shown = formats.slice(0, limit).map(([name, bytes]) => `${name} ${Math.round((100 * bytes) / total)}%`);
  return formats.length > limit ? [...shown, `${formats.length - limit} more`].join(" · ") : shown.join(" · ");
}

export function plural(count, word) {
  return `${count} ${word}${count === 1 ? "" : "s"}`;
}

export const CPU_ONLY_NOTE = "CPU-only ComfyUI: offloading brings nothing here; the copies are host to host.";
