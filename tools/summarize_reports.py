"""Print one line per nox session from the pytest JUnit reports under a folder, the totals, then each session's
failing tests (at most `SHOWN` each, with the first line of the failure's message).

Usage: python tools/summarize_reports.py .nox-reports
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from pathlib import Path

SHOWN = 10


def counts(root: ET.Element) -> tuple[int, int, int]:
    """(passed, failed, skipped) of one parsed JUnit XML report; errors count as failures."""
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    tests = failed = skipped = 0
    for suite in suites:
        tests += int(suite.get("tests", 0))
        failed += int(suite.get("failures", 0)) + int(suite.get("errors", 0))
        skipped += int(suite.get("skipped", 0))
    return tests - failed - skipped, failed, skipped


def failures(root: ET.Element) -> list[str]:
    """`classname::name: message` of each failed or errored test case in one parsed JUnit XML report."""
    out = []
    for case in root.iter("testcase"):
        for bad in (*case.findall("failure"), *case.findall("error")):
            message = (bad.get("message") or bad.text or "").strip().splitlines()
            out.append(f"{case.get('classname')}::{case.get('name')}: {message[0][:200] if message else ''}")
    return out


def main(folder: str) -> int:
    reports = sorted(Path(folder).glob("*.xml"))
    if not reports:
        print(f"no test reports under {folder}")
        return 1
    total = [0, 0, 0]
    width = max(len(r.stem) for r in reports)
    roots = {report: ET.parse(report).getroot() for report in reports}
    for report, root in roots.items():
        row = counts(root)
        total = [a + b for a, b in zip(total, row, strict=True)]
        print(f"{report.stem:<{width}}  {row[0]:>5} passed  {row[1]:>3} failed  {row[2]:>4} skipped")
    print(f"{total[0]} passed, {total[1]} failed, {total[2]} skipped")
    for report, root in roots.items():
        failed = failures(root)
        for line in failed[:SHOWN]:
            print(f"FAILED [{report.stem}] {line}")
        if len(failed) > SHOWN:
            print(f"FAILED [{report.stem}] ... and {len(failed) - SHOWN} more")
    return 0 if total[1] == 0 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else ".nox-reports"))
