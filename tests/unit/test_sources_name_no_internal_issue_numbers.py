"""Code, tests and docs say what they promise, not which internal ticket asked for it: an `issue N`
is only ever another project's (`bitsandbytes issue 1249`, `Hydra issue 1942`), so the word before
it names that project."""

import re
from pathlib import Path

from conftest import REPO

FOLDERS = ("qlora_recipes", "tests", "docs", "scripts", "bench", "conf", "recipes")
SUFFIXES = {".py", ".md", ".yaml"}
ISSUE = re.compile(r"\bissue\s+#?\d+", re.IGNORECASE)


def unowned_issue_numbers(text: str) -> list[str]:
    """Each `issue N` not right after a project's name (comment markers and line breaks between them
    skipped): at the start of a docstring, comment or sentence it can only be an internal one."""
    found = []
    for m in ISSUE.finditer(text):
        before = text[: m.start()].rstrip().rstrip("#").rstrip()
        if not before or not (before[-1].isalnum() or before[-1] in "/-_"):
            found.append(m.group())
    return found


def test_the_check_tells_an_internal_number_from_another_projects():
    issue = "Issue"  # written apart, so this file names no issue of ours itself
    assert unowned_issue_numbers(f'    """{issue} 14: the pipe broke."""') == [f"{issue} 14"]
    assert unowned_issue_numbers(f"fixed. {issue.lower()} 7 next") == [f"{issue.lower()} 7"]
    assert unowned_issue_numbers("# (bitsandbytes issue 1709); peft\n    # issue 1432") == []
    assert unowned_issue_numbers("pytorch/ao issue 1213, Hydra issue 1942") == []


def test_no_source_test_or_doc_names_an_internal_issue_number():
    offenders = {}
    for folder in FOLDERS:
        for path in (REPO / folder).rglob("*"):
            if path.suffix not in SUFFIXES or not path.is_file() or path == Path(__file__):  # its examples
                continue
            if found := unowned_issue_numbers(path.read_text()):
                offenders[str(path.relative_to(REPO))] = found
    assert offenders == {}
