// Loads the web page's script in node over a small stand-in for the browser (elements by id, a
// localStorage, a fetch that never answers) and prints, as JSON, the chat it rendered from the
// stored conversation: each message's classes and its body's HTML, or the error the page threw, and
// what the page left in localStorage.
//
//   node webui_page.js APP_JS < '{"chat": [{"role": "assistant", "content": "..."}]}'
//
// "quota": N makes localStorage refuse a value longer than N characters, as a full storage does.
"use strict";

const fs = require("fs");
const vm = require("vm");

class Element {
  constructor(tag) {
    this.tag = tag;
    this.children = [];
    this.className = "";
    this.textContent = "";
    this.innerHTML = "";
    this.hidden = false;
    this.value = "";
    this.dataset = {};
    this.attributes = {};
    const classes = new Set();
    this.classList = {
      toggle: (name, on) => (on ?? !classes.has(name) ? classes.add(name) : classes.delete(name)),
      add: (name) => classes.add(name),
      remove: (name) => classes.delete(name),
      contains: (name) => classes.has(name),
    };
  }
  append(...nodes) { this.children.push(...nodes); }
  replaceChildren(...nodes) { this.children = nodes; }
  get lastElementChild() { return this.children[this.children.length - 1] ?? null; }
  addEventListener() {}
  setAttribute(name, value) { this.attributes[name] = String(value); }
  querySelector(selector) {
    const name = selector.replace(/^\./, "");
    for (const child of this.children) {
      if (typeof child !== "object") continue;
      if (child.className.split(" ").includes(name)) return child;
      const found = child.querySelector(selector);
      if (found) return found;
    }
    return null;
  }
}

const [appPath] = process.argv.slice(2);
const input = JSON.parse(fs.readFileSync(0, "utf8"));
const byId = new Map();
const stored = new Map([["mlxr.chat", JSON.stringify(input.chat)]]);
const document = {
  visibilityState: "hidden",
  getElementById: (id) => byId.get(id) ?? byId.set(id, new Element("div")).get(id),
  createElement: (tag) => new Element(tag),
};
const sandbox = {
  document,
  window: { addEventListener() {} },
  location: { hash: "" },
  localStorage: {
    getItem: (key) => stored.get(key) ?? null,
    setItem: (key, value) => {
      if (input.quota !== undefined && value.length > input.quota) throw new Error("QuotaExceededError");
      stored.set(key, value);
    },
    removeItem: (key) => stored.delete(key),
  },
  fetch: () => new Promise(() => {}),
  setInterval: () => 0,
  setTimeout: () => 0,
  navigator: {},
  performance: { now: () => 0 },
  console,
};

let error = null;
const started = Date.now();
try {
  vm.runInNewContext(fs.readFileSync(appPath, "utf8"), sandbox, { filename: appPath });
} catch (thrown) {
  error = `${thrown.name}: ${thrown.message}`;
}
const messages = document.getElementById("messages").children
  .filter((node) => node.tag === "article")
  .map((article) => {
    const body = article.querySelector(".body");
    return { className: article.className, html: body.innerHTML, text: body.textContent };
  });
const storage = Object.fromEntries(stored);
process.stdout.write(JSON.stringify({ error, messages, storage, ms: Date.now() - started }));
