// The admin console: one GET each for tenants, deployments, pools and the audit log on load; the pools refresh every
// few seconds; a tenant's quotas and keys, and a deployment's audit log, load when it is opened.
import { ApiError, api, cell, fmt, markReady, query, row, showError } from "./api.js";

const PAGE = 200;
const POOLS_EVERY_MS = 5000;
const status = document.getElementById("status");
// The deployment fields the form edits: its named inputs (admin.html), in the form's order.
const FIELDS = [...document.getElementById("deployment-form").elements].map((input) => input.name).filter(Boolean);
// The quota fields the server rendered from the API's schema (admin_schemas.Quotas).
const QUOTAS = [...document.querySelectorAll("#quotas-form input")].map((input) => input.name);
let quotaKey = null;
const deployments = new Map();
let tenantsCursor = null;
let editing = null;
let pending = null;

function button(label, onClick, className = "secondary") {
  const b = document.createElement("button");
  b.type = "button";
  b.className = className;
  b.textContent = label;
  b.addEventListener("click", onClick);
  return b;
}

function when(iso) {
  return iso ? iso.replace("T", " ").slice(0, 19) : "";
}

function yesNo(value) {
  return value ? "on" : "off";
}

// --- pools -------------------------------------------------------------------------------------------

async function loadPools() {
  const pools = await api("GET", `/admin/pools?${query({ limit: PAGE })}`);
  document.querySelector("#pools tbody").replaceChildren(
    ...pools.data.map((p) =>
      row(
        cell(p.deployment),
        cell(p.pool),
        cell(p.live_workers, { num: true }),
        cell(fmt.format(p.queue_depth), { num: true }),
        cell(p.kv_pages_total ? `${((100 * p.kv_pages_used) / p.kv_pages_total).toFixed(1)}%` : "–", { num: true }),
        cell(p.kv_formats.join(", ") || "–"),
        cell(p.prefix_cache_hit_rate === null ? "–" : `${(100 * p.prefix_cache_hit_rate).toFixed(1)}%`, { num: true }),
        cell(fmt.format(p.integrity_mismatches), { num: true }),
      ),
    ),
  );
  document.getElementById("pools-updated").textContent = `updated ${new Date().toLocaleTimeString()}`;
}

function refreshPools() {
  if (!document.hidden) loadPools().catch((error) => (status.textContent = error.message));
}

// --- deployments -------------------------------------------------------------------------------------

function renderDeployments() {
  document.querySelector("#deployments tbody").replaceChildren(
    ...[...deployments.values()].map((d) =>
      row(
        (() => {
          const td = cell("");
          const edit = button("Edit", () => openDeployment(d.name));
          edit.setAttribute("aria-label", `Edit ${d.name}`);
          td.append(edit);
          return td;
        })(),
        cell(d.name),
        cell(d.mode),
        cell(`${d.prefill_weights} / ${d.decode_weights}`),
        cell(`${d.prefill_kv} / ${d.decode_kv}`),
        cell(d.page_size, { num: true }),
        cell(yesNo(d.integrity_check)),
        cell(yesNo(d.prefix_cache)),
        cell(yesNo(d.enabled)),
      ),
    ),
  );
}

function formValue(name) {
  const input = document.getElementById(`d-${name}`);
  if (input.type === "checkbox") return input.checked;
  if (input.type === "number") return input.value === "" ? null : Number(input.value);
  return input.value;
}

async function openDeployment(name) {
  editing = name;
  const d = deployments.get(name);
  const form = document.getElementById("deployment-form");
  document.getElementById("deployment-name").textContent = name;
  for (const field of FIELDS) {
    const input = document.getElementById(`d-${field}`);
    if (input.type === "checkbox") input.checked = d[field];
    else input.value = d[field] ?? "";
  }
  document.getElementById("deployment-error").hidden = true;
  form.hidden = false;
  document.getElementById("d-checkpoint").focus();
  await loadAudit(name);
}

async function loadAudit(name) {
  const audit = await api("GET", `/admin/deployments/${encodeURIComponent(name)}/audit?${query({ limit: 20 })}`);
  document.querySelector("#deployment-audit tbody").replaceChildren(
    ...audit.data.map((e) =>
      row(
        cell(when(e.at)),
        cell(e.actor),
        cell(e.action),
        cell(
          Object.entries(e.changes)
            .map(([field, [before, after]]) => `${field}: ${JSON.stringify(before)} → ${JSON.stringify(after)}`)
            .join("; "),
        ),
      ),
    ),
  );
}

function review(event) {
  event.preventDefault();
  const d = deployments.get(editing);
  const changes = {};
  for (const field of FIELDS) {
    const value = formValue(field);
    if (value !== d[field]) changes[field] = value;
  }
  const error = document.getElementById("deployment-error");
  if (!Object.keys(changes).length) {
    showError(error, new Error("Nothing changed: edit a field first."));
    return;
  }
  error.hidden = true;
  pending = changes;
  document.querySelector("#diff tbody").replaceChildren(
    ...Object.entries(changes).map(([field, value]) =>
      row(cell(field), cell(JSON.stringify(d[field])), cell(JSON.stringify(value))),
    ),
  );
  document.getElementById("confirm").showModal();
}

async function save() {
  const dialog = document.getElementById("confirm");
  dialog.close();
  const error = document.getElementById("deployment-error");
  const check = document.getElementById("d-check_checkpoint").checked;
  try {
    const updated = await api(
      "PATCH",
      `/admin/deployments/${encodeURIComponent(editing)}?${query({ check_checkpoint: check })}`,
      pending,
    );
    deployments.set(updated.name, updated);
    renderDeployments();
    status.textContent = `Saved ${updated.name}: workers pick the change up as they restart.`;
    await loadAudit(updated.name);
  } catch (e) {
    showError(error, e);
  }
}

// --- audit log (tenants, keys, quotas) -----------------------------------------------------------------

let auditCursor = null;

function compact(values) {
  return values === null ? "" : JSON.stringify(values);
}

async function loadAuditLog(cursor = null) {
  const targetType = document.getElementById("audit-type").value;
  const page = await api("GET", `/admin/audit?${query({ limit: 50, target_type: targetType, cursor })}`);
  const rows = page.data.map((e) =>
    row(cell(when(e.at)), cell(e.actor), cell(e.action), cell(`${e.target_type} ${e.target}`), cell(compact(e.before)), cell(compact(e.after))),
  );
  const body = document.querySelector("#audit tbody");
  if (cursor) body.append(...rows);
  else body.replaceChildren(...rows);
  auditCursor = page.next_cursor;
  document.getElementById("audit-more").hidden = !auditCursor;
}

function refreshAuditLog() {
  loadAuditLog().catch((error) => (status.textContent = error.message));
}

// --- tenants, quotas, keys ---------------------------------------------------------------------------

async function loadTenants(cursor) {
  const page = await api("GET", `/admin/tenants?${query({ limit: PAGE, cursor })}`);
  const body = document.querySelector("#tenants tbody");
  const rows = page.data.map((t) => {
    const td = cell("");
    td.className = "actions";
    const manage = button("Manage", () => openTenant(t.name));
    manage.setAttribute("aria-label", `Manage ${t.name}`);
    const verb = t.disabled ? "Restore" : "Suspend";
    const toggle = button(verb, () => setSuspended(t, !t.disabled), t.disabled ? "secondary" : "danger");
    toggle.setAttribute("aria-label", `${verb} ${t.name}`);
    td.append(manage, toggle);
    return row(cell(t.name), cell(t.disabled ? "suspended" : "active"), cell(when(t.created_at)), td);
  });
  if (cursor) body.append(...rows);
  else body.replaceChildren(...rows);
  tenantsCursor = page.next_cursor;
  document.getElementById("tenants-more").hidden = !tenantsCursor;
}

async function setSuspended(t, disabled) {
  const question = disabled
    ? `Suspend ${t.name}? Its keys are refused at once, until it is restored.`
    : `Restore ${t.name}? Its unrevoked keys work again.`;
  if (!window.confirm(question)) return;
  try {
    await api("PATCH", `/admin/tenants/${encodeURIComponent(t.name)}`, { disabled });
    await loadTenants(null);
    status.textContent = `${t.name} is ${disabled ? "suspended" : "active"}.`;
    refreshAuditLog();
  } catch (e) {
    status.textContent = e.message;
  }
}

let tenant = null;

// The tenant's quotas as loaded: a save sends them back with the form's fields changed, so a limit this
// form has no field for is kept, never reset.
let loadedQuotas = {};

async function openTenant(name) {
  tenant = name;
  const panel = document.getElementById("tenant-panel");
  panel.hidden = true; // shown once filled in, so nothing typed is overwritten by the load
  document.getElementById("tenant-panel-name").textContent = name;
  document.getElementById("secret").hidden = true;
  document.getElementById("key-quotas-form").hidden = true;
  for (const id of ["quotas-error", "keys-error"]) document.getElementById(id).hidden = true;
  const [quotas] = await Promise.all([api("GET", `/admin/tenants/${encodeURIComponent(name)}/quotas`), loadKeys()]);
  loadedQuotas = quotas;
  for (const field of QUOTAS) document.getElementById(`q-${field}`).value = quotas[field] ?? "";
  panel.hidden = false;
  document.getElementById("tenant-panel-h").scrollIntoView();
}

async function loadKeys() {
  const keys = await api("GET", `/admin/tenants/${encodeURIComponent(tenant)}/keys?${query({ limit: PAGE })}`);
  document.querySelector("#keys tbody").replaceChildren(
    ...keys.data.map((k) => {
      const td = cell("");
      td.className = "actions";
      const limits = button("Quotas", () => openKeyQuotas(k).catch((e) => showError(document.getElementById("keys-error"), e)));
      limits.setAttribute("aria-label", `Quotas of ${k.prefix}`);
      td.append(limits);
      if (!k.revoked_at) {
        const revoke = button("Revoke", () => revokeKey(k), "danger");
        revoke.setAttribute("aria-label", `Revoke ${k.prefix}`);
        td.append(revoke);
      }
      return row(cell(k.prefix), cell(k.name), cell(k.scopes.join(", ")), cell(when(k.created_at)), cell(when(k.revoked_at)), td);
    }),
  );
}

function showKeyQuotas(quota) {
  for (const field of QUOTAS) {
    const input = document.getElementById(`kq-${field}`);
    input.value = quota.override?.[field] ?? "";
    const inherited = quota.effective[field];
    input.placeholder = inherited === null || inherited === undefined ? "unlimited" : String(inherited);
  }
}

async function openKeyQuotas(key) {
  const form = document.getElementById("key-quotas-form");
  form.hidden = true; // shown once filled in
  quotaKey = key;
  showKeyQuotas(await api("GET", `/admin/keys/${encodeURIComponent(key.id)}/quotas`));
  document.getElementById("key-quotas-name").textContent = key.prefix;
  document.getElementById("key-quotas-error").hidden = true;
  form.hidden = false;
}

async function saveKeyQuotas(event) {
  event.preventDefault();
  const body = {};
  for (const field of QUOTAS) {
    const value = document.getElementById(`kq-${field}`).value;
    body[field] = value === "" ? null : Number(value);
  }
  const error = document.getElementById("key-quotas-error");
  try {
    showKeyQuotas(await api("PUT", `/admin/keys/${encodeURIComponent(quotaKey.id)}/quotas`, body));
    error.hidden = true;
    status.textContent = `Saved the quotas of ${quotaKey.prefix}.`;
    refreshAuditLog();
  } catch (e) {
    showError(error, e);
  }
}

async function revokeKey(key) {
  if (!window.confirm(`Revoke ${key.prefix}? Requests with it are refused at once.`)) return;
  try {
    await api("DELETE", `/admin/keys/${encodeURIComponent(key.id)}`);
    await loadKeys();
    refreshAuditLog();
  } catch (e) {
    showError(document.getElementById("keys-error"), e);
  }
}

async function createKey(event) {
  event.preventDefault();
  const form = event.target;
  const scopes = [...form.querySelectorAll('input[name="scope"]:checked')].map((i) => i.value);
  try {
    const created = await api("POST", `/admin/tenants/${encodeURIComponent(tenant)}/keys`, { name: document.getElementById("key-name").value, scopes });
    document.getElementById("secret-value").textContent = created.secret;
    document.getElementById("secret").hidden = false;
    document.getElementById("keys-error").hidden = true;
    form.reset();
    await loadKeys();
    refreshAuditLog();
  } catch (e) {
    showError(document.getElementById("keys-error"), e);
  }
}

async function saveQuotas(event) {
  event.preventDefault();
  const body = { ...loadedQuotas };
  for (const field of QUOTAS) {
    const value = document.getElementById(`q-${field}`).value;
    body[field] = value === "" ? null : Number(value);
  }
  const error = document.getElementById("quotas-error");
  try {
    loadedQuotas = await api("PUT", `/admin/tenants/${encodeURIComponent(tenant)}/quotas`, body);
    error.hidden = true;
    status.textContent = `Saved the quotas of ${tenant}.`;
    refreshAuditLog();
  } catch (e) {
    showError(error, e);
  }
}

async function createTenant(event) {
  event.preventDefault();
  try {
    const created = await api("POST", "/admin/tenants", { name: document.getElementById("tenant-name").value });
    event.target.reset();
    await loadTenants(null);
    status.textContent = `Created tenant ${created.name}.`;
    refreshAuditLog();
  } catch (e) {
    status.textContent = e.message;
  }
}

// --- start -------------------------------------------------------------------------------------------

document.getElementById("deployment-form").addEventListener("submit", review);
document.getElementById("deployment-cancel").addEventListener("click", () => {
  document.getElementById("deployment-form").hidden = true;
});
document.getElementById("confirm-save").addEventListener("click", save);
document.getElementById("confirm-cancel").addEventListener("click", () => document.getElementById("confirm").close());
document.getElementById("tenant-create").addEventListener("submit", createTenant);
document.getElementById("tenants-more").addEventListener("click", () => loadTenants(tenantsCursor));
document.getElementById("quotas-form").addEventListener("submit", saveQuotas);
document.getElementById("key-create").addEventListener("submit", createKey);
document.getElementById("key-quotas-form").addEventListener("submit", saveKeyQuotas);
document.getElementById("key-quotas-close").addEventListener("click", () => {
  document.getElementById("key-quotas-form").hidden = true;
});
document.getElementById("audit-type").addEventListener("change", refreshAuditLog);
document.getElementById("audit-more").addEventListener("click", () => loadAuditLog(auditCursor));
document.getElementById("secret-done").addEventListener("click", () => {
  document.getElementById("secret-value").textContent = "";
  document.getElementById("secret").hidden = true;
});

async function start() {
  try {
    const [page] = await Promise.all([
      api("GET", `/admin/deployments?${query({ limit: PAGE })}`),
      loadTenants(null),
      loadPools(),
      loadAuditLog(),
    ]);
    for (const d of page.data) deployments.set(d.name, d);
    renderDeployments();
    status.textContent = "";
  } catch (e) {
    status.textContent = e instanceof ApiError ? e.message : String(e);
  }
  markReady();
  setInterval(refreshPools, POOLS_EVERY_MS);
}

start();
