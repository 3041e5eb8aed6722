"""The GitHub Actions workflows (.github/workflows/*.yml) pass actionlint, which CI installs
(.ci/run); a planted mistake fails it, so the check is live. The macOS workflow installs what the
README and .ci/run install (the same torch pin), builds every Metal library with the developer
check, and keeps the selfcheck's output. Seconds."""

import glob
import os
import re
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKFLOWS = sorted(glob.glob(os.path.join(ROOT, ".github", "workflows", "*.yml")))
MACOS = os.path.join(ROOT, ".github", "workflows", "macos.yml")
ACTIONLINT = shutil.which("actionlint")
needs_actionlint = pytest.mark.skipif(ACTIONLINT is None, reason="actionlint not installed (.ci/run installs it)")


def _lint(*paths):
    return subprocess.run([ACTIONLINT, "-no-color", *paths], capture_output=True, text=True, timeout=120, cwd=ROOT)


@needs_actionlint
def test_workflows_pass_actionlint():
    assert WORKFLOWS, "no workflow to lint"
    r = _lint(*WORKFLOWS)
    assert r.returncode == 0, r.stdout + r.stderr


@needs_actionlint
def test_actionlint_rejects_a_planted_mistake(tmp_path):
    text = open(MACOS).read()
    bad = tmp_path / "macos.yml"
    bad.write_text(text.replace("runs-on: macos-14", "runs-on: macos-14\n    timeout-minute: 90", 1))
    r = _lint(str(bad))
    assert r.returncode != 0 and "timeout-minute" in r.stdout, r.stdout + r.stderr


def test_macos_workflow_follows_the_readme():
    text = open(MACOS).read()
    runner = re.search(r"runs-on: macos-(\d+)", text)
    assert runner and int(runner.group(1)) >= 14, "GitHub's arm64 runners are macos-14 and newer"
    version = re.search(r'python-version: "3\.(\d+)"', text)
    assert version and int(version.group(1)) >= 11
    pins = open(os.path.join(ROOT, "scripts", "venv.sh")).read()  # the set-up behind make run / make test
    torch_pin = re.search(r"torch==[\d.]+", pins).group(0)
    assert torch_pin in text and torch_pin in open(os.path.join(ROOT, "README.md")).read()
    assert "pip install -q -r requirements.txt" in text and "--no-build-isolation -e ." in text
    assert "python csrc/mps/build_metal.py --check" in text  # every library, -Werror, no fallback
    assert "--device \"$device\"" in text and "selfcheck.json" in text and "upload-artifact" in text
    assert "python -m pytest tests" in text
