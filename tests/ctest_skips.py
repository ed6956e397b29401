#!/usr/bin/env python3
"""Prints why ctest skipped what it skipped: ctest's own summary lists skipped tests without
the reason their output gives (GTEST_SKIP's message, a script's "SKIP ..." line).

  tests/ctest_skips.py <build dir>        reads <build dir>/Testing/Temporary/LastTest.log

One line per reason with the number of tests and their names (the first few); exit 0.
"""
import os
import re
import sys
from collections import OrderedDict


def skipped_tests(log_text):
    """(test name, reason) for each skipped test of a LastTest.log."""
    out = []
    for block in re.split(r"\n(?=\d+/\d+ Testing: )", log_text):
        m = re.search(r"^\d+/\d+ Testing: (.+)$", block, re.M)
        if not m:
            continue
        # ctest marks skips as "Test Skipped" / "Not Run" or, for SKIP_REGULAR_EXPRESSION
        # (gtest_discover_tests' GTEST_SKIP), "Skip regular expression found in output"; a
        # SKIP_RETURN_CODE skip is logged as passed, so the scripts' "SKIP: <reason>" line counts.
        flagged = re.search(r"^Test (Skipped|Not Run)|Skip (regular expression|return code) found", block, re.M)
        script_skip = re.search(r"^SKIP: (.+)$", block, re.M)
        if not flagged and not script_skip:
            continue
        name = m.group(1).strip()
        reason = None
        g = re.search(r": Skipped\n(.*?)\n\[  SKIPPED \]", block, re.S)  # GTEST_SKIP() << reason
        if g and g.group(1).strip():
            reason = " ".join(g.group(1).split())
        if reason is None and script_skip:
            reason = script_skip.group(1).strip()
        out.append((name, reason or "no reason printed"))
    return out


def main():
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    log = os.path.join(sys.argv[1], "Testing", "Temporary", "LastTest.log")
    if not os.path.isfile(log):
        print(f"skip summary: no {log} (run ctest first)")
        return 0
    by_reason = OrderedDict()
    for name, reason in skipped_tests(open(log, encoding="utf-8", errors="replace").read()):
        by_reason.setdefault(reason, []).append(name)
    if not by_reason:
        print("skip summary: no test was skipped")
        return 0
    total = sum(len(v) for v in by_reason.values())
    print(f"skip summary: {total} test(s) skipped")
    for reason, names in by_reason.items():
        shown = ", ".join(names[:4]) + (f", ... ({len(names) - 4} more)" if len(names) > 4 else "")
        print(f"  {len(names)} x {reason}: {shown}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
