(function () {
  "use strict";
  var DATA = JSON.parse(document.getElementById("trace-data").textContent);
  var ITEMS = [];   // every selectable thing, in page order: {r, o, k (token position or -1 for stop), el}
  var current = -1;

  function el(tag, cls, text) {
    var e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined && text !== null) e.textContent = String(text);
    return e;
  }
  function add(parent, child) { parent.appendChild(child); return child; }
  function pct(p) {
    if (p === null || p === undefined) return "?";
    if (p <= 0) return "0";
    return Number((p * 100).toPrecision(3)).toString() + "%";
  }
  function binOf(p) {
    if (p === null || p === undefined) return DATA.bins.length - 1;
    for (var i = 0; i < DATA.bins.length - 1; i++) if (p >= DATA.bins[i].low) return i;
    return DATA.bins.length - 2;
  }
  // a token's text made visible: spaces as a dim middle dot, newlines and tabs as arrows
  function chip(text, id, cls) {
    var c = el("span", "chip" + (cls ? " " + cls : ""));
    if (text === null || text === undefined) { c.textContent = "#" + id; c.title = "token id " + id; return c; }
    if (text === "") { add(c, el("span", "ws", "∅")); c.title = "empty text, token id " + id; return c; }
    var run = "";
    function flush() { if (run) { c.appendChild(document.createTextNode(run)); run = ""; } }
    for (var i = 0; i < text.length; i++) {
      var ch = text[i], sym = ch === " " ? "·" : ch === "\n" ? "↵" : ch === "\t" ? "⇥" : ch === "\r" ? "␍" : null;
      if (sym) { flush(); add(c, el("span", "ws", sym)); } else run += ch;
    }
    flush();
    if (text.indexOf("\ufffd") >= 0) add(c, el("span", "ws", "#" + id));  // a partial UTF-8 byte: say which
    c.title = JSON.stringify(text) + "  (id " + id + ")";
    return c;
  }

  function quote(text) { return text === null || text === undefined ? "?" : text === "" ? "∅" : "‘" + text + "’"; }

  function legend() {
    var box = document.getElementById("legend");
    add(box, el("span", "lab", "p(token)"));
    DATA.bins.forEach(function (b) {
      var s = add(box, el("span", "sw", b.label));
      s.style.background = b.light;
    });
    add(box, el("span", "draftkey", "accepted draft"));
  }

  function summary() {
    document.getElementById("title").textContent = DATA.title;
    document.title = DATA.title;
    var n = 0;
    DATA.requests.forEach(function (r) { r.outputs.forEach(function (o) { n += o.tokens.length; }); });
    document.getElementById("summary").textContent = DATA.requests.length + " request" +
      (DATA.requests.length === 1 ? "" : "s") + " · " + n + " tokens · click a token, or use ← →";
  }

  function stopLabel(stop) {
    if (!stop) return "no stop event";
    var s = "■ " + stop.finished;
    if (stop.criterion) s += " · " + stop.criterion;
    return s;
  }

  function buildRequests() {
    var root = document.getElementById("requests");
    DATA.requests.forEach(function (r, ri) {
      var card = add(root, el("div", "card"));
      var head = add(card, el("div", "req-head"));
      add(head, el("h2", null, "request " + r.id));
      add(head, el("span", "muted small", "line " + r.line));
      if (r.prompt !== null && r.prompt !== undefined) {
        var det = add(card, el("details", "prompt"));
        det.open = r.prompt.length <= 320 && DATA.requests.length <= 3;  // short prompts open, for context
        var sum = add(det, el("summary", null, "prompt"));
        add(sum, el("span", "preview", ": " + r.prompt.replace(/\s+/g, " ")));
        add(det, el("pre", null, r.prompt));
      }
      if (r.error) add(card, el("div", "err", "error: " + r.error));
      r.outputs.forEach(function (o, oi) {
        var box = add(card, el("div", "out"));
        box.id = "r" + ri + "o" + oi;
        var oh = add(box, el("div", "out-head"));
        add(oh, el("b", null, "output " + o.index));
        add(oh, el("span", "pill", o.stats.tokens + " tokens"));
        o.stats.strategies.forEach(function (s) { add(oh, el("span", "pill accent", s)); });
        if (o.stats.mean_p !== null) add(oh, el("span", "pill", "mean p " + pct(o.stats.mean_p)));
        if (o.stats.drafted) {
          add(oh, el("span", "pill ok", o.stats.accepted + " of " + o.stats.drafted + " drafts accepted" +
            (o.stats.proposers.length ? " (" + o.stats.proposers.join(", ") + ")" : "")));
        }
        add(oh, el("span", "pill" + (o.finish_reason === "error" ? " bad" : ""), "finish " + o.finish_reason));
        var strip = add(box, el("div", "tokens"));
        if (!o.traced) {
          strip.textContent = o.text;
          add(box, el("div", "muted small", "no trace recorded for this output"));
          return;
        }
        o.tokens.forEach(function (t, k) {
          var text = t.text === null ? "⟨" + t.id + "⟩" : t.text === "" ? "∅" : t.text.replace(/\n/g, "↵\n");
          var span = add(strip, el("span", "tok" + (t.by === "draft accepted" ? " draft" : "") +
                                           (t.text === "" || t.text === null ? " empty" : ""), text));
          span.style.backgroundColor = DATA.bins[t.bin].light;
          span.title = "token " + t.i + " · p " + pct(t.p) + " · " + t.by;
          span.dataset.item = String(ITEMS.length);
          ITEMS.push({r: ri, o: oi, k: k, el: span});
        });
        var sc = add(strip, el("span", "stopchip" + (o.stop && o.stop.finished === "error" ? " error" : ""),
                               stopLabel(o.stop)));
        sc.dataset.item = String(ITEMS.length);
        ITEMS.push({r: ri, o: oi, k: -1, el: sc});
        if (o.tokens.length > 1) spark(box, o, ITEMS.length - 1 - o.tokens.length);
      });
    });
    root.addEventListener("click", function (ev) {
      var t = ev.target.closest("[data-item]");
      if (t) select(Number(t.dataset.item), true);
    });
  }

  // one bar per token, its height the token's probability: where the output was unsure, at a glance
  function spark(box, o, first) {
    var chart = add(box, el("div", "spark"));
    chart.title = "p of each token";
    o.tokens.forEach(function (t, k) {
      var cell = add(chart, el("div", "sb"));
      var bar = add(cell, el("div", "sbf"));
      bar.style.height = (t.p === null ? 100 : Math.max(4, t.p * 100)) + "%";
      bar.style.background = t.p === null ? DATA.bins[t.bin].light : DATA.bins[t.bin].strong;
      cell.dataset.item = String(first + k);
      cell.title = "token " + t.i + " · p " + pct(t.p);
      ITEMS[first + k].bar = cell;
    });
  }

  // ---- the details panel
  function section(panel, title) { add(panel, el("h3", null, title)); }

  function kv(box, k, v, cls) { add(box, el("div", "k", k)); return add(box, el("div", cls || "v", v)); }

  function stopDetails(panel, o) {
    var s = o.stop;
    var box = add(panel, el("div", "kv"));
    if (!s) { kv(box, "stop", "the trace ends without a stop event"); return; }
    kv(box, "finished", s.finished);
    kv(box, "criterion", s.criterion === undefined ? "(not recorded)" : s.criterion);
    if (s.stop_reason !== undefined && s.stop_reason !== null) {
      var v = kv(box, "stop reason", "");
      if (typeof s.stop_reason === "number") {
        v.appendChild(chip(s.stop_reason_text === undefined ? null : s.stop_reason_text, s.stop_reason));
        add(v, el("span", "muted", "  (token " + s.stop_reason + ")"));
      } else v.textContent = JSON.stringify(s.stop_reason);
    }
    if (s.error) kv(box, "error", s.error, "err");
    kv(box, "finish_reason", o.finish_reason);
  }

  function draftDetails(panel, o, t, k) {
    var owner = o.tokens[t.spec];
    var d = owner.drafts;
    section(panel, "drafts" + (d.proposer ? " · proposer " + d.proposer : ""));
    var row = add(panel, el("div", "drafts"));
    d.proposed.forEach(function (p, j) {
      var c = add(row, el("span", "dchip " + p.fate));
      add(c, el("span", "mark", p.fate === "accepted" ? "✓" : p.fate === "rejected" ? "✗" : ""));
      c.appendChild(chip(p.text, p.id));
      if (p.fate === "accepted" && t.spec + j === k) c.classList.add("here");
      c.title = p.fate + (p.model_p !== undefined && p.model_p !== null ? " · model p " + pct(p.model_p) : "");
    });
    var note = d.accepted + " of " + d.proposed.length + " accepted";
    var rej = d.proposed.filter(function (p) { return p.fate === "rejected"; })[0];
    if (rej) {
      note += "; the target refused " + quote(rej.text === null ? "#" + rej.id : rej.text);
      if (rej.model_p !== undefined && rej.model_p !== null) note += " (model p " + pct(rej.model_p) + ")";
      if (d.correction !== null) {
        note += " and " + (o.tokens[d.last].by === "argmax" ? "chose " : "drew ") + quote(d.correction_text) +
          " (token " + d.correction + ") instead";
      }
    } else if (d.bonus) note += "; the target added one token of its own";
    add(panel, el("div", "note muted", note + ". One forward pass produced " + (d.last > d.first ? "tokens " +
      o.tokens[d.first].i + "–" + o.tokens[d.last].i : "token " + o.tokens[d.first].i) + "."));
  }

  function beamDetails(panel, t) {
    section(panel, "beam search");
    if (t.beam) {
      var b = t.beam, s = "";
      if (b.parent !== undefined && b.parent !== null) s += "continues beam " + b.parent + " of the previous step";
      if (b.index === null || b.index === undefined) {
        s += (s ? "; " : "") + "finished here";
        if (b.final_score !== undefined && b.final_score !== null) s += ", final score " + b.final_score.toFixed(4);
      } else s += (s ? " → " : "") + "beam " + b.index + " now";
      if (b.score !== undefined && b.score !== null) s += " · running score " + Number(b.score).toFixed(4);
      add(panel, el("div", "note", s));
    }
    if (t.beams) {
      var table = add(panel, el("table", "beams"));
      var hr = add(add(table, el("thead")), el("tr"));
      ["from beam", "token", "score", "fate"].forEach(function (h) { add(hr, el("th", null, h)); });
      var body = add(table, el("tbody"));
      (t.beams.candidates || []).forEach(function (c) {
        var mine = c.token === t.id && (!t.beam || t.beam.parent === undefined || c.parent === t.beam.parent);
        var tr = add(body, el("tr", mine ? "mine" : null));
        add(tr, el("td", null, c.parent));
        add(tr, el("td")).appendChild(chip(c.text, c.token));
        add(tr, el("td", "num", typeof c.score === "number" ? c.score.toFixed(4) : c.score));
        var f = add(tr, el("td"));
        add(f, el("span", "fate " + c.fate, c.fate + (mine ? " · this sequence" : "")));
      });
      if (t.beams.pruned && t.beams.pruned.length) {
        add(panel, el("div", "note muted", "pruned (no continuation kept): beam" +
          (t.beams.pruned.length > 1 ? "s " : " ") + t.beams.pruned.join(", ")));
      }
    }
  }

  function stageDetails(panel, t) {
    section(panel, "candidates, stage by stage");
    if (!t.stages.length) { add(panel, el("div", "muted", "no candidates recorded for this token")); return; }
    var flow = add(panel, el("div", "flow"));
    t.stages.forEach(function (s, i) {
      if (i) add(flow, el("span", "arrow", "→"));
      var st = add(flow, el("span", "st", s.stage + " "));
      var p = (s.p === undefined) ? null : s.p;  // the chosen token's own p (older files: read off the top N)
      if (p === null) s.top.forEach(function (c) { if (c[0] === t.id) p = c[2]; });
      add(st, el("b", null, pct(p)));
    });
    add(panel, el("div", "muted small", "p of the chosen token after each stage")).style.margin = "3px 0 8px";
    t.stages.forEach(function (s, i) {
      var box = add(panel, el("div", "stage"));
      var head = add(box, el("div", "stage-head"));
      add(head, el("span", "stage-name", s.stage));
      var ch = s.changes;
      var bits = [];
      if (!i) bits.push("the model's top " + s.top.length);
      else {
        if (ch.removed.length) bits.push(ch.removed.length + " removed");
        if (ch.added.length) bits.push(ch.added.length + " new");
        if (ch.left.length) bits.push(ch.left.length + " pushed out");
        if (ch.moved.length) bits.push(ch.moved.length + " moved");
        if (!bits.length) bits.push("same order");
      }
      add(head, el("span", "changes", bits.join(" · ")));
      s.top.forEach(function (c, rank) {
        if (c[2] <= 0) return;  // the zero-probability fillers a truncating stage leaves in its top N
        var r = add(box, el("div", "row" + (c[0] === t.id ? " chosen" : "") + (c[2] <= 0 ? " zero" : "")));
        r.appendChild(chip(c[1], c[0]));
        var bar = add(r, el("div", "bar"));
        var fill = add(bar, el("div", "fill"));
        fill.style.width = Math.max(0, Math.min(100, c[2] * 100)) + "%";
        fill.style.background = DATA.bins[binOf(c[2])].strong;
        add(r, el("div", "num", pct(c[2])));
        var dl = add(r, el("div", "delta"));
        if (i && c[2] > 0) {
          if (c[3] === null || c[3] === undefined) { dl.textContent = "new"; dl.classList.add("new"); }
          else {
            var d = (c[2] - c[3]) * 100;
            var move = c[4] !== null && c[4] !== undefined ? c[4] - rank : 0;
            dl.textContent = (move > 0 ? "↑" + move + " " : move < 0 ? "↓" + (-move) + " " : "") +
              (Math.abs(d) < 0.05 ? "=" : (d > 0 ? "+" : "−") + Math.abs(d).toFixed(1));
            dl.classList.add(d > 0.05 ? "up" : d < -0.05 ? "down" : "same");
            dl.title = "was " + pct(c[3]) + " at the previous stage";
          }
        }
        if (c[0] === t.id) r.title = "the chosen token";
      });
      if (i && (ch.removed.length || ch.left.length)) {
        var g = add(box, el("div", "gone"));
        if (ch.removed.length) {
          add(g, el("span", "muted", "removed:"));
          ch.removed.forEach(function (c) { g.appendChild(chip(c[1], c[0])); });
        }
        if (ch.left.length) {
          add(g, el("span", "muted", "pushed out of the top " + s.top.length + ":"));
          ch.left.forEach(function (c) { g.appendChild(chip(c[1], c[0], "left")); });
        }
      }
      var chosenHere = s.top.some(function (c) { return c[0] === t.id; });
      if (!chosenHere) add(box, el("div", "note muted", "the chosen token is not in this stage's top " + s.top.length));
    });
  }

  function render(item) {
    var panel = document.getElementById("details");
    panel.textContent = "";
    var card = add(panel, el("div", "card"));
    var r = DATA.requests[item.r], o = r.outputs[item.o];
    var where = "request " + r.id + " · output " + o.index;
    if (item.k < 0) {
      var hs = add(card, el("div", "d-head"));
      add(hs, el("span", "d-p", "stop"));
      add(hs, el("span", "muted", where + " · after " + o.tokens.length + " tokens"));
      section(card, "how the sequence ended");
      stopDetails(card, o);
      return;
    }
    var t = o.tokens[item.k];
    var head = add(card, el("div", "d-head"));
    var tok = add(head, el("span", "d-tok"));
    tok.appendChild(chip(t.text, t.id));
    tok.style.background = DATA.bins[t.bin].light;
    add(head, el("span", "d-p", pct(t.p)));
    add(head, el("span", "muted small", "token " + t.i + " of " + o.tokens.length + " · id " + t.id));
    var sub = add(card, el("div", "d-sub"));
    add(sub, el("span", "pill accent", t.by));
    add(sub, el("span", "pill", "strategy " + t.strategy));
    add(sub, el("span", "pill", where));
    if (t.spec !== undefined) draftDetails(card, o, t, item.k);
    if (t.beam || t.beams) beamDetails(card, t);
    stageDetails(card, t);
    if (item.k === o.tokens.length - 1) { section(card, "then the sequence stopped"); stopDetails(card, o); }
  }

  function select(n, fromUser) {
    if (n < 0 || n >= ITEMS.length) return;
    if (current >= 0) {
      ITEMS[current].el.classList.remove("sel");
      if (ITEMS[current].bar) ITEMS[current].bar.classList.remove("sel");
    }
    document.querySelectorAll(".tok.inspec").forEach(function (e) { e.classList.remove("inspec"); });
    current = n;
    var item = ITEMS[n];
    item.el.classList.add("sel");
    if (item.bar) item.bar.classList.add("sel");
    var o = DATA.requests[item.r].outputs[item.o];
    if (item.k >= 0 && o.tokens[item.k].spec !== undefined) {  // mark the tokens of the same forward pass
      var d = o.tokens[o.tokens[item.k].spec].drafts;
      ITEMS.forEach(function (it) {
        if (it.r === item.r && it.o === item.o && it.k >= d.first && it.k <= d.last) it.el.classList.add("inspec");
      });
    }
    render(item);
    if (fromUser) {
      item.el.scrollIntoView({block: "nearest"});
      var r = DATA.requests[item.r];
      var hash = "request=" + encodeURIComponent(r.id) + "&output=" + o.index +
        (item.k < 0 ? "&stop" : "&token=" + o.tokens[item.k].i);
      try { history.replaceState(null, "", "#" + hash); } catch (e) { /* file:// in some browsers */ }
    }
  }

  function find(want) {
    for (var n = 0; n < ITEMS.length; n++) {
      var it = ITEMS[n], r = DATA.requests[it.r], o = r.outputs[it.o];
      if (want.request !== null && want.request !== undefined && r.id !== String(want.request)) continue;
      if (want.output !== null && want.output !== undefined && o.index !== Number(want.output)) continue;
      if (want.stop && it.k < 0) return n;
      if (!want.stop && it.k >= 0 && o.tokens[it.k].i === Number(want.token)) return n;
    }
    return -1;
  }

  function fromHash() {
    var h = new URLSearchParams(location.hash.replace(/^#/, ""));
    if (!h.has("token") && !h.has("stop")) return null;
    return {request: h.get("request"), output: h.get("output"), token: h.get("token"), stop: h.has("stop")};
  }

  function hint() {
    var panel = document.getElementById("details");
    var card = add(panel, el("div", "card"));
    add(card, el("div", "d-p", "How was each token chosen?"));
    var p = add(card, el("p", "hint"));
    p.textContent = "Click a token to see its candidates after the model and after each processor, how it was " +
      "chosen, the drafts a speculative step proposed and what beam search kept. Colours are the chosen " +
      "token's probability at the last stage.";
    var k = add(card, el("p", "hint"));
    add(k, el("span", "kbd", "←")); k.appendChild(document.createTextNode(" "));
    add(k, el("span", "kbd", "→")); k.appendChild(document.createTextNode(" previous / next token   "));
    add(k, el("span", "kbd", "↑")); k.appendChild(document.createTextNode(" "));
    add(k, el("span", "kbd", "↓")); k.appendChild(document.createTextNode(" previous / next output"));
  }

  document.addEventListener("keydown", function (ev) {
    if (ev.altKey || ev.ctrlKey || ev.metaKey) return;
    var it = ITEMS[current];
    if (ev.key === "ArrowRight" || ev.key === "ArrowLeft") {
      select(current < 0 ? 0 : current + (ev.key === "ArrowRight" ? 1 : -1), true);
    } else if ((ev.key === "ArrowDown" || ev.key === "ArrowUp") && it) {
      var step = ev.key === "ArrowDown" ? 1 : -1, n = current;
      while (n >= 0 && n < ITEMS.length && ITEMS[n].r === it.r && ITEMS[n].o === it.o) n += step;
      if (n < 0 || n >= ITEMS.length) return;
      var target = ITEMS[n], first = n;
      while (first - 1 >= 0 && ITEMS[first - 1].r === target.r && ITEMS[first - 1].o === target.o) first--;
      var last = first;
      while (last + 1 < ITEMS.length && ITEMS[last + 1].r === target.r && ITEMS[last + 1].o === target.o) last++;
      select(Math.min(first + Math.max(it.k, 0), last), true);
    } else if (ev.key === "Home" && it) {
      var a = current; while (a - 1 >= 0 && ITEMS[a - 1].r === it.r && ITEMS[a - 1].o === it.o) a--; select(a, true);
    } else if (ev.key === "End" && it) {
      var b = current;
      while (b + 1 < ITEMS.length && ITEMS[b + 1].r === it.r && ITEMS[b + 1].o === it.o) b++;
      select(b, true);
    } else return;
    ev.preventDefault();
  });

  summary();
  legend();
  buildRequests();
  var want = fromHash() || DATA.select;
  var start = want ? find(want) : -1;
  if (start >= 0) { select(start, false); ITEMS[start].el.scrollIntoView({block: "center"}); } else hint();
  window.addEventListener("hashchange", function () {
    var w = fromHash(), n = w ? find(w) : -1;
    if (n >= 0 && n !== current) select(n, false);
  });
  document.body.dataset.ready = String(ITEMS.length);
})();
