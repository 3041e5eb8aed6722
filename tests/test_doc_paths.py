"""scripts/dev/check_doc_paths.py: every path the docs and code comments name exists (and every
heading a markdown link points at), and the checker fails, naming file and line, on a tree with
planted bad references."""
import os
import re
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHECKER = os.path.join(ROOT, "scripts", "dev", "check_doc_paths.py")


def run_checker(root):
    return subprocess.run([sys.executable, CHECKER, str(root)], capture_output=True, text=True, timeout=300)


def test_repository_paths_exist():
    r = run_checker(ROOT)
    assert r.returncode == 0, r.stdout + r.stderr


def write(root, rel, text):
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))


def test_planted_bad_references_fail(tmp_path):
    # The bad names are built at run time so that this file's own text holds none of them.
    missing = "gone" + "_page"
    write(tmp_path, "README.md", f"""\
        # x
        See docs/real.md and docs/{missing}.md.
        Kernels: `csrc/cuda/*.cu`, `csrc/cuda/<family>.cu`, and `csrc/nothing/*.cu`.
        Generated: `build/generated/x.h`, `torch_marlin/_C.so`.
        [ok](docs/real.md#real) [bad](docs/{missing}.md) [web](https://example.org/a/b)
        [bad anchor](docs/real.md#nowhere) [here](#x) [not here](#nowhere)
        ## X
        """)
    write(tmp_path, "docs/real.md", f"""\
        # real
        [up](../README.md) [sibling](real.md) [bad sibling]({missing}.md)
        Both `csrc/cuda/k.{{cu,h}}` exist; `csrc/cuda/k.{{cu,cuh}}` half does not.
        """)
    write(tmp_path, "benchmarks/notes/n.md", f"""\
        # notes
        [product docs](../../docs/real.md) [bad](../../docs/{missing}.md), log: benchmarks/notes/{missing}.md
        """)
    write(tmp_path, "csrc/cuda/k.cu", f"""\
        // streams the weights (csrc/cuda/k.h)
        /* multi-line comment:
           see scripts/dev/{missing}.py */
        const char* s = "scripts/{missing}_in_a_string.py";  // strings are code, not comments
        """)
    write(tmp_path, "csrc/cuda/k.h", "// csrc/cuda/k.cu\n")
    write(tmp_path, "torch_marlin/mod.py", f'''\
        """Module docstring naming tests/{missing}.py."""
        X = "tests/{missing}_in_code.py"  # a comment naming torch_marlin/mod.py (exists)


        def f():
            """Docstring naming torch_marlin/mod.py and metal/{missing}.metal."""
        ''')
    r = run_checker(tmp_path)
    assert r.returncode == 1, r.stdout + r.stderr
    reported = sorted(line for line in r.stdout.splitlines() if re.search(": missing (path|anchor) '", line))
    expected = sorted([
        f"README.md:2: missing path 'docs/{missing}.md'",
        "README.md:3: missing path 'csrc/nothing/*.cu'",
        f"README.md:5: missing path 'docs/{missing}.md'",
        "README.md:6: missing anchor 'docs/real.md#nowhere'",
        "README.md:6: missing anchor '#nowhere'",
        f"docs/real.md:2: missing path '{missing}.md'",
        "docs/real.md:3: missing path 'csrc/cuda/k.cuh'",
        f"benchmarks/notes/n.md:2: missing path '../../docs/{missing}.md'",
        f"benchmarks/notes/n.md:2: missing path 'benchmarks/notes/{missing}.md'",
        f"csrc/cuda/k.cu:3: missing path 'scripts/dev/{missing}.py'",
        f"torch_marlin/mod.py:1: missing path 'tests/{missing}.py'",
        f"torch_marlin/mod.py:6: missing path 'metal/{missing}.metal'",
    ])
    assert reported == expected, r.stdout


def test_clean_tree_passes(tmp_path):
    write(tmp_path, "README.md", "Run `python scripts/dev/tool.py`; layout in [docs](docs/a.md).\n")
    write(tmp_path, "docs/a.md", "Tool: scripts/dev/tool.py, sources csrc/*.cpp.\n")
    write(tmp_path, "scripts/dev/tool.py", '"""Reads csrc/a.cpp."""\n')
    write(tmp_path, "csrc/a.cpp", "// see docs/a.md\n")
    r = run_checker(tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr


def test_paths_after_git_checkout_are_checked_in_that_commit(tmp_path):
    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@example.org"]
    subprocess.run(git + ["init", "-q"], check=True)
    write(tmp_path, "scripts/old_tool.py", '"""A tool that later moved away."""\n')
    subprocess.run(git + ["add", "-A"], check=True)
    subprocess.run(git + ["commit", "-qm", "old layout"], check=True)
    sha = subprocess.run(git + ["rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                         check=True).stdout.strip()
    (tmp_path / "scripts" / "old_tool.py").unlink()
    missing = "never" + "_there.py"
    write(tmp_path, "README.md", f"""\
        `git checkout {sha} && python scripts/old_tool.py` and `git show {sha}:scripts/old_tool.py`
        `git checkout {sha} && python scripts/{missing}`
        `python scripts/old_tool.py`
        """)
    r = run_checker(tmp_path)
    reported = sorted(line for line in r.stdout.splitlines() if ": missing path '" in line)
    assert reported == [f"README.md:2: missing path 'scripts/{missing}' (at commit {sha})",
                        "README.md:3: missing path 'scripts/old_tool.py'"], r.stdout
