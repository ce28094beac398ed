// "Group Offload Report": the final figures of the last sampling run as a table in the node.
//
// The node returns {"ui": {"group_offload": [stats]}}, stats being the final telemetry message (see
// nodes/telemetry.py); onExecuted fills a DOM widget and keeps the stats as `node.groupOffloadReport`.
import {
  CPU_ONLY_NOTE,
  REPORT_NODE_TYPE,
  chainCallback,
  chainResult,
  formatBytes,
  formatMs,
  formatRate,
  formatShares,
  formatUs,
  plural,
} from "./group_offload_common.js";

const { app } = window.comfyAPI.app;

const WIDGET_NAME = "group_offload_report";
const MIN_WIDTH = 330;
const ROW_HEIGHT = 19;
const CHROME_HEIGHT = 44; // title, padding and margins around the table

const STYLE = `
.group-offload-report {
  box-sizing: border-box; height: 100%; overflow: auto; padding: 6px 10px;
  border-radius: 6px; background: var(--comfy-input-bg, #222); color: var(--input-text, #ddd);
  font: 12px/1.4 var(--font-family, Arial, sans-serif);
}
.group-offload-report__title { font-weight: bold; margin-bottom: 4px; }
.group-offload-report__empty { color: var(--descrip-text, #999); }
.group-offload-report table { width: 100%; border-collapse: collapse; }
.group-offload-report th {
  text-align: left; font-weight: normal; color: var(--descrip-text, #999); padding: 1px 10px 1px 0;
  white-space: nowrap; vertical-align: top;
}
.group-offload-report td { text-align: right; padding: 1px 0; font-variant-numeric: tabular-nums; }
.group-offload-report tr + tr > * { border-top: 1px solid var(--border-color, #4446); }
.group-offload-report .group-offload-report--ok { color: #5cc87a; font-weight: bold; }
.group-offload-report .group-offload-report--bad { color: #ff6b6b; font-weight: bold; }
.group-offload-report__note { color: #e8b04a; margin-top: 4px; }
`;

function ensureStyle() {
  const id = "group-offload-report-style";
  if (document.getElementById(id)) return;
  const style = document.createElement("style");
  style.id = id;
  style.textContent = STYLE;
  document.head.append(style);
}

/** [field, label, value, class?] for each row of the table. */
function reportRows(stats) {
  const d2h = stats.bytes_d2h;
  return [
    ["steps", "Sampling steps", String(stats.steps)],
    ["groups", "Groups", `${stats.groups} (${stats.resident_groups} resident, ${stats.streamed_groups} streamed)`],
    ["resident_bytes", "Resident on the GPU", formatBytes(stats.resident_bytes)],
    ["streamed_bytes_per_pass", "Streamed per pass", formatBytes(stats.streamed_bytes_per_pass)],
    ...(stats.formats?.length ? [["formats", "Blocks stored as", formatShares(stats.formats)]] : []),
    ["pinned_bytes", "Pinned host memory", `${formatBytes(stats.pinned_bytes)} of ${formatBytes(stats.host_bytes)}`],
    ...(stats.in_place_bytes > 0 ? inPlaceRows(stats) : []),
    ["bytes_per_step", "Streamed per step", formatBytes(stats.bytes_per_step)],
    ["bytes_h2d", "Host → GPU in all", `${formatBytes(stats.bytes_h2d)} in ${stats.copies_h2d} ${stats.copies_h2d === 1 ? "copy" : "copies"}`],
    ["bytes_d2h", "GPU → host (copy-back)", d2h === 0 ? "0 B" : formatBytes(d2h), d2h === 0 ? "group-offload-report--ok" : "group-offload-report--bad"],
    ...(stats.host_dequantized_bytes_per_pass > 0 ? [["host_dequantized_bytes_per_pass", "GPU → host (dequantized on the host)",
      `${formatBytes(stats.host_dequantized_bytes_per_pass)} a pass: GGUF types ComfyUI-GGUF dequantizes with numpy`,
      "group-offload-report--bad"]] : []),
    ["h2d_gbps", "Achieved host → GPU", formatRate(stats.h2d_gbps)],
    ["compute_wait_ms", "Compute waited for copies", formatMs(stats.compute_wait_ms)],
    ["onloads", "Group onloads", `${stats.onloads} (${stats.sync_onloads} waited on)`],
    ["back_offs", "Out-of-memory back-offs", stats.back_offs
      ? `${stats.back_offs} (ended at ${stats.resident_groups} resident, prefetch ${stats.prefetch})` : "none"],
    ["hook_us_per_group", "Hook time per group", formatUs(stats.hook_us_per_group)],
  ];
}

/** The rows of the groups beyond the host budget, left in place and gathered for each copy (none without them). */
function inPlaceRows(stats) {
  const gathered = stats.gathered_bytes;
  return [
    ["packed_bytes", "Packed host copies", formatBytes(stats.packed_bytes)],
    ["in_place_bytes", "Left in place", `${formatBytes(stats.in_place_bytes)} (${formatBytes(stats.file_backed_bytes)} file-backed)`],
    ["host_limit", "Host budget bound by", stats.host_limit ?? "–"],
    ["kept_cached_bytes", "Kept in the page cache", formatBytes(stats.kept_cached_bytes)],
    ["gathered_bytes_per_step", "Gathered per step", formatBytes(stats.gathered_bytes_per_step)],
    ["gather_gbps", "Gather rate", formatRate(stats.gather_gbps)],
    ["read_ahead", "Read ahead", `${stats.read_ahead ?? 0} ${stats.read_ahead === 1 ? "group" : "groups"}`],
    ["gathered_from_disk_bytes", "Gathered from disk", `${formatBytes(stats.gathered_from_disk_bytes)} of ${formatBytes(gathered)}`],
  ];
}

function element(tag, className, text) {
  const el = document.createElement(tag);
  if (className) el.className = className;
  if (text !== undefined) el.textContent = text;
  return el;
}

function render(root, stats) {
  if (stats == null) {
    root.replaceChildren(element("div", "group-offload-report__empty", "Run the workflow to see what its sampling run streamed."));
    return;
  }
  const table = element("table");
  for (const [field, label, value, className] of reportRows(stats)) {
    const row = element("tr");
    row.dataset.field = field;
    row.append(element("th", "", label), element("td", className, value));
    table.append(row);
  }
  const parts = [element("div", "group-offload-report__title", `Last sampling run · ${plural(stats.steps, "step")}`), table];
  if (stats.cpu_only) parts.push(element("div", "group-offload-report__note", CPU_ONLY_NOTE));
  root.replaceChildren(...parts);
}

function contentHeight(node) {
  const stats = node.groupOffloadReport;
  if (stats == null) return 2 * ROW_HEIGHT + 16;
  return CHROME_HEIGHT + reportRows(stats).length * ROW_HEIGHT + (stats.cpu_only ? 2 * ROW_HEIGHT : 0);
}

function fitNode(node) {
  const [width, height] = node.computeSize();
  const size = [Math.max(node.size[0], width), Math.max(node.size[1], height)];
  if (size[0] !== node.size[0] || size[1] !== node.size[1]) node.setSize(size);
}

function setUpReport(nodeType) {
  const proto = nodeType.prototype;
  chainResult(proto, "computeSize", function (size) {
    return [Math.max(size[0], MIN_WIDTH), size[1]];
  });
  chainCallback(proto, "onNodeCreated", function () {
    if (typeof this.addDOMWidget !== "function") return; // frontends before DOM widgets: no table
    ensureStyle();
    this.groupOffloadReport = null;
    const root = element("div", "group-offload-report");
    render(root, null);
    const widget = this.addDOMWidget(WIDGET_NAME, WIDGET_NAME, root, {
      serialize: false, // not a prompt input
      hideOnZoom: true,
      getMinHeight: () => contentHeight(this),
    });
    widget.serialize = false; // nor part of the saved workflow
    this.groupOffloadReportElement = root;
    fitNode(this);
  });
  chainCallback(proto, "onExecuted", function (output) {
    const stats = output?.group_offload?.[0];
    if (stats == null || this.groupOffloadReportElement == null) return;
    this.groupOffloadReport = stats;
    render(this.groupOffloadReportElement, stats);
    fitNode(this);
    this.setDirtyCanvas(true, true);
  });
  chainCallback(proto, "onRemoved", function () {
    // The frontend removes the DOM widget itself; drop what this extension keeps on the node.
    this.groupOffloadReport = null;
    this.groupOffloadReportElement = null;
  });
}

app.registerExtension({
  name: "GroupOffload.Report",
  async beforeRegisterNodeDef(nodeType, nodeData) {
    if (nodeData?.name !== REPORT_NODE_TYPE) return;
    setUpReport(nodeType);
  },
});
