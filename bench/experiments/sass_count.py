#!/usr/bin/env python3
"""SASS instruction counts per kernel of one CUDA source, without a GPU.

Compiles FILE.cu of this tree for sm_90a to a cubin (the library's include paths and flags),
disassembles it with nvdisasm and prints, per kernel: the instruction count, the counts of a
few opcodes, and the span between the first and the last of one opcode (default HMMA: for a
kernel whose page loop holds its mma.sync products, that span is the loop body's size). An
issue-bound kernel's time follows these counts, so two versions can be compared offline.

    python bench/experiments/sass_count.py src/cuda/inference/paged_decode_rows.cu [--grep nvfp4] [--span HMMA]

nvdisasm is not in every CUDA toolkit install: when it is missing, the PyPI wheel
nvidia-cuda-nvdisasm is installed into build/nvdisasm (pip, once).
"""
import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OPCODES = ("HMMA", "HGMMA", "LDS", "LDSM", "STS", "PRMT", "LOP3", "SHF", "F2FP", "FFMA", "FMUL", "MUFU", "BAR", "BRA")


def nvdisasm():
    found = shutil.which("nvdisasm") or (os.path.exists("/usr/local/cuda/bin/nvdisasm") and "/usr/local/cuda/bin/nvdisasm")
    if found:
        return found
    target = os.path.join(ROOT, "build", "nvdisasm")
    tool = os.path.join(target, "nvidia", "cu13", "bin", "nvdisasm")
    if not os.path.exists(tool):
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", target,
                        "nvidia-cuda-nvdisasm"], check=True)
        os.chmod(tool, 0o755)
    return tool


def kernels(sass):
    """(mangled name, [(opcode, full mnemonic)]) per kernel of nvdisasm's output."""
    for part in re.split(r"\n\s*\.text\.", sass)[1:]:
        name = part.split(":", 1)[0]
        ops = re.findall(r"^\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)", part, re.M)
        yield name, ops


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("source", help="a .cu file of this tree")
    p.add_argument("--grep", default="", help="only kernels whose mangled name contains this")
    p.add_argument("--span", default="HMMA", help="opcode whose first-to-last span is printed")
    p.add_argument("--nvcc", default=shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "k.cubin")
        subprocess.run([args.nvcc, "-DMSA_WITH_CUDA=1", "-I" + os.path.join(ROOT, "include"), "-I" + os.path.join(ROOT, "src"),
                        "-O3", "-DNDEBUG", "-arch=sm_90a", "--expt-relaxed-constexpr", "-std=c++20", "-x", "cu", "-cubin",
                        args.source, "-o", cubin], check=True)
        sass = subprocess.run([nvdisasm(), "-c", cubin], check=True, capture_output=True, text=True).stdout
    print(f"{'kernel (tail of the mangled name)':<60} {'instr':>6} {args.span + ' span':>10}  " +
          " ".join(f"{o:>5}" for o in OPCODES))
    for name, ops in kernels(sass):
        if args.grep.lower() not in name.lower():
            continue
        count = collections.Counter(ops)
        at = [i for i, o in enumerate(ops) if o == args.span]
        span = at[-1] - at[0] if at else 0
        print(f"{name[-60:]:<60} {len(ops):>6} {span:>10}  " + " ".join(f"{count[o]:>5}" for o in OPCODES))


if __name__ == "__main__":
    main()
