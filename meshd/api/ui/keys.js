// The keys the person typed: kept in this tab's sessionStorage at most, and sent as
// request headers (never cookies), so no other site can make the browser send them.

const API = "meshd.apiKey";
const ADMIN = "meshd.adminKey";

function read(name) {
  try {
    return sessionStorage.getItem(name) || "";
  } catch {
    return ""; // storage refused (a private window): the keys live as long as the page
  }
}

const memory = { [API]: read(API), [ADMIN]: read(ADMIN) };

function write(name, value) {
  memory[name] = value;
  try {
    if (value) sessionStorage.setItem(name, value);
    else sessionStorage.removeItem(name);
  } catch {
    // kept in memory only
  }
}

export const keys = {
  get api() { return memory[API]; },
  get admin() { return memory[ADMIN]; },
  set(api, admin) {
    write(API, api.trim());
    write(ADMIN, admin.trim());
  },
  forget() {
    write(API, "");
    write(ADMIN, "");
  },
  /** Headers of a request: the API key, and with `admin` the admin credential (also
   * sent when no API key was given: it opens the reading routes too, so the owner
   * needs no second key to watch a keyed node). */
  headers(admin = false, json = false) {
    const h = {};
    if (memory[API]) h["Authorization"] = `Bearer ${memory[API]}`;
    if ((admin || !memory[API]) && memory[ADMIN]) h["x-meshd-admin"] = memory[ADMIN];
    if (json) h["Content-Type"] = "application/json";
    return h;
  },
};

/** The message of an API error answer (every dialect puts one in error.message). */
export async function errorText(response) {
  let message = "";
  try {
    const body = await response.json();
    message = typeof body?.error === "object" ? body.error.message : body?.error;
  } catch {
    // not JSON: the status says enough
  }
  return `${response.status}: ${message || response.statusText || "error"}`;
}
