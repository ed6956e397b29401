#!/usr/bin/env python3
"""Runs the code examples of README.md, tools/msa/README.md and every docs/*.md.

Fenced blocks tagged cpp, python or sh are examples. A block that is an illustrative fragment
says so in an HTML comment on the line(s) before its fence (blank lines may separate them):

    <!-- example: skip <reason> -->   never run (the reason is printed)
    <!-- example: gpu -->             run only where a CUDA GPU is present
    <!-- example: slow <reason> -->   run only with MSA_DOCS_SLOW=1 in the environment (a
                                      full-size example taking minutes on a CPU)

Modes:
  --extract-cpp DIR    write each runnable C++ block as DIR/<name>.cpp (wrapped in main() with
                       tests/docs/scaffold.h; #include lines stay at the top; GPU examples exit
                       77 = skipped without a GPU) and print one "<name>|<file>:<line>" line
                       per block (CMake builds and runs them)
  --run                run the python and sh blocks: python with --python when `msa` (and
                       `torch`, if the block imports it) import there (in an empty folder), sh
                       with bash from the checkout and the msa tool's folder first on PATH;
                       prints PASS / SKIP (reason) / FAIL per block
  --list               print every block with what would happen to it
Exit status of --run: 0 when nothing failed, 1 otherwise.
"""
import argparse
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile

LANGS = {"cpp": "cpp", "c++": "cpp", "python": "python", "py": "python", "sh": "sh", "bash": "sh"}
MARKER = re.compile(r"<!--\s*example:\s*(skip|gpu|slow)\b\s*(.*?)\s*-->")


def doc_files(root):
    files = [os.path.join(root, "README.md"), os.path.join(root, "tools", "msa", "README.md")]
    files += sorted(glob.glob(os.path.join(root, "docs", "*.md")))
    return [f for f in files if os.path.isfile(f)]


class Block:
    def __init__(self, path, line, lang, code, marker, reason):
        self.path, self.line, self.lang, self.code = path, line, lang, code
        self.marker, self.reason = marker, reason

    def where(self, root):
        return f"{os.path.relpath(self.path, root)}:{self.line}"

    def name(self, root):
        rel = os.path.relpath(self.path, root)
        return re.sub(r"[^A-Za-z0-9]+", "_", rel.rsplit(".", 1)[0]).strip("_") + f"_{self.line}"


def blocks(path):
    lines = open(path, encoding="utf-8").read().split("\n")
    out, i = [], 0
    while i < len(lines):
        m = re.match(r"^(\s*)(```+|~~~+)\s*([\w+-]*)", lines[i])
        if not m:
            i += 1
            continue
        fence, lang, start = m.group(2), m.group(3).lower(), i
        j = i + 1
        while j < len(lines) and not lines[j].strip().startswith(fence):
            j += 1
        code = "\n".join(lines[i + 1:j]) + "\n"
        # The marker: the nearest non-blank line above the fence.
        k = start - 1
        while k >= 0 and not lines[k].strip():
            k -= 1
        marker, reason = None, ""
        if k >= 0:
            mm = MARKER.search(lines[k])
            if mm:
                marker, reason = mm.group(1), mm.group(2)
        if lang in LANGS:
            out.append(Block(path, start + 1, LANGS[lang], code, marker, reason))
        i = j + 1
    return out


def have_gpu():
    smi = shutil.which("nvidia-smi")
    if not smi:
        return False
    return subprocess.run([smi, "-L"], capture_output=True).returncode == 0


def skip_reason(block, gpu):
    if block.marker == "skip":
        return block.reason or "marked as a fragment"
    if block.marker == "gpu" and not gpu:
        return "needs a CUDA GPU (runs in the device check)"
    if block.marker == "slow" and os.environ.get("MSA_DOCS_SLOW") != "1":
        return f"slow ({block.reason}): runs with MSA_DOCS_SLOW=1"
    return None


def wrap_cpp(code, gpu):
    includes, body = [], []
    for line in code.split("\n"):
        (includes if line.startswith("#include") else body).append(line)
    return ("// Generated from a documentation example by tests/docs/docs_examples.py.\n" + "\n".join(includes) +
            '\n#include "scaffold.h"\n\nint main() {\n' +
            ('  if (msa::cuda_device_count() == 0) {\n    std::printf("SKIP: needs a CUDA GPU\\n");\n    return 77;\n  }\n'
             if gpu else "") + '  try {\n' + "\n".join("    " + l for l in body) +
            "\n  } catch (const std::exception& e) {\n    std::fprintf(stderr, \"example failed: %s\\n\", e.what());\n"
            "    return 1;\n  }\n  std::printf(\"example ran\\n\");\n  return 0;\n}\n")


def python_ready(python, code):
    modules = ["msa"] + (["torch"] if re.search(r"^\s*(import|from)\s+torch|\bimport torch\b", code, re.M) else [])
    probe = subprocess.run([python, "-c", "import " + ", ".join(modules)], capture_output=True, text=True)
    if probe.returncode != 0:
        last = (probe.stderr.strip().split("\n") or [""])[-1]
        return f"{' and '.join(modules)} not importable with {python} ({last[:120]})"
    return None


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
    ap.add_argument("--extract-cpp", metavar="DIR")
    ap.add_argument("--run", action="store_true")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--python", action="append",
                    help="interpreter for the python blocks; repeatable: the first that exists is used "
                         "(the project's venv is decided when the tests run, not when they are configured)")
    ap.add_argument("--msa-dir", default="", help="folder of the msa tool, put first on PATH for sh blocks")
    ap.add_argument("--timeout", type=int, default=900)
    args = ap.parse_args()
    root = os.path.abspath(args.root)
    args.python = next((p for p in (args.python or []) if os.sep not in p or os.path.exists(p)), sys.executable)
    if os.sep in args.python:
        args.python = os.path.abspath(args.python)  # the blocks run in a temporary folder
    gpu = have_gpu()
    all_blocks = [b for f in doc_files(root) for b in blocks(f)]

    if args.extract_cpp:
        os.makedirs(args.extract_cpp, exist_ok=True)
        for b in all_blocks:
            if b.lang != "cpp" or b.marker == "skip":
                continue
            name = b.name(root)
            target = os.path.join(args.extract_cpp, name + ".cpp")
            text = wrap_cpp(b.code, b.marker == "gpu")
            if not os.path.exists(target) or open(target).read() != text:
                open(target, "w").write(text)
            print(f"{name}|{b.where(root)}")
        return 0

    if args.list:
        for b in all_blocks:
            print(f"{b.where(root)}: {b.lang}: {skip_reason(b, gpu) or 'runs'}")
        return 0

    if not args.run:
        ap.error("one of --extract-cpp, --run, --list")
    env = dict(os.environ)
    if args.msa_dir:
        env["PATH"] = os.path.abspath(args.msa_dir) + os.pathsep + env.get("PATH", "")
    env.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
    failed, counts = [], {"PASS": 0, "SKIP": 0, "FAIL": 0}
    for b in all_blocks:
        if b.lang == "cpp":
            continue  # built and run as their own ctest tests (docs.cpp.*)
        reason = skip_reason(b, gpu)
        if reason is None and b.lang == "python":
            reason = python_ready(args.python, b.code)
        if reason is not None:
            print(f"SKIP {b.where(root)} ({b.lang}): {reason}")
            counts["SKIP"] += 1
            continue
        with tempfile.TemporaryDirectory(prefix="msa_doc_") as work:
            # sh blocks run from the checkout (as a reader types them there), python blocks in
            # an empty folder.
            cmd = [args.python, "-c", b.code] if b.lang == "python" else ["bash", "-euo", "pipefail", "-c", b.code]
            try:
                r = subprocess.run(cmd, cwd=work if b.lang == "python" else root, env=env, capture_output=True, text=True, timeout=args.timeout)
                ok, tail = r.returncode == 0, (r.stdout + r.stderr)[-2000:]
            except subprocess.TimeoutExpired:
                ok, tail = False, f"timed out after {args.timeout} s"
        status = "PASS" if ok else "FAIL"
        counts[status] += 1
        print(f"{status} {b.where(root)} ({b.lang})")
        if not ok:
            failed.append(b.where(root))
            print("    " + tail.replace("\n", "\n    "))
    print(f"documentation examples: {counts['PASS']} passed, {counts['SKIP']} skipped, {counts['FAIL']} failed"
          + (" (" + ", ".join(failed) + ")" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
