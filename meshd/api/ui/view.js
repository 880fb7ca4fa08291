// The cluster as the node states it (one /v1/cluster/stream snapshot): nodes,
// instances and their stages, models and who holds them. Like `meshctl top`, it shows
// the node's answers (liveness, stage states, speeds) and derives no rule of its own.

import { age, badge, bar, dict, el, figure, gib, list, ms, num, str } from "./dom.js";

function nodeName(node) {
  return str(node.name || dict(node.card).name || str(node.id, 8) || "?", 80);
}

function memory(card, health) {
  const total = num(card.mem_total);
  const avail = num(health.mem_available) ?? num(card.mem_available);
  if (!total || avail === null) return el("div", { cls: "mem", text: "memory -" });
  const used = Math.max(total - avail, 0);
  const frac = used / total;
  const level = frac < 0.7 ? "ok" : frac < 0.9 ? "warn" : "bad";
  return el("div", { cls: "mem" },
    el("span", { text: `${gib(used)}/${gib(total)} GiB` }),
    bar(frac, `memory ${(frac * 100).toFixed(0)}% in use`, level));
}

function device(d) {
  const x = dict(d);
  const free = num(x.mem_free) || 0;
  const total = num(x.mem_total) || 0;
  return `${str(x.name || "?", 40)} ${(free / 2 ** 30).toFixed(0)}/${(total / 2 ** 30).toFixed(0)}G` +
    (x.unified ? " shared" : "");
}

function nodeCard(node, self) {
  const card = dict(node.card);
  const health = dict(node.health);
  const id = str(node.id, 64);
  const serving = Object.values(dict(health.serving)).map(dict);
  const inFlight = serving.reduce((n, s) => n + (num(s.in_flight) || 0), 0);
  const tokens = node.health ? (num(health.tokens_s) || 0).toFixed(1) : "-";
  const runners = list(health.runners).map(dict);
  const backends = [...list(card.backends).map((b) => str(b, 40)), ...list(card.devices).map(device)];
  const state = str(health.state || "", 20);
  return el("article", { cls: "card node", attrs: { "data-id": id } },
    el("div", { cls: "head" },
      el("span", { cls: "name", text: nodeName(node) }),
      id === self ? el("span", { cls: "tag", text: "this page's node" }) : null,
      badge(str(node.liveness || "unknown", 20), "live"),
      state && state !== "up" ? badge(state, "live") : null),
    el("div", { cls: "sub", text: `id ${id}` }),
    memory(card, health),
    el("div", { cls: "figs" },
      figure("tok/s", tokens, "tps"),
      figure("reqs", node.health ? String(inFlight) : "-"),
      figure("load", num(health.load) === null ? "-" : health.load.toFixed(2)),
      figure("heartbeat", age(node.heartbeat_age_s))),
    backends.length ? el("div", { cls: "line", text: `backends: ${backends.join(", ")}` }) : null,
    runners.length
      ? el("ul", { cls: "runners" }, runners.map((r) =>
        el("li", {}, `${str(r.instance, 40)} stage ${num(r.stage) ?? 0} `,
          badge(str(r.state || "?", 20), "run"))))
      : null);
}

function fetchNote(st) {
  const done = num(st.fetched) || 0;
  const total = num(st.fetch_total) || 0;
  const rate = num(st.fetch_rate) || 0;
  if (!total) return el("div", { cls: "fetch", text: "fetching: asking the holders" });
  const frac = done / total;
  const note = `${(frac * 100).toFixed(0)}% of ${(total / 1e6).toFixed(0)} MB, ${(rate / 1e6).toFixed(1)} MB/s`;
  return el("div", { cls: "fetch" }, bar(frac, `fetched ${note}`, "ok"), el("span", { text: note }));
}

function stageLine(st) {
  const state = str(st.state || "?", 20);
  const liveness = str(st.liveness || "", 20);
  return el("li", { cls: "stage" },
    el("span", { cls: "where", text: `${str(st.name || str(st.node, 8), 80)} [${num(st.start) ?? "?"}:${num(st.end) ?? "?"})` }),
    st.engine ? el("span", { cls: "engine", text: str(st.engine, 30) }) : null,
    badge(state, "run"),
    num(st.ms_per_token) !== null ? el("span", { cls: "ms", text: ms(st.ms_per_token) }) : null,
    liveness && liveness !== "alive" ? el("span", { cls: "why", text: `node ${liveness}` }) : null,
    st.reason && state !== "unavailable" ? el("span", { cls: "why", text: str(st.reason) }) : null,
    state === "fetching" ? fetchNote(st) : null);
}

function predicted(inst) {
  const p = num(inst.predicted_tokens_s) || 0;
  const m = num(inst.measured_tokens_s) || 0;
  return `${p ? p.toFixed(0) : "-"}/${m ? m.toFixed(0) : "-"}`;
}

function instanceCard(inst) {
  const speed = dict(inst.speed);
  const id = str(inst.id, 64);
  const hop = num(speed.hop_ms);
  return el("article", { cls: "card instance", attrs: { "data-id": id } },
    el("div", { cls: "head" },
      el("span", { cls: "name model", text: str(inst.model, 500) }),
      badge(str(inst.state || "?", 20), "run")),
    el("div", { cls: "sub", text: `id ${id} · generation ${num(inst.generation) ?? "?"}` }),
    el("div", { cls: "figs" },
      figure("tok/s", (num(speed.tokens_s) || 0).toFixed(1), "tps"),
      figure("reqs", String(num(speed.in_flight) || 0)),
      figure("queue", String(num(speed.queue) || 0), "queue"),
      figure("TTFT", ms(speed.ttft_ms), "ttft"),
      figure("ITL", ms(speed.itl_ms)),
      figure("1 req pred/real", predicted(inst))),
    el("ol", { cls: "stages" }, list(inst.stages).map(dict).map(stageLine)),
    hop !== null ? el("div", { cls: "line", text: `per hop ${ms(hop)}` }) : null,
    list(inst.excluded).map(dict).map((x) => el("div", { cls: "line bad",
      text: `excluded ${str(x.name || str(x.node, 8), 80)} (${str(x.reason || "?")})` })),
    inst.unrepairable ? el("div", { cls: "line bad", text: `cannot serve: ${str(inst.unrepairable)}` }) : null);
}

function size(bytes) {
  const b = num(bytes);
  if (b === null) return ""; // facts not read yet
  return b >= 2 ** 30 ? ` ${gib(b)} GiB` : ` ${(b / 2 ** 20).toFixed(0)} MiB`;
}

function modelsTable(models) {
  if (!models.length) return el("p", { cls: "empty", text: "No node holds a model." });
  return el("table", { cls: "models" },
    el("thead", {}, el("tr", {}, el("th", { text: "model" }), el("th", { text: "held by" }),
      el("th", { text: "serving" }))),
    el("tbody", {}, models.map((m) => el("tr", { attrs: { "data-model": str(m.model, 500) } },
      el("td", { cls: "model" }, str(m.model, 500), el("span", { cls: "size", text: size(m.size) })),
      el("td", { cls: "holders", text: list(m.nodes).map((n) => str(n, 80)).join(", ") || "-" }),
      el("td", { cls: "serving" }, list(m.instances).length
        ? list(m.instances).map(dict).map((i) => el("span", { cls: "inst" }, `${str(i.id, 64)} `,
          badge(str(i.state || "?", 20), "run")))
        : "not placed")))));
}

/** The header line: `cluster home · 2/3 nodes alive · 1 instance · via mini`. */
export function summary(snapshot) {
  const c = dict(snapshot.cluster);
  const nodes = list(c.nodes).map(dict);
  const alive = nodes.filter((n) => n.liveness === "alive").length;
  const n = list(dict(snapshot.instances).data).length;
  const me = nodes.find((x) => x.id === c.self);
  return `cluster ${str(c.cluster, 80)} · ${alive}/${nodes.length} nodes alive · ` +
    `${n} instance${n === 1 ? "" : "s"} · via ${me ? nodeName(me) : str(c.self, 16)}`;
}

/** Draw the nodes, instances and models of one snapshot. */
export function render(snapshot, where) {
  const c = dict(snapshot.cluster);
  const nodes = list(c.nodes).map(dict);
  const instances = list(dict(snapshot.instances).data).map(dict);
  where.nodes.replaceChildren(...nodes.map((n) => nodeCard(n, c.self)));
  where.instances.replaceChildren(...(instances.length ? instances.map(instanceCard)
    : [el("p", { cls: "empty", text: "No model placed: a chat request or meshctl place places one." })]));
  where.models.replaceChildren(modelsTable(list(snapshot.models).map(dict)));
}
