// The admin page's chat box (templates/chat.html): POST /v1/chat/completions with stream: true, read the
// response body as it arrives and show OpenAI's SSE chunks (data: {...}, then data: [DONE]) token by token.
// The conversation is kept here and sent whole each turn, as OpenAI clients do; an agent id goes as "user".
// Optional tools (a JSON array of OpenAI tool definitions) go as "tools" with the chosen "tool_choice"; a reply that
// calls a tool (streamed delta.tool_calls) is shown as the call: the function's name and its pretty-printed
// arguments, in a block of its own. Model output is only ever inserted as textContent.
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
  const toolsBox = document.getElementById("chat-tools");
  const toolChoice = document.getElementById("chat-tool-choice");
  const FORCED = "function:";
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

  // The tools of the tools box: null when it is empty; throws an Error saying what is wrong otherwise.
  function parseTools() {
    const text = toolsBox.value.trim();
    if (!text) {
      return null;
    }
    let tools;
    try {
      tools = JSON.parse(text);
    } catch (error) {
      throw new Error("tools: not JSON: " + error.message);
    }
    if (!Array.isArray(tools)) {
      throw new Error("tools: must be a JSON array of tool definitions");
    }
    return tools;
  }

  // The names of the functions in the tools box (none while it does not parse).
  function functionNames() {
    let tools = null;
    try {
      tools = parseTools();
    } catch (ignored) {
      return [];
    }
    const names = [];
    for (const tool of tools || []) {
      const name = tool && tool.function && tool.function.name;
      if (typeof name === "string" && name && !names.includes(name)) {
        names.push(name);
      }
    }
    return names;
  }

  // The tool choice list: auto, none, required, then "call <name>" for each function of the tools box.
  function refreshChoices() {
    const chosen = toolChoice.value;
    for (const option of Array.from(toolChoice.options)) {
      if (option.value.startsWith(FORCED)) {
        option.remove();
      }
    }
    for (const name of functionNames()) {
      const option = document.createElement("option");
      option.value = FORCED + name;
      option.textContent = "call " + name;
      toolChoice.append(option);
    }
    toolChoice.value = chosen;
    if (toolChoice.value !== chosen) {
      toolChoice.value = "auto";
    }
  }

  function choiceValue(value) {
    if (value.startsWith(FORCED)) {
      return { type: "function", function: { name: value.slice(FORCED.length) } };
    }
    return value;
  }

  // A call's arguments pretty-printed when they are JSON (as they stream, until they are whole: as they came).
  function argumentsText(text) {
    try {
      return JSON.stringify(JSON.parse(text), null, 2);
    } catch (ignored) {
      return text;
    }
  }

  // The reply's tool call blocks, one per call: the function's name, then its arguments.
  function showCalls(reply, calls) {
    let box = reply.querySelector(".tool-calls");
    if (box === null) {
      box = document.createElement("div");
      box.className = "tool-calls";
      reply.append(box);
    }
    const blocks = [];
    for (const call of calls) {
      const block = document.createElement("div");
      block.className = "tool-call";
      block.dataset.callId = call.id || "";
      const head = document.createElement("div");
      head.className = "tool-call-head";
      const label = document.createElement("span");
      label.className = "tool-call-label";
      label.textContent = "calls ";
      const name = document.createElement("code");
      name.className = "tool-name";
      name.textContent = call.function.name;
      head.append(label, name);
      const args = document.createElement("pre");
      args.className = "tool-arguments";
      args.textContent = argumentsText(call.function.arguments);
      block.append(head, args);
      blocks.push(block);
    }
    box.replaceChildren(...blocks);
  }

  // Adds one streamed delta.tool_calls entry to the turn's calls (OpenAI's: the id, type and name come first, then
  // pieces of the arguments, all keyed by the call's index).
  function addCallDelta(turn, delta) {
    const index = typeof delta.index === "number" ? delta.index : turn.calls.length;
    if (!turn.calls[index]) {
      turn.calls[index] = { id: "", type: "function", function: { name: "", arguments: "" } };
    }
    const call = turn.calls[index];
    if (delta.id) {
      call.id = delta.id;
    }
    const fn = delta.function || {};
    if (fn.name) {
      call.function.name += fn.name;
    }
    if (fn.arguments) {
      call.function.arguments += fn.arguments;
    }
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
            if (choice.delta && Array.isArray(choice.delta.tool_calls)) {
              for (const delta of choice.delta.tool_calls) {
                addCallDelta(turn, delta);
              }
              showCalls(reply, turn.calls.filter(Boolean));
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
    const calls = turn.calls.filter(Boolean).length;
    if (calls) {
      text += ", " + calls + (calls === 1 ? " tool call" : " tool calls");
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
    let tools = null;
    try {
      tools = parseTools();
    } catch (error) {
      setStatus("error", error.message);
      return;
    }
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
    if (tools !== null) {
      request.tools = tools;
      request.tool_choice = choiceValue(String(data.get("tool_choice") || "auto"));
      request.parallel_tool_calls = data.get("parallel_tool_calls") !== null;
    }
    addMessage("user", content);
    messageBox.value = "";
    const reply = addMessage("assistant", "");
    reply.dataset.state = "streaming";
    const turn = { content: "", calls: [], finish: null, usage: null };
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
      const answer = { role: "assistant", content: turn.content };
      const calls = turn.calls.filter(Boolean);
      if (calls.length) {
        answer.tool_calls = calls;
        reply.dataset.toolCalls = String(calls.length);
      }
      history = request.messages.concat([answer]);
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
  toolsBox.addEventListener("input", refreshChoices);
  refreshChoices(); // a browser may have kept the box's text over a reload
  stopButton.addEventListener("click", stop);
  clearButton.addEventListener("click", clear);
})();
