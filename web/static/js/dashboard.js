// The usage dashboard: three GETs of /v1/usage (per day, model and key), one of /v1/usage/quality and one of
// /v1/invoices, whatever the data size; an invoice's lines load when it is opened.
import { api, cell, fmt, markReady, query, row, usd } from "./api.js";

const MAX_DAYS = 366;
const prices = JSON.parse(document.getElementById("prices").textContent);
const form = document.getElementById("filters");
const status = document.getElementById("status");
const charts = {};

function isoDay(date) {
  return date.toISOString().slice(0, 10);
}

function initialFilters() {
  const params = new URLSearchParams(window.location.search);
  const today = new Date();
  const monthAgo = new Date(today.getTime() - 29 * 86400e3);
  form.start.value = params.get("start") || isoDay(monthAgo);
  form.end.value = params.get("end") || isoDay(today);
  form.dataset.model = params.get("model") || "";
  form.dataset.key = params.get("key") || "";
}

function filters() {
  return {
    start: form.start.value,
    end: form.end.value,
    model: form.model.value || form.dataset.model,
    key: form.key.value || form.dataset.key,
  };
}

function priceOf(model) {
  return prices[model] ?? prices["*"] ?? null;
}

// Micro-USD the cached tokens saved against the fresh rate: the half-up rounding of the ledger per kind.
function saved(model, cachedTokens) {
  const price = priceOf(model);
  if (!price) return 0;
  const perToken = price.fresh_input - price.cached_input;
  return Math.floor((cachedTokens * perToken + 500000) / 1e6);
}

function fillSelect(select, values, current, label) {
  const known = new Set([...select.options].map((o) => o.value));
  for (const value of values) {
    if (value !== null && !known.has(value)) {
      const option = document.createElement("option");
      option.value = value;
      option.textContent = label(value);
      select.append(option);
    }
  }
  select.value = current;
}

function daysBetween(start, end) {
  const days = [];
  for (let t = Date.parse(`${start}T00:00:00Z`); t <= Date.parse(`${end}T00:00:00Z`); t += 86400e3) {
    days.push(new Date(t).toISOString().slice(0, 10));
  }
  return days;
}

function renderTotals(days, models) {
  const sum = (rows, field) => rows.reduce((total, r) => total + r[field], 0);
  const cached = sum(days, "cached_input_tokens");
  const input = sum(days, "input_tokens");
  const values = {
    requests: fmt.format(sum(days, "requests")),
    cached_input_tokens: fmt.format(cached),
    fresh_input_tokens: fmt.format(sum(days, "fresh_input_tokens")),
    output_tokens: fmt.format(sum(days, "output_tokens")),
    cost_usd: usd(sum(days, "cost")),
    cache_hit_ratio: input ? `${((100 * cached) / input).toFixed(1)}%` : "–",
    saved_usd: usd(models.reduce((total, m) => total + saved(m.model, m.cached_input_tokens), 0)),
  };
  for (const dd of document.querySelectorAll("[data-total]")) dd.textContent = values[dd.dataset.total];
}

function renderTable(id, rows, first) {
  const body = document.querySelector(`#${id} tbody`);
  body.replaceChildren(
    ...rows.map((r) => {
      const cells = [
        cell(first(r)),
        cell(fmt.format(r.requests), { num: true }),
        cell(fmt.format(r.cached_input_tokens), { num: true }),
        cell(fmt.format(r.fresh_input_tokens), { num: true }),
        cell(fmt.format(r.output_tokens), { num: true }),
        cell(r.cost_usd, { num: true }),
      ];
      if (id === "by-model") cells.push(cell(usd(saved(r.model, r.cached_input_tokens)), { num: true }));
      return row(...cells);
    }),
  );
  if (!rows.length) {
    const td = cell("No usage in this range.");
    td.colSpan = document.querySelectorAll(`#${id} thead th`).length;
    body.append(row(td));
  }
}

function renderCharts(days, start, end) {
  const byDay = new Map(days.map((d) => [d.day, d]));
  const labels = daysBetween(start, end);
  const series = (field) => labels.map((day) => byDay.get(day)?.[field] ?? 0);
  const stacked = { x: { stacked: true }, y: { stacked: true, beginAtZero: true } };
  const common = { responsive: true, maintainAspectRatio: false, animation: false };
  const tokens = {
    type: "bar",
    data: {
      labels,
      datasets: [
        { label: "Cached input", data: series("cached_input_tokens"), backgroundColor: "#2a7f62" },
        { label: "Fresh input", data: series("fresh_input_tokens"), backgroundColor: "#0b5cad" },
        { label: "Output", data: series("output_tokens"), backgroundColor: "#c2571a" },
      ],
    },
    options: { ...common, scales: stacked },
  };
  const cost = {
    type: "bar",
    data: {
      labels,
      datasets: [{ label: "Cost (USD)", data: series("cost").map((c) => c / 1e6), backgroundColor: "#6b3fa0" }],
    },
    options: { ...common, scales: { y: { beginAtZero: true } } },
  };
  for (const [id, config] of [["tokens-chart", tokens], ["cost-chart", cost]]) {
    charts[id]?.destroy();
    charts[id] = new window.Chart(document.getElementById(id), config);
  }
}

// Seconds as the quality panel shows them: milliseconds under a second, else seconds.
function seconds(value) {
  if (value === null || value === undefined) return "–";
  return value < 1 ? `${(value * 1000).toFixed(1)} ms` : `${value.toFixed(2)} s`;
}

function countRows(id, counts, empty) {
  const body = document.querySelector(`#${id} tbody`);
  const entries = Object.entries(counts).sort((a, b) => b[1] - a[1] || a[0].localeCompare(b[0]));
  body.replaceChildren(...entries.map(([name, n]) => row(cell(name), cell(fmt.format(n), { num: true }))));
  if (!entries.length) {
    const td = cell(empty);
    td.colSpan = 2;
    body.append(row(td));
  }
}

function renderQuality(quality) {
  const sum = (counts) => Object.values(counts).reduce((total, n) => total + n, 0);
  const t = quality.total;
  const values = {
    ttft_p50: seconds(t.ttft.p50_s),
    ttft_p95: seconds(t.ttft.p95_s),
    tpot_p50: seconds(t.tpot.p50_s),
    tpot_p95: seconds(t.tpot.p95_s),
    errors: fmt.format(sum(t.errors)),
    rejected: fmt.format(t.rejected),
  };
  for (const dd of document.querySelectorAll("[data-quality]")) dd.textContent = values[dd.dataset.quality];
  countRows("errors", t.errors, "No errors in this range.");
  countRows("rejections", t.rejected_by_limit, "No request refused in this range.");
  const body = document.querySelector("#quality-by-day tbody");
  body.replaceChildren(
    ...quality.data.map((d) =>
      row(
        cell(d.day),
        cell(fmt.format(d.requests), { num: true }),
        cell(seconds(d.ttft.p50_s), { num: true }),
        cell(seconds(d.ttft.p95_s), { num: true }),
        cell(seconds(d.tpot.p50_s), { num: true }),
        cell(seconds(d.tpot.p95_s), { num: true }),
        cell(fmt.format(sum(d.errors)), { num: true }),
        cell(fmt.format(d.rejected), { num: true }),
      ),
    ),
  );
  if (!quality.data.length) {
    const td = cell("No requests in this range.");
    td.colSpan = 8;
    body.append(row(td));
  }
}

async function load() {
  const f = filters();
  status.textContent = "Loading…";
  const base = { start: f.start, end: f.end, model: f.model, key: f.key };
  try {
    const [days, models, keys, quality] = await Promise.all([
      api("GET", `/v1/usage?${query({ ...base, group_by: "day", limit: MAX_DAYS })}`),
      api("GET", `/v1/usage?${query({ ...base, group_by: "model", limit: 1000 })}`),
      api("GET", `/v1/usage?${query({ ...base, group_by: "key", limit: 1000 })}`),
      api("GET", `/v1/usage/quality?${query(base)}`),
    ]);
    const ownKey = document.getElementById("by-key").dataset.ownKey;
    fillSelect(form.model, models.data.map((m) => m.model), f.model, (m) => m);
    fillSelect(form.key, keys.data.map((k) => k.key_id), f.key, (k) => (k === ownKey ? `${k} (this key)` : k));
    renderTotals(days.data, models.data);
    renderCharts(days.data, f.start, f.end);
    renderTable("by-model", models.data, (r) => r.model);
    renderTable("by-key", keys.data, (r) => (r.key_id === ownKey ? `${r.key_id} (this key)` : r.key_id ?? "no key"));
    renderTable("by-day", days.data, (r) => r.day);
    renderQuality(quality);
    document.getElementById("csv").href = `/v1/usage?${query({ ...base, group_by: "day", limit: MAX_DAYS, format: "csv" })}`;
    status.textContent = `Usage from ${f.start} to ${f.end} (UTC days).`;
    history.replaceState(null, "", `?${query(base)}`);
  } catch (error) {
    status.textContent = error.message;
    status.classList.add("error");
  }
}

async function openInvoice(period) {
  const invoice = await api("GET", `/v1/invoices/${encodeURIComponent(period)}`);
  document.getElementById("invoice-period").textContent = `${invoice.period} (${invoice.status})`;
  document.querySelector("#invoice-lines tbody").replaceChildren(
    ...invoice.lines.map((l) =>
      row(
        cell(l.adjustment ? `${l.usage_period} (late)` : l.usage_period),
        cell(l.model),
        cell(l.kind.replace("_", " ")),
        cell(fmt.format(l.requests), { num: true }),
        cell(fmt.format(l.quantity), { num: true }),
        cell(l.unit_price_usd, { num: true }),
        cell(l.amount_usd, { num: true }),
      ),
    ),
  );
  document.getElementById("invoice-total").textContent = invoice.total_usd;
  document.getElementById("invoice").hidden = false;
}

async function loadInvoices() {
  const note = document.getElementById("invoices-status");
  try {
    const page = await api("GET", `/v1/invoices?${query({ limit: 12 })}`);
    document.querySelector("#invoices tbody").replaceChildren(
      ...page.data.map((inv) => {
        const open = document.createElement("button");
        open.type = "button";
        open.className = "secondary";
        open.textContent = inv.period;
        open.setAttribute("aria-label", `Invoice ${inv.period}`);
        open.addEventListener("click", () => openInvoice(inv.period).catch((e) => (note.textContent = e.message)));
        const first = cell("");
        first.append(open);
        return row(first, cell(inv.status), cell(inv.closes_at.slice(0, 10)), cell(inv.total_usd, { num: true }));
      }),
    );
    note.textContent = page.data.length ? "" : "No invoices yet.";
  } catch (error) {
    note.textContent = error.status === 404 ? "This server does not serve invoices." : error.message;
  }
}

form.addEventListener("submit", (event) => {
  event.preventDefault();
  status.classList.remove("error");
  form.dataset.model = "";
  form.dataset.key = "";
  load();
});

initialFilters();
// Interactive once the usage panels are drawn; the invoices (drafts are summed from the ledger) follow.
load().then(markReady);
loadInvoices().then(() => {
  performance.mark("tessera:invoices");
  document.body.dataset.invoices = "ready";
});
