// Live offload figures on "Group Offload (no copy-back)" and "Load Diffusion Model (Group Offload)".
//
// nodes/telemetry.py sends "group_offload.telemetry" up to 4 times a second while sampling, and once
// more (final: true) when sampling ends. One module-level listener finds the node by the message's
// node_id and keeps the payload on it as `node.groupOffloadTelemetry`; onDrawForeground draws it
// below the widgets.
import {
  CPU_ONLY_NOTE,
  TELEMETRY_EVENT,
  TELEMETRY_NODE_TYPES,
  chainCallback,
  chainResult,
  findNodeByExecutionId,
  formatBytes,
  formatMs,
  formatRate,
  formatShares,
  plural,
} from "./group_offload_common.js";

const { app } = window.comfyAPI.app;
const { api } = window.comfyAPI.api;

const LAYOUT = {
  minWidth: 330,
  gap: 6, // between the last widget and the panel, and under the panel
  margin: 10, // panel to node edge
  padding: 8, // inside the panel
  header: 20,
  line: 17,
  labelWidth: 86,
  chart: 56,
  noteLines: 2,
};
const COLORS = { ok: "#5cc87a", bad: "#ff6b6b", warn: "#e8b04a", bar: "#5b9bd5", barLast: "#8cc4ff" };

function onTelemetry({ detail }) {
  const node = findNodeByExecutionId(app.graph, detail?.node_id);
  if (node == null || !TELEMETRY_NODE_TYPES.has(node.comfyClass)) return;
  node.groupOffloadTelemetry = detail;
  fitReadout(node);
  node.setDirtyCanvas(true, false);
}

api.addEventListener(TELEMETRY_EVENT, onTelemetry);

function panelHeight(node) {
  const lines = rows(node.groupOffloadTelemetry).length + (node.groupOffloadTelemetry?.cpu_only ? LAYOUT.noteLines : 0);
  return LAYOUT.header + lines * LAYOUT.line + LAYOUT.chart + 2 * LAYOUT.padding;
}

/** Body y where the panel starts: under the widgets as last arranged, else as computeSize counts. */
function panelTop(node) {
  let bottom = 0;
  for (const widget of node.widgets ?? []) {
    if (typeof widget.y === "number") bottom = Math.max(bottom, widget.y + (widget.computedHeight ?? 0));
  }
  return (bottom || node.groupOffloadBaseHeight || 0) + LAYOUT.gap;
}

/** Grow (never shrink) the node so that the panel fits. */
function fitReadout(node) {
  const width = Math.max(node.size[0], LAYOUT.minWidth);
  const height = Math.max(node.size[1], panelTop(node) + panelHeight(node) + LAYOUT.gap);
  if (width !== node.size[0] || height !== node.size[1]) node.setSize([width, height]);
}

function font(size, bold = false) {
  return `${bold ? "bold " : ""}${size}px ${window.LiteGraph?.NODE_FONT ?? "Arial"}`;
}

function fitText(ctx, text, maxWidth) {
  if (ctx.measureText(text).width <= maxWidth) return text;
  let cut = text;
  while (cut.length > 1 && ctx.measureText(`${cut}…`).width > maxWidth) cut = cut.slice(0, -1);
  return `${cut}…`;
}

function wrapText(ctx, text, maxWidth, maxLines) {
  const lines = [];
  let line = "";
  for (const word of text.split(" ")) {
    const candidate = line ? `${line} ${word}` : word;
    if (line && ctx.measureText(candidate).width > maxWidth) {
      lines.push(line);
      line = word;
    } else {
      line = candidate;
    }
  }
  lines.push(line);
  return lines.length > maxLines ? [...lines.slice(0, maxLines - 1), fitText(ctx, lines.slice(maxLines - 1).join(" "), maxWidth)] : lines;
}

/** Label and value rows: [label, value, color?]. */
function rows(stats) {
  if (stats == null) {
    return [["Resident", "–"], ["Streamed", "–"], ["Pinned", "–"], ["Per step", "–"], ["Host → GPU", "–"], ["GPU → host", "–"]];
  }
  const d2h = stats.bytes_d2h;
  const dequantizedOnHost = stats.host_dequantized_bytes_per_pass ?? 0;
  return [
    ["Resident", `${stats.resident_groups} of ${plural(stats.groups, "group")} · ${formatBytes(stats.resident_bytes)}`],
    ["Streamed", `${plural(stats.streamed_groups, "group")} · ${formatBytes(stats.streamed_bytes_per_pass)} a pass`],
    ...(stats.formats?.length ? [["Stored as", formatShares(stats.formats, 3)]] : []),
    ...(stats.left_whole?.length ? [["Loaded whole", loadedWhole(stats.left_whole)]] : []),
    pinnedRow(stats),
    ...(stats.in_place_bytes > 0 ? inPlaceRows(stats) : []),
    ["Per step", `${formatBytes(stats.bytes_per_step)} streamed`],
    ["Host → GPU", `${formatRate(stats.h2d_gbps)} · compute wait ${formatMs(stats.compute_wait_ms)}`],
    dequantizedOnHost > 0
      ? ["GPU → host", `${formatBytes(dequantizedOnHost)} a pass, dequantized on the host · ${formatBytes(d2h)} copied back`, COLORS.bad]
      : ["GPU → host", d2h === 0 ? "0 B · nothing copied back" : `${formatBytes(d2h)} copied back`, d2h === 0 ? COLORS.ok : COLORS.bad],
  ];
}

/** A text encoder's: the encoders beside the one whose layers stream, which ComfyUI loads as it does without the
 *  node (CLIP-L and CLIP-G beside SD3's T5): "clip_l 235 MB · clip_g 1.39 GB". */
function loadedWhole(encoders) {
  return encoders.map(([name, bytes]) => `${name} ${formatBytes(bytes)}`).join(" · ");
}

/** Pinned host memory of the mirrors; short of the streamed packed bytes, some copies come from pageable memory
 *  (groups left in place are never pinned: they stream through the staging buffers). */
function pinnedRow(stats) {
  const packedStreamed = stats.streamed_bytes_per_pass - (stats.in_place_bytes ?? 0);
  const short = !stats.cpu_only && stats.pinned_bytes < packedStreamed;
  return ["Pinned", `${formatBytes(stats.pinned_bytes)} of ${formatBytes(stats.host_bytes)} host`, short ? COLORS.warn : undefined];
}

/** Groups beyond the host budget stay in place (in the model file's pages) and are gathered for each copy: the
 *  limit that bound the host budget, how much stays in the page cache, how much a step, how fast, and how much of
 *  it the page cache did not hold. */
function inPlaceRows(stats) {
  return [
    ["Host copies", `${formatBytes(stats.packed_bytes)} packed · ${formatBytes(stats.in_place_bytes)} in place`],
    ["Host limit", stats.host_limit ?? "–"],
    ["Page cache", `${formatBytes(stats.kept_cached_bytes)} of it kept cached`],
    ["Gathered", `${formatBytes(stats.gathered_bytes_per_step)} a step · ${formatRate(stats.gather_gbps)}`],
    ["From disk", `${formatBytes(stats.gathered_from_disk_bytes)} of ${formatBytes(stats.gathered_bytes)}, rest cached`],
  ];
}

function drawChart(ctx, x, y, width, height, values, colors) {
  ctx.strokeStyle = colors.outline;
  ctx.strokeRect(x + 0.5, y + 0.5, width - 1, height - 1);
  ctx.font = font(10);
  ctx.fillStyle = colors.secondary;
  ctx.textBaseline = "top";
  ctx.textAlign = "left";
  if (!values?.length) {
    ctx.fillText("Rate per step: no step finished yet", x + 4, y + 4);
    return;
  }
  const max = Math.max(...values);
  ctx.fillText("Rate per step", x + 4, y + 3);
  ctx.textAlign = "right";
  ctx.fillText(`max ${formatRate(max)}`, x + width - 4, y + 3);
  const top = y + 16;
  const area = height - 16 - 3;
  const slot = (width - 8) / values.length;
  const barWidth = Math.max(1, Math.min(24, slot - 2));
  values.forEach((value, i) => {
    const barHeight = max > 0 ? Math.max(1, (value / max) * area) : 1;
    ctx.fillStyle = i === values.length - 1 ? COLORS.barLast : COLORS.bar;
    ctx.fillRect(x + 4 + i * slot + (slot - barWidth) / 2, top + area - barHeight, barWidth, barHeight);
  });
}

function drawReadout(node, ctx) {
  const stats = node.groupOffloadTelemetry;
  const LiteGraph = window.LiteGraph ?? {};
  const colors = {
    text: LiteGraph.WIDGET_TEXT_COLOR ?? "#ddd",
    secondary: LiteGraph.WIDGET_SECONDARY_TEXT_COLOR ?? "#999",
    background: LiteGraph.WIDGET_BGCOLOR ?? "#222",
    outline: LiteGraph.WIDGET_OUTLINE_COLOR ?? "#666",
  };
  const x = LAYOUT.margin;
  const y = panelTop(node);
  const width = node.size[0] - 2 * LAYOUT.margin;
  const height = panelHeight(node);
  if (y + height + LAYOUT.gap > node.size[1] + 0.5) {
    fitReadout(node); // drawn at the new size on the next frame
    node.setDirtyCanvas(true, true);
  }
  const inner = width - 2 * LAYOUT.padding;
  const left = x + LAYOUT.padding;

  ctx.fillStyle = colors.background;
  ctx.strokeStyle = colors.outline;
  ctx.beginPath();
  ctx.roundRect(x, y, width, height, 6);
  ctx.fill();
  ctx.stroke();

  let line = y + LAYOUT.padding;
  ctx.textBaseline = "top";
  ctx.textAlign = "left";
  ctx.font = font(12, true);
  ctx.fillStyle = colors.text;
  ctx.fillText("Offload telemetry", left, line);
  const state = stats == null ? "waiting for a run" : `${stats.final ? "final" : "live"} · ${plural(stats.steps, "step")}`;
  ctx.font = font(11);
  ctx.fillStyle = stats != null && !stats.final ? COLORS.ok : colors.secondary;
  ctx.textAlign = "right";
  ctx.fillText(state, left + inner, line + 1);
  line += LAYOUT.header;

  for (const [label, value, color] of rows(stats)) {
    ctx.textAlign = "left";
    ctx.font = font(11);
    ctx.fillStyle = colors.secondary;
    ctx.fillText(label, left, line + 1);
    ctx.font = font(12, color !== undefined);
    ctx.fillStyle = color ?? colors.text;
    ctx.fillText(fitText(ctx, value, inner - LAYOUT.labelWidth), left + LAYOUT.labelWidth, line);
    line += LAYOUT.line;
  }

  drawChart(ctx, left, line + 2, inner, LAYOUT.chart - 6, stats?.step_gbps, colors);
  line += LAYOUT.chart;

  if (stats?.cpu_only) {
    ctx.font = font(11);
    ctx.fillStyle = COLORS.warn;
    ctx.textAlign = "left";
    for (const text of wrapText(ctx, CPU_ONLY_NOTE, inner, LAYOUT.noteLines)) {
      ctx.fillText(text, left, line + 1);
      line += LAYOUT.line;
    }
  }
}

function setUpReadout(nodeType) {
  const proto = nodeType.prototype;
  chainResult(proto, "computeSize", function (size) {
    this.groupOffloadBaseHeight = size[1];
    return [Math.max(size[0], LAYOUT.minWidth), size[1] + LAYOUT.gap + panelHeight(this) + LAYOUT.gap];
  });
  chainCallback(proto, "onNodeCreated", function () {
    this.groupOffloadTelemetry = null;
  });
  chainCallback(proto, "onConfigure", function () {
    fitReadout(this); // a workflow saved before this extension, or smaller, still shows the panel
  });
  chainCallback(proto, "onDrawForeground", function (ctx, canvas) {
    if (this.flags?.collapsed || canvas?.low_quality) return;
    ctx.save();
    try {
      drawReadout(this, ctx);
    } finally {
      ctx.restore();
    }
  });
  chainCallback(proto, "onRemoved", function () {
    this.groupOffloadTelemetry = null;
  });
}

app.registerExtension({
  name: "GroupOffload.Telemetry",
  async beforeRegisterNodeDef(nodeType, nodeData) {
    if (!TELEMETRY_NODE_TYPES.has(nodeData?.name)) return;
    setUpReadout(nodeType);
  },
});
