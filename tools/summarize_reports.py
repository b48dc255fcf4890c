"""Print one line per nox session from the pytest JUnit reports under a folder, then the totals.

Usage: python tools/summarize_reports.py .nox-reports
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def counts(report: Path) -> tuple[int, int, int]:
    """(passed, failed, skipped) of one JUnit XML file; errors count as failures."""
    root = ET.parse(report).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    tests = failed = skipped = 0
    for suite in suites:
        tests += int(suite.get("tests", 0))
        failed += int(suite.get("failures", 0)) + int(suite.get("errors", 0))
        skipped += int(suite.get("skipped", 0))
    return tests - failed - skipped, failed, skipped


def main(folder: str) -> int:
    reports = sorted(Path(folder).glob("*.xml"))
    if not reports:
        print(f"no test reports under {folder}")
        return 1
    total = [0, 0, 0]
    width = max(len(r.stem) for r in reports)
    for report in reports:
        row = counts(report)
        total = [a + b for a, b in zip(total, row, strict=True)]
        print(f"{report.stem:<{width}}  {row[0]:>5} passed  {row[1]:>3} failed  {row[2]:>4} skipped")
    print(f"{total[0]} passed, {total[1]} failed, {total[2]} skipped")
    return 0 if total[1] == 0 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else ".nox-reports"))
