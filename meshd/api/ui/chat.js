// A small chat to try a model: /v1/chat/completions streamed, the model's thoughts
// (`reasoning_content`) shown apart from its answer, Stop ends the answer.

import { el, str } from "./dom.js";
import { readEvents } from "./feed.js";
import { errorText, keys } from "./keys.js";

export class Chat {
  constructor(form) {
    this.form = form;
    this.model = form.querySelector("#chat-model");
    this.log = form.querySelector("#chat-log");
    this.input = form.querySelector("#chat-input");
    this.send = form.querySelector("#chat-send");
    this.stop = form.querySelector("#chat-stop");
    this.history = [];
    this.abort = null;
    this.models = "";
    form.addEventListener("submit", (ev) => {
      ev.preventDefault();
      this.ask();
    });
    this.input.addEventListener("keydown", (ev) => {
      if (ev.key === "Enter" && !ev.shiftKey && !ev.isComposing) {
        ev.preventDefault();
        this.ask();
      }
    });
    this.stop.addEventListener("click", () => this.abort?.abort());
    form.querySelector("#chat-clear").addEventListener("click", () => {
      this.abort?.abort();
      this.history = [];
      this.log.replaceChildren();
    });
  }

  /** The models a chat may pick: those placed (the snapshot's instances). */
  offer(instances) {
    const names = [...new Set(instances.map((i) => str(i.model, 500)))].sort();
    const key = names.join("\n");
    if (key === this.models) return; // unchanged: keep the person's pick
    this.models = key;
    const picked = this.model.value;
    this.model.replaceChildren(...names.map((m) => el("option", { text: m, attrs: { value: m } })));
    if (!names.length) {
      this.model.append(el("option", { text: "no model placed", attrs: { value: "" } }));
    }
    if (names.includes(picked)) this.model.value = picked;
  }

  async ask() {
    const text = this.input.value.trim();
    const model = this.model.value;
    if (!text || !model || this.abort) return;
    this.input.value = "";
    this.history.push({ role: "user", content: text });
    this.log.append(el("div", { cls: "msg user", text }));
    const thoughts = el("pre", { cls: "reasoning-text" });
    const reasoning = el("details", { cls: "reasoning", attrs: { open: "" } },
      el("summary", { text: "Thoughts" }), thoughts);
    reasoning.hidden = true;
    const answer = el("div", { cls: "answer" });
    // Until the first token (a model being placed or loaded takes a while).
    const status = el("div", { cls: "status", text: "waiting for the model…" });
    this.log.append(el("div", { cls: "msg assistant" }, reasoning, answer, status));
    this.abort = new AbortController();
    this.busy(true);
    try {
      const r = await fetch("/v1/chat/completions", {
        method: "POST",
        headers: keys.headers(false, true),
        body: JSON.stringify({ model, messages: this.history, stream: true }),
        signal: this.abort.signal,
        cache: "no-store",
      });
      if (!r.ok) throw new Error(await errorText(r));
      await readEvents(r, (data) => {
        if (data === "[DONE]") return false;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Error(str(chunk.error.message || "the model failed"));
        const delta = chunk.choices?.[0]?.delta || {};
        if (delta.reasoning_content || delta.content) status.textContent = "";
        if (typeof delta.reasoning_content === "string" && delta.reasoning_content) {
          reasoning.hidden = false;
          thoughts.textContent += delta.reasoning_content;
        }
        if (typeof delta.content === "string") answer.textContent += delta.content;
        this.log.scrollTop = this.log.scrollHeight;
        return true;
      });
      status.textContent = "";
      this.history.push({ role: "assistant", content: answer.textContent });
    } catch (e) {
      const stopped = this.abort.signal.aborted;
      status.textContent = stopped ? "(stopped)" : `Error: ${e.message || e}`;
      status.className = stopped ? "status" : "status bad";
      if (answer.textContent) this.history.push({ role: "assistant", content: answer.textContent });
      else this.history.pop(); // no answer: the turn is not part of the conversation
    } finally {
      this.abort = null;
      this.busy(false);
      this.input.focus();
    }
  }

  busy(on) {
    this.send.disabled = on;
    this.stop.disabled = !on;
    this.form.classList.toggle("busy", on);
  }
}
