// The page of one node: the cluster feed drawn as it comes, the keys, the chat.

import { Chat } from "./chat.js";
import { dict, list } from "./dom.js";
import { Feed } from "./feed.js";
import { keys } from "./keys.js";
import { renderPending } from "./pending.js";
import { render, summary } from "./view.js";

const $ = (id) => document.getElementById(id);
const where = { nodes: $("nodes"), instances: $("instances"), models: $("models") };
const link = $("link");
const notice = $("notice");
const panel = $("keys");
const toggle = $("keys-toggle");
const chat = new Chat($("chat-form"));

function say(text) {
  notice.textContent = text;
  notice.hidden = !text;
}

function showKeys(open) {
  panel.hidden = !open;
  toggle.setAttribute("aria-expanded", String(open));
}

function onSnapshot(snapshot) {
  $("summary").textContent = summary(snapshot);
  render(snapshot, where);
  renderPending(snapshot.pending, $("pending"));
  chat.offer(list(dict(snapshot.instances).data).map(dict));
  document.body.dataset.ready = "1"; // for tests and scripts: a snapshot was drawn
}

function onState(state, detail) {
  link.className = `badge link-${state}`;
  link.textContent = { live: "live", retry: "reconnecting", key: "needs a key" }[state] || state;
  if (state === "live") say("");
  if (state === "retry") say(`Lost the node (${detail}); trying again.`);
  if (state === "key") {
    say(`This node needs an API key (${detail}). Enter it under Keys.`);
    showKeys(true);
    $("api-key").focus();
  }
}

const feed = new Feed("/v1/cluster/stream", onSnapshot, onState);

toggle.addEventListener("click", () => showKeys(panel.hidden));
$("keys-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  keys.set($("api-key").value, $("admin-key").value);
  showKeys(false);
  feed.start();
});
$("keys-forget").addEventListener("click", () => {
  keys.forget();
  $("api-key").value = "";
  $("admin-key").value = "";
  feed.start();
});
$("api-key").value = keys.api;
$("admin-key").value = keys.admin;
feed.start();
