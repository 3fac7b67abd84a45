// The admin page's one behaviour beyond htmx attributes: a request the appliance refused before any view ran
// (403 for a stale CSRF token after a restart, 401 after the login expired, 5xx) or could not reach is reported
// where the operator looks, instead of silently not swapping. Loaded by templates/base.html.
"use strict";

(function () {
  function describe(xhr) {
    try {
      const error = JSON.parse(xhr.responseText).error;
      return error.code + ": " + error.message;
    } catch (ignored) {
      return "HTTP " + xhr.status + " " + xhr.statusText;
    }
  }

  function show(target, text) {
    const banner = document.getElementById("connection-status");
    if (target && target.classList.contains("result-area")) {
      const box = document.createElement("div");
      box.className = "result error";
      box.setAttribute("role", "alert");
      box.dataset.outcome = "refused";
      box.textContent = text;
      target.replaceChildren(box);
    } else if (banner) {
      banner.textContent = text;
      banner.hidden = false;
    }
  }

  function responseError(event) {
    const xhr = event.detail.xhr;
    let text = describe(xhr);
    if (xhr.status === 401 || xhr.status === 403) {
      text += " \u2014 reload the page (log in again if asked).";
    }
    show(event.detail.target, text);
  }

  function sendError(event) {
    show(event.detail.target, "Cannot reach the appliance: is it running?");
  }

  function clearBanner() {
    const banner = document.getElementById("connection-status");
    if (banner && !banner.hidden) {
      banner.hidden = true;
      banner.textContent = "";
    }
  }

  document.body.addEventListener("htmx:responseError", responseError);
  document.body.addEventListener("htmx:sendError", sendError);
  document.body.addEventListener("htmx:afterSwap", clearBanner);
})();
