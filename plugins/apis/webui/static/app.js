// mlxr's web page: a chat over the OpenAI-compatible API and a live view of /metrics.
// No dependencies and no build step; the server's Content-Security-Policy allows this file only.
(() => {
  "use strict";

  const $ = (id) => document.getElementById(id);
  const store = {
    get(key, fallback) {
      try {
        const value = localStorage.getItem(`mlxr.${key}`);
        return value === null ? fallback : JSON.parse(value);
      } catch {
        return fallback;
      }
    },
    // Whether it was kept (storage full or disabled: the page still works, it forgets on reload).
    set(key, value) {
      try {
        localStorage.setItem(`mlxr.${key}`, JSON.stringify(value));
        return true;
      } catch {
        return false;
      }
    },
    remove(key) {
      try {
        localStorage.removeItem(`mlxr.${key}`);
      } catch {
        // Disabled storage holds nothing to remove.
      }
    },
  };

  // ---------------------------------------------------------------- server access

  let apiKey = store.get("key", "");

  async function api(path, init = {}) {
    const headers = { ...init.headers };
    if (apiKey) headers.Authorization = `Bearer ${apiKey}`;
    const response = await fetch(path, { ...init, headers });
    if (response.status === 401) askKey(apiKey ? "The server refused this API key." : "This server needs an API key.");
    return response;
  }

  async function errorText(response) {
    try {
      const body = await response.json();
      const error = body.error ?? body;
      return typeof error === "string" ? error : error.message ?? JSON.stringify(error);
    } catch {
      return `${response.status} ${response.statusText}`;
    }
  }

  function askKey(reason) {
    const dialog = $("key-dialog");
    if (dialog.open) return;
    $("key-reason").textContent = reason;
    $("key-input").value = apiKey;
    dialog.showModal();
  }

  function setKey(key) {
    apiKey = key;
    store.set("key", key);
    $("key-dialog").close();
    refreshModels();
  }

  // Server-sent events of a fetch body: yields each event's data.
  async function* serverSentEvents(body) {
    const reader = body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    try {
      for (;;) {
        const { value, done } = await reader.read();
        if (done) return;
        buffer += decoder.decode(value, { stream: true }).replace(/\r\n/g, "\n");
        let end;
        while ((end = buffer.indexOf("\n\n")) >= 0) {
          const block = buffer.slice(0, end);
          buffer = buffer.slice(end + 2);
          const data = block.split("\n").filter((line) => line.startsWith("data:"))
            .map((line) => line.slice(5).replace(/^ /, "")).join("\n");
          if (data) yield data;
        }
      }
    } finally {
      reader.cancel().catch(() => {});
    }
  }

  // ---------------------------------------------------------------- markdown

  const ESCAPES = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };
  const escapeHtml = (text) => text.replace(/[&<>"']/g, (c) => ESCAPES[c]);

  // Inline rules over text escaped first: code spans and links become numbered placeholders (\0N\0,
  // and \0 never survives in the input) so no later rule reaches into them; the only tags that
  // appear are the fixed ones written here, and a link's target must be http(s).
  function inline(raw) {
    const kept = [];
    const keep = (html) => `\0${kept.push(html) - 1}\0`;
    let html = escapeHtml(raw)
      .replace(/`([^`\n]+)`/g, (_, code) => keep(`<code>${code}</code>`))
      .replace(/\[([^\]\n]+)\]\((https?:\/\/[^\s)]+)\)/g,
        (_, label, url) => keep(`<a href="${url}" target="_blank" rel="noopener noreferrer">${label}</a>`))
      .replace(/\*\*(?=\S)([^*\n]*?\S)\*\*/g, "<strong>$1</strong>")
      .replace(/__(?=\S)([^_\n]*?\S)__/g, "<strong>$1</strong>")
      .replace(/(^|[^*\w])\*(?=\S)([^*\n]*?\S)\*(?![*\w])/g, "$1<em>$2</em>")
      .replace(/(^|[^_\w])_(?=\S)([^_\n]*?\S)_(?![_\w])/g, "$1<em>$2</em>")
      .replace(/~~(?=\S)([^~\n]*?\S)~~/g, "<del>$1</del>")
      .replace(/\n/g, "<br>");
    // Placeholders may nest (a code span inside a link's label): restore until none is left.
    while (/\0\d+\0/.test(html)) html = html.replace(/\0(\d+)\0/g, (_, i) => kept[Number(i)]);
    return html;
  }

  const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([\w+#.-]*)/;
  const HEADING = /^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$/;
  const RULE = /^ {0,3}([-*_])(?:\s*\1){2,}\s*$/;
  const ITEM = /^( *)([-*+]|\d{1,9}[.)])\s+(.*)$/;
  const TABLE_RULE = /^\s*\|?\s*:?-+:?\s*(\|\s*:?-+:?\s*)*\|?\s*$/;
  const QUOTE = /^ {0,3}> ?(.*)$/;

  const cells = (line) => line.trim().replace(/^\|/, "").replace(/\|$/, "").split("|").map((c) => inline(c.trim()));
  // Block quotes and list items nest by recursion: deeper than this, their text is shown as it is
  // (5,000 ">" in a reply must not exhaust the stack).
  const MAX_NESTING = 16;

  function markdown(source, depth = 0) {
    if (depth >= MAX_NESTING) return `<p>${inline(source.replace(/\0/g, ""))}</p>`;
    const lines = source.replace(/\0/g, "").replace(/\r\n?/g, "\n").split("\n");
    const out = [];
    let i = 0;
    const startsBlock = (line) => FENCE.test(line) || HEADING.test(line) || RULE.test(line) || ITEM.test(line) || QUOTE.test(line);
    while (i < lines.length) {
      const line = lines[i];
      let m;
      if (!line.trim()) {
        i += 1;
      } else if ((m = FENCE.exec(line))) {
        // An unclosed fence (a reply still streaming) runs to the end.
        const code = [];
        for (i += 1; i < lines.length && !lines[i].trim().startsWith(m[1]); i += 1) code.push(lines[i]);
        i += 1;
        const language = m[2] ? `<span>${escapeHtml(m[2])}</span>` : "<span></span>";
        out.push(`<div class="code"><div class="code-head">${language}<button type="button" class="copy">Copy</button></div>`
          + `<pre><code>${escapeHtml(code.join("\n"))}</code></pre></div>`);
      } else if ((m = HEADING.exec(line))) {
        out.push(`<h${m[1].length}>${inline(m[2])}</h${m[1].length}>`);
        i += 1;
      } else if (RULE.test(line)) {
        out.push("<hr>");
        i += 1;
      } else if (QUOTE.test(line)) {
        const quoted = [];
        for (; i < lines.length && (m = QUOTE.exec(lines[i])); i += 1) quoted.push(m[1]);
        out.push(`<blockquote>${markdown(quoted.join("\n"), depth + 1)}</blockquote>`);
      } else if ((m = ITEM.exec(line))) {
        const ordered = /\d/.test(m[2]);
        const indent = m[1].length;
        const items = [];
        while (i < lines.length) {
          // A blank line between two items of this list does not end it.
          if (!lines[i].trim() && ITEM.exec(lines[i + 1] ?? "")?.[1].length === indent) i += 1;
          const item = ITEM.exec(lines[i]);
          if (!item || item[1].length !== indent || /\d/.test(item[2]) !== ordered) break;
          const body = [item[3]];
          // The item's own lines: indented deeper, or blank lines followed by such.
          for (i += 1; i < lines.length; i += 1) {
            const next = lines[i];
            const deeper = next.length - next.trimStart().length > indent;
            if (next.trim() && !deeper) break;
            if (!next.trim() && !(lines[i + 1] ?? "").startsWith(" ".repeat(indent + 1))) break;
            body.push(next.slice(Math.min(indent + 2, next.length - next.trimStart().length)));
          }
          // A tight item's single paragraph stays inline.
          items.push(`<li>${markdown(body.join("\n"), depth + 1).replace(/^<p>([\s\S]*?)<\/p>/, "$1")}</li>`);
        }
        const start = ordered && parseInt(m[2], 10) !== 1 ? ` start="${parseInt(m[2], 10)}"` : "";
        out.push(ordered ? `<ol${start}>${items.join("")}</ol>` : `<ul>${items.join("")}</ul>`);
      } else if (line.includes("|") && TABLE_RULE.test(lines[i + 1] ?? "") && lines[i + 1].includes("-")) {
        const head = cells(line).map((c) => `<th>${c}</th>`).join("");
        const rows = [];
        for (i += 2; i < lines.length && lines[i].includes("|") && lines[i].trim(); i += 1) {
          rows.push(`<tr>${cells(lines[i]).map((c) => `<td>${c}</td>`).join("")}</tr>`);
        }
        out.push(`<table><thead><tr>${head}</tr></thead><tbody>${rows.join("")}</tbody></table>`);
      } else {
        const paragraph = [];
        for (; i < lines.length && lines[i].trim() && (paragraph.length === 0 || !startsBlock(lines[i])); i += 1) {
          paragraph.push(lines[i]);
        }
        out.push(`<p>${inline(paragraph.join("\n"))}</p>`);
      }
    }
    return out.join("");
  }

  // ---------------------------------------------------------------- conversations

  // Each conversation's messages are kept under mlxr.conversation.<id>; the list (id, title, last
  // change; the newest first) under mlxr.conversations, the one open under mlxr.current. A new
  // chat is listed once it has a message.
  const chat = { id: "", messages: [], controller: null };
  let conversations = [];
  const settings = store.get("settings", {});

  const newId = () => `${Date.now().toString(36)}${Math.random().toString(36).slice(2, 8)}`;

  // The list as stored: read again before each change, so that two tabs of the page add to it
  // rather than write over each other's.
  function readConversations() {
    const listed = store.get("conversations", []);
    conversations = Array.isArray(listed)
      ? listed.filter((c) => c && typeof c.id === "string" && typeof c.title === "string") : [];
  }

  function loadConversations() {
    readConversations();
    // The page kept a single conversation under mlxr.chat before: it joins the list.
    const legacy = store.get("chat", null);
    if (Array.isArray(legacy) && legacy.length) saveChat(newId(), legacy);
    store.remove("chat");
    const current = store.get("current", "");
    openConversation(conversations.some((c) => c.id === current) ? current : conversations[0]?.id);
  }

  function loadMessages(id) {
    const stored = store.get(`conversation.${id}`, []);
    const messages = Array.isArray(stored) ? stored.filter((m) => m && typeof m === "object") : [];
    for (const message of messages) {
      // A reply that was streaming when the page went away ended there.
      if (message.streaming) {
        delete message.streaming;
        message.stopped = true;
      }
    }
    return messages;
  }

  const textOf = (content) => (typeof content === "string" ? content
    : Array.isArray(content) ? content.filter((p) => p?.type === "text").map((p) => String(p.text ?? "")).join("\n")
      : String(content ?? ""));

  function autoTitle(messages) {
    const first = messages.find((m) => m.role === "user");
    const text = textOf(first?.content).replace(/\s+/g, " ").trim();
    if (!text) return first?.images?.length ? "Image" : "New chat";
    return text.length > 48 ? `${text.slice(0, 47)}…` : text;
  }

  // Saves a conversation and moves it to the top of the list. Images are large: when storage is
  // full the conversation is kept without them.
  function saveChat(id = chat.id, messages = chat.messages) {
    if (!messages.length) return;
    readConversations();
    let entry = conversations.find((c) => c.id === id);
    if (entry) conversations.splice(conversations.indexOf(entry), 1);
    else entry = { id, title: "", titled: false };
    conversations.unshift(entry);
    entry.updated = Date.now();
    if (!entry.titled) entry.title = autoTitle(messages);
    if (!store.set(`conversation.${id}`, messages)) {
      store.set(`conversation.${id}`, messages.map(({ images, ...m }) => (images ? { ...m, images_dropped: images.length } : m)));
    }
    store.set("conversations", conversations);
    renderConversations();
  }

  function openConversation(id) {
    stop();
    chat.id = id ?? newId();
    chat.messages = id ? loadMessages(id) : [];
    store.set("current", chat.id);
    renderChat();
    renderConversations();
  }

  function renameConversation(id, title) {
    readConversations();
    const entry = conversations.find((c) => c.id === id);
    if (!entry) return;
    entry.titled = Boolean(title.trim());
    entry.title = entry.titled ? title.trim() : autoTitle(loadMessages(id));
    store.set("conversations", conversations);
    renderConversations();
  }

  function deleteConversation(id) {
    readConversations();
    conversations = conversations.filter((c) => c.id !== id);
    store.remove(`conversation.${id}`);
    store.set("conversations", conversations);
    if (id === chat.id) openConversation(conversations[0]?.id);
    else renderConversations();
  }

  function renderConversations() {
    const items = conversations.map((c) => {
      const item = element("li", c.id === chat.id ? "current" : "");
      item.dataset.id = c.id;
      item.append(button("open", c.title || "Untitled"), button("rename icon", "✎", "Rename"), button("delete icon", "×", "Delete"));
      return item;
    });
    $("conversations").replaceChildren(...items);
  }

  function startRename(item) {
    const entry = conversations.find((c) => c.id === item.dataset.id);
    const input = element("input", "rename-input");
    input.value = entry?.title ?? "";
    input.setAttribute("aria-label", "Conversation name");
    let done = false;
    const finish = (keep) => {
      if (done) return;
      done = true;
      if (keep) renameConversation(item.dataset.id, input.value);
      else renderConversations();
    };
    input.addEventListener("keydown", (event) => {
      if (event.key === "Enter") finish(true);
      else if (event.key === "Escape") finish(false);
    });
    input.addEventListener("blur", () => finish(true));
    item.replaceChildren(input);
    input.focus();
    input.select();
  }

  // ---------------------------------------------------------------- chat

  function saveSettings() {
    store.set("settings", {
      model: $("model").value || settings.model,
      system: $("system").value,
      temperature: $("temperature").value,
      top_p: $("top-p").value,
      max_tokens: $("max-tokens").value,
      tools: $("tools").value,
      tool_choice: $("tool-choice").value,
    });
  }

  function loadSettings() {
    for (const [key, id] of [["system", "system"], ["temperature", "temperature"], ["top_p", "top-p"],
      ["max_tokens", "max-tokens"], ["tools", "tools"], ["tool_choice", "tool-choice"]]) {
      if (typeof settings[key] === "string") $(id).value = settings[key];
    }
    showSliders();
  }

  function showSliders() {
    $("temperature-value").textContent = Number($("temperature").value).toFixed(2);
    $("top-p-value").textContent = Number($("top-p").value).toFixed(2);
  }

  function element(tag, className, text) {
    const node = document.createElement(tag);
    if (className) node.className = className;
    if (text !== undefined) node.textContent = text;
    return node;
  }

  function button(className, text, label) {
    const node = element("button", className, text);
    node.type = "button";
    if (label) {
      node.title = label;
      node.setAttribute("aria-label", label);
    }
    return node;
  }

  // Only images the page itself read from a file: a stored conversation is not trusted.
  const IMAGE_URL = /^data:image\/(?:png|jpeg|gif|webp|bmp);base64,[A-Za-z0-9+/]+=*$/;

  function thumbnail(url) {
    const image = element("img", "thumbnail");
    image.alt = "attached image";
    image.src = url;
    return image;
  }

  function messageView(message, index) {
    const article = element("article", `message ${message.role}`);
    article.dataset.index = String(index);
    const role = element("div", "role");
    role.append(element("span", "", message.role === "user" ? "You" : `Assistant · ${message.model ?? ""}`));
    if (message.role === "user") role.append(button("edit", "Edit", "Edit and send again"));
    if (message.role === "assistant") role.append(button("regenerate", "Regenerate", "Answer again"));
    article.append(role);
    if (message.role === "assistant") {
      const thinking = element("details", "thinking");
      thinking.append(element("summary", "", "Reasoning"), element("div", "thinking-text"));
      article.append(thinking, element("div", "body markdown"), element("div", "tool-calls"), element("div", "meta"));
    } else {
      const images = (Array.isArray(message.images) ? message.images : []).filter((url) => IMAGE_URL.test(url));
      if (images.length) {
        const gallery = element("div", "images");
        gallery.append(...images.map(thumbnail));
        article.append(gallery);
      }
      if (message.images_dropped) article.append(element("div", "meta", `${message.images_dropped} image(s) not kept: browser storage is full`));
      article.append(element("div", "body plain", textOf(message.content)));
    }
    updateMessage(article, message);
    return article;
  }

  function updateMessage(article, message) {
    if (message.role !== "assistant") return;
    const thinking = article.querySelector(".thinking");
    thinking.hidden = !message.reasoning;
    thinking.querySelector(".thinking-text").textContent = message.reasoning ?? "";
    article.querySelector(".body").innerHTML = rendered(message.content);
    const calls = Array.isArray(message.tool_calls) ? message.tool_calls : [];
    article.querySelector(".tool-calls").replaceChildren(...calls.map(toolCallView));
    const meta = [];
    if (message.tokens) meta.push(`${message.tokens} tokens`);
    if (message.tokens_per_s) meta.push(`${message.tokens_per_s.toFixed(1)} tokens/s`);
    if (message.ttft_s !== undefined) meta.push(`first token ${message.ttft_s.toFixed(2)} s`);
    if (message.seconds !== undefined) meta.push(`${message.seconds.toFixed(2)} s`);
    if (message.finish === "length") meta.push("cut at max_tokens");
    if (message.finish === "tool_calls") meta.push("called a tool");
    if (message.stopped) meta.push("stopped");
    if (message.error) meta.push(`error: ${message.error}`);
    article.querySelector(".meta").textContent = meta.join(" · ");
    article.classList.toggle("failed", Boolean(message.error));
    article.classList.toggle("streaming", Boolean(message.streaming));
  }

  // A tool call the model made: its function's name and its arguments (pretty when they are JSON).
  function toolCallView(call) {
    const view = element("div", "tool-call");
    const head = element("div", "tool-head");
    head.append(element("span", "", "Tool call"), element("strong", "tool-name", String(call?.name ?? "")));
    let text = String(call?.arguments ?? "");
    try {
      text = JSON.stringify(JSON.parse(text), null, 2);
    } catch {
      // Still streaming, or not JSON: shown as it came.
    }
    view.append(head, element("pre", "tool-arguments", text));
    return view;
  }

  // One message that cannot be rendered (a stored conversation from an older page, a renderer bug)
  // shows as plain text instead of breaking the whole conversation, on every reload.
  function rendered(content) {
    try {
      return markdown(content);
    } catch {
      return `<p>${escapeHtml(String(content ?? "")).replace(/\n/g, "<br>")}</p>`;
    }
  }

  function renderChat() {
    const list = $("messages");
    list.replaceChildren(...chat.messages.map(messageView));
    if (!chat.messages.length) list.append(element("p", "empty", "Ask the model something."));
    list.scrollTop = list.scrollHeight;
  }

  function setBusy(busy) {
    $("send").hidden = busy;
    $("stop").hidden = !busy;
    $("messages").classList.toggle("busy", busy);
  }

  function note(text) {
    $("composer-note").textContent = text;
  }

  // The messages the model sees: the system prompt, then every finished turn (a user's images as
  // image_url parts, unless the model is known to take none).
  function history(messages) {
    const system = $("system").value.trim();
    const images = takes("vision") !== false;
    const turns = [];
    for (const m of messages) {
      if (m.streaming || m.error) continue;
      const text = textOf(m.content);
      const urls = m.role === "user" && images && Array.isArray(m.images) ? m.images.filter((url) => IMAGE_URL.test(url)) : [];
      if (urls.length) {
        const parts = urls.map((url) => ({ type: "image_url", image_url: { url } }));
        turns.push({ role: "user", content: text ? [...parts, { type: "text", text }] : parts });
      } else if (text) {
        turns.push({ role: m.role, content: text });
      }
    }
    return system ? [{ role: "system", content: system }, ...turns] : turns;
  }

  // The tools field: empty, or a JSON array of OpenAI tools. Throws with a message for the user.
  function tools() {
    const text = $("tools").value.trim();
    if (!text) return null;
    let parsed;
    try {
      parsed = JSON.parse(text);
    } catch (error) {
      throw new Error(`Tools: not JSON (${error.message})`);
    }
    if (!Array.isArray(parsed)) throw new Error("Tools: a JSON array of tools, [{\"type\": \"function\", ...}]");
    return parsed.length ? parsed : null;
  }

  function send(text, images) {
    const message = { role: "user", content: text };
    if (images.length) message.images = images;
    chat.messages.push(message);
    return answer();
  }

  // Streams the model's answer to the conversation as it stands (ending with a user's message).
  async function answer() {
    const { id, messages } = chat;
    const model = $("model").value;
    const body = {
      model, messages: history(messages), stream: true, stream_options: { include_usage: true },
      temperature: Number($("temperature").value), top_p: Number($("top-p").value),
    };
    const maxTokens = parseInt($("max-tokens").value, 10);
    if (maxTokens > 0) body.max_tokens = maxTokens;
    const reply = { role: "assistant", model, content: "", reasoning: "", streaming: true };
    try {
      const listed = tools();
      if (listed) {
        body.tools = listed;
        if ($("tool-choice").value !== "auto") body.tool_choice = $("tool-choice").value;
      }
    } catch (error) {
      reply.error = error.message;
      delete reply.streaming;
    }
    messages.push(reply);
    saveChat(id, messages);
    renderChat();
    if (reply.error) return;
    const article = $("messages").lastElementChild;
    const controller = new AbortController();
    chat.controller = controller;
    setBusy(true);
    const started = performance.now();
    let first = null;
    let pending = false;
    const redraw = () => {
      pending = false;
      const list = $("messages");
      const atBottom = list.scrollHeight - list.scrollTop - list.clientHeight < 40;
      updateMessage(article, reply);
      if (atBottom) list.scrollTop = list.scrollHeight;
    };
    try {
      const response = await api("/v1/chat/completions", {
        method: "POST", headers: { "Content-Type": "application/json" },
        body: JSON.stringify(body), signal: controller.signal,
      });
      if (!response.ok) throw new Error(await errorText(response));
      for await (const data of serverSentEvents(response.body)) {
        if (data === "[DONE]") break;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Error(chunk.error.message ?? String(chunk.error));
        const choice = chunk.choices?.[0];
        const delta = choice?.delta ?? {};
        // Tool calls come whole at the end of a generation: the clock starts at streamed text only.
        if (first === null && (delta.content || delta.reasoning_content)) first = performance.now();
        reply.content += delta.content ?? "";
        reply.reasoning += delta.reasoning_content ?? "";
        for (const call of delta.tool_calls ?? []) {
          reply.tool_calls ??= [];
          const index = Number.isInteger(call.index) ? call.index : reply.tool_calls.length;
          const known = (reply.tool_calls[index] ??= { id: "", name: "", arguments: "" });
          known.id ||= call.id ?? "";
          known.name += call.function?.name ?? "";
          known.arguments += call.function?.arguments ?? "";
        }
        if (choice?.finish_reason) reply.finish = choice.finish_reason;
        if (chunk.usage) reply.tokens = chunk.usage.completion_tokens;
        if (!pending) {
          pending = true;
          requestAnimationFrame(redraw);
        }
      }
    } catch (error) {
      if (error.name === "AbortError") reply.stopped = true;
      else reply.error = error.message;
    } finally {
      const ended = performance.now();
      if (first !== null) {
        reply.ttft_s = (first - started) / 1000;
        if (reply.tokens > 1 && ended > first) reply.tokens_per_s = (reply.tokens - 1) / ((ended - first) / 1000);
      } else if (reply.tool_calls) {
        reply.seconds = (ended - started) / 1000;
      }
      if (reply.tool_calls) reply.tool_calls = reply.tool_calls.filter(Boolean);
      delete reply.streaming;
      if (chat.controller === controller) {
        chat.controller = null;
        setBusy(false);
      }
      updateMessage(article, reply);
      saveChat(id, messages);
    }
  }

  function stop() {
    chat.controller?.abort();
  }

  // Answer again: the reply at index and everything after it go.
  function regenerate(index) {
    if (chat.controller || !chat.messages[index]) return;
    chat.messages.splice(index);
    answer();
  }

  // Edit the user's message at index in place; sending it drops everything after it.
  function startEdit(article) {
    const index = Number(article.dataset.index);
    const message = chat.messages[index];
    if (chat.controller || !message) return;
    const form = element("div", "edit");
    const text = element("textarea", "edit-text");
    text.value = textOf(message.content);
    text.rows = Math.min(12, Math.max(2, text.value.split("\n").length));
    const row = element("div", "row");
    row.append(button("cancel-edit quiet", "Cancel"), button("save-edit", "Send"));
    form.append(text, row);
    article.querySelector(".body").replaceWith(form);
    text.addEventListener("keydown", (event) => {
      if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
        event.preventDefault();
        finishEdit(article, true);
      } else if (event.key === "Escape") {
        finishEdit(article, false);
      }
    });
    text.focus();
  }

  function finishEdit(article, keep) {
    const index = Number(article.dataset.index);
    const text = article.querySelector(".edit-text").value.trim();
    if (!keep || chat.controller || (!text && !chat.messages[index]?.images?.length)) {
      renderChat();
      return;
    }
    chat.messages.splice(index + 1);
    chat.messages[index].content = text;
    answer();
  }

  // ---------------------------------------------------------------- images

  const attachments = [];  // data: URLs of the images the next message carries
  // Bigger files are refused before reading (the server bounds an image's pixels on its side).
  const MAX_IMAGE_BYTES = 20 * 1024 * 1024;

  // Whether the chosen model takes a capability by /v1/models; undefined while unknown.
  function takes(capability) {
    const listed = models.find((m) => m.id === $("model").value)?.capabilities;
    return Array.isArray(listed) ? listed.includes(capability) : undefined;
  }

  // Reads the image files among files into attachments; false when there was none.
  function addImages(files) {
    const images = [...files].filter((file) => file.type.startsWith("image/"));
    if (!images.length) return false;
    if (!takes("vision")) {
      note(`${$("model").value || "This model"} takes no images.`);
      return true;
    }
    for (const file of images) {
      if (file.size > MAX_IMAGE_BYTES) {
        note(`${file.name}: larger than ${MAX_IMAGE_BYTES / 1024 / 1024} MiB.`);
        continue;
      }
      const reader = new FileReader();
      reader.onload = () => {
        if (IMAGE_URL.test(reader.result)) {
          attachments.push(reader.result);
          renderAttachments();
        } else {
          note(`${file.name}: PNG, JPEG, GIF, WebP or BMP images only.`);
        }
      };
      reader.readAsDataURL(file);
    }
    return true;
  }

  function renderAttachments() {
    const views = attachments.map((url, index) => {
      const view = element("figure", "attachment");
      const remove = button("remove icon", "×", "Remove image");
      remove.dataset.index = String(index);
      view.append(thumbnail(url), remove);
      return view;
    });
    $("attachments").replaceChildren(...views);
    $("attachments").hidden = !attachments.length;
  }

  // Image attach is offered when the model takes images; what a model takes shows under its name.
  function showModel() {
    const vision = takes("vision");
    $("attach").hidden = !vision;
    const listed = models.find((m) => m.id === $("model").value)?.capabilities;
    $("model-capabilities").replaceChildren(...(Array.isArray(listed) ? listed : []).map((c) => element("span", "badge", c)));
  }

  // ---------------------------------------------------------------- models

  let models = [];
  let refused = false;  // the last /v1/models was a 401: wait for a key before asking again

  async function refreshModels() {
    try {
      const response = await api("/v1/models");
      refused = response.status === 401;
      if (!response.ok) return;
      models = (await response.json()).data ?? [];
    } catch {
      return;
    }
    const select = $("model");
    const wanted = select.value || settings.model;
    select.replaceChildren(...models.map((m) => new Option(m.id, m.id)));
    if (models.some((m) => m.id === wanted)) select.value = wanted;
    showModel();
    const rows = models.map((m) => {
      const row = element("tr");
      const loaded = m.created ? new Date(m.created * 1000).toLocaleString() : "";
      const capabilities = Array.isArray(m.capabilities) ? m.capabilities.join(", ") : "–";
      row.append(element("td", "", m.id), element("td", "", m.context_length ?? "–"),
        element("td", "", capabilities), element("td", "", loaded));
      return row;
    });
    document.querySelector("#models tbody").replaceChildren(...rows);
  }

  // ---------------------------------------------------------------- status

  const WINDOW_S = 120;
  const samples = [];
  let previous = null;

  function parseMetrics(text) {
    const parsed = [];
    for (const line of text.split("\n")) {
      if (!line || line.startsWith("#")) continue;
      const m = /^([A-Za-z_:][\w:]*)(?:\{(.*)\})?\s+(\S+)/.exec(line);
      if (!m) continue;
      const labels = {};
      for (const [, key, value] of (m[2] ?? "").matchAll(/(\w+)="((?:[^"\\]|\\.)*)"/g)) labels[key] = value;
      parsed.push({ name: m[1], labels, value: Number(m[3]) });
    }
    return parsed;
  }

  const total = (metrics, name, match = () => true) =>
    metrics.filter((s) => s.name === name && match(s.labels)).reduce((sum, s) => sum + s.value, 0);

  function bytes(n) {
    if (!Number.isFinite(n)) return "–";
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let i = 0;
    for (; n >= 1024 && i < units.length - 1; i += 1) n /= 1024;
    return `${n.toFixed(i && n < 10 ? 1 : 0)} ${units[i]}`;
  }

  async function pollMetrics() {
    let metrics;
    try {
      const response = await api("/metrics");
      if (!response.ok) return;
      metrics = parseMetrics(await response.text());
    } catch {
      $("engine-state").textContent = "offline";
      return;
    }
    const now = performance.now() / 1000;
    const state = metrics.find((s) => s.name === "mlxr_engine_state" && s.value === 1)?.labels.state ?? "?";
    $("engine-state").textContent = state;
    $("engine-state").dataset.state = state;
    if (state === "ready" && !models.length && !refused) refreshModels();  // opened while loading
    const memory = (kind) => total(metrics, "mlxr_mlx_memory_bytes", (l) => l.kind === kind);
    // Tokens as they stream: each first token and each later one is observed once by a histogram.
    const counters = {
      tokens: total(metrics, "mlxr_time_to_first_token_seconds_count") + total(metrics, "mlxr_inter_token_latency_seconds_count"),
      firsts: total(metrics, "mlxr_time_to_first_token_seconds_count"),
      ttft: total(metrics, "mlxr_time_to_first_token_seconds_sum"),
    };
    const sample = {
      t: now, tps: null, ttft: null,
      queue: total(metrics, "mlxr_queue_depth"), running: total(metrics, "mlxr_requests_running"),
      active: memory("active"), cache: memory("cache"), peak: memory("peak"),
    };
    // A counter that went down means the server restarted: start over.
    if (previous && counters.tokens >= previous.tokens && counters.firsts >= previous.firsts) {
      sample.tps = (counters.tokens - previous.tokens) / (now - previous.t);
      const firsts = counters.firsts - previous.firsts;
      if (firsts > 0) sample.ttft = (counters.ttft - previous.ttft) / firsts;
    }
    previous = { t: now, ...counters };
    samples.push(sample);
    while (samples.length && samples[0].t < now - WINDOW_S - 5) samples.shift();

    $("stat-queue").textContent = sample.queue;
    $("stat-running").textContent = sample.running;
    $("stat-inflight").textContent = total(metrics, "mlxr_requests_inflight");
    $("stat-kv").textContent = bytes(total(metrics, "mlxr_kv_cache_bytes"));
    $("stat-active").textContent = bytes(sample.active);
    $("stat-peak").textContent = bytes(sample.peak);
    $("stat-finished").textContent = total(metrics, "mlxr_requests_finished_total");
    $("stat-generated").textContent = total(metrics, "mlxr_generation_tokens_total");
    if (view() === "status") drawPlots();
  }

  function drawPlots() {
    const color = (name) => getComputedStyle(document.documentElement).getPropertyValue(name).trim();
    const last = (key) => [...samples].reverse().find((s) => s[key] !== null)?.[key];
    const series = (key, label, colorName) => ({ label, color: color(colorName), points: samples.map((s) => [s.t, s[key]]) });
    const number = (v) => String(Math.round(v * 1000) / 1000);
    plot($("plot-tps"), [series("tps", "tokens/s", "--accent")], number);
    plot($("plot-ttft"), [series("ttft", "s", "--accent-2")], (v) => `${number(v)} s`);
    plot($("plot-batch"), [series("running", "running", "--accent"), series("queue", "queued", "--accent-2")], number);
    plot($("plot-memory"), [series("active", "active", "--accent"), series("cache", "cache", "--accent-2")], bytes);
    const tps = last("tps");
    const ttft = last("ttft");
    $("legend-tps").textContent = tps === undefined ? "" : `now ${tps.toFixed(1)}`;
    $("legend-ttft").textContent = ttft === undefined ? "" : `last ${ttft.toFixed(3)} s`;
    $("legend-batch").textContent = `running ${last("running") ?? 0} · queued ${last("queue") ?? 0}`;
    $("legend-memory").textContent = `active ${bytes(last("active"))} · cache ${bytes(last("cache"))}`;
  }

  // A line chart of the last WINDOW_S seconds; a null value breaks the line (and a lone point
  // between two breaks is drawn as a dot).
  function plot(canvas, series, format) {
    const ratio = window.devicePixelRatio || 1;
    const width = canvas.clientWidth;
    const height = canvas.clientHeight;
    if (!width || !height) return;
    if (canvas.width !== Math.round(width * ratio)) canvas.width = Math.round(width * ratio);
    if (canvas.height !== Math.round(height * ratio)) canvas.height = Math.round(height * ratio);
    const g = canvas.getContext("2d");
    g.setTransform(ratio, 0, 0, ratio, 0, 0);
    g.clearRect(0, 0, width, height);
    const left = 56;
    const right = 8;
    const top = 8;
    const bottom = 20;
    const now = performance.now() / 1000;
    const values = series.flatMap((s) => s.points.map((p) => p[1])).filter((v) => v !== null && Number.isFinite(v));
    const high = niceCeiling(Math.max(0, ...values));
    const x = (t) => left + ((t - (now - WINDOW_S)) / WINDOW_S) * (width - left - right);
    const y = (v) => top + (1 - v / high) * (height - top - bottom);

    g.font = "11px system-ui, sans-serif";
    g.fillStyle = getComputedStyle(canvas).color;
    g.strokeStyle = getComputedStyle(document.documentElement).getPropertyValue("--grid").trim();
    g.lineWidth = 1;
    g.textAlign = "right";
    g.textBaseline = "middle";
    for (let k = 0; k <= 4; k += 1) {
      const v = (high * k) / 4;
      g.beginPath();
      g.moveTo(left, Math.round(y(v)) + 0.5);
      g.lineTo(width - right, Math.round(y(v)) + 0.5);
      g.stroke();
      g.fillText(format(v), left - 6, y(v));
    }
    g.textBaseline = "alphabetic";
    for (const ago of [120, 90, 60, 30, 0]) {
      g.textAlign = ago ? "center" : "right";
      g.fillText(ago ? `-${ago} s` : "now", x(now - ago), height - 5);
    }

    let drawn = 0;
    g.lineWidth = 2;
    for (const s of series) {
      g.strokeStyle = s.color;
      g.fillStyle = s.color;
      g.beginPath();
      let open = false;
      s.points.forEach(([t, v], k) => {
        if (v === null || !Number.isFinite(v) || t < now - WINDOW_S) {
          open = false;
          return;
        }
        drawn += 1;
        if (open) {
          g.lineTo(x(t), y(v));
        } else {
          g.moveTo(x(t), y(v));
          const next = s.points[k + 1];
          if (!next || next[1] === null) g.fillRect(x(t) - 2, y(v) - 2, 4, 4);
        }
        open = true;
      });
      g.stroke();
    }
    canvas.dataset.points = String(drawn);
  }

  function niceCeiling(value) {
    if (value <= 0) return 1;
    const power = 10 ** Math.floor(Math.log10(value));
    return [1, 2, 2.5, 5, 10].map((m) => m * power).find((c) => c >= value);
  }

  // ---------------------------------------------------------------- views and events

  const view = () => (location.hash === "#status" ? "status" : "chat");

  function showView() {
    const current = view();
    $("chat-view").hidden = current !== "chat";
    $("status-view").hidden = current !== "status";
    $("nav-chat").classList.toggle("active", current === "chat");
    $("nav-status").classList.toggle("active", current === "status");
    if (current === "status") {
      refreshModels();
      drawPlots();
    }
  }

  function listenChat() {
    $("composer").addEventListener("submit", (event) => {
      event.preventDefault();
      const text = $("prompt").value.trim();
      if ((!text && !attachments.length) || chat.controller) return;
      if (!$("model").value) {
        // No model listed yet: still loading, or the server wants a key it has not been given.
        refreshModels();
        return;
      }
      if (attachments.length && takes("vision") === false) {
        note(`${$("model").value} takes no images: remove them or choose a model that does.`);
        return;
      }
      $("prompt").value = "";
      note("");
      send(text, attachments.splice(0));
      renderAttachments();
    });
    $("prompt").addEventListener("keydown", (event) => {
      if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
        event.preventDefault();
        $("composer").requestSubmit();
      } else if (event.key === "Escape") {
        stop();
      }
    });
    $("stop").addEventListener("click", stop);
    for (const id of ["model", "system", "temperature", "top-p", "max-tokens", "tools", "tool-choice"]) {
      $(id).addEventListener("input", () => {
        showSliders();
        saveSettings();
      });
    }
    $("model").addEventListener("change", showModel);
    $("messages").addEventListener("click", (event) => {
      const target = event.target.closest("button");
      const article = target?.closest(".message");
      if (!target) return;
      if (target.classList.contains("copy")) copyCode(target);
      else if (target.classList.contains("regenerate")) regenerate(Number(article.dataset.index));
      else if (target.classList.contains("edit")) startEdit(article);
      else if (target.classList.contains("save-edit")) finishEdit(article, true);
      else if (target.classList.contains("cancel-edit")) finishEdit(article, false);
    });
  }

  function copyCode(target) {
    const code = target.closest(".code").querySelector("code").textContent;
    navigator.clipboard?.writeText(code).then(() => {
      target.textContent = "Copied";
      setTimeout(() => { target.textContent = "Copy"; }, 1500);
    }, () => {});
  }

  function listenConversations() {
    $("new-chat").addEventListener("click", () => openConversation(null));
    // Another tab of the page changed the list.
    window.addEventListener("storage", (event) => {
      if (event.key !== "mlxr.conversations") return;
      readConversations();
      renderConversations();
    });
    $("conversations").addEventListener("click", (event) => {
      const target = event.target.closest("button");
      const item = target?.closest("li");
      if (!item) return;
      if (target.classList.contains("open")) {
        if (item.dataset.id !== chat.id) openConversation(item.dataset.id);
      } else if (target.classList.contains("rename")) {
        startRename(item);
      } else if (target.classList.contains("delete")) {
        // A second click deletes: the first one asks.
        if (target.classList.contains("confirm")) {
          deleteConversation(item.dataset.id);
        } else {
          target.classList.add("confirm");
          target.textContent = "Delete?";
          setTimeout(() => {
            target.classList.remove("confirm");
            target.textContent = "×";
          }, 3000);
        }
      }
    });
  }

  function listenImages() {
    $("attach").addEventListener("click", () => $("attach-input").click());
    $("attach-input").addEventListener("change", () => {
      addImages($("attach-input").files);
      $("attach-input").value = "";
    });
    $("attachments").addEventListener("click", (event) => {
      const target = event.target.closest("button.remove");
      if (!target) return;
      attachments.splice(Number(target.dataset.index), 1);
      renderAttachments();
    });
    $("prompt").addEventListener("paste", (event) => {
      const files = [...(event.clipboardData?.items ?? [])].filter((item) => item.kind === "file")
        .map((item) => item.getAsFile()).filter(Boolean);
      if (files.length && addImages(files)) event.preventDefault();
    });
    const zone = $("conversation");
    const carriesFiles = (event) => [...(event.dataTransfer?.types ?? [])].includes("Files");
    zone.addEventListener("dragover", (event) => {
      if (!carriesFiles(event)) return;
      event.preventDefault();
      zone.classList.add("dropping");
    });
    zone.addEventListener("dragleave", (event) => {
      if (!zone.contains(event.relatedTarget)) zone.classList.remove("dropping");
    });
    zone.addEventListener("drop", (event) => {
      zone.classList.remove("dropping");
      if (!carriesFiles(event)) return;
      event.preventDefault();
      addImages(event.dataTransfer.files);
    });
  }

  function start() {
    loadSettings();
    loadConversations();
    showView();
    refreshModels();
    pollMetrics();
    // While the page is visible: metrics every second (the status view's history), models every 10.
    setInterval(() => document.visibilityState === "visible" && pollMetrics(), 1000);
    setInterval(() => document.visibilityState === "visible" && refreshModels(), 10000);

    window.addEventListener("hashchange", showView);
    window.addEventListener("resize", () => view() === "status" && drawPlots());
    listenChat();
    listenConversations();
    listenImages();
    $("key-button").addEventListener("click", () => askKey("The API key this page sends (empty: none)."));
    $("key-form").addEventListener("submit", (event) => {
      event.preventDefault();
      setKey($("key-input").value.trim());
    });
    $("key-forget").addEventListener("click", () => setKey(""));
  }

  start();
})();
