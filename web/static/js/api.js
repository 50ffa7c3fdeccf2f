// The public HTTP API, called with the session cookie; changes carry the page's CSRF token.

const csrf = document.querySelector('meta[name="csrf-token"]')?.content ?? "";

export class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

export async function api(method, path, body) {
  const headers = { Accept: "application/json" };
  if (method !== "GET") headers["X-CSRF-Token"] = csrf;
  if (body !== undefined) headers["Content-Type"] = "application/json";
  const response = await fetch(path, {
    method,
    headers,
    credentials: "same-origin",
    body: body === undefined ? undefined : JSON.stringify(body),
  });
  if (response.status === 401) {
    window.location.assign(`/signin?next=${encodeURIComponent(window.location.pathname)}`);
    throw new ApiError(401, "your session has ended: sign in again");
  }
  const data = await response.json().catch(() => null);
  if (!response.ok) {
    throw new ApiError(response.status, data?.error?.message ?? `the server answered ${response.status}`);
  }
  return data;
}

export function query(params) {
  const search = new URLSearchParams();
  for (const [name, value] of Object.entries(params)) {
    if (value !== undefined && value !== null && value !== "") search.set(name, value);
  }
  return search.toString();
}

// A table cell; numbers right-aligned and grouped.
export function cell(value, { num = false } = {}) {
  const td = document.createElement("td");
  if (num) td.className = "num";
  td.textContent = value ?? "";
  return td;
}

export function row(...cells) {
  const tr = document.createElement("tr");
  tr.append(...cells);
  return tr;
}

export const fmt = new Intl.NumberFormat("en-US");

export function usd(micro) {
  // Exact: integer micro-USD to a dollar string with 6 decimals (like the API's cost_usd).
  const sign = micro < 0 ? "-" : "";
  const abs = Math.abs(micro);
  return `${sign}${Math.floor(abs / 1e6)}.${String(abs % 1e6).padStart(6, "0")}`;
}

export function showError(element, error) {
  element.textContent = error.message;
  element.hidden = false;
}

export function markReady() {
  performance.mark("tessera:ready");
  document.body.dataset.ready = "true";
}
