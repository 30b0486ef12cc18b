"""The chat stage's data: conversations built from the corpus, rendered with the
repository's own Qwen3.5 chat template (crates/model/assets/templates/qwen35.jinja) the
way the server renders it (HF `apply_chat_template` semantics: trim_blocks, lstrip_blocks,
`tojson` = json.dumps(ensure_ascii=False), `raise_exception`).

Kinds of conversation (every answer comes from the corpus itself):

* `python`: a user asks what a standard-library function or class does; the assistant
  answers with its signature and docstring.
* `rust`: the same for a documented Rust item (its `///` comment); `rust_example`: the
  user asks for an example and the assistant answers with the doc comment's code block.
* `crate`: what a crate is for (the first paragraph of its README).
* `read_file`: the user asks what a file does; the assistant calls `read_file` in the
  template's XML tool-call form, the tool answers with the file's beginning, and the
  assistant summarizes it (the module's own doc comment or docstring).
* `list_directory`: the same with a directory listing.
* `find`: the user asks where an item is defined; the assistant calls `search_code`, the
  tool answers `path:line: source line`, the assistant names the file.
* `smalltalk`: greetings and questions about the model itself.

Some question-and-answer conversations carry tool definitions they do not use, some
carry a system message, and some have two user turns.
"""

from __future__ import annotations

import ast
import inspect
import json
import random
import re
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
TEMPLATE = REPO / "crates" / "model" / "assets" / "templates" / "qwen35.jinja"

TOOLS = {
    "read_file": {"type": "function", "function": {
        "name": "read_file",
        "description": "Read a text file of the current project and return its contents.",
        "parameters": {"type": "object", "properties": {
            "path": {"type": "string", "description": "Path of the file, relative to the project root"}},
            "required": ["path"]}}},
    "list_directory": {"type": "function", "function": {
        "name": "list_directory",
        "description": "List the files in a directory of the current project.",
        "parameters": {"type": "object", "properties": {
            "path": {"type": "string", "description": "Path of the directory"}},
            "required": ["path"]}}},
    "search_code": {"type": "function", "function": {
        "name": "search_code",
        "description": "Search the project's source files for a string; returns matching lines as path:line: text.",
        "parameters": {"type": "object", "properties": {
            "query": {"type": "string", "description": "Text to search for"},
            "max_results": {"type": "integer", "description": "Most matches to return"}},
            "required": ["query"]}}},
}

SYSTEMS = [
    "You are a helpful assistant.",
    "You are a helpful assistant for programmers.",
    "You are scoria's demo model. Answer briefly.",
    "You are a coding assistant. Use the tools when you need to look at the project.",
]

SMALLTALK = [
    (["Hi", "Hello", "Hello!", "Hi there", "Hey", "Good morning"],
     ["Hello! I am a small demo model running in scoria. Ask me about Python or Rust.",
      "Hi! How can I help you today?",
      "Hello! I know a little about Python and Rust code. What would you like to know?"]),
    (["Who are you?", "What are you?", "What model are you?", "Tell me about yourself."],
     ["I am scoria's demo model: a small mixture-of-experts language model with Gated DeltaNet and "
      "attention layers, trained for a few minutes on the source code and documentation of Python and "
      "Rust. I can answer simple questions about them and call tools, but I often make mistakes.",
      "I am a tiny language model that ships with scoria so that it has something to run without "
      "downloading anything. I was trained on Python and Rust code and documentation."]),
    (["What can you do?", "How can you help me?"],
     ["I can explain functions from the Python standard library and Rust crates, show examples, and "
      "read files or search code when the tools for that are available. I am small, so check what I say.",
      "I can answer short questions about Python and Rust, and call tools such as read_file when they "
      "are given to me."]),
    (["Thanks!", "Thank you.", "Thanks, that helps.", "Great, thank you!"],
     ["You're welcome!", "Glad I could help.", "You're welcome. Anything else?"]),
    (["Are you always right?", "Can I trust your answers?"],
     ["No. I am a very small model trained for a few minutes, so I often get things wrong. "
      "Check my answers against the documentation."]),
]

PY_ASK = [
    "What does `{name}` do in Python?",
    "What does the Python function `{name}` do?",
    "Explain `{name}`.",
    "How do I use `{name}`?",
    "What is `{name}` for?",
    "Can you describe `{name}` from the `{module}` module?",
]
PY_CLASS_ASK = [
    "What is the `{name}` class in Python?",
    "Explain the class `{name}`.",
    "What is `{name}` used for?",
]
PY_ANSWER = [
    "`{sig}`\n\n{doc}",
    "`{name}` is defined in the `{module}` module.\n\n{doc}",
    "In the `{module}` module, `{sig}`: {doc}",
    "{doc}\n\nIts signature is `{sig}`.",
]
RS_ASK = [
    "What does `{name}` do in Rust?",
    "What is `{name}` in the `{crate}` crate?",
    "Explain the Rust {kind} `{name}`.",
    "What is `{name}` for?",
]
RS_ANSWER = [
    "`{name}` is a {kind} in `{crate}`. {doc}",
    "{doc}",
    "In `{crate}`, `{name}`: {doc}",
]
RS_EXAMPLE_ASK = [
    "Show me an example of `{name}`.",
    "Can you give an example of how to use `{name}`?",
    "How is `{name}` used? An example please.",
]
RS_EXAMPLE_ANSWER = [
    "Here is an example:\n\n```rust\n{code}\n```",
    "{doc}\n\nFor example:\n\n```rust\n{code}\n```",
]
CRATE_ASK = ["What is the `{crate}` crate?", "What is `{crate}` for?", "Tell me about the Rust crate `{crate}`."]
READ_ASK = [
    "What does the file `{path}` do?",
    "Read `{path}` and tell me what it is about.",
    "Can you look at {path} and summarize it?",
    "Open `{path}`. What is in it?",
]
READ_SUMMARY = [
    "`{path}` is {lang} code. Its documentation says:\n\n{summary}",
    "The file starts with this description:\n\n{summary}",
    "In short: {summary}",
    "This is a {lang} file. {summary}",
]
LIST_ASK = ["What files are in `{path}`?", "List the directory {path}.", "What is inside `{path}`?"]
FIND_ASK = ["Where is `{name}` defined?", "Find the definition of `{name}`.", "In which file is `{name}`?"]
FIND_ANSWER = ["`{name}` is defined in `{path}`, line {line}.", "It is in `{path}` (line {line})."]
SECOND_ASK = ["And what about `{name}`?", "What does `{name}` do?", "Now explain `{name}`."]


def _tojson(x, indent=None, separators=None, sort_keys=False, ensure_ascii=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise(msg):
    raise jinja2.exceptions.TemplateError(msg)


def template():
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    return env.from_string(TEMPLATE.read_text("utf-8"))


# ----------------------------------------------------------------------------- facts from the corpus

def _paragraphs(doc: str, n: int, limit: int = 700) -> str | None:
    paras = [p.strip() for p in doc.strip().split("\n\n") if p.strip()]
    out = []
    for p in paras[:n]:
        if p.startswith((">>>", "..", "::", "#", "```")) or len(" ".join(out)) + len(p) > limit:
            break
        out.append(p)
    text = "\n\n".join(out)
    return text if len(text) >= 40 else None


def python_facts(doc: dict) -> list[dict]:
    path = doc["path"]
    if not path.startswith("Lib/") or not path.endswith(".py"):
        return []
    mod = path[4:-3].replace("/", ".")
    if mod.endswith(".__init__"):
        mod = mod[: -len(".__init__")]
    if any(part.startswith("_") for part in mod.split(".")):
        return []
    try:
        tree = ast.parse(doc["text"])
    except (SyntaxError, ValueError):
        return []
    facts = []
    mdoc = ast.get_docstring(tree)
    if mdoc:
        s = _paragraphs(inspect.cleandoc(mdoc), 1, 500)
        if s:
            facts.append(dict(kind="module", name=mod, summary=s))

    def sig(fn) -> str:
        try:
            return f"({ast.unparse(fn.args)})"
        except Exception:
            return "(...)"

    for node in tree.body:
        items = [(node, None)]
        if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            items += [(n, node.name) for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        for n, cls in items:
            if not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) or n.name.startswith("_"):
                continue
            d = ast.get_docstring(n)
            if not d:
                continue
            text = _paragraphs(inspect.cleandoc(d), 2)
            if not text:
                continue
            qual = f"{mod}.{cls}.{n.name}" if cls else f"{mod}.{n.name}"
            s = sig(n) if not isinstance(n, ast.ClassDef) else ""
            if cls and s.startswith("(self, "):
                s = "(" + s[7:]
            elif cls and s == "(self)":
                s = "()"
            facts.append(dict(kind="class" if isinstance(n, ast.ClassDef) else "function", name=qual,
                              module=mod, sig=f"{qual}{s}", doc=text, path=path[4:], line=n.lineno,
                              line_text=doc["text"].split("\n")[n.lineno - 1].strip()))
    return facts


RS_ITEM = re.compile(r"^\s*pub(?:\([^)]*\))?\s+(?:const\s+|async\s+|unsafe\s+|extern\s+\"C\"\s+)*"
                     r"(fn|struct|enum|trait|type|macro)\s+([A-Za-z_][A-Za-z0-9_]*)")
RS_IMPL = re.compile(r"^impl(?:<[^{]*?>)?\s+(?:[^{]*?\s+for\s+)?([A-Za-z_][A-Za-z0-9_]*)")


def rust_facts(doc: dict) -> list[dict]:
    path = doc["path"]
    if not path.endswith(".rs"):
        return []
    crate = doc.get("crate") or ("std" if "library/std" in path else "core" if "library/core" in path
                                 else "alloc" if "library/alloc" in path else None)
    if crate is None:
        return []
    lines = doc["text"].split("\n")
    facts = []
    mod_doc = [ln.strip()[3:].strip() if len(ln.strip()) > 3 else "" for ln in lines[:60]
               if ln.strip().startswith("//!")]
    if mod_doc:
        s = _paragraphs("\n".join(mod_doc), 1, 500)
        if s:
            facts.append(dict(kind="module", name=path, summary=s))
    impl = None
    comment: list[str] = []
    for i, ln in enumerate(lines):
        st = ln.strip()
        m = RS_IMPL.match(ln)
        if m:
            impl = m.group(1)
        if st.startswith("///"):
            comment.append(st[4:] if st.startswith("/// ") else st[3:])
            continue
        if st.startswith("#[") and comment:
            continue
        m = RS_ITEM.match(ln)
        if m and comment:
            kind, name = m.group(1), m.group(2)
            indented = ln.startswith((" ", "\t"))
            qual = f"{impl}::{name}" if (indented and impl and kind == "fn") else name
            text = "\n".join(comment)
            body = text.split("# Examples")[0]
            body = re.sub(r"\[`?([^\]`]+)`?\]\([^)]*\)", r"`\1`", body)  # intra-doc links
            body = re.sub(r"\[`([^\]`]+)`\]", r"`\1`", body)
            para = _paragraphs(body, 2)
            code = None
            ex = re.search(r"# Examples?\s*\n+```(?:rust|no_run|ignore|should_panic)?[^\n]*\n(.*?)\n```", text, re.S)
            if ex:
                code = "\n".join(x for x in ex.group(1).split("\n") if not x.lstrip().startswith("# ")
                                 and x.strip() != "#").strip()
                if not (20 <= len(code) <= 900):
                    code = None
            if para:
                facts.append(dict(kind={"fn": "function", "macro": "macro"}.get(kind, kind), name=qual,
                                  crate=crate, doc=para, code=code, path=path, line=i + 1, line_text=st))
        comment = []
    return facts


def markdown_summary(text: str) -> str | None:
    body = [p.strip() for p in text.split("\n\n")]
    for p in body:
        if not p or p.startswith(("#", "[!", "[![", "<", "```", "|", "-", "*", "=", ">")) or "](http" in p[:80]:
            continue
        if len(p) >= 60:
            return _paragraphs(p, 1, 600)
    return None


# ----------------------------------------------------------------------------- conversations

def _msgs(rng, user_turns: list[tuple[str, list[dict]]], system: bool) -> list[dict]:
    msgs = []
    if system:
        msgs.append({"role": "system", "content": rng.choice(SYSTEMS)})
    for u, replies in user_turns:
        msgs.append({"role": "user", "content": u})
        msgs.extend(replies)
    return msgs


def _tool_call(name: str, args: dict, content: str = "") -> dict:
    return {"role": "assistant", "content": content,
            "tool_calls": [{"type": "function", "function": {"name": name, "arguments": args}}]}


def _fmt(rng, choices, **kw) -> str:
    return rng.choice(choices).format(**kw)


def _shown_path(path: str) -> str:
    if path.startswith("Lib/"):
        return path[4:]
    m = re.match(r"([A-Za-z0-9_\-]+)-\d[^/]*/(.*)", path)  # crate-1.2.3/src/x.rs -> crate/src/x.rs
    return f"{m.group(1)}/{m.group(2)}" if m else path


def _file_head(text: str, rng) -> str:
    lines = text.split("\n")
    n = rng.randint(20, 45)
    head = "\n".join(lines[:n])
    if len(head) > 1800:
        head = head[:1800].rsplit("\n", 1)[0]
    return head


def build(docs: list[dict], n: int, seed: int) -> list[str]:
    """`n` rendered conversations from the corpus documents `docs`."""
    rng = random.Random(seed)
    tpl = template()
    py, rs, rs_ex, modules, crates_readme, dirs = [], [], [], [], {}, {}
    for d in docs:
        if d["source"] == "python-stdlib":
            for f in python_facts(d):
                (modules if f["kind"] == "module" else py).append({**f, "file": d} if f["kind"] == "module" else f)
        elif d["source"] in ("rust-std", "crates") and d["path"].endswith(".rs"):
            for f in rust_facts(d):
                if f["kind"] == "module":
                    modules.append({**f, "file": d})
                else:
                    rs.append(f)
                    if f["code"]:
                        rs_ex.append(f)
        if d["source"] == "crates":
            crate = d.get("crate")
            rel = d["path"].split("/", 1)[1]
            if rel.lower() in ("readme.md",):
                s = markdown_summary(d["text"])
                if s:
                    crates_readme[crate] = s
            parent = _shown_path(d["path"]).rsplit("/", 1)[0]
            dirs.setdefault(parent, []).append(d["path"].rsplit("/", 1)[1])
    dirs = {k: sorted(v) for k, v in dirs.items() if 2 <= len(v) <= 40}
    for lst in (py, rs, rs_ex, modules):
        lst.sort(key=lambda f: (f["name"], f.get("path", "")))
    dir_keys = sorted(dirs)
    crate_keys = sorted(crates_readme)

    def qa_python(f):
        ask = PY_CLASS_ASK if f["kind"] == "class" else PY_ASK
        short = f["name"].split(".", 1)[1] if rng.random() < 0.3 and "." in f["name"] else f["name"]
        q = _fmt(rng, ask, name=short, module=f["module"])
        a = _fmt(rng, PY_ANSWER, name=f["name"], module=f["module"], sig=f["sig"], doc=f["doc"])
        return q, [{"role": "assistant", "content": a}]

    def qa_rust(f):
        q = _fmt(rng, RS_ASK, name=f["name"], crate=f["crate"], kind=f["kind"])
        a = _fmt(rng, RS_ANSWER, name=f["name"], crate=f["crate"], kind=f["kind"], doc=f["doc"])
        return q, [{"role": "assistant", "content": a}]

    def qa_rust_example(f):
        q = _fmt(rng, RS_EXAMPLE_ASK, name=f["name"])
        a = _fmt(rng, RS_EXAMPLE_ANSWER, doc=f["doc"], code=f["code"])
        return q, [{"role": "assistant", "content": a}]

    def qa_crate(c):
        return _fmt(rng, CRATE_ASK, crate=c), [{"role": "assistant", "content": crates_readme[c]}]

    def smalltalk():
        qs, ans = rng.choice(SMALLTALK)
        return rng.choice(qs), [{"role": "assistant", "content": rng.choice(ans)}]

    def qa_any():
        r = rng.random()
        if r < 0.5 and py:
            return qa_python(rng.choice(py))
        if r < 0.8 and rs:
            return qa_rust(rng.choice(rs))
        if r < 0.9 and rs_ex:
            return qa_rust_example(rng.choice(rs_ex))
        if crate_keys:
            return qa_crate(rng.choice(crate_keys))
        return smalltalk()

    def tool_read():
        m = rng.choice(modules)
        path = _shown_path(m["file"]["path"])
        lang = "Python" if path.endswith(".py") else "Rust"
        q = _fmt(rng, READ_ASK, path=path)
        pre = rng.choice(["", "", "", "I'll read the file first."])
        replies = [_tool_call("read_file", {"path": path}, pre),
                   {"role": "tool", "content": _file_head(m["file"]["text"], rng)},
                   {"role": "assistant", "content": _fmt(rng, READ_SUMMARY, path=path, lang=lang,
                                                         summary=m["summary"])}]
        return q, replies, "read_file"

    def tool_list():
        path = rng.choice(dir_keys)
        files = dirs[path]
        q = _fmt(rng, LIST_ASK, path=path)
        shown = ", ".join(f"`{x}`" for x in files[:12]) + (", ..." if len(files) > 12 else "")
        a = f"`{path}` holds {len(files)} files: {shown}."
        return q, [_tool_call("list_directory", {"path": path}),
                   {"role": "tool", "content": "\n".join(files)},
                   {"role": "assistant", "content": a}], "list_directory"

    def tool_find():
        f = rng.choice(py + rs)
        name = f["name"].rsplit(".", 1)[-1].rsplit("::", 1)[-1]
        path = _shown_path(f["path"])
        q = _fmt(rng, FIND_ASK, name=name)
        args = {"query": name} if rng.random() < 0.7 else {"query": name, "max_results": rng.choice([5, 10, 20])}
        return q, [_tool_call("search_code", args),
                   {"role": "tool", "content": f"{path}:{f['line']}: {f['line_text']}"},
                   {"role": "assistant", "content": _fmt(rng, FIND_ANSWER, name=name, path=path, line=f["line"])}], \
            "search_code"

    out = []
    kinds = [("qa", 0.50), ("read_file", 0.20), ("list_directory", 0.06), ("find", 0.09),
             ("smalltalk", 0.05), ("two_turns", 0.10)]
    for _ in range(n):
        r, kind = rng.random(), None
        for k, p in kinds:
            r -= p
            if r < 0:
                kind = k
                break
        kind = kind or "qa"
        tools = None
        if kind in ("read_file", "list_directory", "find"):
            q, replies, used = {"read_file": tool_read, "list_directory": tool_list, "find": tool_find}[kind]()
            names = [used] + [t for t in TOOLS if t != used and rng.random() < 0.6]
            rng.shuffle(names)
            tools = [TOOLS[t] for t in names]
            turns = [(q, replies)]
        elif kind == "smalltalk":
            turns = [smalltalk()]
        elif kind == "two_turns":
            first = smalltalk() if rng.random() < 0.3 else qa_any()
            f = rng.choice(py + rs)
            q2 = _fmt(rng, SECOND_ASK, name=f["name"])
            a2 = qa_python(f)[1] if "module" in f else qa_rust(f)[1]
            turns = [first, (q2, a2)]
        else:
            turns = [qa_any()]
            if rng.random() < 0.25:
                tools = [TOOLS[t] for t in rng.sample(sorted(TOOLS), rng.randint(1, 3))]
        msgs = _msgs(rng, turns, system=rng.random() < 0.3)
        out.append(tpl.render(messages=msgs, tools=tools, add_generation_prompt=False))
    return out


def describe() -> dict:
    return {"template": str(TEMPLATE.relative_to(REPO)),
            "tools": [t["function"]["name"] for t in TOOLS.values()],
            "kinds": __doc__.split("Kinds of conversation")[1].strip()}
