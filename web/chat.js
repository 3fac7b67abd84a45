// The admin page's chat box (templates/chat.html): POST /v1/chat/completions with stream: true, read the
// response body as it arrives and show OpenAI's SSE chunks (data: {...}, then data: [DONE]) token by token.
// The conversation is kept here and sent whole each turn, as OpenAI clients do; an agent id goes as "user".
"use strict";

(function () {
  const form = document.getElementById("chat-form");
  if (!form) {
    return;
  }
  const log = document.getElementById("chat-log");
  const status = document.getElementById("chat-status");
  const messageBox = document.getElementById("chat-message");
  const sendButton = document.getElementById("chat-send");
  const stopButton = document.getElementById("chat-stop");
  const clearButton = document.getElementById("chat-clear");
  const EVENT_END = /\r?\n\r?\n/;
  let history = [];
  let controller = null;

  function setStatus(state, text) {
    status.dataset.state = state;
    status.textContent = text;
  }

  function addMessage(role, text) {
    const item = document.createElement("li");
    item.className = "message message-" + role;
    const who = document.createElement("span");
    who.className = "who";
    who.textContent = role;
    const body = document.createElement("div");
    body.className = "text";
    body.textContent = text;
    item.append(who, body);
    log.append(item);
    return item;
  }

  async function errorText(response) {
    try {
      const body = await response.json();
      const error = body.error || {};
      return (error.code || response.status) + ": " + (error.message || response.statusText);
    } catch (ignored) {
      return "HTTP " + response.status + " " + response.statusText;
    }
  }

  // The data of one SSE event block (its "data:" lines joined), or "" when it has none.
  function eventData(block) {
    const lines = block.split(/\r?\n/);
    const data = [];
    for (const line of lines) {
      if (line.startsWith("data:")) {
        data.push(line.slice(5).trimStart());
      }
    }
    return data.join("\n");
  }

  async function stream(response, reply, turn) {
    const text = reply.querySelector(".text");
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const chunk = await reader.read();
      if (chunk.done) {
        return;
      }
      buffer += decoder.decode(chunk.value, { stream: true });
      let match = EVENT_END.exec(buffer);
      while (match !== null) {
        const data = eventData(buffer.slice(0, match.index));
        buffer = buffer.slice(match.index + match[0].length);
        if (data === "[DONE]") {
          return;
        }
        if (data) {
          const message = JSON.parse(data);
          if (message.error) {
            throw new Error((message.error.code || "error") + ": " + (message.error.message || ""));
          }
          for (const choice of message.choices || []) {
            if (choice.delta && choice.delta.content) {
              turn.content += choice.delta.content;
              text.textContent = turn.content;
            }
            if (choice.finish_reason) {
              turn.finish = choice.finish_reason;
            }
          }
          if (message.usage) {
            turn.usage = message.usage;
          }
        }
        match = EVENT_END.exec(buffer);
      }
    }
  }

  function summary(turn) {
    let text = "Done";
    if (turn.finish) {
      text += " (" + turn.finish + ")";
    }
    if (turn.usage) {
      text += ": " + turn.usage.prompt_tokens + " prompt tokens, " + turn.usage.completion_tokens + " generated";
    }
    return text + ".";
  }

  async function send(event) {
    event.preventDefault();
    const content = messageBox.value.trim();
    if (!content || controller !== null) {
      return;
    }
    const data = new FormData(form);
    const request = {
      model: data.get("model"),
      messages: history.concat([{ role: "user", content: content }]),
      stream: true,
      stream_options: { include_usage: true },
    };
    const maxTokens = parseInt(data.get("max_tokens"), 10);
    if (maxTokens > 0) {
      request.max_tokens = maxTokens;
    }
    const temperature = String(data.get("temperature") || "").trim();
    if (temperature !== "" && !Number.isNaN(Number(temperature))) {
      request.temperature = Number(temperature);
    }
    const user = String(data.get("user") || "").trim();
    if (user) {
      request.user = user;
    }
    addMessage("user", content);
    messageBox.value = "";
    const reply = addMessage("assistant", "");
    reply.dataset.state = "streaming";
    const turn = { content: "", finish: null, usage: null };
    controller = new AbortController();
    sendButton.disabled = true;
    stopButton.disabled = false;
    setStatus("streaming", "Streaming\u2026");
    try {
      const response = await fetch("/v1/chat/completions", {
        method: "POST",
        headers: { "Content-Type": "application/json", Accept: "text/event-stream" },
        body: JSON.stringify(request),
        signal: controller.signal,
        credentials: "same-origin",
      });
      if (!response.ok) {
        throw new Error(await errorText(response));
      }
      await stream(response, reply, turn);
      history = request.messages.concat([{ role: "assistant", content: turn.content }]);
      reply.dataset.state = "done";
      setStatus("done", summary(turn));
    } catch (error) {
      if (error.name === "AbortError") {
        reply.dataset.state = "stopped";
        setStatus("stopped", "Stopped.");
      } else {
        reply.dataset.state = "error";
        reply.classList.add("error");
        setStatus("error", String(error.message || error));
      }
    } finally {
      controller = null;
      sendButton.disabled = false;
      stopButton.disabled = true;
    }
  }

  function stop() {
    if (controller !== null) {
      controller.abort();
    }
  }

  function clear() {
    stop();
    history = [];
    log.replaceChildren();
    setStatus("idle", "");
  }

  form.addEventListener("submit", send);
  stopButton.addEventListener("click", stop);
  clearButton.addEventListener("click", clear);
})();
