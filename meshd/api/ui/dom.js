// Building the page from data: every string from the network goes in as a text node
// or an attribute value, never as markup (no innerHTML anywhere in the page), so a
// node or model named "<img onerror=...>" shows as those characters.

/** An element: `props` sets className (cls), text, attributes (attrs) and click
 * handlers (onclick); `children` are nodes or strings (strings become text). */
export function el(tag, props = {}, ...children) {
  const node = document.createElement(tag);
  if (props.cls) node.className = props.cls;
  if (props.text !== undefined && props.text !== null) node.textContent = String(props.text);
  for (const [name, value] of Object.entries(props.attrs || {})) {
    if (value !== undefined && value !== null) node.setAttribute(name, String(value));
  }
  if (props.onclick) node.addEventListener("click", props.onclick);
  for (const child of children.flat()) {
    if (child === null || child === undefined || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

/** A number from the wire, or null when the field is missing or not a number. */
export function num(value) {
  return typeof value === "number" && Number.isFinite(value) ? value : null;
}

export function list(value) {
  return Array.isArray(value) ? value : [];
}

export function dict(value) {
  return value && typeof value === "object" && !Array.isArray(value) ? value : {};
}

/** A string from the wire, cut to a length a screen can show. */
export function str(value, limit = 300) {
  const s = value === null || value === undefined ? "" : String(value);
  return s.length > limit ? s.slice(0, limit) + "…" : s;
}

export function gib(bytes) {
  return (bytes / 2 ** 30).toFixed(1);
}

export function ms(value) {
  const v = num(value);
  if (v === null) return "-";
  return v >= 100 ? `${v.toFixed(0)} ms` : `${v.toFixed(1)} ms`;
}

export function age(seconds) {
  const s = num(seconds);
  if (s === null) return "-";
  if (s < 10) return `${s.toFixed(1)} s`;
  if (s < 120) return `${s.toFixed(0)} s`;
  if (s < 7200) return `${(s / 60).toFixed(0)} min`;
  return `${(s / 3600).toFixed(0)} h`;
}

/** A bar of `frac` (0..1) filled, with a label for screen readers. */
export function bar(frac, label, cls = "") {
  const f = Math.min(Math.max(frac, 0), 1);
  const fill = el("span", { cls: "fill" });
  // CSSOM, not a style attribute: the policy allows no inline style.
  fill.style.width = `${(f * 100).toFixed(1)}%`;
  return el("span", { cls: `bar ${cls}`, attrs: { role: "img", "aria-label": label } }, fill);
}

/** A figure with its name above it: `tok/s 41.2`. */
export function figure(name, value, cls = "") {
  return el("div", { cls: `fig ${cls}` }, el("span", { cls: "k", text: name }),
    el("span", { cls: "v", text: value }));
}

export function badge(word, kind) {
  return el("span", { cls: `badge ${kind}-${str(word, 20).replace(/[^a-z]/g, "")}`, text: word });
}
