"""Fails when documentation or a code comment names a repository path that does not exist.

    python scripts/dev/check_doc_paths.py [ROOT]      # ROOT defaults to the repository root

Scans README.md, docs/*.md and benchmarks/**/*.md (all of the text, code blocks included), and
the comments and docstrings of the sources under csrc/, metal/, torch_marlin/, scripts/, tests/
(plus setup.py and .ci/run). A path is a token that starts with a top-level entry of the
repository (csrc/, metal/, torch_marlin/, tests/, scripts/, docs/, benchmarks/, .ci/, setup.py,
README.md), or the target of a markdown
link `[text](target)` relative to the document. Prints `file:line: missing path 'token'` for each
one that does not exist and exits 1; exits 0 when every path resolves.

Rules for tokens that are not plain paths:
- A glob (`*`, `?`) must match at least one file: `csrc/cuda/*.cu`.
- Braces list alternatives, each of which must exist: `csrc/metal_emu/runtime.{h,cpp}`.
- A placeholder in angle brackets ends the path; what precedes it must exist:
  `csrc/cuda/<family>.cu` checks `csrc/cuda/`.
- Build outputs are not in the tree and are not checked: `build/...` (never a known top-level
  entry), the compiled extension `torch_marlin/_C*` and its Metal libraries `torch_marlin/metallib/`.
- Paths that follow `git checkout <commit>` or `git show <commit>:` in the same code span (or
  comment line) name that commit's tree: they are checked there with `git cat-file` (the nearest
  such mention before the path counts), and skipped when the commit is not available (a shallow
  clone, no git).
- A markdown link's `#anchor` must name a heading of the linked document (or of the same document
  for `(#anchor)`), as GitHub writes heading anchors; in code spans and comments the anchor is
  dropped. URLs are not paths.
"""
import ast
import glob
import io
import os
import re
import subprocess
import sys
import tokenize

TOP = ("csrc", "metal", "torch_marlin", "tests", "scripts", "docs", "benchmarks", ".ci")
TOP_FILES = ("setup.py", "README.md")
SOURCE_DIRS = ("csrc", "metal", "torch_marlin", "scripts", "tests")
EXTRA_SOURCES = ("setup.py", ".ci/run")
C_LIKE = {".c", ".cc", ".cpp", ".h", ".hpp", ".cu", ".cuh", ".mm", ".m", ".metal", ""}
SHELL = {".sh"}
GENERATED = ("torch_marlin/_C", "torch_marlin/metallib")  # the extension and its Metal libraries (built, not committed)

PATH_RE = re.compile(
    r"(?<![\w./\-$])((?:%s)/[\w.*?<>{},\-/]*|(?:%s)(?![\w.]))" % (
        "|".join(re.escape(t) for t in TOP), "|".join(re.escape(f) for f in TOP_FILES)))
LINK_RE = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
COMMIT_RE = re.compile(r"git (?:checkout ([0-9a-f]{7,40})\b|show ([0-9a-f]{7,40}):)")


def comments_python(text):
    """(line, text) of every comment and docstring of a Python source."""
    out = []
    try:
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type == tokenize.COMMENT:
                out.append((tok.start[0], tok.string))
    except (tokenize.TokenError, SyntaxError):
        pass
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return out
    for node in [tree] + [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                                        ast.ClassDef))]:
        body = getattr(node, "body", [])
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                and isinstance(body[0].value.value, str):
            first = body[0].lineno
            for i, line in enumerate(body[0].value.value.split("\n")):
                out.append((first + i, line))
    return out


def comments_c(text):
    """(line, text) of the // and /* */ comments of a C-like source (string literals skipped)."""
    out, i, n, line = [], 0, len(text), 1
    while i < n:
        c = text[i]
        if c == "\n":
            line += 1
            i += 1
        elif text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append((line, text[i:j]))
            i = j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            for k, part in enumerate(text[i:j].split("\n")):
                out.append((line + k, part))
            line += text.count("\n", i, j)
            i = j
        elif c in "\"'":
            j = i + 1
            while j < n and text[j] != c and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            i = j + 1
        else:
            i += 1
    return out


def comments_shell(text):
    """(line, text) of shell comments: a # at the start of a word, outside quotes."""
    out = []
    for no, line in enumerate(text.split("\n"), 1):
        quote = None
        for i, c in enumerate(line):
            if quote:
                if c == quote:
                    quote = None
            elif c in "\"'":
                quote = c
            elif c == "#" and (i == 0 or line[i - 1] in " \t;") and not line.startswith("#!", i):
                out.append((no, line[i:]))
                break
    return out


def source_files(root):
    for d in SOURCE_DIRS:
        for dirpath, dirnames, filenames in os.walk(os.path.join(root, d)):
            dirnames[:] = [x for x in dirnames if x not in ("__pycache__", "build")]
            for f in filenames:
                yield os.path.relpath(os.path.join(dirpath, f), root)
    for f in EXTRA_SOURCES:
        if os.path.isfile(os.path.join(root, f)):
            yield f


def scanned_lines(root):
    """(file, line, text, is_markdown) to search for paths."""
    docs = glob.glob(os.path.join(root, "docs", "*.md")) + \
        glob.glob(os.path.join(root, "benchmarks", "**", "*.md"), recursive=True)
    for f in ["README.md"] + sorted(os.path.relpath(p, root) for p in docs):
        path = os.path.join(root, f)
        if os.path.isfile(path):
            for no, line in enumerate(open(path, encoding="utf-8").read().split("\n"), 1):
                yield f, no, line, True
    for f in sorted(source_files(root)):
        ext = os.path.splitext(f)[1]
        try:
            text = open(os.path.join(root, f), encoding="utf-8").read()
        except (UnicodeDecodeError, OSError):
            continue  # binary files
        if ext == ".py":
            pieces = comments_python(text)
        elif ext in SHELL or f == ".ci/run":
            pieces = comments_shell(text)
        elif ext in C_LIKE:
            pieces = comments_c(text)
        else:
            continue
        for no, piece in pieces:
            yield f, no, piece, False


def commit_available(root, commit, cache={}):
    if commit not in cache:
        try:
            r = subprocess.run(["git", "-C", root, "rev-parse", "--verify", "-q", commit + "^{commit}"],
                               capture_output=True, text=True)
            cache[commit] = r.stdout.strip() if r.returncode == 0 else None
        except OSError:
            cache[commit] = None
    return cache[commit]


def exists_at_commit(root, commit, path):
    r = subprocess.run(["git", "-C", root, "cat-file", "-e", "%s:%s" % (commit, path.rstrip("/"))],
                       capture_output=True)
    return r.returncode == 0


def expand_braces(token):
    m = re.search(r"\{([^{}]*)\}", token)
    if not m:
        return [token]
    return [x for alt in m.group(1).split(",") for x in expand_braces(token[:m.start()] + alt + token[m.end():])]


def clean(token):
    token = token.split("#", 1)[0]
    if "<" in token:  # placeholder: check the directory before it
        token = token[:token.index("<")]
        token = token[:token.rfind("/") + 1] if "/" in token else ""
    while token and token[-1] in ".,:;":
        token = token[:-1]
    return token


def path_ok(root, rel):
    if not rel or rel.startswith(GENERATED):
        return True
    if any(ch in rel for ch in "*?"):
        return bool(glob.glob(os.path.join(root, rel)))
    return os.path.exists(os.path.join(root, rel))


def spans(line, is_markdown):
    """The parts of a line that form one command: code spans of a markdown line, else the line."""
    if is_markdown and "`" in line:
        parts = line.split("`")
        return [(p, i % 2 == 1) for i, p in enumerate(parts)]
    return [(line, False)]


def heading_anchors(path, cache={}):
    """The anchors GitHub gives the headings of a markdown file (code blocks skipped)."""
    if path not in cache:
        anchors, counts, fenced = set(), {}, False
        for line in open(path, encoding="utf-8"):
            if line.lstrip().startswith("```"):
                fenced = not fenced
                continue
            m = None if fenced else re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
            if m:
                slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
                n = counts.get(slug, 0)
                counts[slug] = n + 1
                anchors.add(slug if n == 0 else "%s-%d" % (slug, n))
        cache[path] = anchors
    return cache[path]


def check(root):
    missing = []
    for f, no, line, is_markdown in scanned_lines(root):
        found = []
        for part, _ in spans(line, is_markdown):
            mentions = [(m.start(), m.group(1) or m.group(2)) for m in COMMIT_RE.finditer(part)]
            for pm in PATH_RE.finditer(part):
                before = [c for pos, c in mentions if pos < pm.start()]
                found.append((pm.group(1), before[-1] if before else None, None))
        if is_markdown:
            for lm in LINK_RE.finditer(line):
                target = lm.group(1)
                if re.match(r"^[a-z]+:", target):
                    continue
                page, _, anchor = target.partition("#")
                rel = os.path.normpath(os.path.join(os.path.dirname(f), page)) if page else f
                if page:
                    found.append((target, None, rel))
                if anchor and rel.endswith(".md") and os.path.isfile(os.path.join(root, rel)) \
                        and anchor not in heading_anchors(os.path.join(root, rel)):
                    missing.append("%s:%d: missing anchor '%s'" % (f, no, target))
        seen = set()  # a link target is also a path token: report it once
        for token, commit, resolved in found:
            for alt in expand_braces(token):
                rel = resolved if resolved is not None else clean(alt)
                shown = alt if resolved is not None else rel
                if (rel, commit) in seen:
                    continue
                seen.add((rel, commit))
                if commit:
                    if commit_available(root, commit) and rel and not exists_at_commit(root, commit, rel):
                        missing.append("%s:%d: missing path '%s' (at commit %s)" % (f, no, shown, commit))
                elif not path_ok(root, rel):
                    missing.append("%s:%d: missing path '%s'" % (f, no, shown))
    return missing


def main(argv):
    root = os.path.abspath(argv[1] if len(argv) > 1 else os.path.join(os.path.dirname(__file__), "..", ".."))
    missing = check(root)
    for m in missing:
        print(m)
    if missing:
        print("check_doc_paths: %d missing path(s)" % len(missing))
        return 1
    print("check_doc_paths: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
