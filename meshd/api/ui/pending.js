// Nodes waiting to join at this page's node, and approving one: the person types the
// code the waiting node's own screen shows (what `meshctl approve CODE` takes), and
// the node asks for the admin credential (the admin key, or on the node's machine its
// owner token). The id shown is the fingerprint of the joiner's key (a hash of its
// public key): compare it with the id the new machine prints.
//
// Rows are kept across snapshots (by node id) so a code being typed survives them.

import { age, dict, el, list, str } from "./dom.js";
import { errorText, keys } from "./keys.js";

const rows = new Map();

async function approve(id, input, result) {
  const code = input.value.trim();
  if (!code) {
    result.textContent = "Type the code the waiting node shows on its screen.";
    return;
  }
  result.textContent = "Approving…";
  result.className = "result";
  try {
    const r = await fetch("/v1/members", {
      method: "POST",
      headers: keys.headers(true, true),
      body: JSON.stringify({ approve: code, node: id }),
      cache: "no-store",
    });
    if (r.ok) {
      result.textContent = "Approved: it joins once it confirms the code.";
      result.className = "result ok";
      return;
    }
    const why = await errorText(r);
    const hint = r.status === 401 || r.status === 403
      ? " Enter the admin key under Keys (or, on the node's own machine, its owner.token)."
      : "";
    result.textContent = `Refused: ${why}${hint}`;
    result.className = "result bad";
  } catch (e) {
    result.textContent = `Could not reach the node: ${e.message || e}`;
    result.className = "result bad";
  }
}

function newRow(p) {
  const id = str(p.id, 64);
  const input = el("input", { cls: "code", attrs: {
    type: "text", placeholder: "ABCD-EFGH", autocomplete: "off", spellcheck: "false",
    maxlength: "20", "aria-label": "approval code",
  } });
  const result = el("p", { cls: "result" });
  const row = el("article", { cls: "card joiner", attrs: { "data-id": id } },
    el("div", { cls: "head" }, el("span", { cls: "name" }), el("span", { cls: "state" })),
    el("div", { cls: "fingerprint" }, el("span", { cls: "k", text: "key fingerprint (node id) " }),
      el("code", { text: id })),
    el("div", { cls: "sub from" }),
    el("form", { cls: "row approve" }, input,
      el("button", { cls: "approve", text: "Approve", attrs: { type: "submit" } })),
    result);
  row.querySelector("form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    approve(id, input, result);
  });
  return row;
}

/** Draw the waiting nodes of a snapshot (`pending` null: an open cluster). */
export function renderPending(pending, where) {
  if (pending === null || pending === undefined) {
    rows.clear();
    where.replaceChildren(el("p", { cls: "empty", text:
      "An open cluster (--open): nodes join without approval." }));
    return;
  }
  const seen = new Set();
  for (const p of list(pending).map(dict)) {
    const id = str(p.id, 64);
    seen.add(id);
    if (!rows.has(id)) rows.set(id, newRow(p));
    const row = rows.get(id);
    row.querySelector(".name").textContent = str(p.name, 80);
    const state = row.querySelector(".state");
    state.textContent = p.approving ? "approved, confirming" : "waiting";
    state.className = `state badge ${p.approving ? "run-ready" : "run-loading"}`;
    row.querySelector(".from").textContent =
      `from ${str(p.address || "?", 80)} · waiting ${age(p.waiting_s)}`;
  }
  for (const id of [...rows.keys()]) if (!seen.has(id)) rows.delete(id);
  const shown = [...rows.values()];
  if (!shown.length) {
    where.replaceChildren(el("p", { cls: "empty", text:
      "No node is waiting. A new machine started with `meshd up` shows up here with a code." }));
    return;
  }
  // Re-appending a kept row keeps its focus and what was typed in it.
  if (where.children.length !== shown.length || shown.some((r, i) => where.children[i] !== r)) {
    where.replaceChildren(...shown);
  }
}
