"""The project speaks of itself only: no tracked text file (code, comments, docs, tests, benchmarks, scripts, README)
cites a work-tracking label of its own — a numbered session, issue or wave, a work branch's tag (`s2` or `h2` and a
digit, then letters), or a session, helper or branch named by such a tag. A figure says what was measured, when, on
which machine and with which command; a design note says what is true and why.

Allowed: words such as a user's "sessions" or a process's "session" (no number), and a peer repository's issue
cited as a source with its repository (`owner/repo issue 123`, or its URL).
"""

from __future__ import annotations

import pathlib
import re
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

# a number after "session", "issue" or "wave" (one or several: "issues 23/24")
NUMBERED = re.compile(r"\b(?:sessions?|issues?|waves?)\s+#?\d+", re.IGNORECASE)
# a work branch's tag: s or h, 2 and a digit, up to two letters ("s25v", "s24o", "h23a", "h28"); case-sensitive,
# so a GPU such as NVIDIA's H20 is not one
TAG = re.compile(r"\b[sh]2\d[a-z]{0,2}\b")
# "this session", "the previous session", "session h24rt", "helper s26p", "branch seqpar2"
NAMED = re.compile(r"\b(?:this|previous|next|earlier|last)\s+session\b"
                   r"|\b(?:session|helper|branch)\s+[a-z]+\d+[a-z]*\b", re.IGNORECASE)
# a peer's issue cited with its repository: "NVIDIA-NeMo/RL issue 1234", "github.com/owner/repo/issues/1234"
PEER_ISSUE = re.compile(r"[\w.-]+/[\w.-]+[ ,]+issues?\s+#?\d+$", re.IGNORECASE)


def labels(text: str) -> list[str]:
    """The labels in `text`, each as it appears."""
    found = []
    for pattern in (NUMBERED, TAG, NAMED):
        for match in pattern.finditer(text):
            if pattern is NUMBERED and PEER_ISSUE.search(text[max(0, match.start() - 80):match.end()]):
                continue
            found.append(match.group(0))
    return found


def tracked_text_files() -> list[pathlib.Path]:
    try:
        listing = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as error:
        pytest.skip(f"not a git checkout ({error}): the tracked files cannot be listed")
    files = []
    for name in listing.decode().split("\0"):
        path = ROOT / name
        if not name or not path.is_file() or path == pathlib.Path(__file__).resolve():  # this file's examples
            continue
        data = path.read_bytes()
        if b"\0" in data:  # binary
            continue
        files.append(path)
    return files


@pytest.mark.parametrize("text", [
    "measured in session 12", "Session 19: W-small", "sessions 1-2", "see issue 28", "issue #45", "Issues 23/24",
    "wave 4", "docs/benchmarks.md, s25v", "(s24o)", "branch h23a", "h28's profile", "this session's merges",
    "the previous session's machine", "session h24rt", "helper s26p", "branch seqpar2",
])
def test_a_label_is_found(text):
    assert labels(text), text


@pytest.mark.parametrize("text", [
    "a user's sessions", "its own session", "--new-session", "NVIDIA H20 GPUs", "h100 and h200", "gen d64xt4",
    "f16xe2", "NVIDIA-NeMo/RL issue 1234", "https://github.com/NVIDIA-NeMo/RL/issues/1234", "s = 2", "waves of decode",
    "an issue with the layout", "sha256 s256", "trust margins 0.052",
])
def test_a_legitimate_word_is_not_a_label(text):
    assert not labels(text), (text, labels(text))


def test_no_tracked_text_file_cites_a_label():
    found = []
    for path in tracked_text_files():
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), start=1):
            found += [f"{path.relative_to(ROOT)}:{number}: {label!r}" for label in labels(line)]
    assert not found, ("work-tracking labels (say what is true and why, with the command that measures a figure):\n"
                       + "\n".join(found))
