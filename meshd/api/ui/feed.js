// Server-Sent Events read from fetch() (EventSource cannot send the API key header),
// and the cluster feed: one connection to /v1/cluster/stream, reopened with a growing
// pause when it drops, and not reopened while the node wants a key nobody gave.

import { errorText, keys } from "./keys.js";

/** The node sends a keep-alive comment every 15 s: this long without a byte, the
 * connection is taken for dead and opened again. */
const SILENCE_MS = 40000;
/** One event larger than this is no event of ours: the connection is dropped. */
const MAX_EVENT = 4 * 1024 * 1024;

/** Call `onData` with the data of each event of `response`'s body, until it ends. */
export async function readEvents(response, onData) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  let timer;
  try {
    for (;;) {
      const silence = new Promise((_, reject) => {
        timer = setTimeout(() => reject(new Error("no word from the node")), SILENCE_MS);
      });
      const { value, done } = await Promise.race([reader.read(), silence]);
      clearTimeout(timer);
      if (done) return;
      buffer += value;
      if (buffer.length > MAX_EVENT) throw new Error("an event too large");
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const block = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        const data = block.split("\n").filter((l) => l.startsWith("data:"))
          .map((l) => l.slice(5).trimStart()).join("\n");
        if (data && onData(data) === false) return;
      }
    }
  } finally {
    clearTimeout(timer);
    reader.cancel().catch(() => {});
  }
}

function pause(ms, signal) {
  return new Promise((resolve) => {
    const t = setTimeout(resolve, ms);
    signal.addEventListener("abort", () => { clearTimeout(t); resolve(); }, { once: true });
  });
}

/** Watch `url`: `onSnapshot(obj)` for each event, `onState(state, detail)` with
 * "live", "retry" (dropped: opened again after a pause) or "key" (401: it waits for
 * `start()` again, called when the person gives a key). */
export class Feed {
  constructor(url, onSnapshot, onState) {
    this.url = url;
    this.onSnapshot = onSnapshot;
    this.onState = onState;
    this.abort = null;
  }

  start() {
    this.abort?.abort();
    this.abort = new AbortController();
    this.run(this.abort.signal);
  }

  async run(signal) {
    let wait = 1000;
    while (!signal.aborted) {
      try {
        const r = await fetch(this.url, { headers: keys.headers(), signal, cache: "no-store" });
        if (r.status === 401) {
          this.onState("key", await errorText(r));
          return;
        }
        if (!r.ok) throw new Error(await errorText(r));
        this.onState("live", "");
        wait = 1000;
        await readEvents(r, (data) => {
          if (signal.aborted) return false;
          this.onSnapshot(JSON.parse(data));
          return true;
        });
        if (!signal.aborted) this.onState("retry", "the node ended the stream (draining?)");
      } catch (e) {
        if (signal.aborted) return;
        this.onState("retry", String(e && e.message ? e.message : e));
      }
      await pause(wait, signal);
      wait = Math.min(wait * 2, 15000);
    }
  }
}
